"""Engram row gather with FP8 dequantization: module op `"engram_gather"`,
`(ids [N] int64, w8 [R, D] float8_e4m3fn, scale [R, D/32] float8_e8m0fnu, out_dtype) -> rows [N, D]`.

DeepSeek-V4.1's Engram tables (docs/V4_1.md §6) are FP8 e4m3 with one UE8M0 scale per 32 values of a row:
`row[r, d] = w8[r, d] * 2**(scale[r, d // 32] - 127)`. A token reads 24 rows of 256 values per Engram layer
(hashes spread uniformly over ~384M rows, ~94 GiB per layer in Flash), so the table is never dequantized as a
whole: only the rows the hashes hit are gathered, then dequantized (exact: a power-of-two scale times an e4m3
value is representable in bf16 and float32). Used by `engine.quant.engram.Fp8EngramTable`, which picks the
implementation from where its table lives (`table_gather_impl`); not in a model's `OpTable`.

Implementations:
  * `"torch"`: the reference, any device (table and ids on one device): `index_select` of the FP8 bytes and the
    scale bytes, then the dequantization in float32, cast to `out_dtype`.
  * `"host"`: a table in host memory (pinned when the engine runs on CUDA: placement "pinned_host") and ids on
    the engine's device: the ids come to the host (a device sync), the FP8 rows and their scales are gathered
    there into a pinned staging buffer, copied to the device (1 byte a value, a quarter of float32's traffic)
    and dequantized there. Same values as `"torch"`.
  * `"triton"`: `_engram_gather_kernel`, one program per `BLOCK_N` ids: each loads its rows' bytes and scale
    bytes, decodes both in registers (e4m3 by a bit cast, UE8M0 as an exponent field) and stores `out_dtype`
    (CUDA, or the CPU under `TRITON_INTERPRET=1`). Bit-identical to `"torch"` (every product is exact). With
    the table in pinned host memory and ids / output on CUDA it reads the rows straight over PCIe (zero copy,
    no host sync; pinned memory is device-addressable under unified addressing) — `w8.is_pinned()` must hold.

NOTE: ids are int64 so row offsets (`id * D`, up to ~1e11 in Flash) never overflow.
"""

from __future__ import annotations

import os

import torch

from deepinfer.engine.quant.formats import e8m0_to_float
from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

ENGRAM_SCALE_BLOCK = 32
"""Values per UE8M0 scale along an Engram row."""

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_engram_gather_args(name: str, ids: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                             out_dtype: torch.dtype) -> None:
    """The wrappers' input checks, with messages naming `name`."""
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"{name}: ids must be a 1-D int64 tensor, got {ids.dtype} {list(ids.shape)}")
    if w8.dim() != 2 or w8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: w8 must be a 2-D float8_e4m3fn table [rows, dim], got {w8.dtype} {list(w8.shape)}")
    rows, dim = w8.shape
    if dim % ENGRAM_SCALE_BLOCK:
        raise ValueError(f"{name}: the row width must be a multiple of {ENGRAM_SCALE_BLOCK}, got {dim}")
    want = (rows, dim // ENGRAM_SCALE_BLOCK)
    if scale.dtype != torch.float8_e8m0fnu or tuple(scale.shape) != want:
        raise ValueError(f"{name}: scale must be float8_e8m0fnu {list(want)} (one per {ENGRAM_SCALE_BLOCK} values of "
                         f"a row), got {scale.dtype} {list(scale.shape)}")
    if scale.device != w8.device:
        raise ValueError(f"{name}: w8 ({w8.device}) and scale ({scale.device}) must live on one device")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")


def _dequant_rows(rows8: torch.Tensor, s8: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Gathered e4m3 rows [N, D] and their UE8M0 scales [N, D/32] -> [N, D] in out_dtype (exact)."""
    n, dim = rows8.shape
    s = e8m0_to_float(s8)[:, :, None]  # [N, D/32, 1]
    return (rows8.float().view(n, dim // ENGRAM_SCALE_BLOCK, ENGRAM_SCALE_BLOCK) * s).view(n, dim).to(out_dtype)


@register_op("engram_gather", "torch", in_op_table=False)
def engram_gather_torch(ids: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                        out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference: gather the FP8 rows and scales of `ids` (on the table's device), then dequantize."""
    check_engram_gather_args("engram_gather_torch", ids, w8, scale, out_dtype)
    if ids.device != w8.device:
        raise ValueError(f"engram_gather_torch: ids ({ids.device}) and the table ({w8.device}) must live on one "
                         "device (a host table with device ids: the 'host' or 'triton' implementation)")
    return _dequant_rows(w8.index_select(0, ids), scale.index_select(0, ids), out_dtype)


@register_op("engram_gather", "host", in_op_table=False)
def engram_gather_host(ids: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A host table, ids anywhere: gather the FP8 rows on the host (pinned staging when CUDA is there), copy the
    bytes to the ids' device, dequantize there. Blocks until the ids reach the host."""
    check_engram_gather_args("engram_gather_host", ids, w8, scale, out_dtype)
    if w8.device.type != "cpu":
        raise ValueError(f"engram_gather_host: the table must be in host memory, got {w8.device}")
    host_ids = ids.cpu()
    pin = ids.device.type == "cuda"
    rows8 = torch.empty((ids.shape[0], w8.shape[1]), dtype=torch.uint8, pin_memory=pin)
    s8 = torch.empty((ids.shape[0], scale.shape[1]), dtype=torch.uint8, pin_memory=pin)
    torch.index_select(w8.view(torch.uint8), 0, host_ids, out=rows8)
    torch.index_select(scale.view(torch.uint8), 0, host_ids, out=s8)
    rows8 = rows8.to(ids.device, non_blocking=pin).view(torch.float8_e4m3fn)
    return _dequant_rows(rows8, s8.to(ids.device, non_blocking=pin), out_dtype)


def table_gather_impl(table_device: torch.device, ids_device: torch.device, pinned: bool = False) -> str:
    """The `"engram_gather"` implementation for a table on `table_device` read with ids on `ids_device`: Triton
    where the table is on CUDA, and for a pinned host table read from CUDA (the zero-copy read over PCIe); the
    host gather for an unpinned host table read from CUDA; else the torch reference.
    NOTE (H200, 2026-12-05, `benchmarks/engram_gather.py`, 24 rows a token from a 2^25-row table): the zero-copy
    read took 43 us for 1 token and 3.6 ms for 4,096, the host gather 236 us and 7.2 ms."""
    table_device, ids_device = torch.device(table_device), torch.device(ids_device)
    if table_device.type == "cuda" and triton is not None:
        return "triton"
    if table_device.type == "cpu" and ids_device.type == "cuda" and pinned and triton is not None:
        return "triton"
    if table_device.type == "cpu" and ids_device.type != "cpu":
        return "host"
    return "torch"


@register_default_impl("engram_gather")
def _default_engram_gather(device: torch.device) -> str:
    return table_gather_impl(device, device)


if triton is not None:

    @triton.jit
    def _engram_gather_kernel(ids_ptr, w_ptr, s_ptr, out_ptr, N, D, S, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                              SCALE_BLOCK: tl.constexpr):
        """out[i, :] = e4m3(w[ids[i], :]) * 2**(s[ids[i], : // SCALE_BLOCK] - 127) for BLOCK_N ids, D <= BLOCK_D."""
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rd = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask_n = rn < N
        mask = mask_n[:, None] & (rd[None, :] < D)
        row = tl.load(ids_ptr + rn, mask=mask_n, other=0).to(tl.int64)  # int64: row * D can pass 2**31
        w_bits = tl.load(w_ptr + row[:, None] * D + rd[None, :], mask=mask, other=0)  # [BLOCK_N, BLOCK_D] bytes
        w = w_bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # exact
        s_bits = tl.load(s_ptr + row[:, None] * S + rd[None, :] // SCALE_BLOCK, mask=mask, other=127).to(tl.int32)
        s = (s_bits << 23).to(tl.float32, bitcast=True)
        s = tl.where(s_bits == 0, 5.877471754111438e-39, s)  # byte 0: 2**-127, a subnormal
        out = (w * s).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rn.to(tl.int64)[:, None] * D + rd[None, :], out, mask=mask)

    @register_op("engram_gather", "triton", in_op_table=False)
    def engram_gather_triton(ids: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                             out_dtype: torch.dtype = torch.float32, block_n: int | None = None) -> torch.Tensor:
        """`_engram_gather_kernel` over ids on CUDA (or the CPU under `TRITON_INTERPRET=1`); the table on the same
        device, or in pinned host memory read zero-copy from CUDA. Returns [N, D] in out_dtype on ids' device."""
        check_engram_gather_args("engram_gather_triton", ids, w8, scale, out_dtype)
        if not (ids.is_contiguous() and w8.is_contiguous() and scale.is_contiguous()):
            raise ValueError("engram_gather_triton: ids, w8 and scale must be contiguous (call .contiguous())")
        if ids.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"engram_gather_triton needs CUDA ids (or TRITON_INTERPRET=1), got {ids.device}")
        if w8.device != ids.device and not (ids.device.type == "cuda" and w8.device.type == "cpu" and w8.is_pinned()
                                            and scale.is_pinned()):
            raise ValueError(f"engram_gather_triton: the table ({w8.device}) must be on the ids' device ({ids.device}) "
                             "or in pinned host memory read from CUDA")
        n, dim = ids.shape[0], w8.shape[1]
        out = torch.empty((n, dim), dtype=out_dtype, device=ids.device)
        if n == 0:
            return out
        block_d = triton.next_power_of_2(dim)
        block_n = block_n or max(1, min(16, 8192 // block_d))
        _engram_gather_kernel[(triton.cdiv(n, block_n),)](
            ids, w8.view(torch.uint8), scale.view(torch.uint8), out, n, dim, scale.shape[1], BLOCK_N=block_n,
            BLOCK_D=block_d, SCALE_BLOCK=ENGRAM_SCALE_BLOCK)
        return out
