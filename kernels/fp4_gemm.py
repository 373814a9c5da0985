"""FP4 (E2M1) GEMM: module op `"fp4_gemm"`, `(x [M, K], packed [N, K/2], scale [N, K/32], block) -> x @ W.T`.

`W[n, k] = E2M1[code(n, k)] * 2**(scale[n, k // block] - 127)`: `packed` int8, two codes a byte (the low
nibble the even k), `scale` float8_e8m0fnu, `block` 32 in V4. `x` is bf16, fp16 or float32; the result
is in x's dtype. Used by `engine.quant.Fp4Linear` and the `"fp4"` MoE backend, which pick the
implementation once per device; not in a model's `OpTable`.

Implementations:
  * `"torch"`: the exact reference (`fp4_gemm_torch`), any device: `ROWS_PER_CHUNK` output rows of W at a
    time are unpacked and scaled to float32 (a bounded scratch, never the whole layer) and multiplied with
    x in float32; each output element is one float32 dot product over all of K, in torch's matmul order.
  * `"triton"`: `_fp4_gemm_kernel` (CUDA, or the CPU under `TRITON_INTERPRET=1`): per slice of packed
    columns it loads the bytes, splits the nibbles, decodes E2M1 and the UE8M0 scales with integer ops in
    registers, and takes two dots: x's even columns with the low nibbles, x's odd columns with the high
    nibbles (no interleave needed). Every weight (code x power of two) is exact in bf16/fp16/fp32, so only
    the float32 summation order differs from the reference.

Grouped op `"fp4_grouped_gemm"`, `(x [R, K], packed [E, N, K/2], scale [E, N, K/32], counts [E], block)
-> [R, N]`: the rows of x sorted by expert, `counts[e]` rows for expert e, each row times its expert's W.T
(the FP4 MoE backend's two projections). `"torch"`: one `fp4_gemm_torch` per expert with rows (exact).
`"triton"`: one launch; a tile map built on the device (no host sync) sends each program a BLOCK_M slice
of one expert's rows, and programs past the last tile exit at once.
"""

from __future__ import annotations

import os

import torch

from deepinfer.engine.quant.formats import dequant_fp4, fp4_scale_shape
from deepinfer.kernels.fp8_gemm import num_sms, pick_split_k
from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

ROWS_PER_CHUNK = 128
"""Output rows the torch reference dequantizes at once (its scratch is ROWS_PER_CHUNK x K floats)."""

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp4_gemm_args(name: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """Raise a ValueError naming `name` and the offending argument unless the arguments fit the op."""
    if x.dim() != 2 or packed.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K] and packed [N, K/2], got {list(x.shape)} and {list(packed.shape)}")
    if x.shape[1] != 2 * packed.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but packed is [{packed.shape[0]}, {packed.shape[1]}] "
                         f"(K/2 = {packed.shape[1]})")
    if x.dtype not in _ACT_DTYPES:
        raise ValueError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{name}: packed must be int8 (two E2M1 codes a byte), got {packed.dtype}")
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"{name}: scale must be float8_e8m0fnu, got {scale.dtype}")
    expected = fp4_scale_shape(packed.shape[0], x.shape[1], block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scale {list(scale.shape)} does not match packed {list(packed.shape)} with block "
                         f"{block} (expected {list(expected)})")
    if not (x.device == packed.device == scale.device):
        raise ValueError(f"{name}: x, packed and scale must share a device, got {x.device}, {packed.device}, "
                         f"{scale.device}")


@register_op("fp4_gemm", "torch", in_op_table=False)
def fp4_gemm_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Exact reference: x [M, K] @ dequant(packed, scale).T -> [M, N] in x's dtype, ROWS_PER_CHUNK rows of W at a time."""
    check_fp4_gemm_args("fp4_gemm_torch", x, packed, scale, block)
    n = packed.shape[0]
    x32 = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for n0 in range(0, n, ROWS_PER_CHUNK):
        n1 = min(n, n0 + ROWS_PER_CHUNK)
        w = dequant_fp4(packed[n0:n1], scale[n0:n1], block)  # [<=ROWS_PER_CHUNK, K] scratch
        out[:, n0:n1] = x32 @ w.T
    return out.to(x.dtype)


@register_default_impl("fp4_gemm")
def _default_fp4_gemm(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def fp4_gemm_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_KP packed columns, num_warps) for M rows."""
    if m <= 16:
        return 16, 64, 64, 4
    if m <= 64:
        return 64, 64, 64, 4
    return 128, 128, 32, 8


if triton is not None:

    @triton.jit
    def _e2m1_decode(c):
        """4-bit E2M1 codes (int32) -> float32: bit 3 sign, bits 1-2 exponent (bias 1), bit 0 mantissa."""
        e = (c >> 1) & 3
        m = c & 1
        normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # (1 + m/2) * 2**(e-1)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
        return tl.where((c & 8) != 0, -mag, mag)

    @triton.jit
    def _e8m0_to_f32(b):
        f = (b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 0, 5.877471754111438e-39, f)

    @triton.jit
    def _fp4_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, KP_SLICE: tl.constexpr, stride_xm, stride_wn,
                         stride_sn, stride_os, stride_om, SCALE_BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
        # NOTE: program_id(2) takes packed columns [s * KP_SLICE, (s + 1) * KP_SLICE); with a split, out_ptr
        # is a float32 [split, M, N] partial-sum buffer. Loop trip counts are compile-time constants
        # (KP_SLICE here, KP = K/2 in the grouped kernel): one compile per distinct value, and triton 3.6's CPU
        # interpreter (with numpy 2.5) cannot loop to a runtime bound.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_KP)
        m_ok, n_ok = rm < M, rn < N
        KP = K // 2
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        j_lo = tl.program_id(2) * KP_SLICE
        for step in range(0, KP_SLICE, BLOCK_KP):  # NOTE: a compile-time trip count; steps past K/2 load nothing
            jj = j_lo + step + rj  # packed column j holds k = 2j (low nibble) and 2j + 1 (high nibble)
            j_ok = jj < KP
            wmask = j_ok[:, None] & n_ok[None, :]
            b = tl.load(w_ptr + rn[None, :] * stride_wn + jj[:, None], mask=wmask, other=0).to(tl.int32)
            s = _e8m0_to_f32(tl.load(s_ptr + rn[None, :] * stride_sn + (2 * jj[:, None]) // SCALE_BLOCK,
                                     mask=wmask, other=127).to(tl.int32))  # [BLOCK_KP, BLOCK_N]
            xmask = m_ok[:, None] & j_ok[None, :]
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * jj[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * jj[None, :] + 1, mask=xmask, other=0.0)
            w_lo = (_e2m1_decode(b & 15) * s).to(x_even.dtype)  # [BLOCK_KP, BLOCK_N], exact
            w_hi = (_e2m1_decode((b >> 4) & 15) * s).to(x_even.dtype)
            if IEEE_DOT:
                acc += tl.dot(x_even, w_lo, input_precision="ieee")
                acc += tl.dot(x_odd, w_hi, input_precision="ieee")
            else:
                acc += tl.dot(x_even, w_lo)
                acc += tl.dot(x_odd, w_hi)
        out_ptr += tl.program_id(2) * stride_os
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @register_op("fp4_gemm", "triton", in_op_table=False)
    def fp4_gemm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                        split_k: int | None = None) -> torch.Tensor:
        """Triton FP4 GEMM: x [M, K] (bf16/fp16/fp32, rows contiguous) @ dequant(packed, scale).T -> [M, N].

        packed int8 [N, K/2] and scale float8_e8m0fnu [N, ceil(K/block)] contiguous, block even. On CUDA, or
        the CPU under `TRITON_INTERPRET=1`. Returns x's dtype. `split_k` as in `fp8_gemm_triton`.
        """
        check_fp4_gemm_args("fp4_gemm_triton", x, packed, scale, block)
        if x.stride(1) != 1 or not packed.is_contiguous() or not scale.is_contiguous():
            raise ValueError("fp4_gemm_triton: x's rows, packed and scale must be contiguous (call .contiguous())")
        if block % 2:
            raise ValueError(f"fp4_gemm_triton: the scale block must be even, got {block}")
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"fp4_gemm_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
        m, n = x.shape[0], packed.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        block_m, block_n, block_kp, warps = fp4_gemm_config(m)
        kp = packed.shape[1]
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        kp_steps = triton.cdiv(kp, block_kp)
        split = split_k or pick_split_k(tiles, kp_steps, num_sms(x.device))
        kp_slice = triton.cdiv(kp_steps, split) * block_kp
        split = triton.cdiv(kp, kp_slice)
        dst = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
        _fp4_gemm_kernel[grid](x, packed.view(torch.uint8), scale.view(torch.uint8), dst, m, n, x.shape[1],
                               kp_slice, x.stride(0), packed.stride(0), scale.stride(0),
                               dst.stride(0) if split > 1 else 0, dst.stride(-2), SCALE_BLOCK=block,
                               IEEE_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_KP=block_kp, num_warps=warps)
        if split > 1:
            out.copy_(dst.sum(0))  # [split, M, N] float32 -> x.dtype
        return out


def check_fp4_grouped_args(name: str, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                           counts: torch.Tensor, block: int) -> None:
    """Raise a ValueError naming `name` and the offending argument unless the grouped arguments fit."""
    if packed.dim() != 3 or scale.dim() != 3:
        raise ValueError(f"{name}: packed must be [E, N, K/2] and scale [E, N, K/block], got "
                         f"{list(packed.shape)} and {list(scale.shape)}")
    check_fp4_gemm_args(name, x, packed[0], scale[0], block)
    if scale.shape[0] != packed.shape[0]:
        raise ValueError(f"{name}: packed has {packed.shape[0]} experts but scale {scale.shape[0]}")
    if counts.dim() != 1 or counts.shape[0] != packed.shape[0] or counts.dtype.is_floating_point:
        raise ValueError(f"{name}: counts must be an integer tensor [E={packed.shape[0]}], got {counts.dtype} "
                         f"{list(counts.shape)}")


@register_op("fp4_grouped_gemm", "torch", in_op_table=False)
def fp4_grouped_gemm_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor,
                           block: int = 32) -> torch.Tensor:
    """Exact reference: rows of x sorted by expert [R, K] -> [R, N], expert e's `counts[e]` rows times its W.T."""
    check_fp4_grouped_args("fp4_grouped_gemm_torch", x, packed, scale, counts, block)
    out = torch.empty(x.shape[0], packed.shape[1], dtype=x.dtype, device=x.device)
    off = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            out[off:off + c] = fp4_gemm_torch(x[off:off + c], packed[e], scale[e], block)
        off += c
    return out


@register_default_impl("fp4_grouped_gemm")
def _default_fp4_grouped_gemm(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def grouped_tile_map(counts: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """Per program of a grouped launch: (expert id, first row, end row) as int32 [max_tiles] each, where
    max_tiles = ceil(num_rows / block_m) + E bounds the real tile count without reading `counts` on the host;
    a tile past the last one gets expert id E (the kernel returns at once)."""
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = tiles.cumsum(0)  # [E]
    max_tiles = -(-num_rows // block_m) + num_experts
    t = torch.arange(max_tiles, device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)  # [max_tiles], E past the end
    ec = e.clamp(max=num_experts - 1)
    row_start = counts.cumsum(0) - counts  # [E]
    first = row_start[ec] + (t - (tile_end - tiles)[ec]) * block_m
    end = row_start[ec] + counts[ec]
    return e.to(torch.int32), first.to(torch.int32), end.to(torch.int32)


if triton is not None:

    @triton.jit
    def _fp4_grouped_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, E, N,
                                 KP: tl.constexpr, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                                 SCALE_BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
        tile = tl.program_id(0)
        e = tl.load(tile_e_ptr + tile)
        if e >= E:
            return
        r0 = tl.load(tile_r0_ptr + tile)
        r1 = tl.load(tile_r1_ptr + tile)
        rm = r0 + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rj = tl.arange(0, BLOCK_KP)
        m_ok, n_ok = rm < r1, rn < N
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j0 in range(0, KP, BLOCK_KP):
            jj = j0 + rj
            j_ok = jj < KP
            wmask = j_ok[:, None] & n_ok[None, :]
            b = tl.load(w_base + rn[None, :] * stride_wn + jj[:, None], mask=wmask, other=0).to(tl.int32)
            s = _e8m0_to_f32(tl.load(s_base + rn[None, :] * stride_sn + (2 * jj[:, None]) // SCALE_BLOCK,
                                     mask=wmask, other=127).to(tl.int32))  # [BLOCK_KP, BLOCK_N]
            xmask = m_ok[:, None] & j_ok[None, :]
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * jj[None, :], mask=xmask, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + 2 * jj[None, :] + 1, mask=xmask, other=0.0)
            w_lo = (_e2m1_decode(b & 15) * s).to(x_even.dtype)
            w_hi = (_e2m1_decode((b >> 4) & 15) * s).to(x_even.dtype)
            if IEEE_DOT:
                acc += tl.dot(x_even, w_lo, input_precision="ieee")
                acc += tl.dot(x_odd, w_hi, input_precision="ieee")
            else:
                acc += tl.dot(x_even, w_lo)
                acc += tl.dot(x_odd, w_hi)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @register_op("fp4_grouped_gemm", "triton", in_op_table=False)
    def fp4_grouped_gemm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor,
                                block: int = 32) -> torch.Tensor:
        """Triton grouped FP4 GEMM: x [R, K] rows sorted by expert (`counts[e]` rows each, counts on x's
        device), packed int8 [E, N, K/2] and scale float8_e8m0fnu [E, N, K/block] contiguous -> [R, N] in
        x's dtype. One launch, no host sync. On CUDA, or the CPU under `TRITON_INTERPRET=1`."""
        check_fp4_grouped_args("fp4_grouped_gemm_triton", x, packed, scale, counts, block)
        if x.stride(1) != 1 or not packed.is_contiguous() or not scale.is_contiguous():
            raise ValueError("fp4_grouped_gemm_triton: x's rows, packed and scale must be contiguous")
        if block % 2:
            raise ValueError(f"fp4_grouped_gemm_triton: the scale block must be even, got {block}")
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"fp4_grouped_gemm_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
        num_rows, n = x.shape[0], packed.shape[1]
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
        if num_rows == 0 or n == 0:
            return out
        # NOTE: rows per expert are ~num_rows * k / E on average: size the tile from that, not from num_rows.
        block_m, block_n, block_kp, warps = fp4_gemm_config(max(1, num_rows // packed.shape[0]))
        tile_e, tile_r0, tile_r1 = grouped_tile_map(counts.to(x.device), block_m, num_rows)
        grid = (tile_e.shape[0], triton.cdiv(n, block_n))
        _fp4_grouped_gemm_kernel[grid](x, packed.view(torch.uint8), scale.view(torch.uint8), out, tile_e, tile_r0,
                                       tile_r1, packed.shape[0], n, packed.shape[2], x.stride(0), packed.stride(0),
                                       packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
                                       SCALE_BLOCK=block, IEEE_DOT=x.dtype == torch.float32, BLOCK_M=block_m,
                                       BLOCK_N=block_n, BLOCK_KP=block_kp, num_warps=warps)
        return out
