"""Per-request sampling parameters (vLLM-shaped) and their validation.

`SamplingParams` is immutable and validated on construction: a bad value raises
`engine.errors.InvalidRequestError` whose `field` (and message) names the parameter, so a request is
refused before it costs compute. Checks that need the model (token ids within the vocabulary) live in
`validate_against_vocab`, which the entrypoint calls once it knows the tokenizer.

`StructuredOutputParams` says what constrained decoding enforces on the output (a JSON schema, any
JSON, a regular expression, an EBNF grammar or an xgrammar structural tag); its syntax is checked
here, and the grammar is compiled against the tokenizer by `engine.structured_output`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.errors import InvalidRequestError

MAX_LOGPROBS = 20
"""Largest `logprobs` / `prompt_logprobs` a request may ask for."""

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are treated as greedy (argmax), as in vLLM."""

MAX_ABS_ADDITIVE_PENALTY = 2.0
"""`presence_penalty` and `frequency_penalty` must lie in [-2, 2] (OpenAI's range)."""


STRUCTURED_OUTPUT_KINDS = ("json_schema", "any_json", "regex", "grammar", "structural_tag")
"""The constraint kinds of `StructuredOutputParams`, exactly one of which a constraint sets."""


@dataclass(frozen=True, kw_only=True)
class StructuredOutputParams:
    """A constraint on a request's output, enforced token by token (constrained decoding with xgrammar).

    Exactly one of the constraint fields is set. Without `reasoning_end` the constraint covers the
    whole output from its first token; with it, the output first runs free (a reasoning block the
    prompt opened) until the text `reasoning_end` (e.g. "</think>"), and the constraint covers what
    follows. Once the constraint is complete only EOS may follow, and the request ends.
    """

    json_schema: str | None = None
    """A JSON Schema as JSON text: the output is one JSON value that validates against it."""
    any_json: bool = False
    """The output is any one JSON value."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect; generation starts at rule `root`)."""
    structural_tag: str | None = None
    """An xgrammar structural tag as JSON text (e.g. tool calls in the model's own syntax)."""
    reasoning_end: str | None = None
    """When set, the constraint starts after the first occurrence of this text; the output before it is free."""
    disable_any_whitespace: bool = False
    """JSON constraints: compact JSON (`", "` and `": "` separators, no other whitespace) instead of
    any whitespace between elements (at most `engine.structured_output.MAX_WHITESPACE` characters)."""

    def __post_init__(self) -> None:
        field_name = "structured_output"
        for name in ("any_json", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured_output.{name} must be a boolean, got {getattr(self, name)!r}",
                                          field=field_name)
        for name in ("json_schema", "regex", "grammar", "structural_tag", "reasoning_end"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_output.{name} must be a non-empty string, got {value!r}",
                                          field=field_name)
        chosen = [name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured_output must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                f"{', '.join(chosen) if chosen else 'none'}",
                field=field_name,
            )
        for name in ("json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                parsed = json.loads(value)
            except ValueError as e:
                raise InvalidRequestError(f"structured_output.{name} is not valid JSON: {e}", field=field_name) from None
            if not isinstance(parsed, (dict, bool)) or (name == "structural_tag" and not isinstance(parsed, dict)):
                raise InvalidRequestError(f"structured_output.{name} must be a JSON object, got {value[:100]!r}",
                                          field=field_name)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `STRUCTURED_OUTPUT_KINDS`."""
        return next(name for name in STRUCTURED_OUTPUT_KINDS if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint's text (the schema, regex, grammar or tag; "" for any_json)."""
        value = getattr(self, self.kind)
        return "" if value is True else value


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample one request's output tokens and when to stop (vLLM-compatible field names).

    Greedy decoding is `temperature=0`; it still applies penalties, `logit_bias` and `min_tokens`.
    Logprobs are those of the raw model logits (before temperature, penalties and bias).

    NOTE: `n > 1` is expanded by the engine into `n` child sequences that share the prompt; when a
    `seed` is given, child `i` samples with `seed + i` (see `for_child`), so every child is
    reproducible on its own and the children differ from each other.
    """

    n: int = 1
    """Number of output sequences to return for the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p, in (0, 1]."""
    top_k: int = -1
    """Keep only the top_k most likely tokens; -1 or 0 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's, in [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated at least once, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output; > 0, 1 disables."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling."""
    seed: int | None = None
    """Seed for reproducible sampling, independent of batch composition; None draws a fresh one per step."""
    stop: list[str] = field(default_factory=list)
    """Strings that end generation when they appear in the output text (a single string is accepted)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    max_tokens: int | None = 16
    """Maximum number of output tokens; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are blocked until this many tokens have been generated."""
    ignore_eos: bool = False
    """Keep generating after EOS (EOS is then neither blocked nor a stop condition)."""
    logprobs: int | None = None
    """Return the logprob of each sampled token plus this many top logprobs (0..20); None disables."""
    prompt_logprobs: int | None = None
    """Return logprobs for each prompt token plus this many top logprobs (0..20); None disables."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string (or stop token text) at the end of the output text."""
    structured_output: StructuredOutputParams | None = None
    """Constrained decoding: the output must match this constraint (a dict of its fields is accepted)."""

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        _check_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0 (0 = greedy), got {self.temperature}", field="temperature"
            )
        _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _check_int("top_k", self.top_k, minimum=-1, hint=" (-1 or 0 disables top-k)")
        _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_float(name, value)
            if not -MAX_ABS_ADDITIVE_PENALTY <= value <= MAX_ABS_ADDITIVE_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be in [-{MAX_ABS_ADDITIVE_PENALTY}, {MAX_ABS_ADDITIVE_PENALTY}], got {value}",
                    field=name,
                )
        _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 (1 disables), got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.seed is not None:
            _check_int("seed", self.seed)
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_token_ids("stop_token_ids", self.stop_token_ids))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, hint=" (or null for up to the context length)")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", field="min_tokens"
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean, got {getattr(self, name)!r}", field=name)
        object.__setattr__(self, "structured_output", _normalize_structured_output(self.structured_output))
        if self.structured_output is not None and self.min_tokens:
            raise InvalidRequestError(
                "min_tokens cannot be combined with structured_output (the constraint decides where the output "
                "ends); leave min_tokens at 0",
                field="min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0)
                if value > MAX_LOGPROBS:
                    raise InvalidRequestError(
                        f"{name} must be in [0, {MAX_LOGPROBS}] (or null), got {value}", field=name
                    )

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax (temperature ~ 0)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Raise `InvalidRequestError` unless every token id in the params is in [0, vocab_size)."""
        for token_id in self.logit_bias or ():
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token id {token_id} is out of range for a vocabulary of {vocab_size} tokens "
                    f"(ids must be in [0, {vocab_size}))",
                    field="logit_bias",
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids contains {token_id}, out of range for a vocabulary of {vocab_size} tokens "
                    f"(ids must be in [0, {vocab_size}))",
                    field="stop_token_ids",
                )

    def min_tokens_blocked_ids(self, eos_token_ids: Sequence[int]) -> list[int]:
        """Token ids masked out while fewer than `min_tokens` tokens were generated (vLLM semantics).

        These are the stop token ids plus, unless `ignore_eos`, the model's EOS ids.
        """
        blocked = list(self.stop_token_ids)
        if not self.ignore_eos:
            blocked.extend(token_id for token_id in eos_token_ids if token_id not in blocked)
        return blocked

    def for_child(self, child_index: int) -> SamplingParams:
        """Params of child sequence `child_index` of an `n > 1` request: `n=1` and seed `seed + child_index`."""
        seed = None if self.seed is None else self.seed + child_index
        return dataclasses.replace(self, n=1, seed=seed)


def _check_int(name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", field=name)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}{hint}, got {value}", field=name)


def _check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number, got {value!r}", field=name)
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value}", field=name)


def _normalize_logit_bias(logit_bias: Mapping[Any, Any] | None) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise InvalidRequestError(f"logit_bias must map token ids to numbers, got {logit_bias!r}", field="logit_bias")
    normalized: dict[int, float] = {}
    for key, value in logit_bias.items():
        # JSON object keys are strings; accept "123" as token id 123.
        token_id = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidRequestError(
                f"logit_bias keys must be non-negative token ids, got {key!r}", field="logit_bias"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidRequestError(
                f"logit_bias values must be finite numbers, got {value!r} for token {token_id}", field="logit_bias"
            )
        normalized[token_id] = float(value)
    return normalized


def _normalize_structured_output(value: Any) -> StructuredOutputParams | None:
    if value is None or isinstance(value, StructuredOutputParams):
        return value
    if not isinstance(value, Mapping):
        raise InvalidRequestError(
            f"structured_output must be an object with one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got {value!r}",
            field="structured_output",
        )
    known = {f.name for f in dataclasses.fields(StructuredOutputParams)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(
            f"structured_output has unknown field(s) {unknown}; use {sorted(known)}", field="structured_output"
        )
    return StructuredOutputParams(**value)


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}", field="stop")
    for item in stop:
        if not isinstance(item, str) or not item:
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {item!r}", field="stop")
    return list(stop)


def _normalize_token_ids(name: str, token_ids: Any) -> list[int]:
    if token_ids is None:
        return []
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidRequestError(f"{name} must be a list of token ids, got {token_ids!r}", field=name)
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidRequestError(f"{name} must contain non-negative token ids, got {token_id!r}", field=name)
    return list(token_ids)
