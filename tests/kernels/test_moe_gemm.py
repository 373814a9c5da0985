"""The grouped MoE GEMM ops (`kernels.moe_gemm`): align / up / down / combine, Triton against the torch
references, and the references against the plain per-expert loop.

The Triton kernels run on the CPU under `TRITON_INTERPRET=1` in a subprocess (tiny shapes; float32 and
float16 activations, float, FP4 and FP8 expert weights, every tile config the CUDA tuner may pick), and on
CUDA in bf16 (`gpu` tests).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import moe_gemm as mg
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def _problem(T=7, E=5, H=64, inter=32, k=3, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=g)
    return [t.to(device) if t.dtype == torch.long else t.to(device, dtype) for t in (x, w13, w2, tw)] + [ids.to(device)]


def _loop(x, w13, w2, tw, ids, limit):
    """The per-expert loop as the torch backend runs it: experts ascending, index_add_ into zeros."""
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if len(tok):
            g = F.linear(x[tok], w13[e, :inter]).clamp(max=limit)
            u = F.linear(x[tok], w13[e, inter:]).clamp(min=-limit, max=limit)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, w2[e]) * tw[tok, slot][:, None].to(x.dtype))
    return out


def _chain(ops, x, w13, w2, tw, ids, limit, wfmt=mg.WFMT_FLOAT, block=32):
    align, up, down, combine = ops
    sp, cnt = align(ids, w13[0].shape[0])
    act = up(x, w13, sp, cnt, ids.shape[1], limit, wfmt, block)
    return combine(down(act, w2, sp, cnt, tw, wfmt, block), ids)


def test_align_reference_groups_stably():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    sp, cnt = mg.moe_align_torch(ids, 4)
    assert cnt.tolist() == [2, 1, 3, 0] and sp.tolist() == [1, 4, 3, 0, 2, 5]
    assert sp.dtype == cnt.dtype == torch.int32


@pytest.mark.parametrize("limit", [10.0, 0.3])
def test_references_equal_the_per_expert_loop(limit):
    x, w13, w2, tw, ids = _problem()
    ops = (mg.moe_align_torch, mg.moe_up_torch, mg.moe_down_torch, mg.moe_combine_torch)
    got = _chain(ops, x, (w13,), (w2,), tw, ids, limit)
    torch.testing.assert_close(got, _loop(x, w13, w2, tw, ids, limit), atol=1e-6, rtol=1e-6)


def test_checks_name_the_bad_argument():
    x, w13, w2, tw, ids = _problem()
    sp, cnt = mg.moe_align_torch(ids, 5)
    with pytest.raises(ValueError, match="float weights must be"):
        mg.check_moe_gemm_args("up", x, (w13.half(),), sp, cnt, mg.WFMT_FLOAT, 64, 64)
    with pytest.raises(ValueError, match="counts must be int32"):
        mg.check_moe_gemm_args("up", x, (w13,), sp, cnt.long(), mg.WFMT_FLOAT, 64, 64)
    with pytest.raises(ValueError, match="FP4 weights must be"):
        mg.check_moe_gemm_args("up", x, (w13,), sp, cnt, mg.WFMT_FP4, 64, 64)
    with pytest.raises(ValueError, match="topk_ids must be"):
        mg.moe_align_torch(ids.float(), 5)


_INTERPRETED = textwrap.dedent("""
    import torch
    from deepinfer.kernels import moe_gemm as mg
    from deepinfer.engine.quant.formats import quantize_fp4
    g = torch.Generator().manual_seed(0)
    from tests.kernels._kernel_checks import RelativeErrors
    errors = RelativeErrors()
    check = errors.check
    # align: identical to the reference, one block and several (E not a power of two, R > BLOCK)
    for T, E, k in ((1, 4, 2), (7, 5, 3), (300, 6, 2), (40, 130, 6)):
        ids = torch.randint(0, E, (T, k), generator=g)
        a, b = mg.moe_align_torch(ids, E), mg.moe_align_triton(ids, E)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    E, H, inter, k = 5, 96, 64, 3
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    q13 = [quantize_fp4(w13[e]) for e in range(E)]
    q2 = [quantize_fp4(w2[e]) for e in range(E)]
    fp4_13 = (torch.stack([p for p, _ in q13]), torch.stack([s for _, s in q13]))
    fp4_2 = (torch.stack([p for p, _ in q2]), torch.stack([s for _, s in q2]))
    for T in (1, 7, 40):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[0, 1] = ids[0, 0] if T > 1 else ids[0, 1]  # a token routed twice to one expert
        tw = torch.rand(T, k, generator=g)
        sp, cnt = mg.moe_align_torch(ids, E)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3))[:1 if T == 40 else 2]:
            x = torch.randn(T, H, generator=g).to(dtype)
            for wfmt, w_up, w_dn in ((mg.WFMT_FLOAT, (w13.to(dtype),), (w2.to(dtype),)), (mg.WFMT_FP4, fp4_13, fp4_2)):
                for limit in (10.0, 0.5):
                    ref = mg.moe_up_torch(x, w_up, sp, cnt, k, limit, wfmt)
                    check(mg.moe_up_triton(x, w_up, sp, cnt, k, limit, wfmt), ref, tol)
                yref = mg.moe_down_torch(ref, w_dn, sp, cnt, tw, wfmt)
                check(mg.moe_down_triton(ref, w_dn, sp, cnt, tw, wfmt), yref, tol)
                assert torch.equal(mg.moe_combine_triton(yref, ids), mg.moe_combine_torch(yref, ids))
        if T != 40:
            continue
        # every tile config the tuner may pick, float32
        x = torch.randn(T, H, generator=g)
        ref = mg.moe_up_torch(x, (w13,), sp, cnt, k, 10.0)
        yref = mg.moe_down_torch(ref, (w2,), sp, cnt, tw)
        for cfg in mg.moe_gemm_candidates(1, "up") + mg.moe_gemm_candidates(500, "up"):
            check(mg.moe_up_triton(x, (w13,), sp, cnt, k, 10.0, config=cfg), ref, 1e-5)
        for cfg in mg.moe_gemm_candidates(1, "down") + mg.moe_gemm_candidates(500, "down"):
            check(mg.moe_down_triton(ref, (w2,), sp, cnt, tw, config=cfg), yref, 1e-5)
        # and with FP4 experts (the swap-AB configs decode the weight tile as the dot's A operand)
        ref4 = mg.moe_up_torch(x, fp4_13, sp, cnt, k, 10.0, mg.WFMT_FP4)
        yref4 = mg.moe_down_torch(ref4, fp4_2, sp, cnt, tw, mg.WFMT_FP4)
        for cfg in mg.moe_gemm_candidates(1, "up") + mg.moe_gemm_candidates(500, "up"):
            check(mg.moe_up_triton(x, fp4_13, sp, cnt, k, 10.0, mg.WFMT_FP4, config=cfg), ref4, 1e-5)
        for cfg in mg.moe_gemm_candidates(1, "down") + mg.moe_gemm_candidates(500, "down"):
            check(mg.moe_down_triton(ref4, fp4_2, sp, cnt, tw, mg.WFMT_FP4, config=cfg), yref4, 1e-5)
    # FP8 block-scaled experts (UE8M0 and float32 scales), K and N off the 128 blocks
    from deepinfer.engine.quant.formats import quantize_fp8_block
    E, H, inter, k, T = 3, 160, 128, 2, 9
    w13 = torch.randn(E, 2 * inter, H, generator=g) * 0.2
    w2 = torch.randn(E, H, inter, generator=g) * 0.2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    tw = torch.rand(T, k, generator=g)
    sp, cnt = mg.moe_align_torch(ids, E)
    for sd in (torch.float8_e8m0fnu, torch.float32):
        q13 = [quantize_fp8_block(w13[e], (128, 128), sd) for e in range(E)]
        q2 = [quantize_fp8_block(w2[e], (128, 128), sd) for e in range(E)]
        f13 = (torch.stack([a for a, _ in q13]), torch.stack([b for _, b in q13]))
        f2 = (torch.stack([a for a, _ in q2]), torch.stack([b for _, b in q2]))
        x = torch.randn(T, H, generator=g)
        ref = mg.moe_up_torch(x, f13, sp, cnt, k, 10.0, mg.WFMT_FP8, (128, 128))
        check(mg.moe_up_triton(x, f13, sp, cnt, k, 10.0, mg.WFMT_FP8, (128, 128)), ref, 2e-5)
        yref = mg.moe_down_torch(ref, f2, sp, cnt, tw, mg.WFMT_FP8, (128, 128))
        check(mg.moe_down_triton(ref, f2, sp, cnt, tw, mg.WFMT_FP8, (128, 128)), yref, 2e-5)
        for cfg in mg.moe_gemm_candidates(1, "up")[3:] + mg.moe_gemm_candidates(1, "down")[3:]:  # swap-AB
            check(mg.moe_up_triton(x, f13, sp, cnt, k, 10.0, mg.WFMT_FP8, (128, 128), config=cfg), ref, 2e-5)
            check(mg.moe_down_triton(ref, f2, sp, cnt, tw, mg.WFMT_FP8, (128, 128), config=cfg), yref, 2e-5)
    print("OK", errors.worst)
""")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture
def _no_tuning(monkeypatch):
    """Each op's first (default) tile config: `test_every_tuning_candidate_on_cuda` runs the rest."""
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")


@pytest.mark.gpu
@pytest.mark.parametrize("T, E, k", [(1, 64, 6), (32, 64, 6), (200, 16, 6), (5, 4, 2)])
def test_bf16_and_fp4_on_cuda(T, E, k, _no_tuning):
    from deepinfer.engine.quant.formats import quantize_fp4

    x, w13, w2, tw, ids = _problem(T=T, E=E, H=512, inter=256, k=k, seed=T, device="cuda")
    sp, cnt = mg.moe_align_triton(ids, E)
    ref = mg.moe_align_torch(ids, E)
    assert torch.equal(sp, ref[0]) and torch.equal(cnt, ref[1])
    xb, tb = x.bfloat16(), tw.bfloat16()
    act = mg.moe_up_triton(xb, (w13.bfloat16(),), sp, cnt, k, 10.0)
    act_ref = mg.moe_up_torch(xb, (w13.bfloat16(),), sp, cnt, k, 10.0)
    torch.testing.assert_close(act.float(), act_ref.float(), atol=2e-2, rtol=2e-2)
    y = mg.moe_down_triton(act_ref, (w2.bfloat16(),), sp, cnt, tb)
    y_ref = mg.moe_down_torch(act_ref, (w2.bfloat16(),), sp, cnt, tb)
    torch.testing.assert_close(y.float(), y_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(mg.moe_combine_triton(y_ref, ids), mg.moe_combine_torch(y_ref, ids))
    q13 = [quantize_fp4(w13[e]) for e in range(E)]
    p13, s13 = torch.stack([p for p, _ in q13]), torch.stack([s for _, s in q13])
    act = mg.moe_up_triton(xb, (p13, s13), sp, cnt, k, 10.0, mg.WFMT_FP4)
    act_ref = mg.moe_up_torch(xb, (p13, s13), sp, cnt, k, 10.0, mg.WFMT_FP4)
    torch.testing.assert_close(act.float(), act_ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_every_tuning_candidate_on_cuda():
    x, w13, w2, tw, ids = _problem(T=300, E=8, H=256, inter=128, k=6, device="cuda", dtype=torch.bfloat16)
    sp, cnt = mg.moe_align_triton(ids, 8)
    ref = mg.moe_up_torch(x, (w13,), sp, cnt, 6, 10.0)
    yref = mg.moe_down_torch(ref, (w2,), sp, cnt, tw)
    from deepinfer.engine.quant.formats import quantize_fp4

    q13 = [quantize_fp4(w13[e].float().cpu()) for e in range(8)]
    q2 = [quantize_fp4(w2[e].float().cpu()) for e in range(8)]
    f13 = (torch.stack([p for p, _ in q13]).cuda(), torch.stack([s for _, s in q13]).cuda())
    f2 = (torch.stack([p for p, _ in q2]).cuda(), torch.stack([s for _, s in q2]).cuda())
    ref4 = mg.moe_up_torch(x, f13, sp, cnt, 6, 10.0, mg.WFMT_FP4)
    yref4 = mg.moe_down_torch(ref4, f2, sp, cnt, tw, mg.WFMT_FP4)
    for rows in (1, 500):
        for w_up, w_dn, wfmt, r, yr in (((w13,), (w2,), mg.WFMT_FLOAT, ref, yref), (f13, f2, mg.WFMT_FP4, ref4, yref4)):
            for cfg in mg.moe_gemm_candidates(rows, "up"):
                torch.testing.assert_close(mg.moe_up_triton(x, w_up, sp, cnt, 6, 10.0, wfmt, config=cfg).float(),
                                           r.float(), atol=2e-2, rtol=2e-2)
            for cfg in mg.moe_gemm_candidates(rows, "down"):
                torch.testing.assert_close(mg.moe_down_triton(r, w_dn, sp, cnt, tw, wfmt, config=cfg).float(),
                                           yr.float(), atol=2e-2, rtol=2e-2)


def _sorted_rows(ids: torch.Tensor, E: int, dtype: torch.dtype, H: int = 48, seed: int = 0):
    """The down projection's rows in expert order (as the `_grouped_mm` route has them), their inverse map, the
    routing weights, and what putting them back, weighting and combining them gives (the route's old steps)."""
    g = torch.Generator().manual_seed(seed)
    sp, _ = mg.moe_align_torch(ids, E)
    y_sorted = (torch.randn(sp.numel(), H, generator=g) * 3).to(dtype)
    tw = torch.rand(ids.shape, generator=g)
    rows = torch.empty_like(sp).scatter_(0, sp.long(), torch.arange(sp.numel(), dtype=sp.dtype))
    y = torch.empty_like(y_sorted).index_copy_(0, sp.long(), y_sorted)
    y.mul_(tw.reshape(-1, 1).to(dtype))
    return y_sorted, rows, tw, mg.moe_combine_torch(y, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_reference_reads_sorted_rows_and_weights(dtype):
    """`rows` / `weights` give the bits of putting expert-ordered rows back at their pairs, weighting and combining."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(9)])
    ids[1, 2] = ids[1, 0]  # a token routed twice to one expert
    y_sorted, rows, tw, want = _sorted_rows(ids, 6, dtype)
    assert torch.equal(mg.moe_combine_torch(y_sorted, ids, rows=rows, weights=tw), want)


def test_combine_with_rows_and_weights_under_the_interpreter():
    out = run_interpreted(textwrap.dedent("""
        import torch
        from deepinfer.kernels import moe_gemm as mg
        from tests.kernels.test_moe_gemm import _sorted_rows
        g = torch.Generator().manual_seed(4)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for T, E, k in ((1, 4, 2), (7, 6, 3), (5, 3, 3)):
                ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
                y_sorted, rows, tw, want = _sorted_rows(ids, E, dtype, seed=T)
                for r in (rows, rows.long()):
                    got = mg.moe_combine_triton(y_sorted, ids, rows=r, weights=tw)
                    assert torch.equal(got, want), (dtype, T)
                y = y_sorted.index_select(0, rows.long())  # rows only / weights only
                assert torch.equal(mg.moe_combine_triton(y_sorted, ids, rows=rows), mg.moe_combine_torch(y, ids))
                assert torch.equal(mg.moe_combine_triton(y, ids, weights=tw), mg.moe_combine_torch(y, ids, weights=tw))
        try:
            mg.moe_combine_triton(y_sorted, ids, rows=rows[:-1])
        except ValueError as e:
            assert "one entry per pair" in str(e)
        else:
            raise AssertionError("a short rows map was accepted")
        print("OK")
    """))
    assert "OK" in out, out


@pytest.mark.gpu
def test_combine_with_rows_and_weights_on_cuda():
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(300)])
    y_sorted, rows, tw, want = _sorted_rows(ids, 64, torch.bfloat16, H=4096)
    got = mg.moe_combine_triton(y_sorted.cuda(), ids.cuda(), rows=rows.cuda(), weights=tw.cuda())
    assert torch.equal(got.cpu(), want)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernels_under_the_interpreter",), timeout=600)
