"""deepinfer: disaggregated, multi-node serving for DeepSeek-V4-family models.

Everything installs under this one namespace: the repository's top-level folders are its subpackages
(`deepinfer.engine`, `deepinfer.kernels`, `deepinfer.prefill_worker`, ...; see setup.py), so nothing
generic lands in site-packages. The offline API:

```python
from deepinfer import LLM, SamplingParams
llm = LLM(model="path/to/ckpt", dtype="float32")
outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=32))
```

Processes run as modules (`python -m deepinfer.prefill_worker ...`); the CLI is `deepinfer`.
"""

from __future__ import annotations

from pathlib import Path

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
# NOTE: in a source checkout this folder sits beside the subpackages' folders (engine/, kernels/, ...)
# instead of containing them: let `deepinfer.engine` resolve there too, so the checkout imports the same
# way as an installed copy (run from the repository root, this folder shadows any installed `deepinfer`).
if not Path(__file__).with_name("engine").is_dir() and (_SOURCE_ROOT / "engine" / "__init__.py").is_file():
    __path__.append(str(_SOURCE_ROOT))  # noqa: F821 (the package's own __path__)

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput", "InvalidRequestError",
           "DeepInferError"]


def __getattr__(name: str):
    # Lazy: `import deepinfer` stays cheap (no torch) until the offline API is used.
    if name in __all__:
        from deepinfer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
