"""mHC Sinkhorn op: each registered implementation's time per call on one device, and its largest
difference from the CPU torch reference (the oracle).

    python -m deepinfer.benchmarks.sinkhorn [--device cuda] [--rows 1,64,1024,8192,65536] [--json OUT]

Inputs are what the model feeds the op: row-softmaxed [T, hc, hc] float32 matrices plus `eps`, with
V4's `hc_mult` 4 and 20 iterations. Times are medians of CUDA-event timed calls after warmup
(`time.perf_counter` around each call on the CPU).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call
from deepinfer.kernels.registry import get_op, op_impl_names
from deepinfer.kernels.sinkhorn import sinkhorn_torch

HC, ITERS, EPS = 4, 20, 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="1,64,1024,8192,65536", help="matrices per call (T)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    impls = [n for n in op_impl_names("sinkhorn") if device.type == "cpu" or n != "numpy_cpu"]
    if device.type == "cpu":
        impls = [n for n in impls if n != "triton"]
    results = []
    print(f"# device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, hc {HC}, iters {ITERS}")
    print("| T | impl | us per call | max abs diff vs CPU torch |")
    print("|---:|---|---:|---:|")
    for num_rows in [int(r) for r in args.rows.split(",")]:
        g = torch.Generator().manual_seed(num_rows)
        comb = torch.softmax(torch.randn(num_rows, HC, HC, generator=g) * 3, dim=-1) + EPS
        ref = sinkhorn_torch(comb, ITERS, EPS)
        x = comb.to(device)
        for name in impls:
            fn = get_op("sinkhorn", name)
            with torch.inference_mode():
                out = fn(x, ITERS, EPS)
                seconds = time_call(lambda fn=fn, x=x: fn(x, ITERS, EPS), device, args.reps)
            diff = (out.cpu() - ref).abs().max().item()
            results.append({"rows": num_rows, "impl": name, "us_per_call": seconds * 1e6, "max_abs_diff": diff})
            print(f"| {num_rows} | {name} | {seconds * 1e6:.1f} | {diff:.2e} |")
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "torch": torch.__version__, "results": results},
                                        indent=1))


if __name__ == "__main__":
    main()
