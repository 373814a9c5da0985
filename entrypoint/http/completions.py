"""The two routes that bypass recipe: `/v1/completions` (OpenAI legacy completions, a raw prompt) and
`/v1/generate` (token ids in, token ids out, for callers that do their own templating).

`/v1/completions` serves `logprobs: K` (0..20) in OpenAI's legacy shape (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`; the engine's stop token is left out, as from the text).

`/v1/generate` body: `{"token_ids": [...], "sampling_params": {...}, "stream": false, "model": ...,
"request_id": ...}` where `sampling_params` holds the fields of `deepinfer.v1.SamplingParams` (the
engine's `SamplingParams`); the answer: `{"id", "object": "generate", "model", "choices": [{"index",
"token_ids", "text", "finish_reason", "stop_reason"}], "usage"}`, or SSE `data:` chunks of the same
shape carrying token deltas, ending `data: [DONE]`. With `sampling_params.logprobs` set, each choice
also has `logprobs`: per token `{"token_id", "logprob", "rank", "top_logprobs": [{"token_id", "logprob"}]}`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

import deepseek_recipe as recipe
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deepinfer.entrypoint.client import FINISH_REASONS, sampling_params_proto
from deepinfer.entrypoint.http import fields
from deepinfer.entrypoint.http.errors import ApiError, invalid, json_object
from deepinfer.entrypoint.http.structured import response_format_constraint
from deepinfer.protos import common_pb2, entrypoint_pb2

TokenId = Annotated[int, Field(ge=0, lt=2 ** 31)]
"""A token id as the wire carries it (int32); the entrypoint checks it against the vocabulary."""


def parse(cls: type[BaseModel], body: bytes) -> Any:
    """The validated body; 400 naming the first offending field otherwise."""
    parsed = json_object(body)
    fields.check_integers(parsed)
    try:
        return cls.model_validate(parsed)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        raise invalid(f"{param}: {error['msg']}" if param else error["msg"], param=param) from None


def _usage(usage: common_pb2.Usage, seed: int | None = None) -> dict:
    """OpenAI's usage (+ DeepSeek's cache hit / miss counts, + `seed`: the seed sampled with, when seeded)."""
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
           "prompt_cache_hit_tokens": usage.cached_prompt_tokens,
           "prompt_cache_miss_tokens": usage.prompt_tokens - usage.cached_prompt_tokens}
    if seed is not None:
        out["seed"] = seed
    return out


MAX_LOGPROBS = 20
"""Largest `logprobs` (alternatives per token) served; the engine's limit."""


def _is_stop_token(msg: entrypoint_pb2.GenerateResponse) -> bool:
    """The delta's last token is the stop token that ended it (EOS or a stop_token_id, not a stop string)."""
    return (msg.finish_reason == common_pb2.FINISH_REASON_STOP and bool(msg.token_ids)
            and msg.WhichOneof("stop_reason") != "stop_str")


def _stop_reason(msg: entrypoint_pb2.GenerateResponse) -> int | str | None:
    which = msg.WhichOneof("stop_reason")
    return getattr(msg, which) if which else None


# ---------------------------------------------------------------------------------------- /v1/completions


class CompletionBody(BaseModel):
    """An OpenAI completions request (the fields we serve; unknown ones are ignored, as OpenAI does, except
    vLLM's guided_* constraints, which are refused rather than silently dropped)."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[TokenId] | list[str]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    """vLLM's extension: divides positive / multiplies negative logits of tokens seen in prompt or output."""
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    response_format: dict | None = None
    """`json_object`, `json_schema` or `regex` (recipe's shapes): enforced by constrained decoding."""

    def prompt_token_ids(self, tokenizer: recipe.Tokenizer) -> list[int]:
        fields.choices_n({"n": self.n, "stream": self.stream})
        if self.echo or self.suffix:
            name = "echo" if self.echo else "suffix"
            raise invalid(f"{name} is not served; leave it unset", param=name)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise invalid("send one prompt per request", param="prompt")
            return tokenizer.encode(self.prompt[0])
        if isinstance(self.prompt, str):
            return tokenizer.encode(self.prompt)
        return list(self.prompt)

    def sampling_params(self, choice: int = 0) -> common_pb2.SamplingParams:
        """The token API's params of choice `choice` (seed + choice when seeded); fields OpenAI's completions API (or vLLM's) defines beyond the declared
        ones (`logit_bias`, `min_tokens`, `top_k`) are carried too, unserved ones refused (`fields`)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        structured_output = response_format_constraint(self.response_format, self.model_extra)
        extras = fields.sampling_extras(self.model_extra or {})
        return sampling_params_proto(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                     presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                     repetition_penalty=self.repetition_penalty, stop=stop or None,
                                     seed=fields.choice_seed(self.seed, choice),
                                     structured_output=structured_output, logit_bias=extras.logit_bias or None,
                                     min_tokens=extras.min_tokens or None, top_k=extras.top_k,
                                     logprobs=self.logprobs)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionBuilder:
    """Token deltas -> an OpenAI `text_completion` object or its stream chunks."""

    def __init__(self, request_id: str, model: str, include_usage: bool,
                 token_text: Callable[[int], str] | None = None) -> None:
        """`token_text`: a token id's text, for logprobs (None: the request asked for none)."""
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self.text = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.token_text = token_text
        self.seed: int | None = None
        """The seed the request sampled with, echoed in usage."""
        self.logprobs: dict[str, list] | None = None if token_text is None else _empty_logprobs()
        self._offset = 0

    def _chunk(self, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def _delta_logprobs(self, msg: entrypoint_pb2.GenerateResponse) -> dict | None:
        """OpenAI's legacy logprobs of the delta's tokens (the stop token left out), or None without logprobs."""
        if self.token_text is None:
            return None
        num_tokens = len(msg.token_ids) - _is_stop_token(msg)
        if len(msg.logprobs) < num_tokens:
            raise ApiError(500, f"the token stream carried {len(msg.logprobs)} logprobs for {num_tokens} tokens "
                           f"(request {self.request_id})", code="internal_error")
        out = _empty_logprobs()
        for lp in msg.logprobs[:num_tokens]:
            token = self.token_text(lp.token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)})
            out["text_offset"].append(self._offset)
            self._offset += len(token)
        return out

    def add(self, msg: entrypoint_pb2.GenerateResponse) -> dict | None:
        """Take a delta; returns its logprobs (legacy shape) when the request asked for them."""
        self.text += msg.text
        delta = self._delta_logprobs(msg)
        if delta is not None:
            for key, values in delta.items():
                self.logprobs[key].extend(values)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason)
            self.usage = _usage(msg.usage, self.seed)
        return delta

    def chunks(self, msg: entrypoint_pb2.GenerateResponse) -> list[dict]:
        delta = self.add(msg)
        has_tokens = bool(delta and delta["tokens"])
        out = [] if not msg.text and not msg.finish_reason and not has_tokens else [
            self._chunk(msg.text, self.finish_reason, delta)]
        if msg.finish_reason and self.include_usage:
            out.append({**self._chunk("", None), "choices": [], "usage": self.usage})
        return out

    def response(self) -> dict:
        return {**self._chunk(self.text, self.finish_reason, self.logprobs), "usage": self.usage}


class TokenTexts:
    """Token id -> its text (the tokenizer's decoding of that token alone), for logprobs; loads the
    tokenizer on first use and caches each id's text."""

    def __init__(self, tokenizer_file: str) -> None:
        self.tokenizer_file = tokenizer_file
        self._tokenizer = None
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                self._tokenizer = Tokenizer.from_file(self.tokenizer_file)
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _empty_logprobs() -> dict[str, list]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _generate_logprobs(msg: entrypoint_pb2.GenerateResponse) -> list[dict]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
             "top_logprobs": [{"token_id": t, "logprob": v} for t, v in zip(lp.top_token_ids, lp.top_logprobs)]}
            for lp in msg.logprobs]


# ---------------------------------------------------------------------------------------- /v1/generate


class GenerateBody(BaseModel):
    """A token-level request: prompt token ids and the token API's sampling params."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    model: str | None = None
    request_id: str | None = None


def generate_sampling_params(body: GenerateBody) -> common_pb2.SamplingParams:
    """The body's `sampling_params` on the wire; 400 for unknown names or wrong types (the
    entrypoint validates the values)."""
    try:
        return sampling_params_proto(**body.sampling_params)
    except (TypeError, ValueError) as e:
        raise invalid(f"sampling_params: {e}", param="sampling_params") from None


class GenerateBuilder:
    """Token deltas -> the `/v1/generate` answer or its stream chunks."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: dict | None = None
        self.logprobs: list[dict] = []
        self.seed: int | None = None
        """The seed the request sampled with, echoed in usage."""

    def _chunk(self, token_ids: list[int], text: str, logprobs: list[dict] | None = None) -> dict:
        choice = {"index": 0, "token_ids": token_ids, "text": text, "finish_reason": self.finish_reason,
                  "stop_reason": self.stop_reason}
        if logprobs:
            choice["logprobs"] = logprobs
        return {"id": self.request_id, "object": "generate", "created": self.created, "model": self.model,
                "choices": [choice]}

    def add(self, msg: entrypoint_pb2.GenerateResponse) -> None:
        self.token_ids += msg.token_ids
        self.text += msg.text
        self.logprobs += _generate_logprobs(msg)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason)
            self.stop_reason = _stop_reason(msg)
            self.usage = _usage(msg.usage, self.seed)

    def chunks(self, msg: entrypoint_pb2.GenerateResponse) -> list[dict]:
        self.add(msg)
        chunk = self._chunk(list(msg.token_ids), msg.text, _generate_logprobs(msg))
        if msg.finish_reason:
            chunk["usage"] = self.usage
        return [chunk]

    def response(self) -> dict:
        return {**self._chunk(self.token_ids, self.text, self.logprobs), "usage": self.usage}
