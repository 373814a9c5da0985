"""Quantized GEMMs on DeepSeek-V4-Flash's shapes: the FP8 block-scaled GEMM and the grouped FP4 expert
GEMM (Triton, `kernels.fp8_gemm` / `kernels.fp4_gemm`) against torch's bf16 matmul on the same shapes.

    python -m deepinfer.benchmarks.quantized_gemm [--device cuda] [--tokens 1,4,16,64,256,1024,8192]
        [--experts 256] [--topk 6] [--tiny] [--json OUT]

Shapes (V4-Flash: hidden 4096, 64 heads x 512, q_lora 1024, o_groups 8 x o_lora 1024, expert width 2048):
FP8 linears wq_a [1024, 4096], wq_b [32768, 1024], wkv [512, 4096], wo_a [8192, 4096], wo_b [4096, 8192],
the shared expert's w1 [2048, 4096] and w2 [4096, 2048]; the routed experts as two grouped FP4 GEMMs,
w13 [E, 4096, 4096] and w2 [E, 4096, 2048], over tokens x topk (token, expert) pairs routed uniformly at
random. Weights are random codes and scales (timing only; correctness is the `gpu` tests' job).

Per shape and token count: median time (CUDA events after warmup; on CUDA by default of a CUDA-graph
replay of 10 captured calls, divided by 10, so the host's per-call overhead (Python checks, Triton's
launcher: ~100 us a call, which dominated the eager figures at decode sizes) is left out, as a decode
step captured in a graph would leave it out; `--eager` times plain calls), TFLOP/s (2*M*N*K per GEMM; for the
grouped GEMM over the routed pairs), GB/s of compulsory traffic (weights + scales read once, for the
grouped GEMM only the experts that received tokens; activations in and out), and that as a fraction of
`--hbm-tbps` (4.8 TB/s, the H200's datasheet figure). The bf16 baseline: `x @ W.T` with W bf16 [N, K];
for the experts, `torch._grouped_mm` over bf16 stacks where it runs, else a per-expert loop.
`--tiny` (and the CPU) runs small shapes through the torch references, a smoke test of this script.
The Triton ops time their candidate tile configs on the first call per shape (outside the timed and
captured calls); the JSON's "tuned" lists the picks.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

import deepinfer.kernels.fp4_gemm  # noqa: F401  (registers the FP4 ops)
import deepinfer.kernels.fp8_gemm  # noqa: F401  (registers the FP8 op)
from deepinfer.benchmarks.timing import time_call
from deepinfer.kernels.fp8_gemm import TUNED
from deepinfer.kernels.registry import default_impl, get_op

FP8_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_a": (8192, 4096),
              "wo_b": (4096, 8192), "shared_w1": (2048, 4096), "shared_w2": (4096, 2048)}
"""name -> (N, K) of V4-Flash's FP8 linears."""
HIDDEN, EXPERT_WIDTH = 4096, 2048


def time_graph(fn, device: torch.device, reps: int, calls: int = 10) -> float:
    """Median seconds of one `fn()` from CUDA-graph replays of `calls` captured calls (eager on failure)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError as exc:
        print(f"# graph capture failed ({str(exc).splitlines()[0]}); timing eager calls")
        return time_call(fn, device, reps)
    return time_call(graph.replay, device, reps) / calls


def _row(kind: str, name: str, m: int, n: int, k: int, impl: str, secs: float, nbytes: int, flops: float,
         hbm: float) -> dict:
    return {"kind": kind, "name": name, "tokens": m, "N": n, "K": k, "impl": impl, "us": secs * 1e6,
            "tflops": flops / secs / 1e12, "gbps": nbytes / secs / 1e9, "hbm_frac": nbytes / secs / (hbm * 1e12)}


def bench_fp8(device, tokens, shapes, reps, hbm, timer) -> list[dict]:
    gemm = get_op("fp8_gemm", default_impl("fp8_gemm", device))
    impl = default_impl("fp8_gemm", device)
    rows = []
    for name, (n, k) in shapes.items():
        w8 = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        scale = torch.randint(120, 128, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, device=device)
        scale = scale.view(torch.float8_e8m0fnu)
        wbf = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            act = 2 * m * (k + n)
            t_q = timer(lambda x=x, w8=w8, scale=scale: gemm(x, w8, scale, (128, 128)), device, reps)
            t_b = timer(lambda x=x, wbf=wbf: x @ wbf.T, device, reps)
            rows.append(_row("fp8", name, m, n, k, impl, t_q, n * k + scale.numel() + act, 2 * m * n * k, hbm))
            rows.append(_row("fp8", name, m, n, k, "torch_bf16", t_b, 2 * n * k + act, 2 * m * n * k, hbm))
    return rows


def _grouped_bf16(x, w, counts_list):
    """bf16 baseline for the grouped GEMM: x [R, K] sorted by expert, w [E, N, K]."""
    if x.device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        offs = torch.tensor(counts_list, device=x.device).cumsum(0).to(torch.int32)
        try:
            torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            return lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        except RuntimeError as exc:  # layouts or sizes it does not take: the loop below
            print(f"# torch._grouped_mm unavailable here ({str(exc).splitlines()[0]}); bf16 baseline is a loop")

    def loop():
        off = 0
        for e, c in enumerate(counts_list):
            if c:
                x[off:off + c] @ w[e].T
            off += c
    return loop


def bench_fp4_grouped(device, tokens, num_experts, topk, hidden, width, reps, hbm, timer) -> list[dict]:
    impl = default_impl("fp4_grouped_gemm", device)
    gemm = get_op("fp4_grouped_gemm", impl)
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for name, (n, k) in {"experts_w13": (2 * width, hidden), "experts_w2": (hidden, width)}.items():
        packed = torch.randint(-128, 128, (num_experts, n, k // 2), dtype=torch.int8, device=device)
        scale = torch.randint(120, 128, (num_experts, n, k // 32), dtype=torch.uint8, device=device)
        scale = scale.view(torch.float8_e8m0fnu)
        wbf = torch.randn(num_experts, n, k, device=device, dtype=torch.bfloat16)
        per_expert_q = n * k // 2 + n * k // 32
        for m in tokens:
            ids = torch.rand(m, num_experts, generator=g).argsort(dim=-1)[:, :topk]  # distinct experts per token
            counts = torch.bincount(ids.reshape(-1), minlength=num_experts)
            used = int((counts > 0).sum())
            r = m * topk
            x = torch.randn(r, k, device=device, dtype=torch.bfloat16)
            counts_dev = counts.to(device)
            act = 2 * r * (k + n)
            t_q = timer(lambda x=x, p=packed, s=scale, c=counts_dev: gemm(x, p, s, c), device, reps)
            t_b = timer(_grouped_bf16(x, wbf, counts.tolist()), device, reps)
            rows.append(_row("fp4_grouped", name, m, n, k, impl, t_q, used * per_expert_q + act, 2 * r * n * k, hbm))
            rows.append(_row("fp4_grouped", name, m, n, k, "torch_bf16", t_b, used * 2 * n * k + act, 2 * r * n * k,
                             hbm))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default="1,4,16,64,256,1024,8192")
    ap.add_argument("--experts", type=int, default=256, help="routed experts (E)")
    ap.add_argument("--topk", type=int, default=6, help="experts per token")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="the HBM bandwidth the fractions refer to")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a smoke run; implied on the CPU)")
    ap.add_argument("--skip-grouped", action="store_true")
    ap.add_argument("--eager", action="store_true", help="time plain calls, not CUDA-graph replays")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = torch.device(args.device)
    tokens = [int(t) for t in args.tokens.split(",")]
    shapes, experts, hidden, width = FP8_SHAPES, args.experts, HIDDEN, EXPERT_WIDTH
    if args.tiny or device.type == "cpu":
        shapes = {"tiny_a": (130, 256), "tiny_b": (256, 128)}
        experts, hidden, width, tokens = 4, 128, 64, [t for t in tokens if t <= 16] or [1]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    timing = "eager" if args.eager or device.type != "cuda" else "graph"
    timer = time_call if timing == "eager" else time_graph
    print(f"# {time.strftime('%Y-%m-%d')} device {device} ({name}), torch {torch.__version__}, timing {timing}")
    rows = bench_fp8(device, tokens, shapes, args.reps, args.hbm_tbps, timer)
    if not args.skip_grouped:
        rows += bench_fp4_grouped(device, tokens, experts, args.topk, hidden, width, args.reps, args.hbm_tbps, timer)
    print(f"{'kind':12} {'name':12} {'tokens':>6} {'N':>6} {'K':>6} {'impl':>11} {'us':>9} {'TFLOP/s':>8} "
          f"{'GB/s':>8} {'HBM%':>5}")
    for r in rows:
        print(f"{r['kind']:12} {r['name']:12} {r['tokens']:6d} {r['N']:6d} {r['K']:6d} {r['impl']:>11} "
              f"{r['us']:9.1f} {r['tflops']:8.2f} {r['gbps']:8.1f} {100 * r['hbm_frac']:5.1f}")
    tuned = {str(key): list(cfg) for key, cfg in TUNED.items()}  # the configs the first-call tuner picked
    for key, cfg in tuned.items():
        print(f"# tuned {key}: {cfg}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "date": time.strftime("%Y-%m-%d"), "timing": timing,
                                         "torch": torch.__version__, "rows": rows, "tuned": tuned}, indent=1))


if __name__ == "__main__":
    main()
