"""The FP8 block-scaled GEMM's decode-size configs, swap-AB against the plain kernel (issue 22's FP8 goal).

    python -m deepinfer.benchmarks.fp8_swap_ab --json OUT.json      (CUDA; a minute or two of compiling and timing)

`kernels.fp8_gemm._fp8_gemm_kernel` has two forms for decode sizes: plain (x @ W.T, the e4m3 weight tile converted
in registers is the dot's B operand and is re-staged through shared memory for the tensor cores) and SWAP
(out.T = W @ x.T, the converted tile is the A operand, which Hopper's wgmma reads from registers). The first-call
tuner picks among `fp8_gemm_candidates`, both kinds. This times every candidate under CUDA-graph replay on V4-Flash's FP8 projection shapes at 1-64 tokens and prints, per (shape, tokens), the best plain and the best
swap-AB config with their fraction of the card's copy rate (measured here), the tuner's pick,
and torch's bf16 matmul of the same shape. Every config is checked against the exact reference first.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from deepinfer.benchmarks.gpu_roofline import copy_rate
from deepinfer.benchmarks.quantized_gemm import FP8_SHAPES, time_graph
from deepinfer.kernels.fp8_gemm import TUNED, fp8_gemm_candidates, fp8_gemm_torch, fp8_gemm_triton


def graph_us(fn, device: torch.device) -> float:
    """Microseconds of one `fn()` under CUDA-graph replay (`quantized_gemm.time_graph`: 50 captured calls)."""
    return time_graph(fn, device, reps=5, calls=50) * 1e6


def _best(times: dict, swap: int):
    """(microseconds, config) of the fastest timed config of one kernel kind, or (None, None)."""
    mine = {c: t for c, t in times.items() if c[6] == swap}
    if not mine:
        return None, None
    cfg = min(mine, key=mine.__getitem__)
    return mine[cfg], cfg


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,4,16,32,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rate = copy_rate(dev) / 1e9  # GB/s, read + written (`gpu_roofline`'s roofline rate)
    print(f"# copy rate {rate:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        w8 = (torch.randn(n, k, device=dev) * 0.5).to(torch.float8_e4m3fn)
        codes = torch.randint(120, 130, (n // 128, k // 128), device=dev, dtype=torch.uint8)
        scale = codes.view(torch.float8_e8m0fnu)
        wb = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        wbytes = n * k + scale.numel()
        for m in map(int, args.tokens.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_gemm_torch(x, w8, scale, (128, 128)).float()
            times = {}
            for cfg in fp8_gemm_candidates(m):
                try:
                    got = fp8_gemm_triton(x, w8, scale, (128, 128), config=cfg).float()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    if err > 1e-2:
                        print(f"# {name} m={m} config {cfg}: WRONG (relative error {err:.3g})", flush=True)
                        continue
                    times[cfg] = graph_us(functools.partial(fp8_gemm_triton, x, w8, scale, (128, 128), config=cfg),
                                          dev)
                except Exception as exc:  # noqa: BLE001 - e.g. shared memory exceeded for one config
                    print(f"# {name} m={m} config {cfg} skipped: {type(exc).__name__}: {exc}", flush=True)
            TUNED.clear()
            fp8_gemm_triton(x, w8, scale, (128, 128))  # the tuner's pick (timed on its own first call)
            picked = next(iter(TUNED.values()), None)
            t_bf = graph_us(functools.partial(torch.matmul, x, wb.T), dev)

            t_plain, c_plain = _best(times, swap=0)
            t_swap, c_swap = _best(times, swap=1)
            pct = lambda t, nbytes: None if t is None else round(nbytes / t / 1e3 / rate * 100, 1)  # noqa: E731
            row = dict(shape=name, n=n, k=k, m=m, plain_us=t_plain, plain_pct=pct(t_plain, wbytes),
                       plain_cfg=c_plain, swap_us=t_swap, swap_pct=pct(t_swap, wbytes), swap_cfg=c_swap,
                       tuner_pick=picked, bf16_us=t_bf, bf16_pct=pct(t_bf, 2 * n * k))
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
