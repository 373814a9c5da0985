"""FP8 block-scaled GEMM: module op `"fp8_gemm"`, `(x [M, K], w8 [N, K], scale, block) -> x @ W.T [M, N]`.

`W[n, k] = w8[n, k] * scale[n // bn, k // bk]`: `w8` float8_e4m3fn, `scale` [ceil(N/bn), ceil(K/bk)]
float8_e8m0fnu (V4) or float32 (`*-Base`), `block = (bn, bk)` (128 x 128 in V4). `x` is bf16, fp16 or
float32; the result is in x's dtype. Used by `engine.quant.Fp8Linear`, which picks the implementation
once per device (`default_impl`); the op is not in a model's `OpTable` (`in_op_table=False`).

Implementations:
  * `"torch"`: the exact reference (`fp8_gemm_torch`), any device: output rows are taken `bn` at a time,
    that row block of W is dequantized to float32 (a bounded scratch of bn x K floats, never the whole
    layer) and multiplied with x in float32. Accumulation: each output element is one float32 dot
    product over all of K, in the order of torch's matmul (BLAS on the CPU).
  * `"triton"`: `_fp8_gemm_kernel`, the weights dequantized in registers (CUDA, or the CPU under
    `TRITON_INTERPRET=1`). Per `BLOCK_K` (a divisor of bk) slice of K it takes `tl.dot(x, w8)` with w8
    converted exactly to x's dtype (e4m3 fits bf16/fp16/fp32), accumulates in float32, and multiplies
    the slice's partial sums by their scale before adding them: with UE8M0 (power-of-two) scales every
    product is exact and only the float32 summation order differs from the reference. float32
    activations take an IEEE (not TF32) dot.

NOTE: activations stay in their dtype here (bf16 on the GPU). The official reference quantizes
activations to FP8 per token per 128 with power-of-two scales before its FP8 GEMM; transformers'
loader dequantizes the weights and runs the model in bf16/fp32, so bf16 activations are what matches
transformers. The FP8-activation variant is not implemented yet.
"""

from __future__ import annotations

import os

import torch

from deepinfer.engine.quant.formats import e8m0_to_float, fp8_scale_shape
from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_gemm_args(name: str, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int]) -> None:
    """Raise a ValueError naming `name` and the offending argument unless the arguments fit the op."""
    if x.dim() != 2 or w8.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K] and w8 [N, K], got {list(x.shape)} and {list(w8.shape)}")
    if x.shape[1] != w8.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but w8 is [{w8.shape[0]}, {w8.shape[1]}]")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: w8 must be float8_e4m3fn, got {w8.dtype}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"{name}: scale must be float8_e8m0fnu or float32, got {scale.dtype}")
    expected = fp8_scale_shape(w8.shape[0], w8.shape[1], block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scale {list(scale.shape)} does not match w8 {list(w8.shape)} with block "
                         f"{list(block)} (expected {list(expected)})")
    if not (x.device == w8.device == scale.device):
        raise ValueError(f"{name}: x, w8 and scale must share a device, got {x.device}, {w8.device}, {scale.device}")


@register_op("fp8_gemm", "torch", in_op_table=False)
def fp8_gemm_torch(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Exact reference: x [M, K] @ dequant(w8, scale).T -> [M, N] in x's dtype, one bn-row block of W at a time."""
    check_fp8_gemm_args("fp8_gemm_torch", x, w8, scale, block)
    bn, bk = block
    n, k = w8.shape
    x32 = x.float()
    s = e8m0_to_float(scale) if scale.dtype == torch.float8_e8m0fnu else scale  # [nb, kb] float32
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for i in range(s.shape[0]):
        n0, n1 = i * bn, min(n, (i + 1) * bn)
        w = w8[n0:n1].float()  # [<=bn, K] scratch: this row block only
        w.view(n1 - n0, -1)[:, :k].mul_(s[i].repeat_interleave(bk)[:k])
        out[:, n0:n1] = x32 @ w.T
    return out.to(x.dtype)


@register_default_impl("fp8_gemm")
def _default_fp8_gemm(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def fp8_gemm_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows: small tiles at decode sizes (more programs)."""
    if m <= 16:
        return 16, 64, 128, 4
    if m <= 64:
        return 64, 64, 128, 4
    return 128, 128, 64, 8


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200; that figure for the CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def pick_split_k(num_programs: int, k_steps: int, sms: int) -> int:
    """How many slices to split K into so that a launch of `num_programs` output tiles fills ~2 waves of
    `sms` multiprocessors (decode: few rows, few tiles), keeping >= 4 `BLOCK_K` steps per slice; a power of two."""
    split = 1
    while num_programs * split < 2 * sms and k_steps // (split * 2) >= 4:
        split *= 2
    return split


if triton is not None:

    @triton.jit
    def _e8m0_decode(b):
        """UE8M0 bytes (int32) -> float32 2**(b - 127): the byte becomes the exponent field."""
        f = (b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 0, 5.877471754111438e-39, f)  # byte 0: 2**-127, a subnormal

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_SLICE: tl.constexpr, stride_xm, stride_wn, stride_sn,
                         stride_os, stride_om, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                         SCALE_E8M0: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # NOTE: BLOCK_K divides BK_SCALE (one K step lies in one scale column) and K_SLICE, the K range of
        # program_id(2)'s split; with a split, out_ptr is a float32 [split, M, N] partial-sum buffer.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(2) * K_SLICE
        for step in range(0, K_SLICE, BLOCK_K):  # NOTE: a compile-time trip count; steps past K load nothing
            k0 = k_lo + step
            kk = k0 + rk
            k_ok = kk < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_bits = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                             other=0)  # [BLOCK_K, BLOCK_N] e4m3 bytes
            w = w_bits.to(tl.float8e4nv, bitcast=True).to(x.dtype)  # exact
            # a step past K (last split) reads a valid scale column and multiplies zero partial sums
            s = tl.load(s_ptr + (rn // BN_SCALE) * stride_sn + tl.minimum(k0, K - 1) // BK_SCALE, mask=n_ok,
                        other=0)  # [BLOCK_N]
            if SCALE_E8M0:
                s = _e8m0_decode(s.to(tl.int32))
            if IEEE_DOT:
                part = tl.dot(x, w, input_precision="ieee")
            else:
                part = tl.dot(x, w)
            acc += part * s[None, :]
        out_ptr += tl.program_id(2) * stride_os
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @register_op("fp8_gemm", "triton", in_op_table=False)
    def fp8_gemm_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        split_k: int | None = None) -> torch.Tensor:
        """Triton FP8 block-scaled GEMM: x [M, K] (bf16/fp16/fp32, rows contiguous) @ dequant(w8, scale).T.

        w8 float8_e4m3fn [N, K] and scale [ceil(N/bn), ceil(K/bk)] (UE8M0 or float32) contiguous; bk a power
        of two >= 16. On CUDA, or the CPU under `TRITON_INTERPRET=1`. Returns [M, N] in x's dtype.
        `split_k` (default: `pick_split_k`) splits K across programs when there are few output tiles
        (decode); the float32 partial sums are then added in split order (deterministic).
        """
        check_fp8_gemm_args("fp8_gemm_triton", x, w8, scale, block)
        if x.stride(1) != 1 or not w8.is_contiguous() or not scale.is_contiguous():
            raise ValueError("fp8_gemm_triton: x's rows, w8 and scale must be contiguous (call .contiguous())")
        bn, bk = block
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"fp8_gemm_triton: the K block must be a power of two >= 16, got {bk}")
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"fp8_gemm_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
        m, n = x.shape[0], w8.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        k = x.shape[1]
        block_m, block_n, block_k, warps = fp8_gemm_config(m)
        block_k = min(block_k, bk)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        k_steps = triton.cdiv(k, block_k)
        split = split_k or pick_split_k(tiles, k_steps, num_sms(x.device))
        k_slice = triton.cdiv(k_steps, split) * block_k
        split = triton.cdiv(k, k_slice)
        dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        is_e8m0 = scale.dtype == torch.float8_e8m0fnu
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
        _fp8_gemm_kernel[grid](x, w8.view(torch.uint8), scale.view(torch.uint8) if is_e8m0 else scale, dst,
                               m, n, k, k_slice, x.stride(0), w8.stride(0), scale.stride(0),
                               dst.stride(0) if split > 1 else 0, dst.stride(-2),
                               BN_SCALE=bn, BK_SCALE=bk, SCALE_E8M0=is_e8m0, IEEE_DOT=x.dtype == torch.float32,
                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        if split > 1:
            out.copy_(dst.sum(0))  # [split, M, N] float32 -> x.dtype
        return out
