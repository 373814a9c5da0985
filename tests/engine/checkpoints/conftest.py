"""Published-layout tiny checkpoints (DeepSeek's FP8/FP4 layout), written once per test session.

Variants (name -> make_checkpoint arguments): every attention kind and both routings appear across
them (`tiny`: sliding, CSA, HCA + hash and learned; `tiny-yarn`: YaRN rope, hc 3; `tiny-sigmoid`: tied
embeddings), `expert_dtype` at both places, an MTP layer, the FP8-everywhere `*-Base` variant, and
`wo_a` groups aligned to the 128-row scale blocks.
"""

from __future__ import annotations

import pytest

from deepinfer.engine.testing.make_checkpoint import make_checkpoint, write_dequantized
from deepinfer.engine.testing.presets import get_preset

VARIANTS: dict[str, dict] = {
    "tiny-fp4": dict(preset="tiny", expert_dtype="fp4", expert_dtype_in="top"),
    "tiny-yarn-v41-spelling": dict(preset="tiny-yarn", expert_dtype="fp4", expert_dtype_in="quantization_config"),
    "tiny-sigmoid-tied": dict(preset="tiny-sigmoid", expert_dtype="fp4", mtp_layers=0),
    "tiny-base": dict(preset="tiny", base=True),
    # o_lora_rank 128: each wo_a group starts on a 128-row scale block (the real model's case, R = 1024)
    "tiny-wide-o": dict(preset={**get_preset("tiny").hf_config(), "o_lora_rank": 128}, mtp_layers=0),
}


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """published(name) -> path of the published-format checkpoint `VARIANTS[name]` (seed 1)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = make_checkpoint(tmp_path_factory.mktemp(name), seed=1, format="published",
                                          max_shard_size="200KB", **VARIANTS[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def dequantized(tmp_path_factory, published):
    """dequantized(name) -> path of the float32 transformers-layout checkpoint that `published(name)` stands for."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = write_dequantized(published(name), tmp_path_factory.mktemp(name + "-dequantized"))
        return cache[name]

    return get
