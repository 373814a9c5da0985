"""Test checkpoints beside the built-in model (`deepinfer.engine.builtin_model`, the embedded default).

`ensure_default_model()` / `DEMO_MODEL_DIR` name the built-in checkpoint for tests;
`random_tiny_model()` writes the random-weight `tiny` architecture with the real V4
vocabulary (to `$DEEPINFER_HOME/default-tiny`, default `~/.cache/deepinfer`) for tests that want
arbitrary weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from deepinfer.engine.builtin_model import BUILTIN_MODEL_DIR, builtin_model_path

DEFAULT_VOCAB = 129280
DEMO_MODEL_DIR = BUILTIN_MODEL_DIR
"""The packaged demo checkpoint."""
ensure_default_model = builtin_model_path


def random_tiny_model() -> Path:
    """Blocks while writing on first use; returns a random-weight `tiny` checkpoint with the V4 vocabulary."""
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.presets import get_preset

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
