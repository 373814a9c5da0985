"""The built-in demo model: the embedded default checkpoint, used when no `--model` is given.

This folder is the checkpoint (config.json + model.safetensors + its model card README.md), trained by
`python -m deepinfer.tools.demo_model.train`: a tiny DeepSeek-V4 with the real V4 tokenizer that answers
two-digit additions, copies/reverses word lists, thinks in `<think>...</think>` and calls a
`get_weather` tool. See the model card for what it learned and how well.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_MODEL_DIR = Path(__file__).resolve().parent
"""The packaged checkpoint directory."""


def builtin_model_path() -> Path:
    """The built-in checkpoint directory; raises FileNotFoundError (naming the fix) when it is missing."""
    if not (BUILTIN_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in demo checkpoint is missing from {BUILTIN_MODEL_DIR} (a broken install?); reinstall "
            "deepinfer or regenerate it with `python -m deepinfer.tools.demo_model.train`."
        )
    return BUILTIN_MODEL_DIR
