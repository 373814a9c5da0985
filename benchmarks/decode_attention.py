"""Decode attention kernel (`kernels.decode_attention`) at V4-Flash shapes: time per layer call and the
bandwidth it reaches on the bytes it must move.

    python -m deepinfer.benchmarks.decode_attention [--contexts 4096,32768,131072] [--batches 1,32,128]
        [--kinds swa,csa,hca] [--split 512] [--block-h 64] [--indexer] [--json OUT]

Shapes: 64 query heads x head_dim 512 over one shared K=V head, window 128, CSA rate 4 with the indexer's
top-512, HCA rate 128 (all entries), bf16 cache, V4-Flash's block of 128 tokens; every row has its own
blocks (no sharing through L2). Bytes per call: the keys the rows attend to (window + entries, 1 KiB
each), the queries and the output (NH x D bf16 each per row); the reference rate is the device's copy
rate (about 4.3 TB/s on an H200, bytes read plus written). `--indexer` also times the decode indexer
(`kernels.indexer`: 64 heads x 128 scores over every visible CSA index key, then the top-512) whose
bytes are the index keys (256 B each). Times are medians of CUDA-event timed calls (`benchmarks.timing`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call

NH, D, W, CSA_RATE, HCA_RATE, TOPK, BLOCK, IH, ID = 64, 512, 128, 4, 128, 512, 128, 64, 128
COPY_RATE = 4.3e12


def _case(kind: str, ctx: int, B: int, device, g: torch.Generator):
    """Inputs of one layer call: `B` rows at position `ctx - 1`, each with its own blocks."""
    dt = torch.bfloat16
    mb = -(-ctx // BLOCK)
    pos = torch.full((B,), ctx - 1, dtype=torch.long, device=device)
    q = torch.randn(B, NH, D, device=device, dtype=dt)
    ring = torch.randn(B, W, D, device=device, dtype=dt)
    slots = torch.arange(B, device=device)
    start = torch.zeros(B, dtype=torch.long, device=device)
    bt = torch.arange(B * mb, device=device).view(B, mb)
    sink = torch.randn(NH, device=device)
    pool = entries = None
    n_comp = 0
    rate = CSA_RATE if kind == "csa" else HCA_RATE
    if kind != "swa":
        epb = BLOCK // rate
        pool = torch.randn(B * mb, epb, D, device=device, dtype=dt)
        vis = ctx // rate
        if kind == "csa":
            entries = torch.rand(B, vis, generator=g).argsort(dim=1)[:, :TOPK].sort(dim=1).values.to(device)
            n_comp = min(TOPK, vis)
        else:
            n_comp = vis
    args = (q, ring, pool, slots, pos, start, bt, entries, rate, sink)
    nbytes = B * ((min(ctx, W) + n_comp) * D * 2 + 2 * NH * D * 2)
    return args, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768,131072")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--kinds", default="swa,csa,hca")
    ap.add_argument("--split", type=int, default=None, help="keys per split (default: the kernel's)")
    ap.add_argument("--block-h", type=int, default=32, help="heads per program")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--indexer", action="store_true", help="also time the decode indexer (CSA)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from deepinfer.kernels.decode_attention import DEFAULT_SPLIT_SIZE, decode_attention_torch, decode_attention_triton
    from deepinfer.kernels.indexer import indexer_topk_triton

    device = torch.device("cuda")
    split = args.split or DEFAULT_SPLIT_SIZE
    g = torch.Generator().manual_seed(0)
    results = []
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, split {split}, block_h {args.block_h}")
    print("| kind | context | batch | us per call | MB moved | GB/s | of copy rate | max diff vs torch |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for kind in args.kinds.split(","):
            for ctx in [int(c) for c in args.contexts.split(",")]:
                for B in [int(b) for b in args.batches.split(",")]:
                    call, nbytes = _case(kind, ctx, B, device, g)
                    fn = lambda call=call: decode_attention_triton(*call, split_size=split, block_h=args.block_h)  # noqa: E731
                    out = fn()
                    q, ring, pool, slots, pos, start, bt, entries, rate, sink = call
                    r = slice(0, min(B, 4))  # the reference on a few rows (it gathers every entry)
                    ref = decode_attention_torch(q[r], ring, pool, slots[r], pos[r], start[r], bt[r],
                                                 None if entries is None else entries[r], rate, sink)
                    diff = (out[r].float() - ref.float()).abs().max().item()
                    seconds = time_call(fn, device, args.reps)
                    bw = nbytes / seconds
                    results.append(dict(op="decode_attention", kind=kind, context=ctx, batch=B, us=seconds * 1e6,
                                        bytes=nbytes, gbps=bw / 1e9, fraction=bw / COPY_RATE, max_diff=diff))
                    print(f"| {kind} | {ctx} | {B} | {seconds * 1e6:.1f} | {nbytes / 1e6:.1f} | {bw / 1e9:.0f} | "
                          f"{bw / COPY_RATE:.0%} | {diff:.1e} |")
                    del call, out, q, ring, pool, entries
                    torch.cuda.empty_cache()
        if args.indexer:
            print("\n| indexer | context | batch | us per call | MB of keys | GB/s | of copy rate |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for ctx in [int(c) for c in args.contexts.split(",")]:
                for B in [int(b) for b in args.batches.split(",")]:
                    mb, epb = -(-ctx // BLOCK), BLOCK // CSA_RATE
                    q = torch.randn(B, IH, ID, device=device, dtype=torch.bfloat16)
                    w = torch.randn(B, IH, device=device)
                    pool = torch.randn(B * mb, epb, ID, device=device, dtype=torch.bfloat16)
                    pos = torch.full((B,), ctx - 1, dtype=torch.long, device=device)
                    bt = torch.arange(B * mb, device=device).view(B, mb)
                    call = (q, w, pool, pos, bt, CSA_RATE, TOPK)
                    seconds = time_call(lambda call=call: indexer_topk_triton(*call), device, args.reps)
                    nbytes = B * (ctx // CSA_RATE) * ID * 2
                    rate = nbytes / seconds
                    results.append(dict(op="indexer_topk", context=ctx, batch=B, us=seconds * 1e6, bytes=nbytes,
                                        gbps=rate / 1e9, fraction=rate / COPY_RATE))
                    print(f"| csa | {ctx} | {B} | {seconds * 1e6:.1f} | {nbytes / 1e6:.1f} | {rate / 1e9:.0f} | "
                          f"{rate / COPY_RATE:.0%} |")
                    del q, w, pool, call
                    torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                         "split": split, "block_h": args.block_h, "results": results}, indent=1))


if __name__ == "__main__":
    main()
