"""engine: the model runtime every stage shares (config, model, cache, scheduler, sampler, offline API).

```python
from deepinfer.engine import LLM, SamplingParams
llm = LLM(model="path/to/ckpt", dtype="float32")
outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=32))
```
"""

from deepinfer.engine.errors import DeepInferError, InvalidRequestError
from deepinfer.engine.sampling.params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "InvalidRequestError", "DeepInferError"]


def __getattr__(name: str):
    # Lazy: importing the engine pulls in torch and the model; `engine.config` users need neither.
    if name == "LLM":
        from deepinfer.engine.llm import LLM

        return LLM
    if name in ("Engine", "EngineConfig", "RequestOutput", "CompletionOutput"):
        import deepinfer.engine.engine as _e
        return getattr(_e, name)
    raise AttributeError(name)
