"""The attention layer's small ops (`kernels.attn_proj`) at V4-Flash shapes: the Triton kernels against the
torch references (the model's arithmetic), time per call and the bandwidth / FLOP rate reached.

    python -m deepinfer.benchmarks.attn_proj [--tokens 1,32,128,8192] [--reps 50] [--json OUT]

Shapes: 64 query heads x 512 with 64 rope channels, o_groups 8 x o_lora_rank 1024 (`wo_a` is 8 x 1024 x
4096 bf16, 64 MiB), a 128-row window ring, bf16. Per token count T:

* `attn_out_proj` (inverse RoPE + grouped `wo_a`): bytes = the weight + o + y; FLOPs = 2 * T * 8192 * 4096;
* `attn_norm_rope` of the queries (T x 64 heads) and of the K=V head with the ring write: bytes read + written.

The reference rates are the device's copy rate (about 4.3 TB/s on an H200) and its bf16 matmul rate (about
800 TFLOP/s). Times are medians of CUDA-event timed calls (`benchmarks.timing`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from deepinfer.benchmarks.timing import time_call

NH, D, HALF, G, R, W = 64, 512, 32, 8, 1024, 128


def _cases(T: int, weight, norm_w, ring, device):
    """(name, torch call, triton call, bytes, FLOPs) of the ops for T tokens."""
    from deepinfer.kernels.attn_proj import (
        attn_norm_rope_torch,
        attn_norm_rope_triton,
        attn_out_proj_torch,
        attn_out_proj_triton,
    )

    dt = weight.dtype
    ang = torch.rand(T, HALF, device=device) * 6
    cos, sin = ang.cos(), ang.sin()
    o = torch.randn(T, NH, D, device=device, dtype=dt)
    kv = torch.randn(T, D, device=device, dtype=dt)
    slots = torch.arange(T, device=device) % ring.shape[0]
    pos = torch.arange(T, device=device) // ring.shape[0] + 1000  # (slot, pos % W) distinct per token
    return [
        ("attn_out_proj", lambda: attn_out_proj_torch(o, cos, sin, weight, G),
         lambda: attn_out_proj_triton(o, cos, sin, weight, G, force_kernel=True),
         weight.numel() * 2 + o.numel() * 2 + T * G * R * 2, 2 * T * G * R * (NH * D // G)),
        ("attn_norm_rope q", lambda: attn_norm_rope_torch(o, None, 1e-6, cos, sin),
         lambda: attn_norm_rope_triton(o, None, 1e-6, cos, sin), 2 * o.numel() * 2, 0),
        ("attn_norm_rope kv + ring", lambda: attn_norm_rope_torch(kv, norm_w, 1e-6, cos, sin, ring, slots, pos),
         lambda: attn_norm_rope_triton(kv, norm_w, 1e-6, cos, sin, ring, slots, pos), 3 * kv.numel() * 2, 0),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,32,128,8192")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device, dt = torch.device("cuda"), torch.bfloat16
    weight = torch.randn(G * R, NH * D // G, device=device, dtype=dt) / 64
    norm_w = torch.rand(D, device=device) + 0.5
    ring = torch.zeros(256, W, D, device=device, dtype=dt)
    results = []
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print("| op | tokens | torch us | triton us | speed-up | triton GB/s | triton TFLOP/s | max diff |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with torch.inference_mode():
        for T in [int(t) for t in args.tokens.split(",")]:
            for name, ref_fn, fn, nbytes, flops in _cases(T, weight, norm_w, ring, device):
                diff = (fn().float() - ref_fn().float()).abs().max().item()
                t_ref, t = time_call(ref_fn, device, args.reps), time_call(fn, device, args.reps)
                results.append(dict(op=name, tokens=T, torch_us=t_ref * 1e6, triton_us=t * 1e6, bytes=nbytes,
                                    gbps=nbytes / t / 1e9, tflops=flops / t / 1e12, max_diff=diff))
                print(f"| {name} | {T} | {t_ref * 1e6:.1f} | {t * 1e6:.1f} | {t_ref / t:.2f}x | {nbytes / t / 1e9:.0f} | "
                      f"{flops / t / 1e12:.1f} | {diff:.1e} |")
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
