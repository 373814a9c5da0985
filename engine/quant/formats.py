"""The quantized number formats of the published DeepSeek-V4 checkpoints, and exact conversions.

Formats (facts of the checkpoint; every conversion here is exact or says how it rounds):

  * **E4M3 (FP8)**: `torch.float8_e4m3fn` weights of the FP8 linears, max 448; torch converts them exactly.
  * **UE8M0 scales**: `torch.float8_e8m0fnu`, one byte holding a biased exponent: value `2**(byte - 127)`,
    byte 255 is NaN, there is no zero and no sign. NOTE: a scale is read by *reinterpreting* its byte
    (`.view(torch.uint8)`) and building the float32 with that exponent; a numeric cast to an integer
    type (`.to(torch.uint8)`) would convert the *value* 2**e, which is wrong.
  * **E2M1 (FP4)**: the routed experts' weights, two 4-bit codes per int8 byte, the LOW nibble holding
    the even k and the high nibble the odd k; a code is sign-magnitude: bit 3 the sign, bits 0-2 index
    the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (`E2M1_VALUES`; code 8 is -0).

Block scaling: an FP8 weight [N, K] has one scale per `block = (bn, bk)` tile (128 x 128 in V4):
`W[n, k] = w8[n, k] * scale[n // bn, k // bk]`, scale [ceil(N/bn), ceil(K/bk)], UE8M0 or, in the
`*-Base` checkpoints, float32. An FP4 weight [N, K] (packed [N, K/2]) has one UE8M0 scale per 1 x 32 run
along k: `W[n, k] = E2M1_VALUES[code[n, k]] * scale[n, k // 32]`, scale [N, ceil(K/32)]. A last block
that is only partly covered (N or K not a multiple of the block) has a scale all the same.

The quantizers (`quantize_fp8_block`, `quantize_fp4`) are for test checkpoints and tests: the scale of a
block is its amax over the format's max (448, 6), rounded UP to a power of two for UE8M0 so nothing
saturates; values round to nearest (E2M1: ties to the even code, as IEEE does).
"""

from __future__ import annotations

import math

import torch

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32)
"""The 16 E2M1 code values, indexed by code (float32, CPU): bit 3 is the sign, bits 0-2 the magnitude."""

E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""

E4M3_MAX = 448.0
"""The largest float8_e4m3fn magnitude."""

FP4_BLOCK = 32
"""The FP4 experts' scale block along k (one scale per 1 x 32 weights)."""

FP8_BLOCK = (128, 128)
"""The FP8 linears' scale block (rows, columns) in V4."""

_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)


def fp8_scale_shape(out_features: int, in_features: int, block: tuple[int, int] = FP8_BLOCK) -> tuple[int, int]:
    """The scale grid of an FP8 weight [out, in]: (ceil(out / bn), ceil(in / bk))."""
    return math.ceil(out_features / block[0]), math.ceil(in_features / block[1])


def fp4_scale_shape(out_features: int, in_features: int, block: int = FP4_BLOCK) -> tuple[int, int]:
    """The scale grid of an FP4 weight [out, in] (packed [out, in / 2]): (out, ceil(in / block))."""
    return out_features, math.ceil(in_features / block)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (`torch.float8_e8m0fnu`, or their raw bytes as uint8) -> float32 `2**(byte - 127)`.

    Exact: the float32 is assembled from the byte as its exponent field (byte 0 is the subnormal
    2**-127, byte 255 NaN); no arithmetic touches the value. Other dtypes are refused (a float32 scale
    is already a value: see `scale_to_float`).
    """
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    elif scale.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float: expected torch.float8_e8m0fnu or uint8 bytes, got {scale.dtype}")
    b = scale.to(torch.int32)
    bits = b << 23  # exponent field = byte: 2**(byte - 127) for bytes 1..254
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)  # 2**-127, a float32 subnormal
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)  # NaN
    return bits.view(torch.float32)


def float_to_e8m0(x: torch.Tensor) -> torch.Tensor:
    """Positive float scales -> `torch.float8_e8m0fnu`: exact for powers of two, anything else rounds UP
    to the next power of two (a quantizer's scale must not shrink, or values would saturate).

    Values at or below 2**-127 (zero included) give byte 0; above 2**127 byte 254; NaN byte 255.
    Negative scales are refused.
    """
    x = x.float()
    if bool((x < 0).any()):
        raise ValueError("float_to_e8m0: scales must be >= 0 (UE8M0 has no sign)")
    bits = x.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless an exact power of two
    exp = torch.where(x <= 2.0 ** -127, torch.zeros_like(exp), exp)  # zero and subnormals up to 2**-127
    exp = torch.where((exp == 0) & (x > 2.0 ** -127), torch.ones_like(exp), exp)  # (2**-127, 2**-126]
    exp = exp.clamp(max=254)
    exp = torch.where(torch.isnan(x), torch.full_like(exp, 255), exp)
    return exp.to(torch.uint8).view(torch.float8_e8m0fnu)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A block-scale tensor as float32 values: UE8M0 (or uint8 bytes) by `e8m0_to_float`, floats as they are."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float(scale)
    if not scale.dtype.is_floating_point:
        raise TypeError(f"scale_to_float: a scale must be float8_e8m0fnu, uint8 bytes or a float, got {scale.dtype}")
    return scale.float()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes int8 (or uint8) [..., K/2] -> their values, float32 [..., K] (unscaled).

    Byte j holds k = 2j in its low nibble and k = 2j + 1 in its high nibble.
    """
    codes = unpack_fp4_codes(packed)
    return E2M1_VALUES.to(packed.device)[codes.long()]


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed int8 (or uint8) [..., K/2] -> the 4-bit codes, uint8 [..., K] (low nibble first)."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"unpack_fp4: packed FP4 must be int8 or uint8, got {packed.dtype}")
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype, values 0..15) [..., K], K even -> int8 [..., K/2] (even k in the low nibble)."""
    if codes.dtype.is_floating_point:
        raise TypeError("pack_fp4: expects integer codes (see float_to_e2m1_codes for values)")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: the last dimension must be even, got {codes.shape[-1]}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("pack_fp4: codes must be in 0..15")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def float_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Float values -> the nearest E2M1 codes, uint8 (ties to the even code; |x| > 6 saturates to +-6)."""
    x = x.float()
    mag = x.abs()
    mids = _E2M1_MIDPOINTS.to(x.device)
    idx = torch.bucketize(mag, mids)  # mag == mids[j] -> j (the lower neighbour)
    tie = (idx < len(mids)) & (mag == mids[idx.clamp(max=len(mids) - 1)]) & (idx % 2 == 1)
    idx = idx + tie.to(idx.dtype)
    return (idx | (torch.signbit(x).to(idx.dtype) << 3)).to(torch.uint8)


def _blocks_amax(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """|w| [N, K] -> the amax of every bn x bk tile, [ceil(N/bn), ceil(K/bk)] (partial tiles at the edges)."""
    n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w.abs(), (0, kb * bk - k, 0, nb * bn - n))
    return padded.view(nb, bn, kb, bk).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    """A per-tile grid [nb, kb] -> one value per element [n, k]."""
    return scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                       scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [N, K] -> (w8 float8_e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)] in `scale_dtype`).

    `scale_dtype` float8_e8m0fnu (V4) rounds each tile's amax / 448 up to a power of two; float32 (the
    `*-Base` checkpoints) keeps amax / 448. An all-zero tile gets the smallest scale.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block: w must be [N, K], got {list(w.shape)}")
    bn, bk = block
    w = w.float()
    amax = _blocks_amax(w, bn, bk)  # [nb, kb]
    if scale_dtype == torch.float8_e8m0fnu:
        scale_q = float_to_e8m0(amax / E4M3_MAX)
        scale_f = e8m0_to_float(scale_q)
    elif scale_dtype == torch.float32:
        scale_f = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        scale_q = scale_f
    else:
        raise ValueError(f"quantize_fp8_block: scale_dtype must be float8_e8m0fnu or float32, got {scale_dtype}")
    q = (w / _expand(scale_f, bn, bk, *w.shape)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale_q


def dequant_fp8_block(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """(w8 float8_e4m3fn [N, K], scale [ceil(N/bn), ceil(K/bk)] UE8M0 or float) -> float32 [N, K], exact."""
    n, k = w8.shape
    bn, bk = block
    if tuple(scale.shape) != fp8_scale_shape(n, k, block):
        raise ValueError(f"dequant_fp8_block: scale {list(scale.shape)} does not match weight [{n}, {k}] with "
                         f"block {list(block)} (expected {list(fp8_scale_shape(n, k, block))})")
    return w8.float() * _expand(scale_to_float(scale), bn, bk, n, k)


def quantize_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [N, K], K even -> (packed int8 [N, K/2], scale float8_e8m0fnu [N, ceil(K/block)]).

    Each 1 x `block` run's scale is its amax / 6 rounded up to a power of two; values round to the
    nearest E2M1 code (ties to even).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp4: w must be [N, K], got {list(w.shape)}")
    w = w.float()
    scale_q = float_to_e8m0(_blocks_amax(w, 1, block) / E2M1_MAX)  # [N, kb]
    codes = float_to_e2m1_codes(w / _expand(e8m0_to_float(scale_q), 1, block, *w.shape))
    return pack_fp4(codes), scale_q


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """(packed int8 [N, K/2], scale UE8M0 [N, ceil(K/block)]) -> float32 [N, K], exact."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if tuple(scale.shape) != fp4_scale_shape(n, k, block):
        raise ValueError(f"dequant_fp4: scale {list(scale.shape)} does not match weight [{n}, {k}] (packed "
                         f"[{n}, {k // 2}]) with block {block} (expected {list(fp4_scale_shape(n, k, block))})")
    return unpack_fp4(packed) * _expand(scale_to_float(scale), 1, block, n, k)
