"""The experts' clamped SwiGLU activation: op `"swiglu"`, `(g, u, limit) -> silu(g.clamp(max=limit)) *
u.clamp(-limit, limit)` in g's dtype.

V4's experts clamp their gate pre-activation `g = w1 x` from above and their up projection `u = w3 x` on both
sides at `swiglu_limit` before the SwiGLU (engine/models/deepseek_v4.py `Expert`); the model runs the shared
expert's activation through this op (the routed experts' activations live in the MoE backends' kernels).

Implementations:
  * `"torch"`: the reference, the model's ops in their order: clamp g, clamp u, `F.silu`, the product (four
    launches on a GPU, each rounding to the tensors' dtype). The default off CUDA.
  * `"triton"`: one elementwise kernel over `BLOCK` elements a program. The CUDA default.

NOTE (why the kernel can match the reference bit for bit): each step rounds where torch's ops do: the clamped
values are stored in the dtype, `silu(g) = g / (1 + exp(-g))` is computed in float32 (torch's CUDA `silu`,
its opmath) and rounded to the dtype, then the product is rounded once (a product of two bfloat16 values is
exact in float32). The division is IEEE (`div_rn`), no product is contracted (`enable_fp_fusion=False`), and on
CUDA the exponential is libdevice's `expf`, the same routine torch's CUDA `::exp` calls; the `gpu` test checks
`torch.equal` against torch on CUDA. Under `TRITON_INTERPRET=1` the exponential is numpy's, and torch's CPU
`exp` (SLEEF) differs from it by an ulp on some inputs: there the kernel equals the reference within an ulp of
x's dtype, and bit for bit a numpy transcription of the same steps (tests/kernels/test_swiglu.py). Elementwise,
so batch invariant; the batch-invariant mode pins it to the reference anyway, as every `OpTable` op.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from deepinfer.kernels.rope import rtne_bf16
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=64)
def _limit_in(limit: float, dtype: torch.dtype) -> float:
    """`limit` rounded to `dtype` (torch.clamp compares with its bound in the tensor's dtype; rounding is
    sign-symmetric, so -limit too). Computed once per value on the CPU: no device work, no sync at call time."""
    return torch.tensor(limit, dtype=dtype, device="cpu").item()
BLOCK = 1024
"""Elements a program."""


@register_op("swiglu", "torch")
def swiglu_torch(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """Reference clamped SwiGLU (module docstring): g = w1 x, u = w3 x of one shape -> like g."""
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return F.silu(g) * u


@register_default_impl("swiglu")
def _default_swiglu(device: torch.device) -> str:
    # one launch instead of four, the reference's bits (module docstring)
    return "triton" if device.type == "cuda" and triton is not None else "torch"


if triton is not None:

    @triton.jit
    def _round(x, BF16: tl.constexpr, FP16: tl.constexpr):
        """float32 x rounded to the dtype (nearest, ties to even), as float32."""
        if BF16:
            x = rtne_bf16(x)
        if FP16:
            x = x.to(tl.float16).to(tl.float32)
        return x

    @triton.jit
    def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, BF16: tl.constexpr, FP16: tl.constexpr,
                       CUDA_EXP: tl.constexpr, BLOCK: tl.constexpr):
        o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = o < n
        gf = tl.load(g_ptr + o, mask=ok, other=0.0).to(tl.float32)
        uf = tl.load(u_ptr + o, mask=ok, other=0.0).to(tl.float32)
        # NOTE: `limit` is already rounded to the dtype (the wrapper), so the clamped values are the dtype's, as the
        # reference's clamped tensors; `where` keeps a NaN, as torch.clamp does
        gc = tl.where(gf > limit, limit, gf)
        uc = tl.where(uf > limit, limit, tl.where(uf < -limit, -limit, uf))
        if CUDA_EXP:
            e = libdevice.exp(-gc)  # CUDA's expf, which torch's silu kernel calls
        else:
            e = tl.exp(-gc)  # the interpreter (libdevice is CUDA only)
        s = _round(tl.math.div_rn(gc, 1.0 + e), BF16, FP16)  # F.silu's result, stored in the dtype
        tl.store(y_ptr + o, _round(s * uc, BF16, FP16).to(y_ptr.dtype.element_ty), mask=ok)

    @register_op("swiglu", "triton")
    def swiglu_triton(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
        """Triton clamped SwiGLU (module docstring): g and u contiguous, of one shape and dtype (float32,
        bfloat16 or float16). Returns a new tensor like g. No autograd. On CUDA, or on the CPU under
        `TRITON_INTERPRET=1`."""
        if g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
            raise ValueError(f"swiglu_triton: g and u must match in shape, dtype and device, got {g.dtype} "
                             f"{list(g.shape)} on {g.device} and {u.dtype} {list(u.shape)} on {u.device}")
        if not g.is_contiguous() or not u.is_contiguous():
            raise ValueError("swiglu_triton: g and u must be contiguous (call .contiguous())")
        if g.dtype not in _FLOATS:
            raise ValueError(f"swiglu_triton: g and u must be float32, bfloat16 or float16, got {g.dtype}")
        if not limit >= 0:
            raise ValueError(f"swiglu_triton: limit must be >= 0, got {limit}")
        if g.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"swiglu_triton needs CUDA tensors (or TRITON_INTERPRET=1), got {g.device}")
        if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
            raise ValueError("swiglu_triton has no backward; use the 'torch' implementation for training")
        y = torch.empty_like(g)
        n = g.numel()
        if n:
            # NOTE: enable_fp_fusion=False: no FMA contraction, every op rounds as torch's
            _swiglu_kernel[(triton.cdiv(n, BLOCK),)](g, u, y, n, _limit_in(float(limit), g.dtype), BF16=g.dtype == torch.bfloat16,
                                                     FP16=g.dtype == torch.float16,
                                                     CUDA_EXP=g.device.type == "cuda", BLOCK=BLOCK, num_warps=4,
                                                     enable_fp_fusion=False)
        return y
