"""Quantized linears (`engine.quant.Fp8Linear` / `Fp4Linear`): the forward against x @ dequant(W).T,
shapes that are not multiples of the blocks, bf16 activations, the checkpoint's names and dtypes, moves
that keep the stored dtypes, and resident bytes against the checkpoint's bytes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.quant import Fp4Linear, Fp8Linear
from deepinfer.kernels import OpTable
from deepinfer.kernels.fp4_gemm import fp4_gemm_torch
from deepinfer.kernels.fp8_gemm import fp8_gemm_torch


def _w(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * torch.logspace(-2, 0.5, in_features)


def _x(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


FP8_SHAPES = [(256, 384), (130, 200), (1, 7), (129, 257), (300, 128)]
FP4_SHAPES = [(64, 128), (130, 200), (1, 70), (33, 2), (257, 96)]


@pytest.mark.parametrize("out_features, in_features", FP8_SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_fp8_forward_matches_dequantized_matmul(out_features, in_features, scale_dtype):
    lin = Fp8Linear.from_float(_w(out_features, in_features), scale_dtype=scale_dtype)
    x = _x(2, 5, in_features)  # [..., in]
    y = lin(x)
    assert y.shape == (2, 5, out_features) and y.dtype == torch.float32 and lin.impl_name == "torch"
    torch.testing.assert_close(y, x @ lin.dequantized().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_features, in_features", FP4_SHAPES)
def test_fp4_forward_matches_dequantized_matmul(out_features, in_features):
    lin = Fp4Linear.from_float(_w(out_features, in_features))
    x = _x(7, in_features)
    y = lin(x)
    assert y.shape == (7, out_features) and lin.impl_name == "torch"
    torch.testing.assert_close(y, x @ lin.dequantized().T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: Fp8Linear.from_float(_w(130, 200)), lambda: Fp4Linear.from_float(_w(130, 200))])
def test_bf16_activations_compute_in_float32_and_return_bf16(make):
    lin = make()
    x = _x(4, 200).bfloat16()
    y = lin(x)
    assert y.dtype == torch.bfloat16
    # computed in float32 from the bf16 input and rounded to bf16 once, at the end: within one bf16 rounding
    ref = x.float() @ lin.dequantized().T
    torch.testing.assert_close(y.float(), ref, atol=1e-6, rtol=2 ** -8)


def test_reference_dequantizes_block_by_block():
    # more than one row block, the last one partial: each row block of the output uses only its own rows
    lin = Fp8Linear.from_float(_w(300, 256))
    x = _x(3, 256)
    y = fp8_gemm_torch(x, lin.weight, lin.scale, lin.block)
    for n0 in (0, 128, 256):
        n1 = min(300, n0 + 128)
        torch.testing.assert_close(y[:, n0:n1], x @ lin.dequantized()[n0:n1].T, atol=1e-5, rtol=1e-5)
    lin4 = Fp4Linear.from_float(_w(300, 64))
    torch.testing.assert_close(fp4_gemm_torch(x[:, :64], lin4.weight, lin4.scale), x[:, :64] @ lin4.dequantized().T,
                               atol=1e-5, rtol=1e-5)


def test_checkpoint_names_dtypes_and_shapes():
    fp8 = Fp8Linear(200, 130)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in fp8.state_dict().items()} == {
        "weight": (torch.float8_e4m3fn, (130, 200)), "scale": (torch.float8_e8m0fnu, (2, 2))}
    assert Fp8Linear(200, 130, scale_dtype=torch.float32).scale.dtype == torch.float32
    fp4 = Fp4Linear(200, 130)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in fp4.state_dict().items()} == {
        "weight": (torch.int8, (130, 100)), "scale": (torch.float8_e8m0fnu, (130, 7))}
    assert (fp8.in_features, fp8.out_features, fp4.in_features, fp4.out_features) == (200, 130, 200, 130)
    assert not any(p.requires_grad for p in [*fp8.parameters(), *fp4.parameters()])
    with pytest.raises(ValueError, match="even"):
        Fp4Linear(7, 3)
    with pytest.raises(ValueError, match="scale_dtype"):
        Fp8Linear(8, 8, scale_dtype=torch.bfloat16)


def test_load_state_dict_round_trip_and_meta_construction():
    pytest.importorskip("pydantic")  # the loader needs it (bare GPU machines run this file without it)
    from deepinfer.engine.loader import meta_parameters

    src = Fp8Linear.from_float(_w(130, 200))
    with meta_parameters():
        dst = Fp8Linear(200, 130)
    assert dst.weight.device.type == "meta"  # no memory until the loader assigns the tensors
    dst.load_state_dict(src.state_dict(), assign=True)
    x = _x(3, 200)
    assert torch.equal(dst(x), src(x))


def test_dtype_casts_keep_the_stored_dtypes():
    lin = Fp8Linear.from_float(_w(130, 200), scale_dtype=torch.float32)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    torch.nn.Sequential(lin).to(torch.bfloat16).float().half()
    for k, v in lin.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v.view(torch.uint8), before[k].view(torch.uint8))


@pytest.mark.parametrize("make, dense", [(lambda: Fp8Linear(4096, 1024), 1024 * 4096),
                                         (lambda: Fp4Linear(4096, 2048), 2048 * 4096)])
def test_resident_bytes_are_the_checkpoint_bytes(make, dense):
    lin = make()
    ckpt_bytes = sum(t.numel() * t.element_size() for t in lin.state_dict().values())
    assert lin.resident_nbytes() == ckpt_bytes
    assert abs(lin.resident_nbytes() - ckpt_bytes) <= 0.05 * ckpt_bytes
    bits_per_weight = 8 * lin.resident_nbytes() / dense
    assert bits_per_weight < (8.01 if isinstance(lin, Fp8Linear) else 4.26)  # FP8: 8 + 8/16384, FP4: 4 + 8/32


def test_module_ops_stay_out_of_the_model_op_table():
    assert set(OpTable("cpu").impl_names) == {"sinkhorn", "mhc_pre", "mhc_post", "mhc_head", "attn_norm_rope", "attn_out_proj",
                                              "rms_norm", "rope", "swiglu"}


def test_kernel_wrappers_check_their_arguments():
    lin = Fp8Linear.from_float(_w(130, 200))
    with pytest.raises(ValueError, match="x has K=100"):
        fp8_gemm_torch(_x(2, 100), lin.weight, lin.scale, lin.block)
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32"):
        fp8_gemm_torch(_x(2, 200).double(), lin.weight, lin.scale, lin.block)
    with pytest.raises(ValueError, match=r"scale \[2, 2\] does not match"):
        fp8_gemm_torch(_x(2, 200), lin.weight, lin.scale, (64, 128))
    lin4 = Fp4Linear.from_float(_w(10, 64))
    with pytest.raises(ValueError, match="scale must be float8_e8m0fnu"):
        fp4_gemm_torch(_x(2, 64), lin4.weight, lin4.scale.float(), 32)
