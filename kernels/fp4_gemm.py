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
`"triton"`: one launch, no host sync: each program finds its BLOCK_M slice of one expert's rows from
`counts` itself (`grouped_tile_map` is the same map on the host); experts without rows get no program,
and the few programs past the last tile exit at once.
"""

from __future__ import annotations

import torch

from deepinfer.engine.quant.formats import dequant_fp4, fp4_scale_shape

# NOTE: the module, not its names: fp8_gemm -> engine.quant -> linear -> this module can run while
# fp8_gemm is still initialising (its helpers are looked up at call time).
from deepinfer.kernels import fp8_gemm as _fp8
from deepinfer.kernels.registry import check_triton_launch, register_default_impl, register_op

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
    """(BLOCK_M, BLOCK_N, BLOCK_KP packed columns, num_warps) for M rows: the first (untuned) candidate."""
    return fp4_gemm_candidates(m)[0][:4]


def fp4_gemm_candidates(m: int) -> list[tuple[int, int, int, int, int, int]]:
    """Configs tried for M rows (per expert in the grouped GEMM): (BLOCK_M, BLOCK_N, BLOCK_KP packed
    columns, num_warps, num_stages, waves), `waves` as in `fp8_gemm_candidates` (the grouped GEMM does
    not split K). The first one is the default without tuning."""
    bm = _fp8.m_bucket(m)
    if bm:
        return [(bm, 64, 128, 4, 3, 2), (bm, 32, 128, 4, 4, 4), (bm, 64, 64, 4, 4, 4), (bm, 128, 128, 4, 3, 2)]
    return [(128, 128, 64, 8, 3, 1), (64, 128, 64, 4, 3, 1)]


if triton is not None:
    from deepinfer.kernels.fp8_gemm import _store_split_k, split_k_buffers

    @triton.jit
    def _fp4_decode(b, sb, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_KP: tl.constexpr):
        """Packed bytes b [BLOCK_N, BLOCK_KP] (int32) and their scale bytes sb [BLOCK_N, G] (int32, one per HALF
        bytes) -> the low and high nibbles' weights E2M1 * 2**(scale - 127) in DTYPE, exact."""
        # NOTE: a form building bf16 bit patterns with integer ops only (no conversions) ran 1.6-1.7x slower in the
        # FP4 MoE kernels on an H100 (2026-12-06: 159 vs 95 us at 1 token, 1179 vs 668 us at 32; BENCHMARKS.md):
        # the selects and adds cost more than the float16 trick's conversions
        sf = ((sb + 14) << 23).to(tl.float32, bitcast=True)  # 2**(scale - 127) * 2**14 (normal for bytes <= 240)
        sf = tl.reshape(tl.broadcast_to(sf[:, :, None], (BLOCK_N, G, HALF)), (BLOCK_N, BLOCK_KP))
        lo = (((b & 8) << 12) | ((b & 7) << 9)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((b & 128) << 8) | ((b & 112) << 5)).to(tl.int16).to(tl.float16, bitcast=True)
        w_lo = (lo.to(tl.float32) * sf).to(DTYPE)  # [BLOCK_N, BLOCK_KP], exact
        w_hi = (hi.to(tl.float32) * sf).to(DTYPE)
        return w_lo, w_hi

    @triton.jit
    def _fp4_step(acc, x_ptr, w_ptr, s_ptr, rm, rn, m_ok, n_ok, j0, K, stride_xm, stride_wn, stride_sn,
                  SCALE_BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_KP: tl.constexpr, SWAP: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += x[rm, 2*j0 : 2*(j0 + BLOCK_KP)] @ W[rn, same k].T, W decoded from packed
        columns [j0, j0 + BLOCK_KP) of w_ptr (rows rn) and their scales. SWAP: acc is the transpose
        [BLOCK_N, BLOCK_M] and the decoded tile the dot's A operand (W @ x.T: Hopper's wgmma reads A from
        registers, where the decoded tile already is; as B it is re-staged through shared memory).

        The packed bytes load as [BLOCK_N, BLOCK_KP] (16-byte runs along K), each row's BLOCK_KP / (SCALE_BLOCK / 2)
        scales once as [BLOCK_N, G] and are broadcast over their SCALE_BLOCK / 2 bytes (`_fp4_decode`). E2M1
        decode by bits: a nibble s|e1 e0 m placed as s at bit 15 and e1 e0 m at bits 9-11 of a float16 is the
        E2M1 value times 2**-14 (normal and subnormal alike), so W = f16 * 2**(scale - 127 + 14), exact. x loads as
        contiguous [BLOCK_M, 2 * BLOCK_KP] and splits into even / odd columns (low / high nibbles).
        NOTE: j0 is a multiple of SCALE_BLOCK / 2, which divides BLOCK_KP; scale bytes above 240 (2**113)
        would overflow the folded 2**14 (real FP4 checkpoints use scales far below 1).
        """
        HALF: tl.constexpr = SCALE_BLOCK // 2
        G: tl.constexpr = BLOCK_KP // HALF
        KP = K // 2
        jj = j0 + tl.arange(0, BLOCK_KP)
        j_ok = jj < KP
        b = tl.load(w_ptr + rn[:, None] * stride_wn + jj[None, :], mask=n_ok[:, None] & j_ok[None, :],
                    other=0).to(tl.int32)  # [BLOCK_N, BLOCK_KP] bytes
        sg = j0 // HALF + tl.arange(0, G)
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + sg[None, :], mask=n_ok[:, None] & (sg < (K + SCALE_BLOCK - 1)
                     // SCALE_BLOCK)[None, :], other=127).to(tl.int32)  # [BLOCK_N, G]
        kk = 2 * j0 + tl.arange(0, 2 * BLOCK_KP)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_KP, 2)))
        w_lo, w_hi = _fp4_decode(b, sb, x.dtype, BLOCK_N, G, HALF, BLOCK_KP)  # [BLOCK_N, BLOCK_KP] each, exact
        if SWAP:  # W @ x.T
            a_lo, b_lo, a_hi, b_hi = w_lo, tl.trans(x_even), w_hi, tl.trans(x_odd)
        else:
            a_lo, b_lo, a_hi, b_hi = x_even, tl.trans(w_lo), x_odd, tl.trans(w_hi)
        if IEEE_DOT:
            acc += tl.dot(a_lo, b_lo, input_precision="ieee")
            acc += tl.dot(a_hi, b_hi, input_precision="ieee")
        else:
            acc += tl.dot(a_lo, b_lo)
            acc += tl.dot(a_hi, b_hi)
        return acc

    @triton.jit
    def _fp4_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, KP_SLICE: tl.constexpr,
                         stride_xm, stride_wn, stride_sn, stride_om, SCALE_BLOCK: tl.constexpr,
                         IEEE_DOT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_KP: tl.constexpr):
        # NOTE: program_id(2) takes packed columns [s * KP_SLICE, (s + 1) * KP_SLICE) (SPLIT of them;
        # `_store_split_k` adds their partial sums). Loop trip counts are compile-time constants (KP_SLICE
        # here, KP = K/2 in the grouped kernel): one compile per distinct value, and triton 3.6's CPU
        # interpreter (with numpy 2.5) cannot loop to a runtime bound.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        j_lo = tl.program_id(2) * KP_SLICE
        for step in range(0, KP_SLICE, BLOCK_KP):  # NOTE: a compile-time trip count; steps past K/2 load nothing
            acc = _fp4_step(acc, x_ptr, w_ptr, s_ptr, rm, rn, m_ok, n_ok, j_lo + step, K, stride_xm, stride_wn,
                            stride_sn, SCALE_BLOCK, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_KP, False)
        _store_split_k(acc, out_ptr, part_ptr, lock_ptr, rm, rn, M, N, stride_om, SPLIT)

    @register_op("fp4_gemm", "triton", in_op_table=False)
    def fp4_gemm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                        split_k: int | None = None, config: tuple | None = None) -> torch.Tensor:
        """Triton FP4 GEMM: x [M, K] (bf16/fp16/fp32, rows contiguous) @ dequant(packed, scale).T -> [M, N].

        packed int8 [N, K/2] and scale float8_e8m0fnu [N, ceil(K/block)] contiguous, block a power of two
        >= 2. On CUDA, or the CPU under `TRITON_INTERPRET=1`. Returns x's dtype. `split_k`, the tuned
        tile config and `config` (one of `fp4_gemm_candidates`) as in `fp8_gemm_triton`.
        """
        check_fp4_gemm_args("fp4_gemm_triton", x, packed, scale, block)
        check_triton_launch("fp4_gemm_triton", x, "x's rows, packed and scale", packed, scale, block=block)
        m, n = x.shape[0], packed.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        kp = packed.shape[1]
        sms = _fp8.num_sms(x.device)

        def launch(cfg):
            block_m, block_n, block_kp, warps, stages, waves = cfg
            if x.dtype == torch.float32:  # float32 operands: 4-byte tiles; the bf16 configs overflow shared memory
                block_kp, stages = min(block_kp, 32), 2
            block_kp = max(block_kp, block // 2)  # NOTE: a scale block never straddles two K steps
            grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
            kp_steps = triton.cdiv(kp, block_kp)
            # NOTE: the float32 partials written (split x M x N x 4 bytes) stay <= half of the packed bytes
            split = split_k or _fp8.pick_split_k(grid_mn[0] * grid_mn[1], kp_steps, sms, waves, min_steps=2,
                                            max_split=max(1, kp // (8 * m)))
            kp_slice = triton.cdiv(kp_steps, split) * block_kp
            split = triton.cdiv(kp, kp_slice)
            part, lock = split_k_buffers(grid_mn, split, m, n, out)
            _fp4_gemm_kernel[grid_mn + (split,)](
                x, packed.view(torch.uint8), scale.view(torch.uint8), out, part, lock, m, n, x.shape[1], kp_slice,
                x.stride(0), packed.stride(0), scale.stride(0), out.stride(0), SCALE_BLOCK=block,
                IEEE_DOT=x.dtype == torch.float32, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_KP=block_kp, num_warps=warps, num_stages=stages)

        idx = x.device.index if x.device.type == "cuda" else -1
        key = ("fp4_gemm", idx, _fp8.m_bucket(m), n, kp, block, x.dtype, split_k)
        launch(config or _fp8.tune_pick(key, fp4_gemm_candidates(m), launch, x.device))
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
    max_tiles = ceil(num_rows / block_m) + min(E, num_rows) bounds the real tile count without reading
    `counts` on the host (each expert with rows adds at most one partial tile; experts without rows get
    none); a tile past the last one gets expert id E (the kernel returns at once)."""
    counts = counts.to(torch.int64)
    num_experts = counts.shape[0]
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = tiles.cumsum(0)  # [E]
    max_tiles = -(-num_rows // block_m) + min(num_experts, num_rows)
    t = torch.arange(max_tiles, device=counts.device)
    e = torch.searchsorted(tile_end, t, right=True)  # [max_tiles], E past the end
    ec = e.clamp(max=num_experts - 1)
    row_start = counts.cumsum(0) - counts  # [E]
    first = row_start[ec] + (t - (tile_end - tiles)[ec]) * block_m
    end = row_start[ec] + counts[ec]
    return e.to(torch.int32), first.to(torch.int32), end.to(torch.int32)


if triton is not None:

    @triton.jit
    def _fp4_grouped_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, counts_ptr, E, N, KP: tl.constexpr, stride_xm,
                                 stride_we, stride_wn, stride_se, stride_sn, stride_om, E_POW2: tl.constexpr,
                                 SCALE_BLOCK: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr):
        # NOTE: program_id(0) is the row tile (fastest varying: the tiles of one expert and N block run side
        # by side and share its weights in L2), program_id(1) the N block. Each program derives its tile
        # from counts [E] itself, as `grouped_tile_map` does on the host (same numbers): expert e owns tiles
        # [sum_{i<e} ceil(c_i / BLOCK_M), sum_{i<=e} ...); experts without rows own none; past the end: exit.
        t = tl.program_id(0)
        ie = tl.arange(0, E_POW2)
        cnt = tl.load(counts_ptr + ie, mask=ie < E, other=0).to(tl.int32)  # [E_POW2]
        ntiles = (cnt + BLOCK_M - 1) // BLOCK_M
        e = tl.sum((tl.cumsum(ntiles, 0) <= t).to(tl.int32), 0)  # the expert owning tile t (E: none)
        if e >= E:
            return
        before = ie < e
        r0 = tl.sum(tl.where(before, cnt, 0), 0) + (t - tl.sum(tl.where(before, ntiles, 0), 0)) * BLOCK_M
        r1 = tl.sum(tl.where(before | (ie == e), cnt, 0), 0)
        rm = r0 + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < r1, rn < N
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j0 in range(0, KP, BLOCK_KP):
            acc = _fp4_step(acc, x_ptr, w_base, s_base, rm, rn, m_ok, n_ok, j0, 2 * KP, stride_xm, stride_wn,
                            stride_sn, SCALE_BLOCK, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_KP, False)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @register_op("fp4_grouped_gemm", "triton", in_op_table=False)
    def fp4_grouped_gemm_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor,
                                block: int = 32, config: tuple | None = None) -> torch.Tensor:
        """Triton grouped FP4 GEMM: x [R, K] rows sorted by expert (`counts[e]` rows each, counts on x's
        device), packed int8 [E, N, K/2] and scale float8_e8m0fnu [E, N, K/block] contiguous -> [R, N] in
        x's dtype. One launch, no host sync; the tile config is timed per (rows-per-expert bucket, N, K)
        on the first call on CUDA (`config`, one of `fp4_gemm_candidates`, forces one). On CUDA, or the CPU
        under `TRITON_INTERPRET=1`."""
        check_fp4_grouped_args("fp4_grouped_gemm_triton", x, packed, scale, counts, block)
        check_triton_launch("fp4_grouped_gemm_triton", x, "x's rows, packed and scale", packed, scale, block=block)
        num_rows, n = x.shape[0], packed.shape[1]
        out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
        if num_rows == 0 or n == 0:
            return out
        # NOTE: rows per expert are ~num_rows / E on average (num_rows = tokens x top-k): size the tile from
        # that, not from num_rows.
        per_expert = max(1, num_rows // packed.shape[0])
        counts = counts.to(x.device)
        num_experts = packed.shape[0]

        def launch(cfg):
            block_m, block_n, block_kp, warps, stages, _ = cfg
            if x.dtype == torch.float32:  # float32 operands: 4-byte tiles; the bf16 configs overflow shared memory
                block_kp, stages = min(block_kp, 32), 2
            block_kp = max(block_kp, block // 2)  # NOTE: a scale block never straddles two K steps
            max_tiles = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)  # as `grouped_tile_map`
            grid = (max_tiles, triton.cdiv(n, block_n))
            _fp4_grouped_gemm_kernel[grid](x, packed.view(torch.uint8), scale.view(torch.uint8), out, counts,
                                           num_experts, n, packed.shape[2], x.stride(0), packed.stride(0),
                                           packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
                                           E_POW2=triton.next_power_of_2(num_experts), SCALE_BLOCK=block,
                                           IEEE_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n,
                                           BLOCK_KP=block_kp, num_warps=warps, num_stages=stages)

        idx = x.device.index if x.device.type == "cuda" else -1
        key = ("fp4_grouped_gemm", idx, _fp8.m_bucket(per_expert), packed.shape[0], n, packed.shape[2], block, x.dtype)
        launch(config or _fp8.tune_pick(key, fp4_gemm_candidates(per_expert), launch, x.device))
        return out


# --- FP4 -> bfloat16 dequantization (the MoE backend's large-batch route) ---------------------------------------


def check_fp4_dequant_args(name: str, packed: torch.Tensor, scale: torch.Tensor, block: int,
                           out: torch.Tensor | None) -> None:
    """Raise a ValueError naming `name` and the offending argument unless (packed [..., N, K/2], scale
    [..., N, K/block], out [..., N, K] bfloat16 or None) fit the `"fp4_dequant"` op."""
    if packed.dim() < 2 or packed.dim() != scale.dim():
        raise ValueError(f"{name}: packed must be [..., N, K/2] and scale [..., N, K/block] (as many dims), got "
                         f"{list(packed.shape)} and {list(scale.shape)}")
    if packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{name}: packed must be int8 (two E2M1 codes a byte), got {packed.dtype}")
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"{name}: scale must be float8_e8m0fnu, got {scale.dtype}")
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    expected = (*packed.shape[:-2], *fp4_scale_shape(n, k, block))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}: scale {list(scale.shape)} does not match packed {list(packed.shape)} with block "
                         f"{block} (expected {list(expected)})")
    if out is not None and (tuple(out.shape) != (*packed.shape[:-1], k) or out.dtype != torch.bfloat16
                            or not out.is_contiguous() or out.device != packed.device):
        raise ValueError(f"{name}: out must be a contiguous bfloat16 [{', '.join(map(str, (*packed.shape[:-1], k)))}] "
                         f"on {packed.device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if packed.device != scale.device:
        raise ValueError(f"{name}: packed and scale must share a device, got {packed.device} and {scale.device}")


@register_op("fp4_dequant", "torch", in_op_table=False)
def fp4_dequant_torch(packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """W = E2M1(packed) * 2**(scale - 127) as bfloat16 [..., N, K], exact (every E2M1 value times a power of two
    within bf16's range is a bf16 value). Written into `out` when given; `ROWS_PER_CHUNK` rows of float32
    scratch at a time."""
    check_fp4_dequant_args("fp4_dequant_torch", packed, scale, block, out)
    k = 2 * packed.shape[-1]
    flat_p, flat_s = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1, scale.shape[-1])
    if out is None:
        out = torch.empty(*packed.shape[:-1], k, dtype=torch.bfloat16, device=packed.device)
    flat_o = out.view(-1, k)
    for r0 in range(0, flat_p.shape[0], ROWS_PER_CHUNK):
        r1 = min(flat_p.shape[0], r0 + ROWS_PER_CHUNK)
        flat_o[r0:r1] = dequant_fp4(flat_p[r0:r1], flat_s[r0:r1], block)
    return out


register_default_impl("fp4_dequant")(_default_fp4_gemm)  # Triton on CUDA, the reference elsewhere


if triton is not None:

    @triton.jit
    def _fp4_dequant_kernel(w_ptr, s_ptr, out_ptr, ROWS, KP, SCALE_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_KP: tl.constexpr):
        # One [BLOCK_R, BLOCK_KP] tile of packed bytes -> [BLOCK_R, 2 * BLOCK_KP] bf16: `_fp4_decode` (the GEMMs'
        # decode), the low nibble the even column.
        HALF: tl.constexpr = SCALE_BLOCK // 2
        G: tl.constexpr = BLOCK_KP // HALF
        rr = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        jj = tl.program_id(1) * BLOCK_KP + tl.arange(0, BLOCK_KP)
        r_ok, j_ok = rr < ROWS, jj < KP
        b = tl.load(w_ptr + rr[:, None] * KP + jj[None, :], mask=r_ok[:, None] & j_ok[None, :], other=0).to(tl.int32)
        SP = (KP + HALF - 1) // HALF  # scales a row
        sg = tl.program_id(1) * G + tl.arange(0, G)
        sb = tl.load(s_ptr + rr[:, None] * SP + sg[None, :], mask=r_ok[:, None] & (sg < SP)[None, :],
                     other=127).to(tl.int32)
        w_lo, w_hi = _fp4_decode(b, sb, tl.bfloat16, BLOCK_R, G, HALF, BLOCK_KP)
        w = tl.reshape(tl.join(w_lo, w_hi), (BLOCK_R, 2 * BLOCK_KP))
        kk = 2 * tl.program_id(1) * BLOCK_KP + tl.arange(0, 2 * BLOCK_KP)
        tl.store(out_ptr + rr[:, None] * (2 * KP) + kk[None, :], w, mask=r_ok[:, None] & (kk < 2 * KP)[None, :])

    @register_op("fp4_dequant", "triton", in_op_table=False)
    def fp4_dequant_triton(packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                           out: torch.Tensor | None = None) -> torch.Tensor:
        """`fp4_dequant_torch` in one launch (packed and scale contiguous; bit-identical: both exact). On CUDA, or
        the CPU under `TRITON_INTERPRET=1`. NOTE: scale bytes above 240 overflow the folded 2**14 (as in
        `_fp4_step`; real checkpoints' scales are far below)."""
        check_fp4_dequant_args("fp4_dequant_triton", packed, scale, block, out)
        kp = packed.shape[-1]
        check_triton_launch("fp4_dequant_triton", packed.reshape(-1, max(kp, 1)), "packed and scale", packed, scale,
                            block=block)
        if out is None:
            out = torch.empty(*packed.shape[:-1], 2 * kp, dtype=torch.bfloat16, device=packed.device)
        rows = packed.numel() // max(kp, 1)
        if rows == 0 or kp == 0:
            return out
        block_r, block_kp = 32, max(128, block // 2)
        grid = (triton.cdiv(rows, block_r), triton.cdiv(kp, block_kp))
        _fp4_dequant_kernel[grid](packed.view(torch.uint8), scale.view(torch.uint8), out, rows, kp, SCALE_BLOCK=block,
                                  BLOCK_R=block_r, BLOCK_KP=block_kp, num_warps=4)
        return out
