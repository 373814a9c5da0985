"""The `"triton"` MoE backend's kernels and the fused mHC ops on DeepSeek-V4-Flash's shapes, against the
memory roofline.

    python -m deepinfer.benchmarks.moe_kernels [--tokens 1,32,128,4096] [--experts 64,256] [--topk 6]
        [--formats bf16,fp4] [--parts routed,routing,mhc,prefill] [--prefill-tokens 8192]
        [--copy-tbps 4.3] [--json OUT] [--tiny]

Routed experts (hidden 4096, expert width 2048, top-6; 64 and 256 experts; tokens routed uniformly at
random to distinct experts; random weights: timing only, correctness is the tests' job):
  * `triton`: the backend's four launches (`kernels.moe_gemm`: align, gate/up + SwiGLU, down + weight,
    combine), bf16 experts or FP4 experts (E2M1 + UE8M0 scales, decoded in registers);
  * `grouped_mm` (bf16): the backend's large-batch route (`triton_backend.grouped_mm_experts`, taken from
    `DEEPINFER_MOE_GROUPED_MM_MIN_ROWS` rows): the same align and combine around torch's `_grouped_mm` for
    the projections (x gathered, gate and up as two grouped GEMMs, the `"swiglu"` op, the rows put back at
    their pairs and weighted);
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

`--parts prefill` (issue 22's prefill MFU): one `--prefill-tokens` prompt (8,192) through 64 bf16 experts
(or the first of `--experts`), top-6, width 2048, hidden 4096 — one MoE layer of the prefill case of
`gpu_roofline` — run eagerly as a prefill step runs: `triton` (the four kernels) against `grouped_mm` (the
route), each whole and split into its up part (align, gate/up, SwiGLU) and down part (down, weighting,
combine); TFLOP/s and the fraction of a measured bf16 8192^3 matmul; the route's largest deviation from the
Triton path (relative to the output's mean magnitude) and each path's peak extra memory.
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
from deepinfer.engine.moe.triton_backend import fp4_grouped_mm_experts, grouped_mm_experts
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


def triton_forward(x, ids, tw, w13, w2, wfmt: int = mg.WFMT_FLOAT, limit: float = 10.0):
    """The backend's four Triton launches (align, gate/up + SwiGLU, down + weight, combine) over stacked experts."""
    align, up, down = get_op("moe_align", "triton"), get_op("moe_up", "triton"), get_op("moe_down", "triton")
    sp, cnt = align(ids, w13[0].shape[0])
    act = up(x, w13, sp, cnt, ids.shape[1], limit, wfmt)
    return get_op("moe_combine", "triton")(down(act, w2, sp, cnt, tw, wfmt), ids)


def _routed_variants(x, ids, tw, w13, w2, wfmt: int, fmt: str, inter: int) -> dict:
    """The timed forwards of one routed case: name -> fn() (see the module docstring)."""
    align, combine = get_op("moe_align", "triton"), get_op("moe_combine", "triton")
    num_experts, k = w13[0].shape[0], ids.shape[1]

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

    variants = {"triton": functools.partial(triton_forward, x, ids, tw, w13, w2, wfmt)}
    if fmt == "bf16" and hasattr(torch, "_grouped_mm"):
        swiglu = get_op("swiglu", "triton")
        variants["grouped_mm"] = functools.partial(grouped_mm_experts, x, tw, ids, w13[0], w2[0], 10.0, align, swiglu,
                                                   combine)
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


def _matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """TFLOP/s of a bf16 n^3 matmul (the MFU denominator of `gpu_roofline`)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / time_call(lambda: a @ b, device, iters) / 1e12


def _peak_extra_bytes(fn, device: torch.device) -> int:
    """Bytes `fn()` allocates at its peak above what was allocated before it (its output included)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) - base


def prefill_cases(args, device: torch.device, out: list[dict]) -> None:
    """The Triton path against the `_grouped_mm` route at a prefill's size, eagerly (module docstring)."""
    hidden, inter, k, tokens, num_experts = args.hidden, args.inter, args.topk, args.prefill_tokens, args.experts[0]
    align, up, down = get_op("moe_align", "triton"), get_op("moe_up", "triton"), get_op("moe_down", "triton")
    combine, swiglu = get_op("moe_combine", "triton"), get_op("swiglu", "triton")
    w13, w2, _ = expert_weights(num_experts, hidden, inter, "bf16", device)
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
    ids = torch.rand(tokens, num_experts, device=device, generator=g).argsort(dim=1)[:, :k].contiguous()
    tw = torch.rand(tokens, k, device=device, generator=g)  # float32, as the router gives them
    rows, limit = tokens * k, 10.0
    sp, cnt = align(ids, num_experts)
    offs = cnt.cumsum(0, dtype=torch.int32)
    act = up(x, w13, sp, cnt, k, limit)
    w13t = w13[0].transpose(1, 2)

    def grouped_up():
        xs = x.index_select(0, sp // k)
        return swiglu(torch._grouped_mm(xs, w13t[:, :, :inter], offs=offs),
                      torch._grouped_mm(xs, w13t[:, :, inter:], offs=offs), limit)

    def grouped_down():
        y_sorted = torch._grouped_mm(act, w2[0].transpose(1, 2), offs=offs)
        y = torch.empty_like(y_sorted)
        y.index_copy_(0, sp.long(), y_sorted)
        return combine(y.mul_(tw.reshape(-1, 1).bfloat16()), ids)

    flops = {"whole": 2 * 3 * rows * hidden * inter, "up": 2 * 2 * rows * hidden * inter, "down": 2 * rows * hidden * inter}
    variants = {
        ("triton", "whole"): functools.partial(triton_forward, x, ids, tw, w13, w2, limit=limit),
        ("triton", "up"): lambda: up(x, w13, *align(ids, num_experts), k, limit),
        ("triton", "down"): lambda: combine(down(act, w2, sp, cnt, tw), ids),
        ("grouped_mm", "whole"): functools.partial(grouped_mm_experts, x, tw, ids, w13[0], w2[0], limit, align,
                                                   swiglu, combine),
        ("grouped_mm", "up"): lambda: (align(ids, num_experts), grouped_up()),
        ("grouped_mm", "down"): grouped_down,
    }
    matmul = _matmul_tflops(device)
    ref = variants[("triton", "whole")]().float()
    got = variants[("grouped_mm", "whole")]().float()
    dev = ((got - ref).abs().max() / ref.abs().mean()).item()
    for (impl, part), fn in variants.items():
        sec = time_call(fn, device, args.iters)
        row = {"kind": "prefill", "format": "bf16", "experts": num_experts, "tokens": tokens, "impl": impl,
               "part": part, "ms": sec * 1e3, "tflops": flops[part] / sec / 1e12, "matmul_tflops": matmul,
               "of_matmul": flops[part] / sec / 1e12 / matmul}
        if part == "whole":
            row.update(peak_extra_mb=_peak_extra_bytes(fn, device) / 1e6,
                       max_dev_vs_triton=dev if impl == "grouped_mm" else 0.0)
        out.append(row)
        print(f"prefill bf16 E={num_experts} T={tokens} {impl:10s} {part:5s} {row['ms']:8.3f} ms "
              f"{row['tflops']:6.1f} TFLOP/s  {100 * row['of_matmul']:5.1f}% of matmul ({matmul:.0f})"
              + (f"  peak +{row['peak_extra_mb']:.0f} MB" if part == "whole" else "")
              + (f"  max |route - triton| / mean |triton| {dev:.2e}" if impl == "grouped_mm" and part == "whole" else ""),
              flush=True)


def _dequant_every(dequant, w13, w2, scratch) -> None:
    dequant(*w13, 32, out=scratch[0])
    dequant(*w2, 32, out=scratch[1])


def prefill_fp4_cases(args, device: torch.device, out: list[dict]) -> None:
    """FP4 experts at prefill sizes: the Triton FP4 kernels against the dequantize-then-`_grouped_mm` route
    (`triton_backend.fp4_grouped_mm_experts`, 1 GiB of scratch), eagerly, per expert count and token count; the
    route's dequantization alone (every expert once) too. Where the route wins sets
    `DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT`."""
    hidden, inter, k, limit = args.hidden, args.inter, args.topk, 10.0
    ops = [get_op(name, "triton") for name in ("moe_align", "swiglu", "moe_combine", "fp4_dequant")]
    matmul = _matmul_tflops(device)
    for num_experts in args.experts:
        w13, w2, _ = expert_weights(num_experts, hidden, inter, "fp4", device)
        scratch = (torch.empty(num_experts, 2 * inter, hidden, device=device, dtype=torch.bfloat16),
                   torch.empty(num_experts, hidden, inter, device=device, dtype=torch.bfloat16))
        sec = time_call(functools.partial(_dequant_every, ops[3], w13, w2, scratch), device, args.iters)
        scratch = None
        nbytes = num_experts * 3 * hidden * inter * (0.5 + 1 / 32 + 2)
        out.append({"kind": "prefill_fp4", "experts": num_experts, "impl": "dequant_all", "ms": sec * 1e3,
                    "gbps": nbytes / sec / 1e9})
        print(f"prefill fp4 E={num_experts} dequantize every expert {sec * 1e3:8.3f} ms {nbytes / sec / 1e9:7.0f} GB/s",
              flush=True)
        for tokens in args.fp4_prefill_tokens:
            g = torch.Generator(device=device).manual_seed(tokens)
            x = torch.randn(tokens, hidden, device=device, generator=g).bfloat16()
            ids = torch.rand(tokens, num_experts, device=device, generator=g).argsort(dim=1)[:, :k].contiguous()
            tw = torch.rand(tokens, k, device=device, generator=g)
            kernels = functools.partial(triton_forward, x, ids, tw, w13, w2, mg.WFMT_FP4, limit)
            route = functools.partial(fp4_grouped_mm_experts, x, tw, ids, w13, w2, 32, limit, *ops)
            ref, got = kernels().float(), route().float()
            dev = ((got - ref).abs().max() / ref.abs().mean()).item()
            flops = 2 * 3 * tokens * k * hidden * inter
            for impl, fn in (("triton", kernels), ("dequant_route", route)):
                sec = time_call(fn, device, args.iters)
                row = {"kind": "prefill_fp4", "experts": num_experts, "tokens": tokens, "rows_per_expert":
                       tokens * k / num_experts, "impl": impl, "ms": sec * 1e3, "tflops": flops / sec / 1e12,
                       "of_matmul": flops / sec / 1e12 / matmul, "matmul_tflops": matmul,
                       "peak_extra_mb": _peak_extra_bytes(fn, device) / 1e6,
                       "max_dev_vs_triton": dev if impl != "triton" else 0.0}
                out.append(row)
                print(f"prefill fp4 E={num_experts} T={tokens} ({tokens * k // num_experts} rows/expert) {impl:13s} "
                      f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s {100 * row['of_matmul']:5.1f}% of matmul "
                      f"peak +{row['peak_extra_mb']:.0f} MB" + (f"  max dev {dev:.2e}" if impl != "triton" else ""),
                      flush=True)


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
    p.add_argument("--parts", default="routed,routing,mhc", help="any of routed,routing,mhc,prefill,prefill_fp4")
    p.add_argument("--fp4-prefill-tokens", default="1024,4096,8192,32768", help="tokens of the prefill_fp4 part")
    p.add_argument("--prefill-tokens", type=int, default=8192, help="tokens of the prefill part")
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
    args.fp4_prefill_tokens = [int(t) for t in args.fp4_prefill_tokens.split(",")]
    if args.tiny:
        args.hidden, args.inter, args.tokens, args.experts, args.prefill_tokens = 256, 128, [1, 64], [8], 256
        args.fp4_prefill_tokens = [256]
    device = torch.device("cuda")
    out: list[dict] = []
    t0 = time.time()
    parts = {"routed": routed_cases, "routing": routing_cases, "mhc": mhc_cases, "prefill": prefill_cases,
             "prefill_fp4": prefill_fp4_cases}
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
