"""The `"triton"` MoE backend's kernels and the fused mHC ops on DeepSeek-V4-Flash's shapes, against the
memory roofline.

    python -m deepinfer.benchmarks.moe_kernels [--tokens 1,32,128,4096] [--experts 64,256] [--topk 6]
        [--formats bf16,fp4] [--copy-tbps 4.3] [--json OUT] [--tiny]

Routed experts (hidden 4096, expert width 2048, top-6; 64 and 256 experts; tokens routed uniformly at
random to distinct experts; random weights: timing only, correctness is the tests' job):
  * `triton`: the backend's four launches (`kernels.moe_gemm`: align, gate/up + SwiGLU, down + weight,
    combine), bf16 experts or FP4 experts (E2M1 + UE8M0 scales, decoded in registers);
  * `grouped_mm` (bf16): the same align and combine around torch's `_grouped_mm` for the two projections
    (x gathered, SwiGLU and weighting as torch ops), the alternative the backend could have used;
  * `fp4_op` (FP4): the same around the existing `"fp4_grouped_gemm"` op (`kernels.fp4_gemm`).
Each is timed as a CUDA-graph replay of `--reps` captured calls (divided by `--reps`), so the host's
per-launch cost is left out as in a captured decode step; CUDA events, median of `--iters` replays,
after the first call (which compiles and times the tile configs). GB/s counts the weights actually touched
(the experts that received a token: 3 x 2048 x 4096 weights each, 2 bytes in bf16, 0.5 + 1/32 in FP4)
and the activations in and out; "of copy" is that against `--copy-tbps` (the device-to-device copy rate
measured on the H200: 4.3 TB/s).

Also: the routing kernel (`kernels.moe_routing`) against the torch router's ops after the gate matmul,
and the fused mHC pre/post mix (`kernels.mhc`, hc 4) against the reference ops (with the Triton Sinkhorn,
as the model ran on CUDA before), both captured the same way.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deepinfer.benchmarks.timing import time_call
from deepinfer.kernels import get_op
from deepinfer.kernels import moe_gemm as mg
from deepinfer.kernels.fp8_gemm import TUNED


def graph_seconds(fn, reps: int, iters: int) -> float:
    """Seconds of one `fn()` from a CUDA graph of `reps` captured calls (after one eager warm-up call)."""
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    sec = time_call(graph.replay, torch.device("cuda"), iters) / reps
    del graph
    return sec


def expert_weights(num_experts: int, hidden: int, inter: int, fmt: str, device: torch.device):
    """Random stacked expert weights: (w13, w2) as the backend holds them, and the bytes of one expert."""
    if fmt == "bf16":
        w13 = (torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16) * 0.02,)
        w2 = (torch.randn(num_experts, hidden, inter, device=device, dtype=torch.bfloat16) * 0.02,)
        return w13, w2, 3 * inter * hidden * 2

    def fp4(n: int, k: int):
        packed = torch.randint(-128, 128, (num_experts, n, k // 2), dtype=torch.int8, device=device)
        scale = torch.randint(118, 124, (num_experts, n, k // 32), dtype=torch.uint8, device=device)
        return packed, scale.view(torch.float8_e8m0fnu)

    return fp4(2 * inter, hidden), fp4(hidden, inter), 3 * inter * hidden * (0.5 + 1 / 32)


def _routed_variants(x, ids, tw, w13, w2, wfmt: int, fmt: str, inter: int) -> dict:
    """The timed forwards of one routed case: name -> fn() (see the module docstring)."""
    align, up, down = get_op("moe_align", "triton"), get_op("moe_up", "triton"), get_op("moe_down", "triton")
    combine = get_op("moe_combine", "triton")
    num_experts, k = w13[0].shape[0], ids.shape[1]

    def triton_fwd():
        sp, cnt = align(ids, num_experts)
        act = up(x, w13, sp, cnt, k, 10.0, wfmt)
        return combine(down(act, w2, sp, cnt, tw, wfmt), ids)

    def swiglu_around(gemm13, gemm2):
        """align, x gathered, gemm13, SwiGLU, gemm2, weighting, pair order, combine (torch ops between)."""
        sp, cnt = align(ids, num_experts)
        rows = sp.long()
        h = gemm13(x[rows // k], cnt)
        a = F.silu(h[:, :inter].clamp(max=10.0)) * h[:, inter:].clamp(min=-10.0, max=10.0)
        y = gemm2(a.contiguous(), cnt) * tw.reshape(-1)[rows, None]
        y_pair = torch.empty_like(y)
        y_pair[rows] = y
        return combine(y_pair, ids)

    variants = {"triton": triton_fwd}
    if fmt == "bf16" and hasattr(torch, "_grouped_mm"):
        w13t, w2t = w13[0].transpose(1, 2), w2[0].transpose(1, 2)  # [E, H, 2I], [E, I, H]

        def grouped(w):
            return lambda a, cnt: torch._grouped_mm(a, w, offs=cnt.cumsum(0).to(torch.int32))

        variants["grouped_mm"] = lambda: swiglu_around(grouped(w13t), grouped(w2t))
    if fmt == "fp4":
        gemm = get_op("fp4_grouped_gemm", "triton")
        variants["fp4_op"] = lambda: swiglu_around(lambda a, cnt: gemm(a, w13[0], w13[1], cnt),
                                                   lambda a, cnt: gemm(a, w2[0], w2[1], cnt))
    return variants


def routed_cases(args, device: torch.device, out: list[dict]) -> None:
    hidden, inter, k = args.hidden, args.inter, args.topk
    for fmt in args.formats:
        wfmt = mg.WFMT_FLOAT if fmt == "bf16" else mg.WFMT_FP4
        for num_experts in args.experts:
            w13, w2, expert_bytes = expert_weights(num_experts, hidden, inter, fmt, device)
            for tokens in args.tokens:
                g = torch.Generator(device=device).manual_seed(tokens)
                x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
                ids = torch.rand(tokens, num_experts, device=device, generator=g).argsort(dim=1)[:, :k].contiguous()
                tw = torch.rand(tokens, k, device=device, generator=g).bfloat16()
                touched = int((torch.bincount(ids.reshape(-1), minlength=num_experts) > 0).sum())
                act_bytes = tokens * hidden * 2 * 2 + tokens * k * (2 * inter + hidden) * 2 * 2
                nbytes = touched * expert_bytes + act_bytes
                for name, fn in _routed_variants(x, ids, tw, w13, w2, wfmt, fmt, inter).items():
                    reps = args.reps if tokens < 1024 else 2
                    try:
                        sec = graph_seconds(fn, reps, args.iters)
                    except Exception as exc:  # noqa: BLE001 - e.g. _grouped_mm not built for this device
                        print(f"# {fmt} E={num_experts} T={tokens} {name}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    row = {"kind": "routed", "format": fmt, "experts": num_experts, "tokens": tokens, "impl": name,
                           "us": sec * 1e6, "experts_touched": touched, "bytes": nbytes, "gbps": nbytes / sec / 1e9,
                           "of_copy": nbytes / sec / (args.copy_tbps * 1e12),
                           "tflops": 2 * 3 * tokens * k * hidden * inter / sec / 1e12}
                    out.append(row)
                    print(f"{fmt:5s} E={num_experts:4d} T={tokens:5d} {name:11s} {row['us']:9.1f} us  "
                          f"{touched:4d} experts {nbytes / 1e6:9.1f} MB  {row['gbps']:7.0f} GB/s  "
                          f"{row['of_copy'] * 100:5.1f}% of copy  {row['tflops']:6.1f} TFLOP/s", flush=True)
            w13 = w2 = None
            torch.cuda.empty_cache()


def routing_cases(args, device: torch.device, out: list[dict]) -> None:
    ref, fast = get_op("moe_routing", "torch"), get_op("moe_routing", "triton")
    for num_experts in args.experts:
        bias = torch.randn(num_experts, device=device) * 0.01
        for tokens in args.tokens:
            logits = torch.randn(tokens, num_experts, device=device).bfloat16()
            for name, op in (("torch", ref), ("triton", fast)):
                call = functools.partial(op, logits, args.topk, "sqrtsoftplus", 1.5, bias=bias)
                sec = graph_seconds(call, args.reps, args.iters)
                out.append({"kind": "routing", "experts": num_experts, "tokens": tokens, "impl": name, "us": sec * 1e6})
                print(f"routing E={num_experts:4d} T={tokens:5d} {name:7s} {sec * 1e6:8.1f} us", flush=True)


def _mix(pre, post, streams, y, fn, base, scale, sinkhorn):
    hc = streams.shape[1]
    coll, p, c = pre(streams, fn, base, scale, hc, 20, 1e-6, 1e-6, sinkhorn)
    return coll, post(y, streams, p, c)


def mhc_cases(args, device: torch.device, out: list[dict]) -> None:
    hc, hidden = 4, args.hidden
    n = (2 + hc) * hc
    fn = torch.randn(n, hc * hidden, device=device) * 0.01
    base, scale = torch.zeros(n, device=device), torch.ones(3, device=device)
    sinkhorn = get_op("sinkhorn", "triton")
    impls = {"torch": (get_op("mhc_pre", "torch"), get_op("mhc_post", "torch")),
             "triton": (get_op("mhc_pre", "triton"), get_op("mhc_post", "triton"))}
    for tokens in args.tokens:
        streams = torch.randn(tokens, hc, hidden, device=device).bfloat16()
        y = torch.randn(tokens, hidden, device=device).bfloat16()
        nbytes = 2 * streams.numel() * 2 + fn.numel() * 4 + tokens * hidden * 2 * 2  # streams in twice, out; fn
        for name, (pre, post) in impls.items():
            call = functools.partial(_mix, pre, post, streams, y, fn, base, scale, sinkhorn)
            sec = graph_seconds(call, args.reps, args.iters)
            out.append({"kind": "mhc", "tokens": tokens, "impl": name, "us": sec * 1e6, "bytes": nbytes,
                        "gbps": nbytes / sec / 1e9})
            print(f"mhc pre+post T={tokens:5d} {name:7s} {sec * 1e6:8.1f} us  {nbytes / sec / 1e9:7.0f} GB/s", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,32,128,4096")
    p.add_argument("--experts", default="64,256")
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--formats", default="bf16,fp4")
    p.add_argument("--parts", default="routed,routing,mhc")
    p.add_argument("--reps", type=int, default=10, help="calls captured per graph (2 at >= 1024 tokens)")
    p.add_argument("--iters", type=int, default=10, help="graph replays timed (median)")
    p.add_argument("--copy-tbps", type=float, default=4.3)
    p.add_argument("--tiny", action="store_true", help="small shapes (a smoke test of this script)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernels needs a CUDA device (the kernels' CPU tests run under TRITON_INTERPRET=1)")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.experts = [int(e) for e in args.experts.split(",")]
    args.formats = args.formats.split(",")
    if args.tiny:
        args.hidden, args.inter, args.tokens, args.experts = 256, 128, [1, 64], [8]
    device = torch.device("cuda")
    out: list[dict] = []
    t0 = time.time()
    parts = {"routed": routed_cases, "routing": routing_cases, "mhc": mhc_cases}
    for part in args.parts.split(","):
        parts[part](args, device, out)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host": platform.node(),
                  "date": time.strftime("%Y-%m-%d"), "hidden": args.hidden, "inter": args.inter, "topk": args.topk,
                  "copy_tbps": args.copy_tbps, "seconds": time.time() - t0, "rows": out,
                  "tuned": {repr(k): v for k, v in TUNED.items() if k[0] in ("moe_up", "moe_down")}}
        if args.json:  # after every part: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"# {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
