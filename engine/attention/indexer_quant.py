"""The official DeepSeek-V4 reference's indexer numerics: a Hadamard rotation and an FP4 quantization simulation.

What DeepSeek's reference inference code (`inference/model.py`, `inference/kernel.py` of the DeepSeek-V4 release)
does in its lightning indexer, and transformers' DeepseekV4 (`DeepseekV4Indexer`, `DeepseekV4CSACompressor`) does not:

* queries (`Indexer.forward`): `q = wq_b(qr)`, split into heads, RoPE on the trailing `rope_head_dim` channels
  (`apply_rotary_emb(q[..., -rd:], ...)`), then `q = rotate_activation(q)` and `fp4_act_quant(q, fp4_block_size=32,
  inplace=True)`;
* compressed index keys (`Compressor.forward` with `rotate=True`, the indexer's own compressor): after the softmax
  pooling, `kv = self.norm(kv)`, RoPE on the trailing channels at the window's first position, then
  `kv = rotate_activation(kv)` and `fp4_act_quant(kv, 32, True)`; the result is what the indexer's cache holds.
* `rotate_activation(x)` = `fast_hadamard_transform.hadamard_transform(x, scale=x.size(-1) ** -0.5)` over the whole
  head (index_head_dim = 128): the Sylvester (natural-order) Walsh-Hadamard matrix, normalised to be orthogonal;
  the input must be bf16 and the output is bf16 (the CUDA kernel computes in fp32). Its docstring says "randomized",
  but no random signs or permutation are applied: it is the plain Sylvester matrix.
* `fp4_act_quant(x, 32, inplace=True)` (`fp4_quant_kernel` in kernel.py, tilelang): per row and per 32 consecutive
  channels, `amax = max(|x|)` in fp32 floored at `6 * 2**-126`, scale `s = 2**ceil(log2(amax * (1/6)))`
  (`fast_round_scale`: bit tricks on the fp32 product, a power of two, e8m0-representable), then
  `y = cast_bf16(float(cast_e2m1(clamp(x / s, -6, 6))) * s)`: round-to-nearest-even onto the e2m1 grid
  {0, 0.5, 1, 1.5, 2, 3, 4, 6} (the GPU's `cvt.rn`), dequantised in place (quantisation-aware training simulation).
  NOTE: some vendored copies replace kernel.py by a pure-torch port whose `fp4_act_quant` clamps without rounding
  onto the e2m1 grid; the tilelang kernel above does round (`T.Cast(FP4, ...)`), and so does this module.

Since the rotation is orthogonal, q.k is unchanged by it up to rounding; the scores change through the FP4 error,
which the rotation spreads evenly over the channels. The main attention's FP8 simulations (`act_quant` on the
window KV and on the non-RoPE channels of the main compressor's entries, block 64) are not part of this module.
"""

from __future__ import annotations

import torch
from torch import nn

FP4_MAX = 6.0
"""Largest magnitude of float4 e2m1."""
FP4_BLOCK = 32
"""Channels per scale of the indexer's FP4 simulation (`fp4_block_size` in the reference's model.py)."""
INDEXER_NUMERICS = ("transformers", "reference")
"""`EngineConfig.indexer_numerics` choices: transformers' plain bf16/fp32 indexer, or the official reference's
Hadamard rotation + FP4 simulation of the indexer's queries and compressed keys."""


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform along the last dim (a power of two): `x @ H_n / sqrt(n)`.

    H_n is Sylvester's natural-order matrix (H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]), as
    `fast_hadamard_transform.hadamard_transform(x, scale=n ** -0.5)` uses in the reference's `rotate_activation`.
    Computed in fp32 by log2(n) butterfly stages, returned in x.dtype (the reference rounds to bf16 there too).
    NOTE: the fp32 summation order differs from the CUDA kernel's; results can differ in the last fp32 bit,
    which rarely survives the rounding to bf16.
    """
    n = x.shape[-1]
    assert n > 0 and n & (n - 1) == 0, f"Hadamard size {n} must be a power of two"
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, n)  # [.., n]: block j -> [a+b | a-b]
        h *= 2
    return (y * n**-0.5).view(x.shape).to(x.dtype)


def round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values in [-6, 6] to the nearest float4 e2m1 value, ties to the even mantissa.

    The grid is 0, 0.5, 1, 1.5 (step 0.5), 2, 3 (step 1), 4, 6 (step 2); within each step range an even
    multiple of the step has an even mantissa, so `torch.round` (half to even) on v / step is the e2m1 RNE.
    """
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, v)


def fp4_quant_dequant(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Simulated MXFP4 round trip of `x` along its last dim (blocks of `block` channels) -> same shape and dtype.

    The arithmetic of the reference's `fp4_act_quant(x, block, inplace=True)` (`fp4_quant_kernel`, kernel.py):
    fp32 amax per block floored at 6 * 2**-126, power-of-two scale 2**ceil(log2(amax * fp32(1/6))), values
    clamped to [-6, 6] after the (exact) division and rounded to e2m1 (nearest, ties to even), times the scale.
    """
    n = x.shape[-1]
    assert n % block == 0, f"last dim {n} not divisible by block {block}"
    xb = x.float().unflatten(-1, (n // block, block))  # [..., n/block, block]
    amax = xb.abs().amax(dim=-1, keepdim=True).clamp_min(FP4_MAX * 2.0**-126)
    ratio = amax * torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)  # fp32 product, as the kernel
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(ratio), torch.where(mant == 0.5, exp - 1, exp))  # 2**ceil(log2(ratio))
    q = round_to_e2m1((xb / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).flatten(-2).to(x.dtype)


def rotate_and_quant(x: torch.Tensor) -> torch.Tensor:
    """The reference's indexer transform of a query head or a compressed index key (after its RoPE):
    `fp4_act_quant(rotate_activation(x), 32, inplace=True)`. x: [..., index_head_dim] -> same shape, dtype."""
    return fp4_quant_dequant(hadamard_transform(x))


def set_indexer_numerics(model: nn.Module, numerics: str) -> None:
    """Switch every lightning indexer of `model` (`engine.models.deepseek_v4.Indexer`, MTP layers included)
    to `numerics` ("transformers" or "reference", see `INDEXER_NUMERICS`)."""
    if numerics not in INDEXER_NUMERICS:
        raise ValueError(f"indexer_numerics must be one of {INDEXER_NUMERICS}, got {numerics!r}")
    from deepinfer.engine.models.deepseek_v4 import Indexer  # lazy: the model module imports this one

    for m in model.modules():
        if isinstance(m, Indexer):
            d = m.head_dim
            if numerics == "reference" and (d & (d - 1) or d % FP4_BLOCK):
                raise ValueError(f'indexer_numerics="reference" needs index_head_dim a power of two and a multiple '
                                 f"of {FP4_BLOCK} (the official model's is 128), got {d}")
            m.numerics = numerics
            m.compressor.rotate_quant = numerics == "reference"
