"""FP8 activations as the official DeepSeek reference quantizes them: per token, per 128 channels,
power-of-two (UE8M0) scales, E4M3 values. The torch reference; `Fp8Linear(act_quant=True)` uses it.

The official inference code (its `kernel.py` `act_quant`, used by its `linear` before `fp8_gemm` when
`scale_fmt == "ue8m0"`) does, for each run of `block` (128) consecutive channels of one token:

    amax  = max(max |x|, 1e-4)                      # float32; the floor keeps all-zero runs finite
    s     = 2 ** ceil(log2(amax / 448))             # the smallest power of two with amax / s <= 448
    x8    = float8_e4m3fn(x / s)                    # round to nearest, ties to even; |x / s| <= 448
    y     = sum_k x8 * s_x[m, k // 128] * w8 * s_w[n // 128, k // 128]   # the FP8 GEMM, float32 accumulation

NOTE: `ceil(log2(.))` is taken exactly from the float32 bits (`torch.frexp`), not through a rounded
`log2`: for t = m * 2**e with m in [0.5, 1), ceil(log2 t) is e - 1 when m == 0.5 (t a power of two) and e
otherwise. `x / s` is exact (s a power of two), so the only rounding is the E4M3 cast.

NOTE: the dequantized activation `x8 * s` is exactly representable in float32 and in bfloat16 (three
mantissa bits, an 8-bit exponent), so `fp8_gemm(dequant(x8, s), w8, s_w)` computes the same products as
an FP8 x FP8 GEMM with both scales; only the float32 summation order may differ. That is how
`Fp8Linear` runs this mode on every device: the activations are rounded onto the FP8 grid here, then the
existing `"fp8_gemm"` op (torch reference / Triton) multiplies. It reproduces the official numerics; it
does not use FP8 tensor cores (no speed gain over bf16 activations).

A last run shorter than `block` (K not a multiple of 128; the official code requires K % 128 == 0) takes
its amax over the channels it has.
"""

from __future__ import annotations

import torch

from deepinfer.engine.quant.formats import E4M3_MAX

ACT_BLOCK = 128
"""Channels per activation scale (one scale per token per 128 channels)."""

AMAX_FLOOR = 1e-4
"""The official reference's lower bound on a run's amax (an all-zero run gets scale 2**-22)."""

FP8_ACTIVATION_MODES = ("bf16", "fp8")
"""`EngineConfig.fp8_activations`: "bf16" keeps activations in the compute dtype (matches transformers);
"fp8" quantizes them as the official reference does."""


def _ceil_log2(t: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2 t) for positive finite float32 t, as int32."""
    mantissa, exponent = torch.frexp(t)  # t = mantissa * 2**exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(exponent.dtype)).to(torch.int32)


def act_quant_fp8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (x8 float8_e4m3fn [M, K], scale float32 [M, ceil(K / block)]), the scales
    powers of two, `x ~= x8 * scale[m, k // block]`."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"act_quant_fp8: x must be a float [M, K] tensor, got {x.dtype} {list(x.shape)}")
    m, k = x.shape
    nb = -(-k // block)
    x32 = x.float()
    padded = torch.nn.functional.pad(x32, (0, nb * block - k)) if nb * block != k else x32
    amax = padded.view(m, nb, block).abs().amax(-1).clamp_min(AMAX_FLOOR)  # [M, nb]
    scale = torch.ldexp(torch.ones_like(amax), _ceil_log2(amax / E4M3_MAX).float())  # [M, nb], powers of two
    x8 = (padded.view(m, nb, block) / scale[..., None]).view(m, nb * block)[:, :k].to(torch.float8_e4m3fn)
    return x8.contiguous(), scale


def act_dequant_fp8(x8: torch.Tensor, scale: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """(x8 [M, K], scale [M, ceil(K / block)]) -> float32 [M, K] = x8 * scale (exact)."""
    k = x8.shape[1]
    return x8.float() * scale.repeat_interleave(block, dim=1)[:, :k]


def fp8_round_activations(x: torch.Tensor, block: int = ACT_BLOCK) -> torch.Tensor:
    """x [M, K] rounded onto the official FP8 activation grid, in a dtype that holds it exactly: x's dtype for
    bfloat16 / float32, float32 for float16 (whose range cannot hold every scale)."""
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return act_dequant_fp8(*act_quant_fp8(x, block), block).to(out_dtype)
