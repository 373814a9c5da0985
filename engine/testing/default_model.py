"""The embedded default model used when no checkpoint is given.

Until the trained built-in demo checkpoint ships, the default is the random-weight `tiny`
architecture with the real DeepSeek-V4 vocabulary (129280 ids), written once to
`$DEEPINFER_HOME/default-tiny` (default `~/.cache/deepinfer`). Its outputs are well-formed token
streams, not meaningful text.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.testing.make_checkpoint import make_checkpoint
from engine.testing.presets import get_preset

DEFAULT_VOCAB = 129280


def ensure_default_model() -> Path:
    """Blocks while writing on first use; returns the default checkpoint directory."""
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
