"""Test helpers shared by every stage: random-weight DeepSeek-V4 checkpoints and their presets.

- `engine.testing.presets`: `PRESETS`, the small architectures (config dicts) tests run on.
- `engine.testing.make_checkpoint`: `make_checkpoint(dir, preset, seed, dtype, writer)` and its CLI,
  `python -m deepinfer.engine.testing.make_checkpoint DIR --preset tiny`.

NOTE: `make_checkpoint` is imported from its submodule, not re-exported here: the function and the
module share a name, and importing the module from this package would make `python -m` warn.
Nothing here imports transformers at import time; only `make_checkpoint(..., writer="hf")` needs it.
"""

from deepinfer.engine.testing.presets import PRESETS, Preset, get_preset

__all__ = ["PRESETS", "Preset", "get_preset"]
