"""Prefill attention kernel (`kernels.prefill_attention`) at V4-Flash shapes: time per chunk and layer, and
the TFLOP/s it reaches on the FLOPs it must do.

    python -m deepinfer.benchmarks.prefill_attention [--chunks 8192] [--starts 0,65536] [--kinds swa,csa,hca]
        [--block-h 32] [--block-n 32] [--warps 8] [--indexer] [--json OUT]

Shapes: 64 query heads x head_dim 512 over one shared K=V head, window 128, CSA rate 4 with the indexer's
top-512 per query (random picks among the visible entries), HCA rate 128 (every visible entry), bf16. One
chunk of `--chunks` tokens starting at position `--starts` (the ring holds the history before it). FLOPs:
`4 * 512` per head and (query, key) pair attended (QK and PV), the keys a query sees: its window (fewer
at the start of a request) plus its entries; the reference rate is a bf16 8192^3 `torch.matmul` measured
in the same run (MFU = achieved / that). `--indexer` also times the CSA selection the `triton` backend
runs for a chunk (`indexer_topk` with every query a row: 64 heads x 128 scores over the visible index keys,
then the top-512). Times are medians of CUDA-event timed calls (`benchmarks.timing`); `max diff` is
against the torch reference on the chunk's first 256 queries.
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

    dt = torch.bfloat16
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


def _matmul_rate(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    seconds = time_call(lambda: a @ b, device, 20)
    return 2 * 8192**3 / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="8192")
    ap.add_argument("--starts", default="0,65536")
    ap.add_argument("--kinds", default="swa,csa,hca")
    ap.add_argument("--block-h", type=int, default=32, help="heads per program")
    ap.add_argument("--block-n", type=int, default=32, help="keys per tile")
    ap.add_argument("--warps", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--indexer", action="store_true", help="also time the CSA selection of a chunk")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from deepinfer.kernels.indexer import indexer_topk_triton
    from deepinfer.kernels.prefill_attention import PrefillSpans, prefill_attention_torch, prefill_attention_triton

    device = torch.device("cuda")
    peak = _matmul_rate(device)
    results = []
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, block_h {args.block_h}, "
          f"block_n {args.block_n}, warps {args.warps or 'auto'}; bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    print("| kind | chunk | start | ms per call | GFLOP | TFLOP/s | MFU | max diff vs torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for kind in args.kinds.split(","):
            for p0 in [int(s) for s in args.starts.split(",")]:
                for n in [int(c) for c in args.chunks.split(",")]:
                    call, flops = _case(kind, n, p0, device)
                    kw = dict(block_h=args.block_h, block_n=args.block_n, num_warps=args.warps)
                    fn = lambda call=call, kw=kw: prefill_attention_triton(*call, **kw)  # noqa: E731
                    out = fn()
                    q, kv, ring, spans, comp, entries, sink = call
                    m = min(n, 256)
                    first = PrefillSpans.single(m, p0, 0, 0, spans.rate, device)
                    ref = prefill_attention_torch(q[:m], kv[:m], ring, first, comp,
                                                  None if entries is None else entries[:m], sink)
                    diff = (out[:m].float() - ref.float()).abs().max().item()
                    seconds = time_call(fn, device, args.reps)
                    rate_f = flops / seconds
                    results.append(dict(op="prefill_attention", kind=kind, chunk=n, start=p0, ms=seconds * 1e3,
                                        flops=flops, tflops=rate_f / 1e12, mfu=rate_f / peak, max_diff=diff))
                    print(f"| {kind} | {n} | {p0} | {seconds * 1e3:.2f} | {flops / 1e9:.0f} | {rate_f / 1e12:.0f} | "
                          f"{rate_f / peak:.0%} | {diff:.1e} |")
                    del call, out, q, kv, comp, entries
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
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                         "matmul_tflops": peak / 1e12, "block_h": args.block_h,
                                         "block_n": args.block_n, "warps": args.warps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
