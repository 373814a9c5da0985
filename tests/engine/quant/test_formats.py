"""The quantized number formats (`engine.quant.formats`): the E2M1 table and nibble order, UE8M0 scales
read by reinterpretation, packing, and block quantize/dequantize round trips (edge blocks included)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.quant.formats import (
    E2M1_VALUES,
    dequant_fp4,
    dequant_fp8_block,
    e8m0_to_float,
    float_to_e2m1_codes,
    float_to_e8m0,
    fp4_scale_shape,
    fp8_scale_shape,
    pack_fp4,
    quantize_fp4,
    quantize_fp8_block,
    unpack_fp4,
    unpack_fp4_codes,
)


def test_e2m1_table_is_sign_magnitude():
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert E2M1_VALUES[:8].tolist() == mags
    assert E2M1_VALUES[8:].tolist() == [-m for m in mags]
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is -0: the sign bit alone
    # the table is the IEEE-like E2M1 decode: 1 sign, 2 exponent (bias 1), 1 mantissa bit
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        value = (m / 2) if e == 0 else (1 + m / 2) * 2.0 ** (e - 1)
        assert E2M1_VALUES[code].item() == (-value if s else value)


def test_nibble_order_low_nibble_is_the_even_k():
    # byte 0x5A: low nibble 0xA (code 10 = -1.0) is k = 0, high nibble 0x5 (code 5 = 3.0) is k = 1
    packed = torch.tensor([[0x5A - 256 if 0x5A > 127 else 0x5A, 0xF1 - 256]], dtype=torch.int8)
    assert unpack_fp4(packed).tolist() == [[-1.0, 3.0, 0.5, -6.0]]
    assert unpack_fp4_codes(packed).tolist() == [[10, 5, 1, 15]]
    assert torch.equal(pack_fp4(torch.tensor([[10, 5, 1, 15]])), packed)


def test_pack_unpack_round_trip_all_codes():
    codes = torch.arange(256).reshape(16, 16) % 16
    codes = codes[torch.randperm(16)]  # [16, 16]
    assert torch.equal(unpack_fp4_codes(pack_fp4(codes)), codes.to(torch.uint8))
    assert torch.equal(unpack_fp4(pack_fp4(codes)), E2M1_VALUES[codes])
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_fp4(torch.tensor([[16, 0]]))


def test_e2m1_rounding_is_nearest_ties_to_even():
    x = torch.tensor([0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -0.1])
    got = E2M1_VALUES[float_to_e2m1_codes(x).long()].tolist()
    assert got == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -0.0]
    assert torch.equal(E2M1_VALUES[float_to_e2m1_codes(E2M1_VALUES).long()], E2M1_VALUES)


def test_e8m0_is_read_by_reinterpreting_the_byte():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = e8m0_to_float(raw)
    assert got.dtype == torch.float32
    for b in (0, 1, 100, 126, 127, 128, 200, 254):
        assert got[b].item() == 2.0 ** (b - 127)
    assert torch.isnan(got[255])
    # the same bytes as torch.float8_e8m0fnu give the same values (and match torch's own conversion)
    as_e8m0 = raw.view(torch.float8_e8m0fnu)
    assert torch.equal(e8m0_to_float(as_e8m0)[:255], got[:255])
    assert torch.equal(as_e8m0.float()[:255], got[:255])
    # NOTE: a numeric cast would read the value 2**(b-127) as a number, not the byte: 2.0 -> 2, not 128
    assert as_e8m0[128].to(torch.uint8).item() == 2 and as_e8m0[128].view(torch.uint8).item() == 128
    with pytest.raises(TypeError, match="float8_e8m0fnu or uint8"):
        e8m0_to_float(torch.ones(2))


def test_float_to_e8m0_exact_for_powers_of_two_and_rounds_up_otherwise():
    pows = torch.tensor([2.0 ** e for e in range(-127, 128)])
    assert torch.equal(e8m0_to_float(float_to_e8m0(pows)), pows)
    assert float_to_e8m0(pows).view(torch.uint8).tolist() == list(range(0, 255))
    x = torch.tensor([0.75, 3.0, 1.0000001, 0.0, 1e-45, 2.0 ** 130])
    assert e8m0_to_float(float_to_e8m0(x)).tolist() == [1.0, 4.0, 2.0, 2.0 ** -127, 2.0 ** -127, 2.0 ** 127]
    with pytest.raises(ValueError, match=">= 0"):
        float_to_e8m0(torch.tensor([-1.0]))


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 7), (129, 129)])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32])
def test_fp8_block_round_trip(shape, scale_dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])  # tiles of different ranges
    w8, scale = quantize_fp8_block(w, (128, 128), scale_dtype)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    assert scale.dtype == scale_dtype and tuple(scale.shape) == fp8_scale_shape(*shape)
    deq = dequant_fp8_block(w8, scale, (128, 128))
    # re-quantizing the dequantized weight is exact (a fixed point), and the error is e4m3's (3 mantissa bits)
    w8b, scaleb = quantize_fp8_block(deq, (128, 128), scale_dtype)
    assert torch.equal(dequant_fp8_block(w8b, scaleb, (128, 128)), deq)
    rel = ((deq - w).abs() / w.abs().clamp(min=1e-6))
    assert rel[w.abs() > 0.1 * w.abs().max()].max() < 2 ** -3
    # every element is exactly w8 * its tile's scale
    n, k = shape[0] - 1, shape[1] - 1
    s = e8m0_to_float(scale) if scale_dtype == torch.float8_e8m0fnu else scale
    assert deq[n, k] == w8[n, k].float() * s[n // 128, k // 128].float()


def test_fp8_scale_grid_mismatch_is_refused():
    w8, scale = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match=r"scale \[2, 2\] does not match weight \[256, 384\]"):
        dequant_fp8_block(torch.zeros(256, 384, dtype=torch.float8_e4m3fn), scale)


@pytest.mark.parametrize("shape", [(64, 128), (3, 70), (5, 2), (33, 96)])
def test_fp4_round_trip(shape):
    g = torch.Generator().manual_seed(shape[1])
    w = torch.randn(*shape, generator=g)
    packed, scale = quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (shape[0], shape[1] // 2)
    assert scale.dtype == torch.float8_e8m0fnu and tuple(scale.shape) == fp4_scale_shape(*shape)
    deq = dequant_fp4(packed, scale)
    assert deq.shape == w.shape
    # a fixed point, and the error is at most half the largest E2M1 gap (4 -> 6) times the block's scale
    assert torch.equal(dequant_fp4(*quantize_fp4(deq)), deq)
    s = e8m0_to_float(scale).repeat_interleave(32, 1)[:, :shape[1]]
    assert ((deq - w).abs() <= 1.0 * s + 1e-7).all()
    # element by element: table value of the code times its block's scale
    codes = unpack_fp4_codes(packed).long()
    assert torch.equal(deq, E2M1_VALUES[codes] * s)


def test_fp4_known_values():
    # one block of 32 whose amax is 12: scale 2 (12 / 6), codes exact
    w = torch.tensor([[12.0, -1.0, 3.0, 0.0] + [0.0] * 28])
    packed, scale = quantize_fp4(w)
    assert e8m0_to_float(scale).tolist() == [[2.0]]
    assert dequant_fp4(packed, scale)[0, :4].tolist() == [12.0, -1.0, 3.0, 0.0]
    assert packed[0, 0].view(torch.uint8).item() == (0x9 << 4) | 0x7  # -0.5 * 2 high, 6 * 2 low
