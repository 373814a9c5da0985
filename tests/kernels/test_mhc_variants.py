"""The "split" variant of the mHC pre-mix kernels (`kernels.mhc`, DEEPINFER_MHC_VARIANT): the hidden-split mix
equals the legacy mix bit for bit, the logit-split projection keeps every token's bits independent of T, the
matmul route for long chunks stays within the reference's tolerance and is never taken in batch-invariant
mode, and so does the opt-in fused long-chunk projection (DEEPINFER_MHC_LONG_PROJ=fused); the switches and their
routes; the benchmark's CPU smoke run. CPU under TRITON_INTERPRET=1 (tiny shapes);
the bit-identity of the projection to the legacy kernel is a GPU test (the interpreter runs tl.dot as numpy's
BLAS matmul, whose rounding follows the tile shape).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from tests.kernels._interp import prefetch_interpreted, run_interpreted
from tests.kernels._kernel_checks import run_module_interpreted

TOKENS = (1, 3, 16, 17, 40)


def _interpret(script: str, timeout: int = 300) -> str:
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:  # the script picks its variants itself
        for name in ("DEEPINFER_MHC_VARIANT", "DEEPINFER_MHC_MATMUL_MIN_T", "DEEPINFER_MHC_NSPLIT_MAX_T",
                     "DEEPINFER_MHC_LONG_PROJ"):
            mp.delenv(name, raising=False)
        out = run_interpreted(script, timeout=timeout)
    assert "OK" in out, out
    return out


def test_switch_and_routes(monkeypatch):
    pytest.importorskip("triton")
    from deepinfer.kernels import mhc

    if "DEEPINFER_MHC_VARIANT" not in os.environ:
        assert mhc.VARIANT == "split"  # the default since the H100 run of 2026-12-05
    assert mhc._proj_route(1, "legacy", 1) == mhc._proj_route(10_000, "legacy", 1) == "legacy"
    assert mhc._proj_route(15, "split", 16, 64) == "nsplit" and mhc._proj_route(16, "split", 16, 64) == "matmul"
    assert mhc._proj_route(10_000, "split", 0, 10_000) == "nsplit"  # 0: no matmul route
    assert mhc._proj_route(16, "split", 0, 16) == "nsplit" and mhc._proj_route(17, "split", 0, 16) == "legacy_proj"
    assert mhc._proj_route(1, "split", 16, 0) == "legacy_proj"  # nsplit_max_t 0: never the nsplit projection
    if "DEEPINFER_MHC_NSPLIT_MAX_T" not in os.environ:
        assert mhc._proj_route(1, "split", 16) == "legacy_proj"  # the default since the H100 run of 2026-12-05
    monkeypatch.setattr(mhc, "VARIANT", "split")
    monkeypatch.setattr(mhc, "MATMUL_MIN_T", 8)
    monkeypatch.setattr(mhc, "NSPLIT_MAX_T", 64)
    assert mhc._proj_route(7) == "nsplit" and mhc._proj_route(8) == "matmul"
    monkeypatch.setattr(mhc, "_cublas_tf32", lambda: True)  # TF32 on: never the cuBLAS route
    assert mhc._proj_route(8) == "nsplit"
    monkeypatch.setattr(mhc, "VARIANT", "fast")
    with pytest.raises(ValueError, match="DEEPINFER_MHC_VARIANT"):
        mhc._proj_route(1)
    monkeypatch.setenv("DEEPINFER_MHC_MATMUL_MIN_T", "lots")
    with pytest.raises(ValueError, match="DEEPINFER_MHC_MATMUL_MIN_T must be an integer"):
        mhc._env_int("DEEPINFER_MHC_MATMUL_MIN_T", 1)


def test_long_proj_knob(monkeypatch):
    pytest.importorskip("triton")
    from deepinfer.kernels import mhc

    if "DEEPINFER_MHC_LONG_PROJ" not in os.environ:
        assert mhc.LONG_PROJ == "matmul"  # opt-in until timed on a GPU
    # the fused projection replaces the matmul route exactly where that applies, nowhere else
    assert mhc._proj_route(16, "split", 16, 64, "fused") == "fused"
    assert mhc._proj_route(15, "split", 16, 64, "fused") == "nsplit"
    assert mhc._proj_route(10_000, "split", 0, 16, "fused") == "legacy_proj"
    assert mhc._proj_route(10_000, "legacy", 16, 64, "fused") == "legacy"
    assert mhc._proj_route(16, "split", 16, 64, "matmul") == "matmul"
    monkeypatch.setattr(mhc, "VARIANT", "split")
    monkeypatch.setattr(mhc, "MATMUL_MIN_T", 8)
    monkeypatch.setattr(mhc, "NSPLIT_MAX_T", 64)
    monkeypatch.setattr(mhc, "LONG_PROJ", "fused")
    assert mhc._proj_route(7) == "nsplit" and mhc._proj_route(8) == "fused"
    from deepinfer.engine.batch_invariant import BatchInvariantMode

    with BatchInvariantMode():
        assert mhc._proj_route(8) == "nsplit"
    monkeypatch.setattr(mhc, "_cublas_tf32", lambda: True)  # the matmul route's conditions, unchanged
    assert mhc._proj_route(8) == "nsplit"
    monkeypatch.setattr(mhc, "LONG_PROJ", "cublas")
    with pytest.raises(ValueError, match="DEEPINFER_MHC_LONG_PROJ.*'cublas'"):
        mhc._proj_route(8)
    with pytest.raises(ValueError, match="DEEPINFER_MHC_LONG_PROJ"):
        mhc._proj_route(8, "split", 8, 64, "Fused")
    with pytest.raises(ValueError, match="proj must be"):
        mhc._pre_launch_split(torch.zeros(1, 2, 8), torch.zeros(8, 16), torch.zeros(8), torch.ones(3), 1, 1e-6, 1e-6,
                              False, proj="fuse")


def test_batch_invariant_mode_keeps_the_fixed_split():
    pytest.importorskip("triton")
    from deepinfer.engine.batch_invariant import BatchInvariantMode
    from deepinfer.kernels import mhc

    assert mhc._proj_route(4096, "split", 16, 1 << 20) == "matmul"
    with BatchInvariantMode():
        assert mhc._batch_invariant_active()
        assert mhc._proj_route(4096, "split", 16, 1 << 20) == "nsplit"
        assert mhc._proj_route(4096, "split", 16, 0) == "legacy_proj"
    assert not mhc._batch_invariant_active()


_SPLIT_EQUALS_LEGACY = textwrap.dedent("""
    import torch
    from deepinfer.kernels import mhc
    g = torch.Generator().manual_seed(0)
    ITERS, EPS = 2, 1e-6
    def params(T, hc, H, dtype):
        n = (2 + hc) * hc
        s = torch.randn(T, hc, H, generator=g).to(dtype)
        return s, torch.randn(n, hc * H, generator=g) * 0.05, torch.randn(n, generator=g) * 0.5, torch.rand(3, generator=g) + 0.5
    TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    def close(a, b, tol):
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
        assert err < tol, err
    # hc*H = 288: two K_SLICE splits, the last one partial; 120: one partial split
    for hc, H, dtype, tokens in ((4, 72, torch.bfloat16, __TOKENS__), (3, 40, torch.float32, (1, 17))):
        S, fn, base, scale = params(max(tokens), hc, H, dtype)
        hf, hb, hs = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
        first = None
        for T in tokens:
            s = S[:T].contiguous()
            args = (s, fn, base, scale, ITERS, EPS, EPS)
            leg = mhc._pre_launch_legacy(*args, False)
            # the hidden-split mix on the legacy partials: the legacy bits, every T
            mix = mhc._pre_launch_split(*args, False, proj="legacy", block_h=64)
            assert all(torch.equal(a, b) for a, b in zip(leg, mix)), (hc, H, T)
            # the whole split variant: a token's bits never depend on T; within float32 rounding of legacy
            new = mhc._pre_launch_split(*args, False, proj="nsplit", block_h=64)
            first = first or [new, None]
            assert all(torch.equal(a[:1], b) for a, b in zip(new, first[0])), (hc, H, T)
            if T in (1, 17, 40):  # other tilings of the projection: still T-invariant (fixed knobs, not by T)
                knobs = mhc._pre_launch_split(*args, False, proj="nsplit", block_n=16, dot_t=4, dot_k=64, block_h=64)
                first[1] = first[1] or knobs
                assert all(torch.equal(a[:1], b) for a, b in zip(knobs, first[1])), (hc, H, T)
                for a, b in zip(knobs, leg):
                    close(a, b, TOL[dtype])
            for a, b in zip(new, leg):
                close(a, b, TOL[dtype])
            if T in (1, 17):  # the head (one logit group, no post / comb)
                hargs = (s, hf, hb, hs, 1, EPS, EPS, True)
                hl = mhc._pre_launch_legacy(*hargs)[0]
                assert torch.equal(mhc._pre_launch_split(*hargs, proj="legacy", block_h=64)[0], hl)
                close(mhc._pre_launch_split(*hargs, proj="nsplit")[0], hl, TOL[dtype])
    print("OK")
""").replace("__TOKENS__", repr(TOKENS))


def test_split_variant_bits_under_the_interpreter():
    _interpret(_SPLIT_EQUALS_LEGACY)


_ROUTES = textwrap.dedent("""
    import torch
    from deepinfer.kernels import mhc
    from deepinfer.kernels.mhc import mhc_head_torch, mhc_head_triton, mhc_pre_torch, mhc_pre_triton
    g = torch.Generator().manual_seed(1)
    EPS = 1e-6
    TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
    def close(a, b, tol):
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
        assert err < tol, err
    mhc.VARIANT, mhc.MATMUL_MIN_T, mhc.NSPLIT_MAX_T = "split", 16, 64
    # through the registered ops: T < 16 the logit-split kernel, T >= 16 cuBLAS float32 (+ `_mhc_sumsq_kernel`,
    # writing float32 x for half streams, reading float32 streams as they are); the reference's tolerances
    for hc, H, dtype in ((4, 64, torch.float32), (4, 48, torch.bfloat16), (3, 40, torch.float16)):
        n = (2 + hc) * hc
        fn = torch.randn(n, hc * H, generator=g) * 0.05
        base = torch.randn(n, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        tol = TOL[dtype]
        for T in (5, 20):
            assert mhc._proj_route(T) == ("matmul" if T >= 16 else "nsplit")
            s = torch.randn(T, hc, H, generator=g).to(dtype)
            got = mhc_pre_triton(s, fn, base, scale, hc, 20, EPS, EPS)
            ref = mhc_pre_torch(s, fn, base, scale, hc, 20, EPS, EPS)
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype and a.shape == b.shape
                close(a, b, tol)
            hf, hb, hs = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
            close(mhc_head_triton(s, hf, hb, hs, EPS, EPS), mhc_head_torch(s, hf, hb, hs, EPS, EPS), tol)
    # batch-invariant mode: no matmul route, so a token's bits stay those of T = 1 for every T
    from deepinfer.engine.batch_invariant import BatchInvariantMode
    hc, H = 4, 48
    n = (2 + hc) * hc
    S = torch.randn(40, hc, H, generator=g).to(torch.bfloat16)
    fn, base, scale = torch.randn(n, hc * H, generator=g) * 0.05, torch.randn(n, generator=g) * 0.5, torch.ones(3)
    with BatchInvariantMode():
        one = mhc_pre_triton(S[:1].contiguous(), fn, base, scale, hc, 2, EPS, EPS)
        for T in (17, 40):
            out = mhc_pre_triton(S[:T].contiguous(), fn, base, scale, hc, 2, EPS, EPS)
            assert all(torch.equal(a[:1], b) for a, b in zip(out, one)), T
    # outside it the same T = 40 call takes the matmul route: other bits, same numbers
    out = mhc_pre_triton(S, fn, base, scale, hc, 2, EPS, EPS)
    for a, b in zip(out, one):
        close(a[:1], b, TOL[torch.bfloat16])
    print("OK")
""")


def test_split_variant_routes_under_the_interpreter():
    _interpret(_ROUTES)


_FUSED = textwrap.dedent("""
    import os
    os.environ["DEEPINFER_MHC_LONG_PROJ"] = "fused"  # the knob, read at import
    os.environ["DEEPINFER_MHC_MATMUL_MIN_T"] = "16"
    import torch
    from deepinfer.kernels import mhc
    from deepinfer.kernels.mhc import mhc_head_torch, mhc_head_triton, mhc_pre_torch, mhc_pre_triton
    assert mhc.LONG_PROJ == "fused" and mhc.MATMUL_MIN_T == 16, (mhc.LONG_PROJ, mhc.MATMUL_MIN_T)
    mhc.VARIANT, mhc.NSPLIT_MAX_T = "split", 0
    mhc._mhc_sumsq_kernel = None  # the matmul route would fail: only the fused kernel projects from T = 16
    g = torch.Generator().manual_seed(2)
    EPS = 1e-6
    TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
    def close(a, b, tol):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        err = ((a.float() - b.float()).abs() / (1 + b.float().abs())).max().item()
        assert err < tol, err
    # hc*H = 160 / 168: not multiples of FUSED_BLOCK_K (64) nor of 16-column steps' chunks; T = 20, 70: not
    # multiples of FUSED_BLOCK_T (64), 70 two blocks
    for hc, H, dtype in ((4, 40, torch.bfloat16), (3, 56, torch.float32)):
        n = (2 + hc) * hc
        fn = torch.randn(n, hc * H, generator=g) * 0.05
        base = torch.randn(n, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        hf, hb, hs = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
        tol = TOL[dtype]
        for T in (20, 70):
            assert mhc._proj_route(T) == "fused"
            s = torch.randn(T, hc, H, generator=g).to(dtype)
            ref = mhc_pre_torch(s, fn, base, scale, hc, 20, EPS, EPS)  # collapsed (pre's), post, comb
            for a, b in zip(mhc_pre_triton(s, fn, base, scale, hc, 20, EPS, EPS), ref):
                close(a, b, tol)
            close(mhc_head_triton(s, hf, hb, hs, EPS, EPS), mhc_head_torch(s, hf, hb, hs, EPS, EPS), tol)
            # other cuts: one chunk of several steps (the last partial), uneven chunks of 16-column steps
            for kw in ({"fused_split": 1}, {"fused_split": 3, "fused_block_k": 16}, {"fused_block_t": 16}):
                for a, b in zip(mhc._pre_launch_split(s, fn, base, scale, 20, EPS, EPS, False, proj="fused", **kw),
                                ref):
                    close(a, b, tol)
    print("OK")
""")


def test_fused_long_proj_under_the_interpreter():
    _interpret(_FUSED)


def test_benchmark_smoke():
    pytest.importorskip("triton")
    out = run_module_interpreted("deepinfer.benchmarks.gpu_mhc", "--smoke")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| pre |")]
    got = {(r[2].strip(), r[3].strip()): r[6].strip() for r in rows}
    assert set(got) == {(t, c) for t in ("1", "17") for c in ("legacy", "mix_split", "split", "matmul", "fused")}
    assert got["1", "mix_split"] == got["17", "mix_split"] == "True"


# ---------------------------------------------------------------------------- CUDA


def _cuda_params(T, hc=4, H=4096, head=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = hc if head else (2 + hc) * hc
    s = torch.randn(T, hc, H, generator=g).to("cuda", dtype)
    fn = (torch.randn(n, hc * H, generator=g) * 0.02).cuda()
    base = (torch.randn(n, generator=g) * 0.5).cuda()
    scale = (torch.rand(1 if head else 3, generator=g) + 0.5).cuda()
    return s, fn, base, scale


@pytest.mark.gpu
@pytest.mark.parametrize("head, dtype", [(False, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16)])
def test_split_variant_is_bit_identical_to_legacy_on_cuda(head, dtype):
    """V4-Flash widths: the logit-split projection and the hidden-split mix give the legacy bits for every T,
    so the "split" variant below MATMUL_MIN_T keeps batch invariance and changes no model output."""
    from deepinfer.kernels import mhc

    S, fn, base, scale = _cuda_params(128, head=head, dtype=dtype, seed=7)
    iters = 1 if head else 20
    first = None
    for T in (*TOKENS, 128):
        args = (S[:T].contiguous(), fn, base, scale, iters, 1e-6, 1e-6, head)
        leg = mhc._pre_launch_legacy(*args)
        outs = (0,) if head else (0, 1, 2)
        for kw in ({"proj": "legacy"}, {"proj": "nsplit"},
                   {"proj": "nsplit", "block_n": 4, "dot_t": 1, "dot_k": 32, "block_h": 512},
                   {"proj": "nsplit", "block_n": 32, "dot_t": 4, "dot_k": 64, "block_h": 1024}):
            new = mhc._pre_launch_split(*args, **kw)
            for i in outs:
                assert torch.equal(new[i], leg[i]), (T, kw, i, (new[i].float() - leg[i].float()).abs().max().item())
        first = first or leg
        for i in outs:
            assert torch.equal(leg[i][:1], first[i])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1024, 4096])
def test_matmul_route_matches_the_reference_on_cuda(T):
    from deepinfer.kernels import mhc

    s, fn, base, scale = _cuda_params(T, seed=T)
    got = mhc._pre_launch_split(s, fn, base, scale, 20, 1e-6, 1e-6, False, proj="matmul")
    ref = mhc.mhc_pre_torch(s.cpu().float(), fn.cpu(), base.cpu(), scale.cpu(), 4, 20, 1e-6, 1e-6)
    torch.testing.assert_close(got[1].cpu(), ref[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2].cpu(), ref[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0].cpu().float(), ref[0], atol=1e-2, rtol=1e-2)
    leg = mhc._pre_launch_legacy(s, fn, base, scale, 20, 1e-6, 1e-6, False)
    torch.testing.assert_close(got[2], leg[2], atol=1e-4, rtol=1e-4)  # float32 rounding apart


@pytest.mark.gpu
@pytest.mark.parametrize("head, dtype", [(False, torch.bfloat16), (False, torch.float32), (True, torch.bfloat16),
                                         (True, torch.float32)])
def test_fused_long_proj_matches_the_matmul_route_on_cuda(head, dtype, monkeypatch):
    """V4-Flash widths, T = 1536 (24 token blocks, 16 K chunks): the fused 3xTF32 projection within float32
    rounding of the cuBLAS float32 route (and of the CPU reference), and the knob routing mhc_pre / mhc_head to it."""
    from deepinfer.kernels import mhc

    s, fn, base, scale = _cuda_params(1536, head=head, dtype=dtype, seed=11)
    iters = 1 if head else 20
    args = (s, fn, base, scale, iters, 1e-6, 1e-6, head)
    mm = mhc._pre_launch_split(*args, proj="matmul")
    outs = (0,) if head else (0, 1, 2)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 collapsed: an ulp where the float32 weights round apart
    for kw in ({}, {"fused_split": 1}):
        got = mhc._pre_launch_split(*args, proj="fused", **kw)
        for i in outs:
            t = tol if i == 0 else 1e-4
            torch.testing.assert_close(got[i].float(), mm[i].float(), atol=t, rtol=t)
    if not head:
        ref = mhc.mhc_pre_torch(s.cpu().float(), fn.cpu(), base.cpu(), scale.cpu(), 4, 20, 1e-6, 1e-6)
        torch.testing.assert_close(got[1].cpu(), ref[1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got[2].cpu(), ref[2], atol=1e-4, rtol=1e-4)
    monkeypatch.setattr(mhc, "VARIANT", "split")
    monkeypatch.setattr(mhc, "MATMUL_MIN_T", 1024)
    monkeypatch.setattr(mhc, "LONG_PROJ", "fused")
    assert mhc._proj_route(1536) == "fused"
    fused = mhc._pre_launch_split(*args, proj="fused")
    if head:
        assert torch.equal(mhc.mhc_head_triton(s, fn, base, scale, 1e-6, 1e-6), fused[0])
    else:
        assert all(torch.equal(a, b) for a, b in zip(mhc.mhc_pre_triton(s, fn, base, scale, 4, 20, 1e-6, 1e-6),
                                                      fused))


@pytest.mark.gpu
def test_split_variant_in_batch_invariant_mode_on_cuda(monkeypatch):
    from deepinfer.engine.batch_invariant import BatchInvariantMode
    from deepinfer.kernels import mhc

    monkeypatch.setattr(mhc, "VARIANT", "split")
    monkeypatch.setattr(mhc, "MATMUL_MIN_T", 16)
    S, fn, base, scale = _cuda_params(64, seed=3)
    with BatchInvariantMode():
        one = mhc.mhc_pre_triton(S[:1].contiguous(), fn, base, scale, 4, 20, 1e-6, 1e-6)
        whole = mhc.mhc_pre_triton(S, fn, base, scale, 4, 20, 1e-6, 1e-6)
    leg = mhc._pre_launch_legacy(S, fn, base, scale, 20, 1e-6, 1e-6, False)
    for a, b, c in zip(whole, one, leg):
        assert torch.equal(a[:1], b) and torch.equal(a, c)


@pytest.mark.gpu
def test_split_variant_under_a_cuda_graph():
    from deepinfer.kernels import mhc

    s, fn, base, scale = _cuda_params(8, seed=5)
    eager = mhc._pre_launch_split(s, fn, base, scale, 20, 1e-6, 1e-6, False)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mhc._pre_launch_split(s, fn, base, scale, 20, 1e-6, 1e-6, False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mhc._pre_launch_split(s, fn, base, scale, 20, 1e-6, 1e-6, False)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, eager))


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_SPLIT_EQUALS_LEGACY, tests=("test_split_variant_bits_under_the_interpreter",), timeout=300)
prefetch_interpreted(_ROUTES, tests=("test_split_variant_routes_under_the_interpreter",), timeout=300)
prefetch_interpreted(_FUSED, tests=("test_fused_long_proj_under_the_interpreter",), timeout=300)
