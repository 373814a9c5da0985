"""Prefill attention (`kernels.prefill_attention`): the torch reference against a plain per-query softmax,
the Triton kernel against the reference (CPU under `TRITON_INTERPRET=1` in a subprocess, the variable must
be set before triton is imported; and on CUDA, float32 and bf16 at V4-Flash head shapes).

Covered: a first chunk (positions from 0), a later chunk reading the ring's history, history before the
request's state start (masked), chunks shorter and longer than the window, HCA (every visible entry,
causal), CSA (a per-query selection in any order with -1 padding), sliding layers (no entries), head
counts and widths that are not powers of two, and the wrapper's checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.kernels.prefill_attention import prefill_attention_torch
from deepinfer.kernels.registry import default_impl

ROOT = Path(__file__).resolve().parents[2]


def make_case(n=11, NH=4, D=32, S=3, W=8, p0=13, state_start=0, rate=4, K=3, seed=0, dtype=torch.float32,
              device="cpu"):
    """Random inputs of one chunk: `n` tokens from position `p0` in ring slot 1; CSA picks in random order."""
    g = torch.Generator().manual_seed(seed)
    C = (p0 + n) // rate
    entries = torch.full((n, K), -1, dtype=torch.long)
    for i in range(n):
        vis = (p0 + i + 1) // rate
        picks = torch.randperm(vis, generator=g)[:K]
        entries[i, torch.randperm(K, generator=g)[:len(picks)]] = picks
    cast = dict(dtype=dtype, device=device)
    return dict(q=torch.randn(n, NH, D, generator=g).to(**cast), kv=torch.randn(n, D, generator=g).to(**cast),
                ring=torch.randn(S, W, D, generator=g).to(**cast), slot=1, p0=p0, state_start=state_start,
                comp=torch.randn(C, D, generator=g).to(**cast), entries=entries.to(device), rate=rate,
                sink=torch.randn(NH, generator=g).to(device))


def _variant(c, kind):
    c = dict(c)
    if kind != "csa":
        c["entries"] = None
    if kind == "sliding":
        c["comp"] = None
    return c


def _naive(c):
    """Per query and head: softmax over the listed keys plus the sink, in float64."""
    q, ring, kv = c["q"].double(), c["ring"].double(), c["kv"].double()
    n, NH, D = q.shape
    W = ring.shape[1]
    out = torch.zeros(n, NH, D, dtype=torch.float64)
    for i in range(n):
        p = c["p0"] + i
        keys = []
        for kp in range(p - W + 1, p + 1):
            if kp >= max(c["state_start"], 0):
                keys.append(kv[kp - c["p0"]] if kp >= c["p0"] else ring[c["slot"], kp % W])
        if c["comp"] is not None:
            ents = [int(e) for e in c["entries"][i] if e >= 0] if c["entries"] is not None \
                else list(range((p + 1) // c["rate"]))
            keys += [c["comp"][e].double() for e in ents]
        k = torch.stack(keys) if keys else torch.zeros(0, D, dtype=torch.float64)
        logits = torch.cat([q[i] @ k.T * D**-0.5, c["sink"].double()[:, None]], dim=1)
        out[i] = logits.softmax(-1)[:, :-1] @ k
    return out


@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
@pytest.mark.parametrize("geo", [dict(), dict(p0=0, n=5), dict(p0=5, state_start=3, n=20), dict(state_start=16)])
def test_reference_matches_a_plain_softmax(kind, geo):
    c = _variant(make_case(seed=len(geo), **geo), kind)
    torch.testing.assert_close(prefill_attention_torch(**c).double(), _naive(c), atol=1e-5, rtol=1e-5)


def test_cpu_default_is_the_reference():
    assert default_impl("prefill_attention", "cpu") == "torch"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels.test_prefill_attention import make_case, _variant
    from deepinfer.kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
    worst = 0.0
    cases = [(0, {}), (1, dict(p0=0, n=5)), (2, dict(p0=5, state_start=3, n=20, W=16, K=5)),
             (3, dict(NH=20, D=24, n=7, p0=40, rate=8, state_start=36)), (4, dict(W=4, n=9, p0=2, rate=2, K=6))]
    for seed, kw in cases:
        c = make_case(seed=seed, **kw)
        for kind in ("hca", "csa", "sliding"):
            args = _variant(c, kind)
            ref = prefill_attention_torch(**args)
            for bn in (16, 32):
                out = prefill_attention_triton(**args, block_n=bn, block_h=16)
                d = (out - ref).abs().max().item()
                assert d <= 2e-6, (seed, kind, bn, d)
                worst = max(worst, d)
    c = make_case()
    for bad, msg in [(dict(q=c["q"].transpose(1, 2)), "q [n, NH, D]"), (dict(sink=c["sink"].double()), "sink"),
                     (dict(entries=c["entries"].int()), "entries must be"), (dict(ring=c["ring"].half()), "one dtype"),
                     (dict(slot=3), "not a ring slot"), (dict(comp=c["comp"][:, :16].contiguous()), "comp must be"),
                     (dict(kv=c["kv"].t().contiguous().t()), "kv must be contiguous")]:
        try:
            prefill_attention_triton(**{**c, **bad})
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(msg)
    print("ok", worst)
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
def test_triton_kernel_on_cuda(dtype, kind):
    """V4-Flash head shapes (64 heads x 512, window 128, top-512), a later chunk with history."""
    from deepinfer.kernels.prefill_attention import prefill_attention_triton

    rate = 128 if kind == "hca" else 4
    c = _variant(make_case(n=300, NH=64, D=512, S=4, W=128, p0=2100, state_start=0, rate=rate, K=512, seed=7,
                           dtype=dtype, device="cuda"), kind)
    ref = prefill_attention_torch(**c)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for block_h in (32, 64):
        out = prefill_attention_triton(**c, block_h=block_h)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
