"""mHC pre-mix kernels (`kernels.mhc`): the "legacy" launches against the "split" variant's, per token count,
eagerly and replayed from a CUDA graph, with each variant's bits checked against "legacy".

    python -m deepinfer.benchmarks.gpu_mhc [--tokens 1,8,32,128,8192] [--json OUT]
    TRITON_INTERPRET=1 python -m deepinfer.benchmarks.gpu_mhc --smoke   # tiny shapes on the CPU

Shapes are V4-Flash's: hc_mult 4, hidden 4096, so the pre-mix `fn` is [24, 16384] and the head's [4, 16384]
(float32), the streams bf16, 20 Sinkhorn iterations. Cases (see `kernels.mhc._pre_launch_split`):

* `legacy`: `_mhc_proj_kernel` + `_mhc_mix_kernel` (what the H200 roofline of 2026-12-05 ran);
* `mix_split`: the legacy projection + `_mhc_mix_split_kernel` (the hidden-split mix alone);
* `split`: `_mhc_proj_nsplit_kernel` + `_mhc_mix_split_kernel` (the "split" variant below MATMUL_MIN_T);
* `matmul`: cuBLAS float32 x @ fn.T + `_mhc_sumsq_kernel` + the split mix (the variant from MATMUL_MIN_T on);
* `fused`: `_mhc_proj_kernel` with TF32X3 (x read once, sums of squares and a 3xTF32 x @ fn.T over token blocks and K
  chunks) + the split mix (from MATMUL_MIN_T on with DEEPINFER_MHC_LONG_PROJ=fused); time it against `matmul`
  with `--tokens 1024,8192`;
* `split_n{N}_t{DT}_k{DK}_h{H}`: `split` with PROJ_BLOCK_N N, PROJ_DOT_T DT, PROJ_DOT_K DK and MIX_BLOCK_H H
  (`--sweep`; T <= 128 only): pick the module's defaults from these;
* `matmul_h{H}`: `matmul` with MIX_BLOCK_H_LONG H (`--sweep`; T >= 1024 only);
* `fused_t{BT}_k{BK}_s{S}`: `fused` with FUSED_BLOCK_T BT, FUSED_BLOCK_K BK and S K chunks per token block (`auto`:
  the module's rule, `_fused_split`) (`--sweep`; T >= 1024 only).

`bit_identical` says whether a case's three outputs equal "legacy"'s (torch.equal); `max_abs_diff` is the
largest difference from "legacy" over them. Times are medians of CUDA-event timed calls after warm-up (10
calls from T = 1024 on); under a graph, `--graph-calls` calls (1 from T = 1024 on) are captured in one graph
and the replay's time divided by them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call

HC, HIDDEN, ITERS, EPS, NORM_EPS = 4, 4096, 20, 1e-6, 1e-6


def make_inputs(T: int, hc: int, hidden: int, device: torch.device, dtype: torch.dtype, head: bool, seed: int = 0):
    """Random streams [T, hc, hidden] and float32 fn / base / scale shaped like a layer's (or the head's)."""
    g = torch.Generator().manual_seed(seed)
    n = hc if head else (2 + hc) * hc
    streams = torch.randn(T, hc, hidden, generator=g).to(device, dtype)
    fn = (torch.randn(n, hc * hidden, generator=g) * 0.02).to(device)
    base = (torch.randn(n, generator=g) * 0.5).to(device)
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).to(device)
    return streams, fn, base, scale


def cases(sweep: bool, T: int) -> dict[str, dict]:
    """Case name -> keyword arguments of `kernels.mhc._pre_launch_split` (None: the legacy launches)."""
    out: dict[str, dict] = {"legacy": None, "mix_split": {"proj": "legacy"}, "split": {"proj": "nsplit"},
                            "matmul": {"proj": "matmul"}, "fused": {"proj": "fused"}}
    if sweep and T <= 128:
        combos = [(bn, 16, 128, 256) for bn in (4, 16, 32)]  # logit groups (32: one group, the legacy programs)
        combos += [(8, dt, 128, 256) for dt in (1, 4, 8)]  # dot rows: no masked FMAs at decode
        combos += [(8, 16, dk, 256) for dk in (32, 64)]  # dot columns: fewer operand registers
        combos += [(8, 1, 32, 256), (4, 1, 32, 256), (4, 1, 64, 512)]
        combos += [(8, 16, 128, bh) for bh in (128, 512, 1024)]  # mix programs per token block
        for bn, dt, dk, bh in combos:
            out[f"split_n{bn}_t{dt}_k{dk}_h{bh}"] = {"proj": "nsplit", "block_n": bn, "dot_t": dt, "dot_k": dk,
                                                     "block_h": bh}
    if sweep and T >= 1024:
        for bh in (256, 512, 2048, 4096):
            out[f"matmul_h{bh}"] = {"proj": "matmul", "block_h": bh}
        combos = [(bt, bk, None) for bt, bk in ((64, 32), (64, 128), (128, 64), (128, 32), (32, 64))]
        combos += [(64, 64, sp) for sp in (1, 2, 4, 8, 16)]  # K chunks: programs against partials
        for bt, bk, sp in combos:
            out[f"fused_t{bt}_k{bk}_s{sp or 'auto'}"] = {"proj": "fused", "fused_block_t": bt, "fused_block_k": bk,
                                                        "fused_split": sp}
    return out


def graph_time(fn, device: torch.device, reps: int, calls: int) -> float:
    """Median seconds of one `fn()` replayed from a CUDA graph holding `calls` calls of it."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_call(graph.replay, device, reps) / calls


def once(fn) -> float:
    """Seconds of one `fn()` (the smoke run: the interpreter is the cost, not the kernels)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(tokens: list[int], device: torch.device, dtype: torch.dtype, hc: int, hidden: int, reps: int,
        graphs: bool, graph_calls: int, sweep: bool, ops: list[str], iters: int = ITERS) -> list[dict]:
    from deepinfer.kernels import mhc

    results = []
    print("| op | T | case | us eager | us graph | bit-identical to legacy | max abs diff |")
    print("|---|---:|---|---:|---:|---|---:|")
    for op in ops:
        head = op == "head"
        op_iters = 1 if head else iters
        for T in tokens:
            streams, fn, base, scale = make_inputs(T, hc, hidden, device, dtype, head, seed=T)
            ref = None
            for name, kw in cases(sweep, T).items():
                args = (streams, fn, base, scale, op_iters, EPS, NORM_EPS, head)
                if kw is None:
                    def call(args=args):
                        return mhc._pre_launch_legacy(*args)
                else:
                    def call(args=args, kw=kw):
                        return mhc._pre_launch_split(*args, **kw)
                with torch.inference_mode():
                    got = call()
                    if ref is None:
                        ref = got
                    outs = (0,) if head else (0, 1, 2)
                    same = all(torch.equal(got[i], ref[i]) for i in outs)
                    diff = max((got[i].float() - ref[i].float()).abs().max().item() if T else 0.0 for i in outs)
                    # NOTE: long chunks take milliseconds a call (the legacy projection ~20 ms at 8,192 tokens)
                    n = reps if T < 1024 else min(reps, 10)
                    eager = time_call(call, device, n) if n else once(call)
                    graph = graph_time(call, device, n, graph_calls if T < 1024 else 1) if graphs else None
                row = {"op": op, "tokens": T, "case": name, "us_eager": eager * 1e6,
                       "us_graph": None if graph is None else graph * 1e6, "bit_identical": same,
                       "max_abs_diff": diff}
                results.append(row)
                g = "n/a" if graph is None else f"{graph * 1e6:.1f}"
                print(f"| {op} | {T} | {name} | {eager * 1e6:.1f} | {g} | {same} | {diff:.2e} |", flush=True)
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.gpu_mhc", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,128,8192", help="token counts T per call")
    ap.add_argument("--ops", default="pre,head", help="pre (a layer's mhc_pre) and/or head (mhc_head)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--graph-calls", type=int, default=10, help="calls captured in one CUDA graph")
    ap.add_argument("--no-graphs", action="store_true", help="eager timings only")
    ap.add_argument("--sweep", action="store_true", help="also other tilings (see the split_* and matmul_h* cases)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU under TRITON_INTERPRET=1: tiny shapes (hc 4, hidden 64), T 1 and 17, 2 Sinkhorn "
                         "iterations, one timed call")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            if "deepinfer.kernels.mhc" in sys.modules:
                raise SystemExit("--smoke needs TRITON_INTERPRET=1 set before the kernels are imported")
            os.environ["TRITON_INTERPRET"] = "1"
        device, dtype, hc, hidden = torch.device("cpu"), torch.bfloat16, 4, 64
        tokens, reps, graphs, iters = [1, 17], 0, False, 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --smoke on the CPU)")
        device, dtype, hc, hidden = torch.device("cuda"), torch.bfloat16, HC, HIDDEN
        tokens, reps, graphs, iters = [int(t) for t in args.tokens.split(",")], args.reps, not args.no_graphs, ITERS
    import triton

    from deepinfer.kernels import mhc

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}, hc {hc}, hidden {hidden}, "
          f"{dtype}, K_SLICE {mhc.K_SLICE}, PROJ_BLOCK_N {mhc.PROJ_BLOCK_N}, PROJ_DOT_T {mhc.PROJ_DOT_T}, "
          f"PROJ_DOT_K {mhc.PROJ_DOT_K}, MIX_BLOCK_H {mhc.MIX_BLOCK_H} ({mhc.MIX_BLOCK_H_LONG} from T 1024), "
          f"FUSED_BLOCK_T {mhc.FUSED_BLOCK_T}, FUSED_BLOCK_K {mhc.FUSED_BLOCK_K}, FUSED_PROGRAMS {mhc.FUSED_PROGRAMS}")
    if mhc._cublas_tf32():
        raise SystemExit("TF32 is on for cuBLAS float32 matmuls: the matmul case would not be float32")
    results = run(tokens, device, dtype, hc, hidden, reps, graphs, args.graph_calls, args.sweep,
                  args.ops.split(","), iters)
    report = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "config": {"hc": hc, "hidden": hidden, "dtype": str(dtype).removeprefix("torch."),
                         "iters_pre": iters, "k_slice": mhc.K_SLICE, "proj_block_n": mhc.PROJ_BLOCK_N,
                         "mix_block_h": mhc.MIX_BLOCK_H, "mix_block_h_long": mhc.MIX_BLOCK_H_LONG,
                         "matmul_min_t": mhc.MATMUL_MIN_T, "long_proj": mhc.LONG_PROJ,
                         "fused_block_t": mhc.FUSED_BLOCK_T, "fused_block_k": mhc.FUSED_BLOCK_K,
                         "fused_programs": mhc.FUSED_PROGRAMS},
              "results": results}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
