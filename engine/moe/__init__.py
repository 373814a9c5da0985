"""engine.moe: the MoE layer's seam: a router and a backend for the routed experts.

  * `router.Gate`: learned top-k or hash routing -> (topk_weights, topk_ids) per token.
  * `base.MoEBackend`: `prepare(experts)` once after load, `forward(x, topk_weights, topk_ids)` every
    step; `register_moe_backend` / `get_moe_backend` / `moe_backend_names` (CLI choices).
  * `torch_backend`: `"torch"` (grouped matmuls over packed weights where supported) and `"torch_loop"`,
    the readable reference and the oracle for every other backend.
  * `fp4_backend`: `"fp4"`, routed experts kept as published FP4 (`engine.quant.Fp4Linear`), run as two
    grouped FP4 GEMMs (Triton on CUDA).
  * `triton_backend`: `"triton"`, float, FP4 or FP8 experts as grouped GEMMs with no host sync (routing, grouping,
    gate/up + SwiGLU, down + weighting, combine: `kernels.moe_routing`, `kernels.moe_gemm`); CUDA-graph safe.
  * `ep_backend`: expert parallelism, not selected by name: `ExpertParallelMoEBackend` wraps a layer's backend
    (the inner one computes this rank's experts) with dispatch/combine behind a `Dispatcher` (all-to-all over
    torch.distributed; a DeepEP-class transport later); installed by `engine.distributed` when
    `EngineConfig.expert_parallel_size > 1`. `eplb`: where redundant expert replicas go (EPLB).

Where a new backend goes: quantized experts (FP8 block-scaled, FP4 weights kept quantized, a fused
MoE kernel) or expert-parallel dispatch/combine (tokens sent to the rank that owns each expert and the
results gathered back) are new `MoEBackend` subclasses in their own modules here, registered by name
and imported below; the model picks one by name at construction (`moe_backend=`).
"""

from deepinfer.engine.moe import fp4_backend as _fp4_backend  # noqa: F401  (registers "fp4")
from deepinfer.engine.moe import torch_backend as _torch_backend  # noqa: F401  (registers "torch" and "torch_loop")
from deepinfer.engine.moe import triton_backend as _triton_backend  # noqa: F401  (registers "triton")
from deepinfer.engine.moe.base import MoEBackend, get_moe_backend, moe_backend_names, register_moe_backend
from deepinfer.engine.moe.router import Gate

__all__ = ["Gate", "MoEBackend", "get_moe_backend", "moe_backend_names", "register_moe_backend"]
