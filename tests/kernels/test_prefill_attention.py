"""Prefill attention (`kernels.prefill_attention`): the torch reference against a plain per-query softmax,
the Triton kernel against the reference (CPU under `TRITON_INTERPRET=1` in a subprocess, the variable must
be set before triton is imported; and on CUDA, float32 and bf16 at V4-Flash head shapes).

Covered: a first chunk (positions from 0), a later chunk reading the ring's history, history before the
request's state start (masked), chunks shorter and longer than the window, HCA (every visible entry,
causal), CSA (a per-query selection in any order with -1 padding), sliding layers (no entries), head
counts and widths that are not powers of two, and the wrapper's checks.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels.prefill_attention import PrefillSpans, prefill_attention_torch
from deepinfer.kernels.registry import default_impl
from tests.kernels._interp import prefetch_interpreted, run_interpreted
from tests.kernels._kernel_checks import (
    assert_compiles_for_sm90_without_spills,
    attended_entries,
    sink_softmax_attention,
)


def make_case(chunks=((11, 13, 0),), NH=4, D=32, S=3, W=8, rate=4, K=3, gap=0, seed=0, dtype=torch.float32,
              device="cpu"):
    """Random inputs of a step: chunks `(n, p0, state_start)` in ring slots 0, 1, .., `gap` other (decode) rows
    before each; every chunk's request has its own entries; CSA picks in random order, -1 padded."""
    g = torch.Generator().manual_seed(seed)
    starts, row = [], 0
    for n, _, _ in chunks:
        starts.append(row + gap)
        row += gap + n
    T = row + gap
    comps, entries = [], []
    for n, p0, _ in chunks:
        comps.append(torch.randn((p0 + n) // rate, D, generator=g))
        for i in range(n):
            e = torch.full((K,), -1, dtype=torch.long)
            picks = torch.randperm((p0 + i + 1) // rate, generator=g)[:K]
            e[torch.randperm(K, generator=g)[:len(picks)]] = picks
            entries.append(e)
    cast = dict(dtype=dtype, device=device)
    spans = PrefillSpans.build(starts, [c[0] for c in chunks], [c[1] for c in chunks], list(range(len(chunks))),
                               [c[2] for c in chunks], rate, device)
    return dict(q=torch.randn(T, NH, D, generator=g).to(**cast), kv=torch.randn(T, D, generator=g).to(**cast),
                ring=torch.randn(S, W, D, generator=g).to(**cast), spans=spans, comp=torch.cat(comps).to(**cast),
                entries=torch.stack(entries).to(device), sink=torch.randn(NH, generator=g).to(device))


def _variant(c, kind):
    c = dict(c)
    if kind != "csa":
        c["entries"] = None
    if kind == "sliding":
        c["comp"] = None
        sp = c["spans"]
        c["spans"] = PrefillSpans(sp.starts, sp.lengths, sp.p0s, sp.slots, sp.state_starts, 0, sp.table)
    return c


def _naive(c):
    """Per query and head: softmax over the listed keys plus the sink, in float64 (rows of no chunk: 0)."""
    q, ring, kv = c["q"].double(), c["ring"].double(), c["kv"].double()
    T, NH, D = q.shape
    W = ring.shape[1]
    sp = c["spans"]
    out = torch.zeros(T, NH, D, dtype=torch.float64)
    c0 = k = 0
    for a, n, p0, slot, ss, C in zip(sp.starts, sp.lengths, sp.p0s, sp.slots, sp.state_starts, sp.comp_counts):
        for i in range(n):
            p = p0 + i
            keys = [kv[a + kp - p0] if kp >= p0 else ring[slot, kp % W]
                    for kp in range(p - W + 1, p + 1) if kp >= max(ss, 0)]
            if c["comp"] is not None:
                ents = attended_entries(None if c["entries"] is None else c["entries"][k], p, sp.rate)
                keys += [c["comp"][c0 + e].double() for e in ents]
            out[a + i] = sink_softmax_attention(q[a + i], keys, c["sink"])
            k += 1
        c0 += C
    return out


GEOS = [dict(), dict(chunks=((5, 0, 0),)), dict(chunks=((20, 5, 3),)), dict(chunks=((11, 13, 16),)),
        dict(chunks=((7, 0, 0), (12, 30, 25), (3, 9, 0)), gap=2)]


@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
@pytest.mark.parametrize("geo", range(len(GEOS)))
def test_reference_matches_a_plain_softmax(kind, geo):
    c = _variant(make_case(seed=geo, **GEOS[geo]), kind)
    want = _naive(c)
    rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
    torch.testing.assert_close(prefill_attention_torch(**c)[rows].double(), want[rows], atol=1e-5, rtol=1e-5)


def test_spans_table():
    sp = PrefillSpans.build([2, 10], [3, 2], [0, 40], [1, 0], [0, 38], 4, "cpu")
    assert sp.comp_counts == (0, 10) and sp.num_tokens == 5
    assert sp.table.tolist() == [[0, 0, 2, 1, 0, 0], [1, 0, 2, 1, 0, 0], [2, 0, 2, 1, 0, 0],
                                 [40, 40, -30, 0, 38, 0], [41, 40, -30, 0, 38, 0]]


def test_cpu_default_is_the_reference():
    assert default_impl("prefill_attention", "cpu") == "torch"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_prefill_attention import make_case, _variant
    from deepinfer.kernels.prefill_attention import prefill_attention_torch, prefill_attention_triton
    worst = 0.0
    cases = [(0, {}), (1, dict(chunks=((5, 0, 0),))), (2, dict(chunks=((20, 5, 3),), W=16, K=5)),
             (3, dict(NH=20, D=24, chunks=((7, 40, 36),), rate=8)), (4, dict(W=4, chunks=((9, 2, 0),), rate=2, K=6)),
             (5, dict(chunks=((7, 0, 0), (12, 30, 25), (3, 9, 0)), gap=2, S=4))]
    for seed, kw in cases:
        c = make_case(seed=seed, **kw)
        rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
        for kind in ("hca", "csa", "sliding"):
            args = _variant(c, kind)
            ref = prefill_attention_torch(**args)
            for bn in (16, 32):
                base = torch.full_like(c["q"], 7.0)
                out = prefill_attention_triton(**args, out=base.clone(), block_n=bn, block_h=16)
                d = (out[rows] - ref[rows]).abs().max().item()
                assert d <= 2e-6, (seed, kind, bn, d)
                keep = torch.ones(len(out), dtype=torch.bool)
                keep[rows] = False
                assert torch.equal(out[keep], base[keep]), "rows of no chunk were written"
                worst = max(worst, d)
    c = make_case()
    for bad, msg in [(dict(q=c["q"].transpose(1, 2)), "q [T, NH, D]"), (dict(sink=c["sink"].double()), "sink"),
                     (dict(entries=c["entries"].int()), "entries must be"), (dict(ring=c["ring"].half()), "one dtype"),
                     (dict(ring=c["ring"][:0].contiguous()), "not a ring slot"),
                     (dict(comp=c["comp"][:, :16].contiguous()), "comp must be"),
                     (dict(comp=c["comp"][:-1].contiguous()), "comp must be"),
                     (dict(kv=c["kv"].t().contiguous().t()), "kv must be contiguous"),
                     (dict(q=c["q"][:5].contiguous(), kv=c["kv"][:5].contiguous()), "run past")]:
        assert_refused(lambda: prefill_attention_triton(**{**c, **bad}), msg)
    print("ok", worst)
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.startswith("ok"), out


def test_kernels_compile_for_sm90_without_spills():
    """The default launch configurations at V4-Flash widths (the three layer kinds), compiled ahead of time for sm_90a
    on the CPU: the interpreter never lowers a kernel."""
    assert_compiles_for_sm90_without_spills("prefill_attention")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hca", "csa", "sliding"])
def test_triton_kernel_on_cuda(dtype, kind):
    """V4-Flash head shapes (64 heads x 512, window 128, top-512): a later chunk with history beside a first
    chunk and decode rows, in one launch."""
    from deepinfer.kernels.prefill_attention import prefill_attention_triton

    rate = 128 if kind == "hca" else 4
    c = _variant(make_case(chunks=((300, 2100, 0), (150, 0, 0)), NH=64, D=512, S=4, W=128, rate=rate, K=512,
                           gap=3, seed=7, dtype=dtype, device="cuda"), kind)
    rows = c["spans"].table[:, 0] + c["spans"].table[:, 2]
    ref = prefill_attention_torch(**c)[rows]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for block_h in (16, 32):
        out = prefill_attention_triton(**c, block_h=block_h)[rows]
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=600)
