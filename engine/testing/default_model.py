"""The embedded default model used when no checkpoint is given.

The default is the trained built-in demo model shipped inside the package at
`engine/testing/demo_model/` (config.json + model.safetensors + its model card README.md; trained by
`python -m deploy.demo_model.train`): a tiny DeepSeek-V4 with the real V4 tokenizer that answers
two-digit additions, copies/reverses word lists, thinks in `<think>...</think>` and calls a
`get_weather` tool. See that README for what it learned and how well.

`random_tiny_model()` still writes the random-weight `tiny` architecture with the real V4
vocabulary (to `$DEEPINFER_HOME/default-tiny`, default `~/.cache/deepinfer`) for tests that want
arbitrary weights.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_VOCAB = 129280
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
"""The packaged demo checkpoint."""


def ensure_default_model() -> Path:
    """The default checkpoint directory: the packaged trained demo model."""
    if not (DEMO_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"the built-in demo checkpoint is missing from {DEMO_MODEL_DIR} (a broken install?); reinstall deepinfer "
            "or regenerate it with `python -m deploy.demo_model.train`."
        )
    return DEMO_MODEL_DIR


def random_tiny_model() -> Path:
    """Blocks while writing on first use; returns a random-weight `tiny` checkpoint with the V4 vocabulary."""
    from engine.testing.make_checkpoint import make_checkpoint
    from engine.testing.presets import get_preset

    home = Path(os.environ.get("DEEPINFER_HOME", Path.home() / ".cache" / "deepinfer"))
    path = home / "default-tiny"
    if (path / "config.json").exists():
        return path
    cfg = get_preset("tiny").hf_config()
    cfg.update(vocab_size=DEFAULT_VOCAB, bos_token_id=0, eos_token_id=1)
    tmp = home / "default-tiny.tmp"
    make_checkpoint(tmp, preset=cfg, seed=0, overwrite=True)
    tmp.rename(path)
    return path
