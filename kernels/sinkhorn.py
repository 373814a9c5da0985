"""mHC Sinkhorn normalisation: op `"sinkhorn"`, `(comb [T, hc, hc] float32, iters, eps) -> [T, hc, hc]`.

Sinkhorn-Knopp towards a doubly-stochastic matrix: normalise columns (divide by the column sum
plus `eps`), then `iters - 1` rounds of rows then columns.

Implementations:
  * `"torch"`: the reference (`sinkhorn_torch`); any device, autograd.
  * `"numpy_cpu"`: the same float32 arithmetic in numpy for small CPU batches (bit-identical);
    the default on the CPU.
  * `"triton"`: one Triton program per `BLOCK_T` matrices, every matrix kept in registers for all
    iterations (CUDA, or the CPU under `TRITON_INTERPRET=1`). Bit-identical to the CPU reference for
    hc <= 4 (V4's hc is 4): each sum adds in index order, as torch's CPU reduction and numpy do for so
    few elements, and divisions round to nearest (`div_rn`). Registered only where `triton` imports.

NOTE: on the CPU every implementation sums a row or column in index order, `((a0 + a1) + a2) + a3`,
and adds `eps` in float32: that order is what makes them agree bit for bit. torch's CUDA reduction
adds in another order: on an H200 (torch 2.11, triton 3.6) the Triton kernel equalled the CPU
reference bit for bit while torch on CUDA differed from both by up to 2.4e-7, and it took ~30 us a
call against torch's ~1-2 ms (40 small launches). So "triton" is the CUDA default wherever triton
imports (CUDA results move towards the CPU reference, by float32 rounding); `op_impls={"sinkhorn":
"torch"}` restores the plain torch loop.
"""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

NUMPY_MAX_ROWS = 64
"""The numpy path's largest batch: beyond it torch's vectorised ops are faster than numpy's."""


@register_op("sinkhorn", "torch")
def sinkhorn_torch(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Reference Sinkhorn of `comb` [T, hc, hc] (any float dtype and device; differentiable)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@register_op("sinkhorn", "numpy_cpu")
def sinkhorn_numpy_cpu(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The reference's float32 arithmetic in numpy, for CPU tensors (bit-identical results).

    NOTE: the matrices are tiny, so the cost is per-op dispatch, which numpy does in about half
    torch's time; at decode batch sizes this loop is the largest single cost of a CPU step. Batches
    over `NUMPY_MAX_ROWS` rows, tensors that need a gradient, and tensors off the CPU (a model moved
    after construction without `prepare_for_inference`) take the torch reference.
    """
    if comb.requires_grad or comb.shape[0] > NUMPY_MAX_ROWS or comb.device.type != "cpu":
        return sinkhorn_torch(comb, iters, eps)
    a = comb.numpy(force=True)
    a = a / (a.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        a /= a.sum(-1, keepdims=True) + eps
        a /= a.sum(-2, keepdims=True) + eps
    return torch.from_numpy(a)


@register_default_impl("sinkhorn")
def _default_sinkhorn(device: torch.device) -> str:
    # NOTE: on CUDA the Triton kernel equals the CPU reference bit for bit (torch's CUDA reduction
    # does not) and is ~40x faster than the torch loop (see the module docstring).
    if device.type == "cpu":
        return "numpy_cpu"
    return "triton" if device.type == "cuda" and triton is not None else "torch"


BLOCK_T = 64
"""Matrices per Triton program."""

if triton is not None:

    @triton.jit
    def _ordered_sum(a, idx, AXIS: tl.constexpr, HC: tl.constexpr):
        """Sum of `a` over AXIS in index order, kept as a size-1 axis. `idx` holds each element's index
        along AXIS; selecting one index with `where` and summing the rest's zeros is exact."""
        s = tl.sum(tl.where(idx == 0, a, 0.0), axis=AXIS)
        for k in tl.static_range(1, HC):
            s = s + tl.sum(tl.where(idx == k, a, 0.0), axis=AXIS)
        return tl.expand_dims(s, AXIS)

    @triton.jit
    def _sinkhorn_kernel(comb_ptr, out_ptr, num_rows, eps, ITERS: tl.constexpr, HC: tl.constexpr,
                         HC_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
        # NOTE: each matrix is held as [HC_PAD, HC_PAD] (the next power of two); padded entries are 0 and
        # stay 0, and `_ordered_sum` adds only the HC real indices, so padding changes no bit.
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        i = tl.arange(0, HC_PAD)[None, :, None]  # [1, hc_pad, 1] row index
        j = tl.arange(0, HC_PAD)[None, None, :]  # [1, 1, hc_pad] column index
        offs = rows[:, None, None] * (HC * HC) + i * HC + j  # [BLOCK_T, hc_pad, hc_pad]
        mask = (rows < num_rows)[:, None, None] & (i < HC) & (j < HC)
        a = tl.load(comb_ptr + offs, mask=mask, other=0.0)
        a = tl.math.div_rn(a, _ordered_sum(a, i, 1, HC) + eps)
        for _ in range(ITERS - 1):
            a = tl.math.div_rn(a, _ordered_sum(a, j, 2, HC) + eps)
            a = tl.math.div_rn(a, _ordered_sum(a, i, 1, HC) + eps)
        tl.store(out_ptr + offs, a, mask=mask)

    @register_op("sinkhorn", "triton")
    def sinkhorn_triton(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """Triton Sinkhorn of `comb` [T, hc, hc]: float32, contiguous, hc >= 1, iters >= 1.

        On CUDA, or on the CPU under `TRITON_INTERPRET=1`. No autograd; `ITERS` is a compile-time
        constant (one compile per distinct `iters`). On either device its result equals
        `sinkhorn_torch` on the CPU bit for bit (hc <= 4); torch on CUDA differs by float32 rounding
        (see the module docstring for why it is the CUDA default all the same).
        """
        if comb.dim() != 3 or comb.shape[1] != comb.shape[2]:
            raise ValueError(f"sinkhorn_triton: comb must be [T, hc, hc], got {list(comb.shape)}")
        hc = comb.shape[1]
        if hc < 1:
            raise ValueError(f"sinkhorn_triton: hc must be >= 1, got {hc}")
        if comb.dtype != torch.float32:
            raise ValueError(f"sinkhorn_triton: comb must be float32, got {comb.dtype}")
        if not comb.is_contiguous():
            raise ValueError("sinkhorn_triton: comb must be contiguous (call .contiguous())")
        if iters < 1:
            raise ValueError(f"sinkhorn_triton: iters must be >= 1, got {iters}")
        if comb.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"sinkhorn_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {comb.device}")
        if comb.requires_grad and torch.is_grad_enabled():
            raise ValueError("sinkhorn_triton has no backward; use the 'torch' implementation for training")
        out = torch.empty_like(comb)
        num_rows = comb.shape[0]
        if num_rows:
            _sinkhorn_kernel[(triton.cdiv(num_rows, BLOCK_T),)](comb, out, num_rows, eps, ITERS=iters, HC=hc,
                                                                HC_PAD=triton.next_power_of_2(hc), BLOCK_T=BLOCK_T)
        return out
