"""kernels: the model's small fused ops, each with named implementations behind one registry.

`kernels.registry` is the seam: `register_op(op_name, impl_name)`, `get_op`, `op_impl_names`, and
`OpTable`, the set of implementations a model picks once at construction. Each op lives in its own
file beside its torch reference (the oracle) and a wrapper that checks shapes, dtypes and contiguity:

  * `kernels.sinkhorn`: the mHC Sinkhorn normalisation ("torch", "numpy_cpu", "triton").
  * `kernels.mhc`: the mHC pre-mix (RMS-normed projection, sigmoid / softmax, Sinkhorn, collapse), post-mix
    and head collapse ("torch", the model's reference arithmetic; "triton", fused, the CUDA default).
  * `kernels.attn_proj`: the attention layer's RMSNorm + RoPE (+ the window-ring write) and its grouped output
    projection with the inverse RoPE ("torch", the model's arithmetic; "triton").
  * `kernels.rmsnorm`, `kernels.rope`, `kernels.swiglu`: the layers' RMSNorm, the interleaved partial RoPE (queries,
    the indexer's queries, the output's inverse rotation) and the shared expert's clamped SwiGLU ("torch", the model's
    arithmetic; "triton", one launch each, the CUDA default: decode steps are launch-bound).
  * `kernels.moe_routing`, `kernels.moe_gemm`: the `"triton"` MoE backend's routing and grouped expert GEMMs
    (module ops, picked by the backend).
  * `kernels.fp8_gemm`, `kernels.fp4_gemm`: the quantized GEMMs behind `engine.quant.Fp8Linear` / `Fp4Linear`
    and the "fp4" MoE backend ("torch" exact block-wise references, "triton"). They are *module ops*
    (`register_op(..., in_op_table=False)`): the modules pick them per device, a model's `OpTable` does not
    list them; they register when `deepinfer.engine.quant` is imported.

  * `kernels.engram_gather`: DeepSeek-V4.1's Engram row gather + FP8 dequantization ("torch", "host": a host
    table read from the device, "triton"; a module op picked by `engine.quant.engram.Fp8EngramTable`).

A new kernel (Triton, TileLang) goes into the op's file, or a new `kernels/<op>.py` imported below.
"""

from deepinfer.kernels import attn_proj as _attn_proj  # noqa: F401  (registers "attn_norm_rope", "attn_out_proj")
from deepinfer.kernels import mhc as _mhc  # noqa: F401  (registers "mhc_pre", "mhc_post", "mhc_head")
from deepinfer.kernels import rmsnorm as _rmsnorm  # noqa: F401  (registers "rms_norm")
from deepinfer.kernels import rope as _rope  # noqa: F401  (registers "rope")
from deepinfer.kernels import sinkhorn as _sinkhorn  # noqa: F401  (registers the op's implementations)
from deepinfer.kernels import swiglu as _swiglu  # noqa: F401  (registers "swiglu")
from deepinfer.kernels.registry import OpTable, default_impl, get_op, op_impl_names, op_names, register_op

__all__ = ["OpTable", "default_impl", "get_op", "op_impl_names", "op_names", "register_op"]
