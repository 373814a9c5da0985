"""Prefill attention kernel (`kernels.prefill_attention`) at V4-Flash shapes: time per chunk and layer, and
the TFLOP/s it reaches on the FLOPs it must do.

    python -m deepinfer.benchmarks.prefill_attention [--chunks 8192] [--starts 0,65536] [--kinds swa,csa,hca]
        [--kernels legacy,legacy_aligned,m64:n16,m64,m64:n32:s3,m64:n64] [--block-h 32] [--block-n 32] [--warps 8] [--indexer]
        [--json OUT]

Shapes: 64 query heads x head_dim 512 over one shared K=V head, window 128, CSA rate 4 with the indexer's
top-512 per query (random picks among the visible entries), HCA rate 128 (every visible entry), bf16. One
chunk of `--chunks` tokens starting at position `--starts` (the ring holds the history before it). FLOPs:
`4 * 512` per head and (query, key) pair attended (QK and PV), the keys a query sees: its window (fewer
at the start of a request) plus its entries; the reference rate is a bf16 8192^3 `torch.matmul` measured
in the same run (MFU = achieved / that). `--indexer` also times the CSA selection the `triton` backend
runs for a chunk (`indexer_topk` with every query a row: 64 heads x 128 scores over the visible index keys,
then the top-512). Times are medians of CUDA-event timed calls (`benchmarks.timing`); `max diff` is
against the torch reference on the chunk's first 256 queries.

`--kernels` times the Triton kernel variants side by side on the same inputs (`kernels.prefill_attention.VARIANTS`,
the wrapper's `variant=`): each entry is a variant with optional `:n<keys per tile>`, `:h<heads per program>`,
`:w<warps>`, `:s<pipeline stages>` (e.g. `m64:n32:s3`); a bare `legacy` / `legacy_aligned` takes `--block-h` /
`--block-n` / `--warps`, other fields left out take the variant's defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call

NH, D, W, CSA_RATE, HCA_RATE, TOPK, BLOCK, IH, ID = 64, 512, 128, 4, 128, 512, 128, 64, 128


def _case(kind: str, n: int, p0: int, device):
    """Inputs of one chunk and layer (ring slot 0), and its FLOPs."""
    from deepinfer.kernels.prefill_attention import PrefillSpans, prefill_flops

    dt = torch.bfloat16 if device.type == "cuda" else torch.float32  # the interpreter's bf16 dots are not exact
    q = torch.randn(n, NH, D, device=device, dtype=dt)
    kv = torch.randn(n, D, device=device, dtype=dt)
    ring = torch.randn(2, W, D, device=device, dtype=dt)
    sink = torch.randn(NH, device=device)
    comp = entries = None
    rate = CSA_RATE if kind == "csa" else HCA_RATE
    pos = p0 + torch.arange(n, device=device)
    vis = (pos + 1) // rate
    if kind != "swa":
        comp = torch.randn((p0 + n) // rate, D, device=device, dtype=dt)
    if kind == "csa":
        # TOPK random visible picks per query (-1 past the visible count), in no particular order
        r = torch.rand(n, comp.shape[0], device=device).masked_fill(
            torch.arange(comp.shape[0], device=device)[None, :] >= vis[:, None], 2.0)
        k = min(TOPK, comp.shape[0])
        entries = r.argsort(dim=1)[:, :k]
        entries = torch.where(torch.arange(k, device=device)[None, :] < vis[:, None], entries, -1).contiguous()
    counts = (vis.clamp(max=TOPK) if kind == "csa" else vis).tolist() if kind != "swa" else [0] * n
    flops = prefill_flops(n, p0, NH, D, W, 0, lambda i: counts[i])
    spans = PrefillSpans.single(n, p0, 0, 0, rate if kind != "swa" else 0, device)
    return (q, kv, ring, spans, comp, entries, sink), flops


def parse_kernel(spec: str, block_h: int | None = None, block_n: int | None = None,
                 warps: int | None = None) -> dict:
    """`variant[:n<block_n>][:h<block_h>][:w<warps>][:s<stages>]` -> the wrapper's keyword arguments (`block_h`,
    `block_n`, `warps` fill what a bare "legacy" leaves out)."""
    from deepinfer.kernels.prefill_attention import VARIANTS

    variant, *fields = spec.split(":")
    if variant not in VARIANTS:
        raise SystemExit(f"--kernels: {variant!r} is not a variant ({', '.join(VARIANTS)})")
    kw = dict(variant=variant)
    if variant.startswith("legacy"):
        kw.update(block_h=block_h, block_n=block_n, num_warps=warps)
    names = dict(n="block_n", h="block_h", w="num_warps", s="num_stages")
    for f in fields:
        if f[:1] not in names or not f[1:].isdigit():
            raise SystemExit(f"--kernels: bad field {f!r} in {spec!r} (n<keys>, h<heads>, w<warps>, s<stages>)")
        kw[names[f[0]]] = int(f[1:])
    return kw


def _matmul_rate(device) -> float:
    n = 8192 if device.type == "cuda" else 256  # the CPU: a smoke run of the script, not a measurement
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    seconds = time_call(lambda: a @ b, device, 20)
    return 2 * n**3 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="8192")
    ap.add_argument("--starts", default="0,65536")
    ap.add_argument("--kinds", default="swa,csa,hca")
    ap.add_argument("--kernels", default="legacy,legacy_aligned,m64:n16,m64,m64:n32:s3,m64:n64",
                    help="kernel variants to time, comma-separated (see the module docstring)")
    ap.add_argument("--block-h", type=int, default=32, help="heads per program (bare legacy)")
    ap.add_argument("--block-n", type=int, default=32, help="keys per tile (bare legacy)")
    ap.add_argument("--warps", type=int, default=None, help="warps (bare legacy)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--indexer", action="store_true", help="also time the CSA selection of a chunk")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from deepinfer.kernels.indexer import indexer_topk_triton
    from deepinfer.kernels.prefill_attention import PrefillSpans, prefill_attention_torch, prefill_attention_triton

    kernels = [(spec, parse_kernel(spec, args.block_h, args.block_n, args.warps)) for spec in args.kernels.split(",")]
    device = torch.device(args.device)
    peak = _matmul_rate(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    results = []
    print(f"# {name}, torch {torch.__version__}, kernels {args.kernels} (bare legacy: "
          f"block_h {args.block_h}, block_n {args.block_n}, warps {args.warps or 'auto'}); bf16 matmul "
          f"{peak / 1e12:.0f} TFLOP/s")
    print("| kind | chunk | start | kernel | ms per call | GFLOP | TFLOP/s | MFU | max diff vs torch |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for kind in args.kinds.split(","):
            for p0 in [int(s) for s in args.starts.split(",")]:
                for n in [int(c) for c in args.chunks.split(",")]:
                    call, flops = _case(kind, n, p0, device)
                    q, kv, ring, spans, comp, entries, sink = call
                    m = min(n, 256)
                    first = PrefillSpans.single(m, p0, 0, 0, spans.rate, device)
                    ref = prefill_attention_torch(q[:m], kv[:m], ring, first, comp,
                                                  None if entries is None else entries[:m], sink)
                    for spec, kw in kernels:
                        fn = lambda call=call, kw=kw: prefill_attention_triton(*call, **kw)  # noqa: E731
                        try:
                            out = fn()
                        except Exception as e:  # noqa: BLE001 - e.g. a tile that needs more shared memory: go on
                            results.append(dict(op="prefill_attention", kind=kind, chunk=n, start=p0, kernel=spec,
                                                error=f"{type(e).__name__}: {e}"[:300]))
                            print(f"| {kind} | {n} | {p0} | {spec} | failed: {type(e).__name__}: {str(e)[:120]} |",
                                  flush=True)
                            continue
                        diff = (out[:m].float() - ref.float()).abs().max().item()
                        del out
                        seconds = time_call(fn, device, args.reps)
                        rate_f = flops / seconds
                        results.append(dict(op="prefill_attention", kind=kind, chunk=n, start=p0, kernel=spec,
                                            ms=seconds * 1e3, flops=flops, tflops=rate_f / 1e12, mfu=rate_f / peak,
                                            max_diff=diff))
                        print(f"| {kind} | {n} | {p0} | {spec} | {seconds * 1e3:.2f} | {flops / 1e9:.0f} | "
                              f"{rate_f / 1e12:.0f} | {rate_f / peak:.0%} | {diff:.1e} |", flush=True)
                    del call, q, kv, comp, entries, ref
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if args.indexer:
            print("\n| indexer (chunk) | chunk | start | ms per call |")
            print("|---|---:|---:|---:|")
            for p0 in [int(s) for s in args.starts.split(",")]:
                for n in [int(c) for c in args.chunks.split(",")]:
                    epb = BLOCK // CSA_RATE
                    mb = -(-(p0 + n) // BLOCK)
                    qi = torch.randn(n, IH, ID, device=device, dtype=torch.bfloat16)
                    w = torch.randn(n, IH, device=device)
                    pool = torch.randn(mb, epb, ID, device=device, dtype=torch.bfloat16)
                    pos = p0 + torch.arange(n, device=device)
                    bt = torch.arange(mb, device=device)[None, :].expand(n, -1).contiguous()
                    call = (qi, w, pool, pos, bt, CSA_RATE, TOPK)
                    seconds = time_call(lambda call=call: indexer_topk_triton(*call), device, args.reps)
                    results.append(dict(op="indexer_topk_prefill", chunk=n, start=p0, ms=seconds * 1e3))
                    print(f"| csa | {n} | {p0} | {seconds * 1e3:.2f} |")
                    del qi, w, pool, bt, call
                    torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                         "matmul_tflops": peak / 1e12, "kernels": args.kernels, "block_h": args.block_h,
                                         "block_n": args.block_n, "warps": args.warps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
