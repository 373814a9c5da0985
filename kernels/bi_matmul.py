"""Batch-invariant matmul for CUDA: `bi_matmul(a [..., M, K], b [..., K, N]) -> [..., M, N]` with one fixed
tiling, so an output row's bits never depend on M (how many rows share the call) or on the batch count.

Why: cuBLAS picks its kernel and its split-K from the problem shape, so a row of `X @ W` changes bits with
the number of rows of X (`engine.batch_invariant`, the batch-invariant mode, routes every matmul of a
forward here on CUDA). `_bi_matmul_kernel` computes each [BLOCK_M, BLOCK_N] output tile with a float32
accumulator over K in BLOCK_K steps, in order, never split: an output element is the same sequence of
`tl.dot` steps over the same K slices whatever M or the batch are (rows past M and columns past N are
masked loads, which touch no other element). The tile sizes are constants of this module, not tuned per
shape, which is the point. float32 operands take an IEEE (not TF32) dot.

Split K (`split_k_for`): a one-row GEMM of a [K, N] weight has only N / BLOCK_N tiles (32 for N = 2048: a
quarter of an H100's SMs), so K is cut into a number of slices fixed by K and N alone, never by M or the batch:
each slice's partial sum is the same `tl.dot` steps, and the tile's last slice to finish adds the float32
partials in slice order (the `fp8_gemm` scheme, one launch). An element's bits then depend on (K, N) and its own
row, as before. The price is the partials' traffic (split x M x N float32 written and read), which a weight
with many tiles (the LM head) avoids (split 1).

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
SPLIT_TARGET_PROGRAMS = 128
"""`split_k_for` splits K until a one-row-tile GEMM has about this many programs (an H100 / H200 has 132 SMs)."""
SPLIT_MIN_K_STEPS = 16
"""Each K slice keeps at least this many BLOCK_K steps (512 of K): shorter slices cost more in partials than
they gain in programs."""
MAX_SPLIT = 8

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GRID_Z = 65535


def split_k_for(k: int, n: int) -> int:
    """K slices of a GEMM with reduction length `k` and `n` output columns: a power of two <= MAX_SPLIT, from K and N
    only (so the same for every M and batch), such that cdiv(N, BLOCK_N) x split reaches SPLIT_TARGET_PROGRAMS while
    each slice keeps >= SPLIT_MIN_K_STEPS steps of BLOCK_K."""
    from deepinfer.kernels.fp8_gemm import pick_split_k

    return pick_split_k(-(-n // BLOCK_N), -(-k // BLOCK_K), SPLIT_TARGET_PROGRAMS, waves=1,
                        min_steps=SPLIT_MIN_K_STEPS, max_split=MAX_SPLIT)


def bi_matmul_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Reference: `torch.matmul` in float32, in a's dtype."""
    return torch.matmul(a.float(), b.float()).to(a.dtype)


if triton is not None:

    @triton.jit
    def _bi_matmul_kernel(a_ptr, b_ptr, c_ptr, part_ptr, lock_ptr, M, N, K, K_SLICE,
                          sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
                          IEEE_DOT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program (row tile, column tile, batch x SPLIT + slice): the slice's K range in BLOCK_K steps, in order
        z = tl.program_id(2)
        batch = z // SPLIT
        sl = z % SPLIT
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        a_row = a_ptr + batch * sab + rm[:, None] * sam
        b_col = b_ptr + batch * sbb + rn[None, :] * sbn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum(K, (sl + 1) * K_SLICE)
        for k0 in range(sl * K_SLICE, k_end, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_row + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < k_end), other=0.0)
            b = tl.load(b_col + kk[:, None] * sbk, mask=(kk[:, None] < k_end) & (rn[None, :] < N), other=0.0)
            if IEEE_DOT:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        c = c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn
        if SPLIT == 1:
            tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            # the partials [batches, SPLIT, M, N]; the tile's last slice to finish adds them in slice order
            # (`fp8_gemm._store_split_k`: the barrier orders every thread's store before the counter's release)
            off = rm[:, None].to(tl.int64) * N + rn[None, :]
            base = part_ptr + batch.to(tl.int64) * SPLIT * M * N
            tl.store(base + sl.to(tl.int64) * M * N + off, acc, mask=mask)
            tl.debug_barrier()
            tile = (batch * tl.num_programs(0) + tl.program_id(0)) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT):
                    total += tl.load(base + s * M * N + off, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(c, total.to(c_ptr.dtype.element_ty), mask=mask)


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
    split = split_k_for(K, N)
    k_slice = triton.cdiv(triton.cdiv(K, BLOCK_K), split) * BLOCK_K
    split = triton.cdiv(K, k_slice)  # slices that hold K (a function of K and N still)
    tiles = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    per_launch = _MAX_GRID_Z // split  # the grid's third dim (batches x slices) holds at most 65535 programs
    for b0 in range(0, nb, per_launch):
        b1 = min(nb, b0 + per_launch)
        x, y, z = a3[b0:b1], b3[b0:b1], out[b0:b1]
        if split > 1:
            part = torch.empty(b1 - b0, split, M, N, dtype=torch.float32, device=a.device)
            lock = torch.zeros((b1 - b0) * tiles[0] * tiles[1], dtype=torch.int32, device=a.device)
        else:
            part = lock = z  # unused
        _bi_matmul_kernel[tiles + ((b1 - b0) * split,)](
            x, y, z, part, lock, M, N, K, k_slice, x.stride(0), x.stride(1), x.stride(2),
            y.stride(0), y.stride(1), y.stride(2), z.stride(0), z.stride(1), z.stride(2),
            IEEE_DOT=a.dtype == torch.float32, SPLIT=split, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS)
    return out.reshape(*batch_shape, M, N)
