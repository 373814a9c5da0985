"""Batch-invariant matmul for CUDA: `bi_matmul(a [..., M, K], b [..., K, N]) -> [..., M, N]` with one fixed
tiling, so an output row's bits never depend on M (how many rows share the call) or on the batch count.

Why: cuBLAS picks its kernel and its split-K from the problem shape, so a row of `X @ W` changes bits with
the number of rows of X (`engine.batch_invariant`, the batch-invariant mode, routes every matmul of a
forward here on CUDA). `_bi_matmul_kernel` computes each [BLOCK_M, BLOCK_N] output tile with a float32
accumulator over K in BLOCK_K steps, in order, never split: an output element is the same sequence of
`tl.dot` steps over the same K slices whatever M, N or the batch are (rows past M and columns past N are
masked loads, which touch no other element). The tile sizes are constants of this module, not tuned per
shape, which is the point. float32 operands take an IEEE (not TF32) dot.

Reference: `bi_matmul_torch` (torch.matmul in float32, cast back), equal up to float32 summation order.
Runs on CUDA, or on the CPU under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS = 64, 64, 32, 4
"""The one tiling (never chosen by shape: a shape-dependent choice would break invariance)."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GRID_Z = 65535


def bi_matmul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Reference: `torch.matmul` in float32, in a's dtype."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


if triton is not None:

    @triton.jit
    def _bi_matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                          sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                          IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        batch = tl.program_id(2)
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_row = a_ptr + batch * sab + rm[:, None] * sam
        b_col = b_ptr + batch * sbb + rn[None, :] * sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_row + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(b_col + kk[:, None] * sbk, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
            if IEEE_DOT:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        c = c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def bi_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (batch dims broadcast as torch.matmul does; 2-D or more) -> [..., M, N]
    in a's dtype, with the fixed tiling above. Raises ValueError on mismatched shapes, dtypes or devices."""
    if triton is None:
        raise RuntimeError("bi_matmul needs triton")
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError(f"bi_matmul: operands must be at least 2-D, got {list(a.shape)} and {list(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"bi_matmul: a is [..., {a.shape[-2]}, {a.shape[-1]}] but b is [..., {b.shape[-2]}, "
                         f"{b.shape[-1]}]")
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise ValueError(f"bi_matmul: operands must share a dtype among bfloat16, float16, float32; got {a.dtype} "
                         f"and {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"bi_matmul: operands on {a.device} and {b.device}")
    if a.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"bi_matmul needs CUDA tensors (or TRITON_INTERPRET=1), got {a.device}")
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    batch_shape = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    nb = math.prod(batch_shape)
    if nb == 0 or M == 0 or N == 0:  # before the reshapes: `reshape(-1, 0, K)` is ambiguous (a step with no logits)
        return torch.empty(*batch_shape, M, N, dtype=a.dtype, device=a.device)
    a3 = a.expand(*batch_shape, M, K).reshape(nb, M, K)  # a view where the batch dims merge
    b3 = b.expand(*batch_shape, K, N).reshape(nb, K, N)
    out = torch.empty(nb, M, N, dtype=a.dtype, device=a.device)
    for b0 in range(0, nb, _MAX_GRID_Z):  # the grid's third dim holds at most 65535 programs
        b1 = min(nb, b0 + _MAX_GRID_Z)
        x, y, z = a3[b0:b1], b3[b0:b1], out[b0:b1]
        grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N), b1 - b0)
        _bi_matmul_kernel[grid](x, y, z, M, N, K, x.stride(0), x.stride(1), x.stride(2),
                                y.stride(0), y.stride(1), y.stride(2), z.stride(0), z.stride(1), z.stride(2),
                                IEEE_DOT=a.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                num_warps=NUM_WARPS)
    return out.reshape(*batch_shape, M, N)
