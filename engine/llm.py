"""The offline API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from tqdm import tqdm

from engine.engine import Engine, EngineConfig, RequestOutput
from engine.sampling import SamplingParams


class LLM:
    """Offline batched generation over an in-process `Engine`."""

    def __init__(self, model: str | None = None, dtype: str = "float32", device: str = "cpu", **engine_kwargs) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Blocks until every prompt finished; returns one `RequestOutput` per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or `prompt_token_ids`.
        Every prompt is validated before any runs: one bad prompt raises `InvalidRequestError`
        and nothing is queued.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single list of token ids
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.engine.add_request(None, p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]

    def stream(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs (`new_token_ids` / `new_text` deltas) of one request as they come."""
        rid = self.engine.add_request(None, prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)
