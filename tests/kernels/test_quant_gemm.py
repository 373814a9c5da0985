"""The quantized GEMM kernels (`kernels.fp8_gemm`, `kernels.fp4_gemm`): Triton against the exact torch
references, and the references against x @ dequant(W).T.

The Triton kernels run on the CPU under `TRITON_INTERPRET=1` in a subprocess (the variable must be set
before triton is imported) on small random data, shapes that are not multiples of the blocks included,
and on CUDA where there is one (`gpu` tests, bf16 and float32 activations against the CPU reference).
NOTE: triton's CPU interpreter mishandles bfloat16 activations (triton 3.9: wrong values, fp16 and fp32
are right), so the interpreter test uses float32 and float16; bf16 is covered by the `gpu` tests.
Imports only torch, triton, `deepinfer.kernels` and `deepinfer.engine.quant` (runs on a bare GPU machine).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.quant.formats import dequant_fp4, dequant_fp8_block, quantize_fp4, quantize_fp8_block
from deepinfer.kernels.fp4_gemm import fp4_gemm_torch, fp4_grouped_gemm_torch, grouped_tile_map
from deepinfer.kernels.fp8_gemm import fp8_gemm_torch
from deepinfer.kernels.registry import default_impl, get_op
from tests.kernels._interp import prefetch_interpreted, run_interpreted

# (M, N, K): decode-sized and prefill-sized rows, N and K off the 128 / 32 blocks
SHAPES = [(1, 130, 200), (5, 64, 256), (17, 257, 96), (70, 100, 320)]


def _fp8(n: int, k: int, scale_dtype=torch.float8_e8m0fnu, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(n, k, generator=g) * torch.logspace(-2, 0.5, k), (128, 128), scale_dtype)


def _fp4(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp4(torch.randn(n, k, generator=g) * torch.logspace(-2, 0.5, k))


def _x(m: int, k: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m, n, k", SHAPES)
def test_torch_references_match_the_dequantized_matmul(m, n, k):
    x = _x(m, k)
    for scale_dtype in (torch.float8_e8m0fnu, torch.float32):
        w8, s = _fp8(n, k, scale_dtype)
        torch.testing.assert_close(fp8_gemm_torch(x, w8, s, (128, 128)), x @ dequant_fp8_block(w8, s).T,
                                   atol=1e-5, rtol=1e-5)
    p, s = _fp4(n, k)
    torch.testing.assert_close(fp4_gemm_torch(x, p, s), x @ dequant_fp4(p, s).T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n, k", [(130, 200), (257, 384), (256, 96)])
def test_fp8_dequantize_to_bf16_is_exact(n, k):
    """The large-M route's weight (`dequantize_fp8_bf16`) holds the reference's float32 W exactly, block tails
    included; a float32 scale (whose products round) is refused."""
    from deepinfer.kernels.fp8_gemm import dequantize_fp8_bf16

    w8, s = _fp8(n, k)
    w = dequantize_fp8_bf16(w8, s, (128, 128))
    assert w.dtype == torch.bfloat16 and torch.equal(w.float(), dequant_fp8_block(w8, s))
    with pytest.raises(ValueError, match="UE8M0 scales only"):
        dequantize_fp8_bf16(*_fp8(n, k, torch.float32), (128, 128))


def test_fp8_large_m_takes_the_dequantize_then_matmul_route(monkeypatch):
    """From `DEQUANT_MIN_ROWS` rows (bf16 x, UE8M0 scales) the Triton entry point is one bf16 matmul over the
    dequantized W (plain torch: runs here without the interpreter); fewer rows or a float32 scale do not take it."""
    pytest.importorskip("triton")
    from deepinfer.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "DEQUANT_MIN_ROWS", 16)
    w8, s = _fp8(200, 384)
    x = _x(40, 384).to(torch.bfloat16)
    ref = fp8_gemm_torch(x.float(), w8, s, (128, 128))
    out = fp8_gemm.fp8_gemm_triton(x, w8, s, (128, 128))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)
    assert torch.equal(out, x @ fp8_gemm.dequantize_fp8_bf16(w8, s, (128, 128)).T)
    assert fp8_gemm._dequant_route(x, s) and not fp8_gemm._dequant_route(x[:15], s)
    assert not fp8_gemm._dequant_route(x, _fp8(200, 384, torch.float32)[1])
    assert not fp8_gemm._dequant_route(x.float(), s)
    monkeypatch.setattr(fp8_gemm, "DEQUANT_MIN_ROWS", 0)  # off
    assert not fp8_gemm._dequant_route(x, s)


def test_fp8_row_groups_reference_and_checks():
    """`groups`: output group g is x's g-th K columns times W's g-th rows (V4's grouped wo_a); the reference equals
    the block-diagonal product; rows not in whole scale blocks per group, or x of the wrong width, are refused."""
    w8, s = _fp8(3 * 256, 200)
    x = _x(7, 3 * 200)
    w = dequant_fp8_block(w8, s)
    want = torch.cat([x[:, g * 200:(g + 1) * 200] @ w[g * 256:(g + 1) * 256].T for g in range(3)], dim=1)
    torch.testing.assert_close(fp8_gemm_torch(x, w8, s, (128, 128), groups=3), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="groups=2 must split"):
        fp8_gemm_torch(_x(7, 400), *_fp8(3 * 128, 200), (128, 128), groups=2)  # 192-row groups
    with pytest.raises(ValueError, match="3 row groups"):
        fp8_gemm_torch(_x(7, 200), w8, s, (128, 128), groups=3)


def test_fp8_row_groups_dequantize_route(monkeypatch):
    pytest.importorskip("triton")
    from deepinfer.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "DEQUANT_MIN_ROWS", 16)
    w8, s = _fp8(4 * 128, 256)
    x = _x(40, 4 * 256).to(torch.bfloat16)
    out = fp8_gemm.fp8_gemm_triton(x, w8, s, (128, 128), groups=4)
    ref = fp8_gemm_torch(x.float(), w8, s, (128, 128), groups=4)
    assert out.dtype == torch.bfloat16 and out.shape == (40, 512)
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


def test_grouped_tile_map():
    counts = torch.tensor([3, 0, 20, 1])
    e, r0, r1 = grouped_tile_map(counts, 16, 24)
    assert e.tolist() == [0, 2, 2, 3, 4, 4]  # ceil(24/16) + 4 programs; 2 tiles for 20 rows; past the end: id E
    assert r0[:4].tolist() == [0, 3, 19, 23] and r1[:4].tolist() == [3, 23, 23, 24]


def test_cpu_defaults_are_the_references():
    assert default_impl("fp8_gemm", "cpu") == default_impl("fp4_gemm", "cpu") == "torch"
    assert get_op("fp4_grouped_gemm", default_impl("fp4_grouped_gemm", "cpu")) is fp4_grouped_gemm_torch


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from deepinfer.engine.quant.formats import quantize_fp4, quantize_fp8_block
    from deepinfer.kernels.fp4_gemm import (fp4_gemm_torch, fp4_gemm_triton, fp4_grouped_gemm_torch,
                                            fp4_grouped_gemm_triton)
    from deepinfer.kernels.fp8_gemm import fp8_gemm_torch, fp8_gemm_triton

    g = torch.Generator().manual_seed(0)
    from tests.kernels._kernel_checks import RelativeErrors
    errors = RelativeErrors()
    check = errors.check
    for m, n, k in [(1, 130, 200), (17, 257, 96), (33, 64, 256)]:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            x = torch.randn(m, k, generator=g).to(dtype)
            for sd in (torch.float8_e8m0fnu, torch.float32):
                w8, s = quantize_fp8_block(torch.randn(n, k, generator=g), (128, 128), sd)
                check(fp8_gemm_triton(x, w8, s, (128, 128)), fp8_gemm_torch(x, w8, s, (128, 128)), tol)
            p, s = quantize_fp4(torch.randn(n, k, generator=g))
            check(fp4_gemm_triton(x, p, s), fp4_gemm_torch(x, p, s), tol)
    # K split across programs (decode): partial sums added in split order; the last slice partial
    x = torch.randn(2, 320, generator=g)
    w8, s = quantize_fp8_block(torch.randn(70, 320, generator=g), (128, 128))
    for split in (2, 3):
        check(fp8_gemm_triton(x, w8, s, (128, 128), split_k=split), fp8_gemm_torch(x, w8, s, (128, 128)), 1e-5)
    p, s = quantize_fp4(torch.randn(70, 320, generator=g))
    check(fp4_gemm_triton(x, p, s, split_k=2), fp4_gemm_torch(x, p, s), 1e-5)
    ps = [quantize_fp4(torch.randn(40, 96, generator=g)) for _ in range(4)]
    packed, scale = torch.stack([p for p, _ in ps]), torch.stack([s for _, s in ps])
    counts = torch.tensor([3, 0, 20, 1])
    x = torch.randn(24, 96, generator=g)
    check(fp4_grouped_gemm_triton(x, packed, scale, counts), fp4_grouped_gemm_torch(x, packed, scale, counts), 1e-5)
    # every tile config the CUDA tuner may pick (decode and prefill buckets), K split where it applies;
    # float32 rounding of sums over K = 320 in another order: 5e-5
    from deepinfer.kernels.fp4_gemm import fp4_gemm_candidates
    from deepinfer.kernels.fp8_gemm import fp8_gemm_candidates
    w8, s8 = quantize_fp8_block(torch.randn(70, 320, generator=g), (128, 128))
    p, s = quantize_fp4(torch.randn(70, 320, generator=g))
    for m in (3, 40, 70):
        x = torch.randn(m, 320, generator=g)
        for cfg in fp8_gemm_candidates(m):
            check(fp8_gemm_triton(x, w8, s8, (128, 128), config=cfg), fp8_gemm_torch(x, w8, s8, (128, 128)), 5e-5)
        for cfg in fp4_gemm_candidates(m):
            check(fp4_gemm_triton(x, p, s, config=cfg), fp4_gemm_torch(x, p, s), 5e-5)
    # row groups (the grouped wo_a, one launch): every candidate, a K split, N blocks inside 128-row groups
    w8, s8 = quantize_fp8_block(torch.randn(4 * 128, 160, generator=g), (128, 128))
    for m in (1, 40):
        x = torch.randn(m, 4 * 160, generator=g)
        ref = fp8_gemm_torch(x, w8, s8, (128, 128), groups=4)
        for cfg in fp8_gemm_candidates(m):
            check(fp8_gemm_triton(x, w8, s8, (128, 128), config=cfg, groups=4), ref, 5e-5)
        check(fp8_gemm_triton(x, w8, s8, (128, 128), split_k=2, groups=4), ref, 5e-5)
    x = torch.randn(24, 96, generator=g)
    for cfg in fp4_gemm_candidates(1) + fp4_gemm_candidates(100):
        check(fp4_grouped_gemm_triton(x, packed, scale, counts, config=cfg),
              fp4_grouped_gemm_torch(x, packed, scale, counts), 5e-5)
    print("OK", errors.worst)
""")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRET_SCRIPT)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    """The CUDA tests run each op's first (default) config; `test_every_tuning_candidate_on_cuda` runs the rest."""
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES + [(128, 1024, 4096), (2048, 1024, 4096)])  # 2048: the cuBLAS route
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_triton_on_cuda_matches_the_cpu_reference(m, n, k, dtype):
    from deepinfer.kernels.fp8_gemm import fp8_gemm_triton

    assert default_impl("fp8_gemm", "cuda") == "triton"
    x = _x(m, k).to(dtype)
    for scale_dtype in (torch.float8_e8m0fnu, torch.float32):
        w8, s = _fp8(n, k, scale_dtype)
        ref = fp8_gemm_torch(x.float(), w8, s, (128, 128))  # float32 on the CPU
        out = fp8_gemm_triton(x.cuda(), w8.cuda(), s.cuda(), (128, 128)).cpu()
        assert out.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.gpu
def test_split_k_counters_are_left_zeroed_for_the_next_launch():
    """Split-K launches share the device's zeroed tile counters (no fill launch each): every launch leaves them at
    zero, eager and replayed in a CUDA graph, FP8 and FP4 alike, and the results stay those of the reference."""
    from deepinfer.kernels import fp8_gemm
    from deepinfer.kernels.fp4_gemm import fp4_gemm_triton

    w8, s = _fp8(1024, 4096)
    p4, s4 = _fp4(1024, 4096)
    x = _x(4, 4096).to(torch.bfloat16)
    ref8 = fp8_gemm_torch(x.float(), w8, s, (128, 128))
    ref4 = fp4_gemm_torch(x.float(), p4, s4)
    w8, s, p4, s4, xc = w8.cuda(), s.cuda(), p4.cuda(), s4.cuda(), x.cuda()

    def step():
        return (fp8_gemm.fp8_gemm_triton(xc, w8, s, (128, 128), split_k=4), fp4_gemm_triton(xc, p4, s4, split_k=4))

    for _ in range(3):
        a, b = step()
        torch.testing.assert_close(a.float().cpu(), ref8, atol=1e-2 * ref8.abs().max().item(), rtol=1e-2)
        torch.testing.assert_close(b.float().cpu(), ref4, atol=1e-2 * ref4.abs().max().item(), rtol=1e-2)
    locks = fp8_gemm._LOCKS[xc.device.index]
    assert not locks.any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], a) and torch.equal(outs[1], b) and not locks.any()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 2048])  # 2048: the bmm route
def test_fp8_row_groups_on_cuda_match_the_cpu_reference(m):
    """V4-Flash's grouped wo_a (8 groups of 1024 rows, K 4096) in one launch against the CPU reference."""
    from deepinfer.kernels.fp8_gemm import fp8_gemm_triton

    w8, s = _fp8(8 * 1024, 4096)
    x = _x(m, 8 * 4096).to(torch.bfloat16)
    ref = fp8_gemm_torch(x.float(), w8, s, (128, 128), groups=8)
    out = fp8_gemm_triton(x.cuda(), w8.cuda(), s.cuda(), (128, 128), groups=8).cpu()
    torch.testing.assert_close(out.float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", SHAPES + [(128, 2048, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_triton_on_cuda_matches_the_cpu_reference(m, n, k, dtype):
    from deepinfer.kernels.fp4_gemm import fp4_gemm_triton

    assert default_impl("fp4_gemm", "cuda") == "triton"
    x = _x(m, k).to(dtype)
    p, s = _fp4(n, k)
    ref = fp4_gemm_torch(x.float(), p, s)
    out = fp4_gemm_triton(x.cuda(), p.cuda(), s.cuda()).cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_grouped_triton_on_cuda_matches_the_cpu_reference(dtype):
    from deepinfer.kernels.fp4_gemm import fp4_grouped_gemm_triton

    g = torch.Generator().manual_seed(3)
    ps = [_fp4(200, 96, seed=e) for e in range(8)]
    packed, scale = torch.stack([p for p, _ in ps]), torch.stack([s for _, s in ps])
    counts = torch.tensor([0, 1, 70, 3, 0, 17, 16, 33])
    x = torch.randn(int(counts.sum()), 96, generator=g).to(dtype)
    ref = fp4_grouped_gemm_torch(x.float(), packed, scale, counts)
    out = fp4_grouped_gemm_triton(x.cuda(), packed.cuda(), scale.cuda(), counts.cuda()).cpu()
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.gpu
def test_quantized_linears_pick_triton_on_cuda():
    from deepinfer.engine.quant import Fp4Linear, Fp8Linear

    x = _x(3, 256)
    for lin in (Fp8Linear.from_float(_x(130, 256, seed=4)), Fp4Linear.from_float(_x(130, 256, seed=5))):
        ref = lin(x)
        assert lin.impl_name == "torch"
        lin.cuda()
        out = lin(x.cuda())
        assert lin.impl_name == "triton" and lin.weight.dtype != torch.float32
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 40, 200])
def test_every_tuning_candidate_on_cuda(m):
    """Each config the first-call tuner may pick (K split included) against the CPU reference, bf16."""
    from deepinfer.kernels.fp4_gemm import fp4_gemm_candidates, fp4_gemm_triton, fp4_grouped_gemm_triton
    from deepinfer.kernels.fp8_gemm import fp8_gemm_candidates, fp8_gemm_triton

    def close(out, ref):
        torch.testing.assert_close(out.cpu().float(), ref, atol=1e-2 * ref.abs().max().item(), rtol=1e-2)

    x = _x(m, 2048).to(torch.bfloat16)
    w8, s8 = _fp8(1000, 2048)
    ref8 = fp8_gemm_torch(x.float(), w8, s8, (128, 128))
    p, s = _fp4(1000, 2048)
    ref4 = fp4_gemm_torch(x.float(), p, s)
    for cfg in fp8_gemm_candidates(m):
        close(fp8_gemm_triton(x.cuda(), w8.cuda(), s8.cuda(), (128, 128), config=cfg), ref8)
    for cfg in fp4_gemm_candidates(m):
        close(fp4_gemm_triton(x.cuda(), p.cuda(), s.cuda(), config=cfg), ref4)
    ps = [_fp4(300, 512, seed=e) for e in range(8)]
    packed, scale = torch.stack([q for q, _ in ps]), torch.stack([t for _, t in ps])
    counts = torch.tensor([0, m, 2 * m + 1, 3, 0, 17, 1, 0])
    xg = torch.randn(int(counts.sum()), 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    refg = fp4_grouped_gemm_torch(xg.float(), packed, scale, counts)
    for cfg in fp4_gemm_candidates(m):
        close(fp4_grouped_gemm_triton(xg.cuda(), packed.cuda(), scale.cuda(), counts.cuda(), config=cfg), refg)


def test_decode_configs_compile_for_sm90():
    """The FP8 GEMM and the FP4 MoE GEMMs at a decode config (`benchmarks.kernel_registers`), compiled ahead of time
    for sm_90a: both forms compile without spills; the swap-AB form's dots are warpgroup MMAs (the weight tile as
    the A operand), the plain form's (16 token rows) Ampere-style mma.sync."""
    pytest.importorskip("triton")
    from deepinfer.benchmarks.kernel_registers import _ptxas, compile_report, quantized_gemm_configurations

    if _ptxas() is None:
        pytest.skip("no ptxas bundled with triton")
    for name, fn, sig, consts, warps in quantized_gemm_configurations():
        r = compile_report(fn, sig, consts, warps)
        assert r["spill_stores"] == 0 and 0 < r["registers"] <= 255, (name, r)
        if name.endswith("swap"):
            assert r["wgmma"] > 0 and r["mma_sync"] == 0, (name, r)
        else:
            assert r["mma_sync"] > 0, (name, r)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRET_SCRIPT, tests=("test_triton_kernels_under_the_interpreter",), timeout=300)
