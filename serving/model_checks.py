"""Checks a prefill / decode worker config makes against its checkpoint when it is built, before anything loads.

The engine refuses the same pairings at start (`Engine.__init__`), but only after a process, a Ray actor or a
whole `deepinfer up` was launched; the worker configs (and through them the cluster YAML, `deploy.config`) call
`check_worker_model` so `--speculative dspark` on a V4 checkpoint, `--speculative mtp` on V4.1 or an Engram
placement for a checkpoint without Engram tables fail at once, with the engine's message.

Only checkpoints readable without a download are checked: the built-in model (`model` None) and local
directories. A repo id, or a directory whose config the loader refuses, is left to the engine (it names the problem).
"""

from __future__ import annotations

from pathlib import Path


def local_model_config(model: str | None):
    """The checkpoint's model config (`ModelConfig` or `V41Config`) when it can be read without a download, else
    None (a repo id; a broken directory, which the engine's loader reports at start)."""
    from deepinfer.engine.loader import CheckpointError, read_checkpoint_config

    if model is None:
        from deepinfer.engine.builtin_model import builtin_model_path

        try:
            path = builtin_model_path()
        except FileNotFoundError:
            return None
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            return None
    try:
        return read_checkpoint_config(path)[0]
    except CheckpointError:
        return None


def check_worker_model(model: str | None, speculative: str | None, engram_placement: str) -> None:
    """Raise ValueError when the drafter or the Engram placement does not fit the checkpoint (module docstring)."""
    if speculative is None and engram_placement == "auto":
        return
    mc = local_model_config(model)
    if mc is None:
        return
    from deepinfer.engine.spec_decode.config import check_drafter_for_model

    check_drafter_for_model(speculative, mc)
    if engram_placement != "auto" and not getattr(mc, "engram_layer_ids", ()):
        raise ValueError(f"engram_placement={engram_placement!r} places DeepSeek-V4.1's Engram tables; this checkpoint "
                         "has none: leave it 'auto' (--engram-placement auto)")
