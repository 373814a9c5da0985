"""Experiment for issue 21's GEMM goal: a "swap-AB" FP8 block-scaled GEMM for decode-sized M.

    python -m deepinfer.benchmarks.fp8_swap_ab OUT.json      (CUDA; about 4 minutes of compiling and timing)

The production kernel (`kernels.fp8_gemm._fp8_gemm_kernel`) computes `x [M, K] @ W.T` with the weights
as the MMA's B operand: each e4m3 tile is converted to bf16 in registers and then has to be staged
back through shared memory for the tensor cores, and it reached 41-46% of HBM at 1-64 tokens on the
H200 (BENCHMARKS.md). Hopper's wgmma takes its A operand from registers, so this variant computes
`out.T = W @ x.T`: the converted weight tile [BLOCK_N, BLOCK_K] is A (no re-staging, and it loads in
W's own row-major order), the few tokens are B's N dimension (BLOCK_M 16/32/64). It sweeps tile
configs per shape and prints, per (shape, tokens), the production kernel's and the best swap-AB
config's time and fraction of 4.8 TB/s, and torch's bf16 matmul, all under CUDA-graph replay.

STATUS: checked against the exact reference under TRITON_INTERPRET=1 (float32 activations;
tests/benchmarks/test_fp8_swap_ab.py); NOT yet run on a GPU (the one attempt, 2026-12-04, lost its
machine). If it wins, it becomes a candidate of `fp8_gemm_candidates` for M <= 64.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

from deepinfer.kernels.fp8_gemm import (
    _e8m0_decode,
    _store_split_k,
    fp8_gemm_torch,
    fp8_gemm_triton,
    pick_split_k,
    split_k_buffers,
)


@triton.jit
def _swap_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, K_SLICE: tl.constexpr,
                 stride_xm, stride_wn, stride_sn, stride_om, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                 IEEE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """out[M, N] = x @ dequant(w8).T computed as (W @ x.T).T: the weight tile is the dot's A operand."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_lo = tl.program_id(2) * K_SLICE
    s_row = s_ptr + (rn // BN_SCALE) * stride_sn
    for step in range(0, K_SLICE, BLOCK_K):
        k0 = k_lo + step
        kk = k0 + rk
        k_ok = kk < K
        w_bits = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                         other=0)
        w = w_bits.to(tl.float8e4nv, bitcast=True).to(x_ptr.dtype.element_ty)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=m_ok[None, :] & k_ok[:, None],
                     other=0.0)
        s = tl.load(s_row + tl.minimum(k0, K - 1) // BK_SCALE, mask=n_ok, other=0)
        s = _e8m0_decode(s.to(tl.int32))
        acc += tl.dot(w, xt, input_precision="ieee" if IEEE else "tf32") * s[:, None]
    _store_split_k(tl.trans(acc), out_ptr, part_ptr, lock_ptr, rm, rn, M, N, stride_om, SPLIT)


def swap_gemm(x, w8, scale, cfg, out=None):
    """x [M, K] @ dequant(w8 [N, K], UE8M0 scale, 128 x 128 blocks).T; cfg = (BLOCK_M, BLOCK_N, BLOCK_K,
    warps, stages, waves) as in `kernels.fp8_gemm.fp8_gemm_candidates` (K split like the production op)."""
    block_m, block_n, block_k, warps, stages, waves = cfg
    m, k = x.shape
    n = w8.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    k_steps = triton.cdiv(k, block_k)
    split = pick_split_k(grid_mn[0] * grid_mn[1], k_steps, 132, waves, min_steps=2, max_split=max(1, k // (8 * m)))
    k_slice = triton.cdiv(k_steps, split) * block_k
    split = triton.cdiv(k, k_slice)
    part, lock = split_k_buffers(grid_mn, split, m, n, out)
    _swap_kernel[(grid_mn[0], grid_mn[1], split)](
        x, w8.view(torch.uint8), scale.view(torch.uint8), out, part, lock, m, n, k, k_slice, x.stride(0),
        w8.stride(0), scale.stride(0), out.stride(0), BN_SCALE=128, BK_SCALE=128, IEEE=x.dtype == torch.float32,
        SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def graph_time(fn, reps: int = 50) -> float:
    """Microseconds per `fn()` from CUDA-graph replays of `reps` captured calls (best of 5)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps * 1000)
    return min(times)


SHAPES = {"wq_b": (32768, 1024), "wo_a": (8192, 4096), "wo_b": (4096, 8192), "wq_a": (1024, 4096),
          "shared_w13": (4096, 4096)}
"""V4-Flash's FP8 projections (N, K)."""


def best_swap_config(x, w8, scale, ref):
    """(us, config) of the fastest swap-AB config that matches `ref` (relative max error <= 1e-2)."""
    best = None
    bm = 16 if x.shape[0] <= 16 else 32 if x.shape[0] <= 32 else 64
    for bn, warps, stages, waves in itertools.product((64, 128), (4, 8), (3, 4), (2, 4, 8)):
        cfg = (bm, bn, 128, warps, stages, waves)
        try:
            got = swap_gemm(x, w8, scale, cfg).float()
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"# config {cfg}: WRONG (relative error {err:.3g})")
                continue
            t = graph_time(functools.partial(swap_gemm, x, w8, scale, cfg))
        except Exception as exc:  # noqa: BLE001 - e.g. shared memory exceeded for one config
            print(f"# config {cfg} skipped: {type(exc).__name__}")
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    return best


def main() -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w8 = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        codes = torch.randint(120, 130, (n // 128, k // 128), device=dev, dtype=torch.uint8)
        scale = codes.view(torch.float8_e8m0fnu)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        for m in (1, 4, 16, 64):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_gemm_torch(x, w8, scale, (128, 128)).float()
            wbytes = n * k + scale.numel()
            t_old = graph_time(functools.partial(fp8_gemm_triton, x, w8, scale, (128, 128)))
            t_bf = graph_time(functools.partial(torch.matmul, x, wb.T))
            t_swap, cfg = best_swap_config(x, w8, scale, ref)
            row = dict(shape=name, n=n, k=k, m=m, old_us=t_old, old_pct=wbytes / t_old / 1e6 / 4.8 * 100,
                       swap_us=t_swap, swap_pct=wbytes / t_swap / 1e6 / 4.8 * 100, swap_cfg=cfg,
                       bf16_us=t_bf, bf16_pct=2 * n * k / t_bf / 1e6 / 4.8 * 100)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
