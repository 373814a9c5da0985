"""Decode attention (`kernels.decode_attention`): the torch reference against a plain per-row softmax,
the Triton kernel against the reference (CPU under `TRITON_INTERPRET=1` in a subprocess, the variable
must be set before triton is imported; and on CUDA, float32 and bf16).

Covered: the window ring (validity from position and state start, rows before position W), HCA (all
visible entries through the block table), CSA (a selection with -1 padding), sliding layers (no pool),
a padding row (slot and blocks past the real ranges: attends to the sink only), rows of one split and
of several (the reduce kernel), batch invariance (a row alone equals it in a batch, bit for bit), and the
wrapper's checks.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels.decode_attention import decode_attention_torch, ring_write_torch
from deepinfer.kernels.registry import default_impl
from tests.kernels._interp import prefetch_interpreted, run_interpreted
from tests.kernels._kernel_checks import attended_entries, sink_softmax_attention


def make_case(B=4, NH=4, D=32, S=5, W=8, N=12, epb=4, MB=4, rate=4, K=6, seed=0, dtype=torch.float32,
              device="cpu"):
    """Random inputs: rows at various positions (one padding row last), CSA entries valid first."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, D, generator=g)
    ring = torch.randn(S, W, D, generator=g)
    pool = torch.randn(N, epb, D, generator=g)
    sink = torch.randn(NH, generator=g)
    max_pos = MB * epb * rate - 1
    pos = torch.randint(0, max_pos + 1, (B,), generator=g)
    pos[0], pos[-1] = min(3, max_pos), 0  # a row before position W; the padding row
    if B > 2:
        pos[1] = max_pos
    slots = torch.randperm(S, generator=g)[:B] if B <= S else torch.randint(0, S, (B,), generator=g)
    slots[-1] = S  # padding slot
    state_start = (pos - torch.randint(0, W + 2, (B,), generator=g)).clamp(min=0)
    bt = torch.stack([torch.randperm(N, generator=g)[:MB] for _ in range(B)])
    bt[-1] = N  # padding blocks
    entries = torch.full((B, K), -1, dtype=torch.long)
    for b in range(B):
        vis = int(pos[b] + 1) // rate
        picks = torch.randperm(vis, generator=g)[:K].sort().values if vis else torch.zeros(0, dtype=torch.long)
        entries[b, :len(picks)] = picks
    cast = dict(dtype=dtype, device=device)
    return dict(q=q.to(**cast), ring=ring.to(**cast), pool=pool.to(**cast), slots=slots.to(device),
                pos=pos.to(device), state_start=state_start.to(device), block_tables=bt.to(device),
                entries=entries.to(device), rate=rate, sink=sink.to(device))


def _naive(c):
    """Per row and head: softmax over the listed keys plus the sink, in float64."""
    q, ring, pool = c["q"].double(), c["ring"].double(), c["pool"]
    B, NH, D = q.shape
    S, W = ring.shape[:2]
    out = torch.zeros(B, NH, D, dtype=torch.float64)
    for b in range(B):
        p, s = int(c["pos"][b]), int(c["slots"][b])
        keys = []
        if s < S:
            for j in range(W):
                kp = p - ((p - j) % W)
                if kp >= int(c["state_start"][b]):
                    keys.append(ring[s, j])
        if pool is not None:
            epb = pool.shape[1]
            for e in attended_entries(None if c["entries"] is None else c["entries"][b], p, c["rate"]):
                blk = int(c["block_tables"][b, e // epb])
                if blk < pool.shape[0]:
                    keys.append(pool[blk, e % epb].double())
        out[b] = sink_softmax_attention(q[b], keys, c["sink"])
    return out


@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
def test_reference_matches_a_plain_softmax(kind):
    c = make_case(seed={"hca": 1, "csa": 2, "sliding": 3}[kind])
    if kind == "hca":
        c["entries"] = None
    if kind == "sliding":
        c["pool"], c["entries"] = None, None
    out = decode_attention_torch(**c)
    torch.testing.assert_close(out.double(), _naive(c), atol=1e-5, rtol=1e-5)
    assert torch.all(out[-1] == 0)  # the padding row attends to the sink only


def test_ring_write_skips_padding_rows():
    ring = torch.zeros(3, 4, 2)
    ring_write_torch(ring, torch.tensor([1, 3]), torch.tensor([6, 0]), torch.ones(2, 2))
    assert ring.sum() == 2 and torch.all(ring[1, 2] == 1)


def test_cpu_default_is_the_reference():
    assert default_impl("decode_attention", "cpu") == default_impl("ring_write", "cpu") == "torch"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_decode_attention import make_case
    from deepinfer.kernels.decode_attention import (decode_attention_torch, decode_attention_triton, ring_write_torch,
                                                    ring_write_triton)
    worst = 0.0
    for seed, kw in [(0, {}), (1, dict(B=3, W=16, MB=6, K=20)), (2, dict(B=2, NH=20, D=16, epb=2, rate=8, K=3)),
                     (3, dict(B=5, S=4, MB=2))]:
        for dtype in (torch.float32, torch.float16):
            c = make_case(seed=seed, dtype=dtype, **kw)
            for kind in ("hca", "csa", "sliding"):
                args = dict(c)
                if kind != "csa":
                    args["entries"] = None
                if kind == "sliding":
                    args["pool"] = None
                ref = decode_attention_torch(**args)
                for split in (16, 32, 64):
                    out = decode_attention_triton(**args, split_size=split, block_n=16)
                    d = (out.float() - ref.float()).abs().max().item()
                    tol = 2e-6 if dtype == torch.float32 else 2e-3
                    assert d <= tol, (seed, dtype, kind, split, d)
                    if dtype == torch.float32:
                        worst = max(worst, d)
        if len(set(c["slots"].tolist())) < len(c["slots"]):
            continue  # two rows in one slot (never so in the engine): the write order would decide
        r1, r2 = c["ring"].clone(), c["ring"].clone()
        src = torch.randn(c["q"].shape[0], r1.shape[-1]).to(r1.dtype)
        ring_write_torch(r1, c["slots"], c["pos"], src)
        ring_write_triton(r2, c["slots"], c["pos"], src)
        assert torch.equal(r1, r2)
    # batch invariance: a row's result does not depend on the rows beside it (bit for bit)
    c = make_case(B=5, S=6, MB=6, K=20, seed=4)
    for split in (16, 64):
        full = decode_attention_triton(**c, split_size=split, block_n=16)
        part = {k: (v[1:3] if isinstance(v, torch.Tensor) and k not in ("ring", "pool", "sink") else v)
                for k, v in c.items()}
        assert torch.equal(decode_attention_triton(**part, split_size=split, block_n=16), full[1:3])
    c = make_case()
    for bad, msg in [(dict(q=c["q"].transpose(1, 2)), "q [B, NH, D]"), (dict(sink=c["sink"].double()), "sink"),
                     (dict(pos=c["pos"].int()), "pos must be"), (dict(ring=c["ring"].half()), "one dtype"),
                     (dict(q=c["q"][:, :, :16].contiguous(), ring=c["ring"][..., :16].contiguous()), "pool must be")]:
        assert_refused(lambda: decode_attention_triton(**{**c, **bad}), msg)
    print("ok", worst)
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.startswith("ok"), out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
def test_triton_kernel_on_cuda(dtype, kind):
    """V4-Flash head shapes (64 heads x 512, window 128), several splits and a padding row."""
    from deepinfer.kernels.decode_attention import decode_attention_triton

    c = make_case(B=6, NH=64, D=512, S=8, W=128, N=64, epb=2 if kind == "hca" else 32, MB=40,
                  rate=128 if kind == "hca" else 4, K=512, seed=7, dtype=dtype, device="cuda")
    if kind != "csa":
        c["entries"] = None
    if kind == "sliding":
        c["pool"] = None
    ref = decode_attention_torch(**c)
    for split in (128, 512):
        out = decode_attention_triton(**c, split_size=split)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=600)
