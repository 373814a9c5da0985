"""Small DeepSeek-V4 architectures for random-weight test checkpoints.

Each preset is a transformers-style config dict (what `DeepseekV4Config(**config)` accepts and
`ModelConfig.from_hf_dict` reads). Together they cover every code path of the model:

| preset         | attention layers         | MoE layers            | router       | also                                 |
|----------------|--------------------------|-----------------------|--------------|--------------------------------------|
| `tiny`         | sliding, CSA, HCA, CSA   | hash, hash, moe, moe  | sqrtsoftplus | hc_mult 2, window 8, CSA 4, HCA 8    |
| `tiny-yarn`    | CSA, HCA, sliding, HCA   | hash, moe, moe, moe   | sqrtsoftplus | YaRN compress rope, hc_mult 3        |
| `tiny-sigmoid` | HCA, CSA, sliding        | hash, moe, moe        | sigmoid      | tied embeddings, hc_mult 4, HCA 16   |
| `tiny-softmax` | CSA, CSA, HCA, sliding   | hash, moe, moe, moe   | softmax      | swiglu_limit 1 (clamp active)        |
| `small`        | 6 mixed                  | 2 hash + 4 moe        | sqrtsoftplus | hidden 256, 8 experts, for benchmarks |

NOTE: transformers 5.24 cannot build a `softmax`-router model (no such activation in its ACT2FN), so
`tiny-softmax` has no transformers oracle; its `hf`-writer checkpoint is still written (see
make_checkpoint.py).

NOTE: windows and compress rates are tiny on purpose, so prompts of tens of tokens cross many
sliding-window and compression boundaries, and `index_topk` is below the number of compressed
entries of such prompts, so the lightning indexer really selects. The least common multiple of
each preset's compress rates is at most 32 (the cache's block constraint).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@dataclass(frozen=True)
class Preset:
    """A named test architecture: a transformers-style DeepSeek-V4 config dict plus what it is for."""

    name: str
    """Registry key, also the `--preset` choice of `python -m deepinfer.engine.testing.make_checkpoint`."""
    description: str
    """What the preset exercises."""
    config: dict[str, Any]
    """transformers-style config dict; use `hf_config()` for a copy you may change."""

    def hf_config(self) -> dict[str, Any]:
        """A deep copy of the config dict."""
        return copy.deepcopy(self.config)


_TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 4,
    "sliding_window": 8,
    "compress_rates": {CSA: 4, HCA: 8},
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
    "partial_rotary_factor": 0.25,  # 8 rotary channels of 32
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 0,  # no MTP weights in test checkpoints yet
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _variant(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(_TINY)
    config.update(changes)
    return config


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny",
            "All three attention types and both MoE kinds in 4 layers: hidden 64, vocab 512, 4 experts "
            "(top-2), hc_mult 2, sliding window 8, CSA rate 4 (index_topk 4), HCA rate 8.",
            _variant(),
        ),
        Preset(
            "tiny-yarn",
            "`tiny` with a YaRN-scaled compress rope (factor 4 over 64 positions, in the flat "
            "rope_parameters form transformers folds into 'compress'), hc_mult 3, 6 experts (top-3) "
            "and a different layer order.",
            _variant(
                layer_types=[CSA, HCA, SLIDING, HCA],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                hc_mult=3,
                n_routed_experts=6,
                num_experts_per_tok=3,
                index_topk=3,
                max_position_embeddings=256,
                rope_parameters={
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            ),
        ),
        Preset(
            "tiny-sigmoid",
            "3 layers with the sigmoid router, tied input/output embeddings, hc_mult 4, sliding window "
            "16 and HCA rate 16.",
            _variant(
                num_hidden_layers=3,
                layer_types=[HCA, CSA, SLIDING],
                mlp_layer_types=["hash_moe", "moe", "moe"],
                scoring_func="sigmoid",
                tie_word_embeddings=True,
                hc_mult=4,
                sliding_window=16,
                compress_rates={CSA: 4, HCA: 16},
                routed_scaling_factor=2.5,
            ),
        ),
        Preset(
            "tiny-softmax",
            "4 layers with the softmax router and swiglu_limit 1.0, so the SwiGLU clamp is active on "
            "random weights; two CSA layers in a row.",
            _variant(
                layer_types=[CSA, CSA, HCA, SLIDING],
                mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                scoring_func="softmax",
                swiglu_limit=1.0,
                routed_scaling_factor=1.0,
                index_topk=6,
            ),
        ),
        Preset(
            "small",
            "Benchmark-sized (about 9M parameters): hidden 256, vocab 4096, 6 layers, 8 experts (top-2), "
            "hc_mult 4, sliding window 32, CSA rate 4 (index_topk 16), HCA rate 32.",
            _variant(
                vocab_size=4096,
                hidden_size=256,
                moe_intermediate_size=128,
                num_hidden_layers=6,
                num_attention_heads=8,
                head_dim=64,
                q_lora_rank=128,
                o_groups=4,
                o_lora_rank=64,
                n_routed_experts=8,
                num_experts_per_tok=2,
                hc_mult=4,
                index_n_heads=4,
                index_head_dim=32,
                index_topk=16,
                sliding_window=32,
                compress_rates={CSA: 4, HCA: 32},
                layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA],
                mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
                max_position_embeddings=16384,
            ),
        ),
    )
}
"""Test architectures by name."""


def get_preset(name: str) -> Preset:
    """The preset called `name`; the error lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}.") from None
