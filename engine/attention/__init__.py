"""Attention backends: where a new attention kernel goes.

A layer's `Attention` module (`engine.models.deepseek_v4`) owns the weights and computes the
projections; everything after (writing the cache, compressing, indexing, attending) is done by an
`AttentionBackend` picked once, by name, when the model is built
(`DeepseekV4ForCausalLM(config, attention_backend="torch")`).

* `base.py` — the contract: `LayerSpec` (one per layer, from the cache layout), `AttentionMetadata`
  (built once per step by the model runner: positions, rope, decode-row index tensors, per-chunk
  geometry), `AttentionInputs` (what a layer hands its backend), `AttentionBackend` and the registry.
* `torch_backend.py` — `"torch"`: plain PyTorch, the readable reference and the oracle.
* `triton_backend.py` — `"triton"`: fused Triton decode kernels (`kernels.decode_attention`,
  `kernels.indexer`, `kernels.compressor`) over static metadata, CUDA-graph safe (`cuda_graph_safe`);
  prefill chunks as the `torch` backend.

A new kernel: add a module here with a subclass of `AttentionBackend` decorated with
`@register_attention_backend("name")`, import it below so the registry sees it, and test it against
the `torch` backend on the same `AttentionMetadata` (the kernel itself lives in `kernels/`, beside its
torch reference). The metadata is the only per-step input: extend `build_attention_metadata` (built
before the forward, host ints allowed) rather than computing indices inside a layer.
"""

from deepinfer.engine.attention import torch_backend as _torch_backend  # noqa: F401  (registers "torch")
from deepinfer.engine.attention import triton_backend as _triton_backend  # noqa: F401  (registers "triton")
from deepinfer.engine.attention.base import (
    AttentionBackend,
    AttentionInputs,
    AttentionMetadata,
    ChunkCompressor,
    ChunkWindow,
    CompressedIndex,
    DecodeCompressorRows,
    DecodeRows,
    LayerSpec,
    PrefillChunk,
    attention_backend_names,
    build_attention_metadata,
    get_attention_backend,
    layer_specs,
    register_attention_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionInputs",
    "AttentionMetadata",
    "ChunkCompressor",
    "ChunkWindow",
    "CompressedIndex",
    "DecodeCompressorRows",
    "DecodeRows",
    "LayerSpec",
    "PrefillChunk",
    "attention_backend_names",
    "build_attention_metadata",
    "get_attention_backend",
    "layer_specs",
    "register_attention_backend",
]
