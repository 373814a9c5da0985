"""The `"triton"` MoE backend's FP4 prefill route (`fp4_grouped_mm_experts`): FP4 experts dequantized to bf16 a
group at a time (`"fp4_dequant"`, exact) and run through `torch._grouped_mm`, from
`DEEPINFER_MOE_FP4_DEQUANT_ROWS_PER_EXPERT` rows per expert with bf16 activations.

CPU: the dequant op's torch reference is exact and its Triton kernel bit-identical under the interpreter; the route
equals the backend's FP4 kernels path (their torch references) and the float reference MoE, over several expert
groups; the thresholds. `gpu`: the route against the Triton FP4 kernels at prefill size, and graph captures keep
the kernels.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.moe.triton_backend import (
    DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT,
    FP4_DEQUANT_ROWS_PER_EXPERT_ENV,
    TritonMoEBackend,
    fp4_grouped_mm_experts,
)
from deepinfer.engine.quant.formats import dequant_fp4
from deepinfer.engine.quant.linear import Fp4Linear
from deepinfer.kernels.fp4_gemm import fp4_dequant_torch
from tests.engine.moe.test_triton_moe import _inputs, _moe
from tests.kernels._interp import prefetch_interpreted, run_interpreted

_WIDE = {"n_routed_experts": 8, "num_experts_per_tok": 3}


def _fp4_codes(shape, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    scales = (*shape[:-1], -(-2 * shape[-1] // block))
    return packed, torch.randint(100, 140, scales, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def test_dequant_reference_is_exact_and_checks_its_arguments():
    packed, scale = _fp4_codes((3, 40, 48), 32)
    want = torch.stack([dequant_fp4(packed[e], scale[e], 32) for e in range(3)])
    got = fp4_dequant_torch(packed, scale, 32)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), want)  # every value exact in bf16
    out = torch.empty(3, 40, 96, dtype=torch.bfloat16)
    assert fp4_dequant_torch(packed, scale, 32, out=out) is out and torch.equal(out, got)
    with pytest.raises(ValueError, match="scale"):
        fp4_dequant_torch(packed, scale[:, :, :2], 32)
    with pytest.raises(ValueError, match="out must be"):
        fp4_dequant_torch(packed, scale, 32, out=torch.empty(3, 40, 96))
    with pytest.raises(ValueError, match="int8"):
        fp4_dequant_torch(packed.float(), scale, 32)


_INTERPRETED_DEQUANT = textwrap.dedent("""
    import torch
    from deepinfer.kernels.fp4_gemm import fp4_dequant_torch, fp4_dequant_triton
    from tests.engine.moe.test_fp4_dequant_route import _fp4_codes
    for shape, block in (((3, 40, 96), 32), ((2, 70, 300), 32), ((5, 64), 16)):  # 300: a partial scale block
        packed, scale = _fp4_codes(shape, block, seed=len(shape))
        want = fp4_dequant_torch(packed, scale, block)
        assert torch.equal(fp4_dequant_triton(packed, scale, block).view(torch.int16), want.view(torch.int16))
        out = torch.empty_like(want)
        assert fp4_dequant_triton(packed, scale, block, out=out) is out and torch.equal(out, want)
    # every byte (two codes, both signs) under every scale byte the decode is exact for (2**-125 .. 2**113)
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).repeat(239, 1)  # [239, 256]
    scale = torch.arange(2, 241, dtype=torch.uint8)[:, None].repeat(1, 16).view(torch.float8_e8m0fnu)
    want = fp4_dequant_torch(packed, scale, 32)
    assert torch.equal(fp4_dequant_triton(packed, scale, 32).view(torch.int16), want.view(torch.int16))
    print("OK")
""")


def test_dequant_kernel_bit_identical_under_the_interpreter():
    """The `"fp4_dequant"` kernel shares the GEMMs' decode (`_fp4_decode`), so this also checks the FP4 GEMMs'
    bf16 weights (the interpreter's bf16 dot products cannot be checked bit for bit)."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED_DEQUANT)
    assert "OK" in out, out


def _fp4_routed(rows_per_expert: int = 1, scratch_experts: int | None = None, **kw):
    moe = _moe("triton", quant=Fp4Linear, dtype=torch.bfloat16, **{**_WIDE, **kw})
    moe.prepare()
    b = moe.backend
    b.grouped_mm_min_rows, b.fp4_dequant_rows_per_expert = 1, rows_per_expert
    if scratch_experts is not None:
        hidden, inter = b.w2[0].shape[1], 2 * b.w2[0].shape[2]
        b.fp4_dequant_scratch_bytes = scratch_experts * 2 * 3 * hidden * inter
    return moe


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("scratch_experts", [None, 3])  # all 8 experts at once; groups of 3, 3, 2
def test_route_equals_the_fp4_kernels_path_and_the_reference(is_hash, scratch_experts, grouped_mm_calls):
    routed = _fp4_routed(scratch_experts=scratch_experts, is_hash=is_hash)
    plain = _moe("triton", quant=Fp4Linear, dtype=torch.bfloat16, is_hash=is_hash, **_WIDE)  # route at 4,096 rows
    ref = _moe("torch_loop", quant=Fp4Linear, dtype=torch.bfloat16, is_hash=is_hash, **_WIDE)
    assert routed.backend.fp4_route_usable and not routed.backend.grouped_mm_usable
    x, ids = _inputs(40, dtype=torch.bfloat16)
    got = routed(x, ids)
    groups = 1 if scratch_experts is None else 3
    assert len(grouped_mm_calls) == 3 * groups
    kernels = plain(x, ids)
    assert len(grouped_mm_calls) == 3 * groups  # the plain backend's 120 rows stay below its threshold
    tol = {"atol": 1e-2, "rtol": 1.6e-2}  # bf16 roundings after float32 sums in another order
    torch.testing.assert_close(got, kernels, **tol)
    torch.testing.assert_close(got, ref(x, ids), **tol)


def test_groups_without_rows_are_skipped(grouped_mm_calls):
    routed = _fp4_routed(scratch_experts=2)  # groups {0,1} {2,3} {4,5} {6,7}
    x, _ = _inputs(4, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1, 6]] * 4)
    b = routed.backend
    got = fp4_grouped_mm_experts(x, torch.full((4, 3), 0.25), ids, b.w13, b.w2, b.block, b.limit, b._align,
                                 b._swiglu, b._combine, b._dequant, b.fp4_dequant_scratch_bytes)
    assert len(grouped_mm_calls) == 6  # two groups with rows
    plain = _moe("triton", quant=Fp4Linear, dtype=torch.bfloat16, **_WIDE)
    plain.prepare()
    want = plain.backend(x, torch.full((4, 3), 0.25), ids)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1.6e-2)


def test_thresholds_and_activation_dtype(monkeypatch):
    monkeypatch.delenv(FP4_DEQUANT_ROWS_PER_EXPERT_ENV, raising=False)
    assert TritonMoEBackend().fp4_dequant_rows_per_expert == DEFAULT_FP4_DEQUANT_ROWS_PER_EXPERT
    monkeypatch.setenv(FP4_DEQUANT_ROWS_PER_EXPERT_ENV, "bad")
    with pytest.raises(ValueError, match=FP4_DEQUANT_ROWS_PER_EXPERT_ENV):
        TritonMoEBackend()
    monkeypatch.delenv(FP4_DEQUANT_ROWS_PER_EXPERT_ENV)
    b = _fp4_routed(rows_per_expert=5).backend  # 8 experts: 40 rows
    assert b.uses_grouped_mm(40) and not b.uses_grouped_mm(39)
    assert not b.uses_grouped_mm(40, x_dtype=torch.float32)  # the scratch is bf16: other activations keep kernels
    b.grouped_mm_min_rows = 41  # both thresholds apply
    assert not b.uses_grouped_mm(40)
    b.grouped_mm_min_rows, b.fp4_dequant_rows_per_expert = 1, 0  # 0: off
    assert not b.uses_grouped_mm(10**9)


def test_wrapper_checks_its_inputs():
    b = _fp4_routed().backend
    x, _ = _inputs(5, dtype=torch.bfloat16)
    tw, tid = torch.full((5, 2), 0.5), torch.zeros(5, 2, dtype=torch.long)
    ops = (b._align, b._swiglu, b._combine, b._dequant)
    with pytest.raises(ValueError, match="experts' dtype"):
        fp4_grouped_mm_experts(x.float(), tw, tid, b.w13, b.w2, b.block, b.limit, *ops)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        fp4_grouped_mm_experts(x, tw[:4], tid, b.w13, b.w2, b.block, b.limit, *ops)


# ---------------------------------------------------------------------------- CUDA

_BIG = {"hidden_size": 512, "moe_intermediate_size": 256, "n_routed_experts": 16, "num_experts_per_tok": 6}


@pytest.mark.gpu
def test_cuda_fp4_route_at_prefill_size_tracks_the_kernels(grouped_mm_calls, monkeypatch):
    monkeypatch.setenv("DEEPINFER_QGEMM_TUNE", "0")
    routed = _moe("triton", quant=Fp4Linear, device="cuda", dtype=torch.bfloat16, **_BIG)
    routed.prepare()
    if not routed.backend.fp4_route_usable:
        pytest.skip(f"no fused bf16 torch._grouped_mm on {torch.cuda.get_device_name()}")
    routed.backend.fp4_dequant_scratch_bytes = 5 * 2 * 3 * 512 * 256  # groups of 5, 5, 5, 1
    plain = _moe("triton", quant=Fp4Linear, device="cuda", dtype=torch.bfloat16, **_BIG)
    plain.prepare()
    plain.backend.fp4_dequant_rows_per_expert = 0
    x, ids = _inputs(1366, 512, device="cuda", dtype=torch.bfloat16)  # 8,196 rows: 512 an expert
    got = routed(x, ids).float()
    assert len(grouped_mm_calls) == 12
    kernels = plain(x, ids).float()
    err = ((got - kernels).abs() / (kernels.abs() + kernels.abs().mean())).max().item()
    assert err < 5e-2, err
    assert (got - kernels).abs().mean() < 2e-2 * kernels.abs().mean()
    b = routed.backend
    with torch.inference_mode():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a capture never takes the route
            static_out = routed(x[:64], ids[:64])
        graph.replay()
        assert len(grouped_mm_calls) == 12 and torch.equal(static_out, plain(x[:64], ids[:64]))
    assert b.uses_grouped_mm(8196, 1366)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED_DEQUANT, tests=("test_dequant_kernel_bit_identical_under_the_interpreter",))
