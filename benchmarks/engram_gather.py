"""Engram gather time per token: a DeepSeek-V4.1 FP8 Engram table in device memory vs in pinned host memory.

    python -m deepinfer.benchmarks.engram_gather [--device cuda] [--rows 33554432] [--tokens 1,8,64,512,4096]
        [--reps 20] [--threads 1] [--json OUT]

One Engram layer's table as the engine holds it (`engine.quant.engram.Fp8EngramTable`): FP8 e4m3 rows of
`--dim` 256 values plus one UE8M0 scale per 32 (264 bytes a row); each token reads `--cols` 24 rows of it
(2-, 3- and 4-grams x 8 heads; Flash has two such layers), at row ids spread uniformly over the table as its
hashes are. Random bytes (timing only; the implementations are first checked equal to the torch reference on the
same ids). Per token count T (T x 24 rows per call), the median time of one gather + dequantization to bf16
(`"engram_gather"` op, `kernels/engram_gather.py`) for:

  * `device`: the table in the engine device's memory (CUDA: the Triton kernel; also the torch reference);
  * `pinned_host/host`: the table in pinned host memory; ids to the host (a sync), FP8 rows gathered there,
    copied to the device, dequantized there (the engine's default for that placement);
  * `pinned_host/zero_copy`: the same table read by the Triton kernel straight from pinned memory over PCIe
    (CUDA only; a failure is recorded, not raised).

Reported: microseconds per call and per token, and GB/s of row bytes gathered. The table size: `--rows` (default
2^25 rows = 8.25 GiB on CUDA, beyond every cache and TLB reach as Flash's 384M rows / 94 GiB are; 2^20 on the CPU,
where both placements are host memory and only the code paths differ). A CUDA run stays well under 60 s (the
8 GiB table is filled on the device and copied once into pinned memory).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call
from deepinfer.kernels import engram_gather as eg
from deepinfer.kernels.registry import get_op


def random_table(rows: int, dim: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 rows (NaN codes avoided) and UE8M0 scales near 1, filled on `device`."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randint(0, 0x7F, (rows, dim), dtype=torch.uint8, device=device, generator=g)  # positive, no NaN
    s = torch.randint(120, 135, (rows, dim // 32), dtype=torch.uint8, device=device, generator=g)
    return w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def pinned_copy(t: torch.Tensor, chunk_rows: int = 1 << 20) -> torch.Tensor:
    """`t` copied into pinned host memory (plain host memory without CUDA), chunk by chunk."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    for r in range(0, t.shape[0], chunk_rows):
        out[r:r + chunk_rows].copy_(t[r:r + chunk_rows])
    return out


def run(device: torch.device, rows: int, dim: int, cols: int, tokens: list[int], reps: int,
        out_dtype: torch.dtype = torch.bfloat16) -> dict:
    t0 = time.perf_counter()
    w_dev, s_dev = random_table(rows, dim, device)
    w_host, s_host = (pinned_copy(w_dev), pinned_copy(s_dev)) if device.type == "cuda" else (w_dev, s_dev)
    setup_s = time.perf_counter() - t0
    cases = {"device": (w_dev, s_dev, eg.table_gather_impl(device, device))}
    if device.type == "cuda":
        cases["device/torch"] = (w_dev, s_dev, "torch")
        cases["pinned_host/host"] = (w_host, s_host, "host")
        cases["pinned_host/zero_copy"] = (w_host, s_host, "triton")
    else:
        cases["pinned_host/host"] = (w_host, s_host, "host")  # host memory either way on a CPU
    row_bytes = dim + dim // 32
    g = torch.Generator(device=device).manual_seed(1)
    check_ids = torch.randint(0, rows, (97,), device=device, generator=g)
    want = eg.engram_gather_torch(check_ids, w_dev, s_dev, out_dtype)
    results, errors = [], {}
    for name, (w, s, impl) in cases.items():
        op = get_op("engram_gather", impl)
        try:
            ok = torch.equal(op(check_ids, w, s, out_dtype), want)
        except Exception as exc:  # noqa: BLE001 - e.g. the zero-copy read refused by a launcher: recorded
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        if not ok:
            errors[name] = "differs from the torch reference"
            continue
        for t in tokens:
            ids = torch.randint(0, rows, (t * cols,), device=device, generator=g)
            sec = time_call(lambda op=op, ids=ids, w=w, s=s: op(ids, w, s, out_dtype), device, reps)
            results.append({"case": name, "impl": impl, "tokens": t, "rows_gathered": t * cols, "us": sec * 1e6,
                            "us_per_token": sec * 1e6 / t, "gb_s": t * cols * row_bytes / sec / 1e9})
    return {"setup_s": setup_s, "table_gib": rows * row_bytes / 2**30, "results": results, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=None, help="table rows (default 2^25 on CUDA, 2^20 on the CPU)")
    ap.add_argument("--dim", type=int, default=256, help="values per row (Flash: engram_head_dim 256)")
    ap.add_argument("--cols", type=int, default=24, help="rows per token per layer (Flash: 3 n-gram orders x 8 heads)")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per point (default 20 on CUDA, 5 on the CPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the host gather; 1: stable timings)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = args.rows or (1 << 25 if device.type == "cuda" else 1 << 20)
    reps = args.reps or (20 if device.type == "cuda" else 5)
    tokens = [int(t) for t in args.tokens.split(",")]
    start = time.perf_counter()
    out = run(device, rows, args.dim, args.cols, tokens, reps)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"# engram gather on {name} ({device}), table {rows} rows x {args.dim} (+ scales) = {out['table_gib']:.2f} "
          f"GiB, {args.cols} rows a token, bf16 out, median of {reps}; setup {out['setup_s']:.1f} s")
    print(f"{'case':24} {'impl':7} {'tokens':>6} {'us/call':>10} {'us/token':>9} {'GB/s':>7}")
    for r in out["results"]:
        print(f"{r['case']:24} {r['impl']:7} {r['tokens']:6d} {r['us']:10.1f} {r['us_per_token']:9.2f} "
              f"{r['gb_s']:7.2f}")
    for case, err in out["errors"].items():
        print(f"# {case}: not timed: {err}")
    total = time.perf_counter() - start
    print(f"# total {total:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "date": time.strftime("%Y-%m-%d"), "rows": rows,
                                         "dim": args.dim, "cols": args.cols, "reps": reps, "total_s": total, **out},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
