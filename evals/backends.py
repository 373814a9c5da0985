"""Prompt rendering (recipe, as the HTTP front renders a chat request) and the two ways to generate:
the offline `LLM` in this process, or a running cluster's token-level entrypoint.

Both take the same prompt token ids and sampling fields and return token ids, so a run on a cluster
and a run offline send the same prompts and are graded the same way. `Renderer.render` builds the
Chat Completions body a client would send (system message, user text, image parts, `thinking` and
`reasoning_effort`) and converts it with deepseek-recipe under the checkpoint's chat encoding, exactly
as `entrypoint.http.conversion.RecipeFront` does; the answer's token ids come back and are split at
`</think>` (`Renderer.split`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from deepinfer.evals.grading import THINK_END, split_thinking
from deepinfer.evals.tasks import Prompt

THINKING_MODES = ("off", "high", "max")
"""`--thinking`: off = non-thinking mode; high / max = thinking mode with that reasoning effort (the
model card's three modes; recipe renders each effort's preamble)."""

UNBOUNDED_CONTEXT = 2**32 - 1
"""The context limit handed to recipe's max_tokens rule when the context length is unknown (a cluster
without --max-model-len): recipe's largest (a u32)."""

MODEL_NAME = "deepinfer-eval"
"""The model name of the rendered request body (mapped to the checkpoint's recipe model version)."""


@dataclass(frozen=True)
class Request:
    """One sample to generate: its key, prompt token ids, image data URLs and sampling fields."""

    key: tuple[str, int]
    """(item id, sample index)."""
    prompt_token_ids: list[int]
    images: tuple[str, ...]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


@dataclass(frozen=True)
class Completion:
    """What came back for one request."""

    token_ids: list[int]
    finish_reason: str | None


class Renderer:
    """The checkpoint's chat encoding and tokenizer: prompts in, answers out."""

    def __init__(self, model_path: str | Path) -> None:
        import deepseek_recipe as recipe

        from deepinfer.engine.config import read_config_json
        from deepinfer.engine.tokenizer import (
            TemplateChatEncoding,
            chat_encoding_name,
            load_chat_encoding,
            load_tokenizer,
        )

        self.model_path = Path(model_path)
        self.encoding = load_chat_encoding(model_path)
        self.is_template = isinstance(self.encoding, TemplateChatEncoding)
        """The checkpoint renders with its own chat template (no thinking mode, no images)."""
        self.has_vision = "vision_config" in read_config_json(self.model_path / "config.json")
        self.tokenizer = load_tokenizer(model_path)
        self.think_end_id = self.tokenizer.token_to_id(THINK_END)
        # NOTE: as RecipeFront: V4-Pro's conversion drops image parts, V4.1-Flash's keeps them
        if self.has_vision or (not self.is_template and chat_encoding_name(model_path) == "v4.1"):
            version = recipe.ModelVersion.DeepseekV41Flash
        else:
            version = recipe.ModelVersion.DeepseekV4Pro
        self.options = recipe.ConversionOptions().with_model_versions_by_name({MODEL_NAME: version})

    def check_thinking(self, thinking: str) -> None:
        """Raises ValueError for a thinking mode this checkpoint's prompt format cannot render."""
        if thinking not in THINKING_MODES:
            raise ValueError(f"--thinking must be one of {', '.join(THINKING_MODES)}, got {thinking!r}")
        if thinking != "off" and self.is_template:
            raise ValueError(f"{self.model_path} renders prompts with its own chat template, which has no thinking "
                             "mode; use --thinking off")

    def body(self, prompt: Prompt, thinking: str) -> dict:
        """The Chat Completions request body of one prompt (what a client of the HTTP front would send)."""
        messages = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
        if prompt.images:
            content = [{"type": "text", "text": prompt.user}]
            content += [{"type": "image_url", "image_url": {"url": url}} for url in prompt.images]
            messages.append({"role": "user", "content": content})
        else:
            messages.append({"role": "user", "content": prompt.user})
        body = {"model": MODEL_NAME, "messages": messages,
                "thinking": {"type": "disabled" if thinking == "off" else "enabled"}}
        if thinking != "off":
            body["reasoning_effort"] = thinking
        return body

    def render(self, prompt: Prompt, thinking: str, max_tokens: int | None, max_model_len: int | None) -> tuple[list[int], int]:
        """`(prompt_token_ids, max_tokens)`: the prompt rendered by recipe, and max_tokens resolved by recipe's
        rule (the given one, else 8192 outside thinking mode, 65536 with effort high, 131072 with max, lowered
        to the context left after the prompt when `max_model_len` is known)."""
        import deepseek_recipe as recipe

        body = self.body(prompt, thinking)
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        try:
            converted = recipe.ChatCompletionRequest(body).convert(self.options)
            ids = self.encoding.encode(converted.conversation)
        except (recipe.ConversionError, ValueError, RuntimeError) as e:
            raise ValueError(f"the prompt cannot be rendered: {e}") from None
        if max_model_len is None:
            return ids, max_tokens or converted.resolve_max_tokens(len(ids), UNBOUNDED_CONTEXT)
        if len(ids) >= max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, at least the context length {max_model_len}; "
                             "raise --max-model-len")
        if max_tokens is not None:
            return ids, min(max_tokens, max_model_len - len(ids))
        return ids, converted.resolve_max_tokens(len(ids), max_model_len)

    def split(self, token_ids: Sequence[int], thinking: str) -> tuple[str, str, bool]:
        """`(reasoning, answer, is_reasoning_finished)` of a completion's token ids (special tokens such as
        the end of sentence are dropped from both texts)."""
        ids = list(token_ids)
        is_thinking = thinking != "off"
        if is_thinking and self.think_end_id is not None and self.think_end_id in ids:
            k = ids.index(self.think_end_id)
            return self._decode(ids[:k]), self._decode(ids[k + 1:]), True
        return split_thinking(self._decode(ids), is_thinking)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@functools.lru_cache(maxsize=4)
def renderer_for(model_path: Path) -> Renderer:
    """The `Renderer` of a checkpoint directory, built once per process (loading the tokenizers takes
    seconds)."""
    return Renderer(model_path)


OnDone = Callable[[Request, Completion], None]


class GenerationError(RuntimeError):
    """A sample could not be generated (the cluster refused or failed it); the run stops, keeping what
    finished."""


class OfflineBackend:
    """Generates with the offline `LLM` in this process, `batch_size` requests at a time (each batch is
    continuously batched by the engine; results are handed back, and saved, batch by batch)."""

    def __init__(self, model: str | None, *, dtype: str, device: str, max_model_len: int | None,
                 revision: str | None = None, batch_size: int = 256) -> None:
        from deepinfer.engine import LLM

        kwargs = {} if max_model_len is None else {"max_model_len": max_model_len}
        self.llm = LLM(model=model, dtype=dtype, device=device, revision=revision, **kwargs)
        self.model_path = Path(self.llm.engine.model_path)
        self.max_model_len = self.llm.engine.max_model_len
        self.batch_size = batch_size
        self.name = "offline"

    def generate(self, requests: Sequence[Request], on_done: OnDone) -> None:
        """Blocks until every request finished; calls `on_done` for each, batch by batch."""
        import base64

        from deepinfer.engine import SamplingParams

        for start in range(0, len(requests), self.batch_size):
            batch = requests[start:start + self.batch_size]
            prompts = []
            for r in batch:
                prompt: dict = {"prompt_token_ids": r.prompt_token_ids}
                if r.images:
                    prompt["multi_modal_data"] = {"image": [base64.b64decode(u.split(",", 1)[1]) for u in r.images]}
                prompts.append(prompt)
            params = [SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p, seed=r.seed)
                      for r in batch]
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            for r, out in zip(batch, outs):
                c = out.outputs[0]
                on_done(r, Completion(list(c.token_ids), c.finish_reason))

    def close(self) -> None:
        self.llm.shutdown()


CLUSTER_TIMEOUT_S = 6 * 3600.0
"""Longest one request may take on a cluster (a bound on a stuck cluster; long thinking runs are slow)."""


class ClusterBackend:
    """Generates on a running cluster through its entrypoint's token-level gRPC API
    (`entrypoint.client.Client`), `concurrency` requests in flight."""

    def __init__(self, address: str, model_path: str | Path, *, max_model_len: int | None, concurrency: int = 64,
                 secret: str | None = None, client=None) -> None:
        """`secret`: the cluster secret (None: this process's, `serving.auth`); `client` replaces the gRPC
        client (tests)."""
        if client is None:
            from deepinfer.entrypoint.client import Client

            client = Client(address, timeout_s=CLUSTER_TIMEOUT_S, **({"secret": secret} if secret else {}))
        self.client = client
        self.model_path = Path(model_path)
        self.max_model_len = max_model_len
        self.concurrency = concurrency
        self.name = f"cluster {address}"

    def generate(self, requests: Sequence[Request], on_done: OnDone) -> None:
        """Blocks until every request finished; calls `on_done` (in this thread) as each one finishes.
        A failed request raises `GenerationError` once the requests already running are done; the ones
        not yet sent are cancelled (a --resume sends them)."""
        if not requests:
            return
        with ThreadPoolExecutor(max(1, min(self.concurrency, len(requests)))) as pool:
            futures = {pool.submit(self._one, r): r for r in requests}
            try:
                for fut in as_completed(futures):
                    on_done(futures[fut], fut.result())
            except BaseException:
                for fut in futures:
                    fut.cancel()
                raise

    def _one(self, r: Request) -> Completion:
        from deepinfer.entrypoint.client import GenerateError

        try:
            out = self.client.generate(r.prompt_token_ids, max_tokens=r.max_tokens, temperature=r.temperature,
                                       top_p=r.top_p, seed=r.seed, images=list(r.images) or None)
        except GenerateError as e:
            raise GenerationError(f"item {r.key[0]} sample {r.key[1]} failed on the cluster: {e}") from e
        return Completion(list(out["token_ids"]), out["finish_reason"])

    def close(self) -> None:
        self.client.close()


def recorded_cluster() -> tuple[str, str | None]:
    """`(entrypoint address, cluster secret)` of the cluster `deepinfer up` recorded (for `--cluster auto`:
    the one named by $DEEPINFER_CLUSTER, else the only one recorded); raises ValueError if none runs."""
    from deepinfer.deploy.launcher import ClusterNotFound, default_cluster_name, find_state

    try:
        state = find_state(default_cluster_name(None))
    except ClusterNotFound as e:
        raise ValueError(f"--cluster auto: {e}") from None
    if not state.get("entrypoint"):
        raise ValueError("--cluster auto: the recorded cluster has no entrypoint address; give its HOST:PORT")
    return state["entrypoint"], state.get("cluster_secret")
