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
    activations take an IEEE (not TF32) dot. At decode sizes the tuner also tries its `SWAP` form,
    which computes `out.T = W @ x.T` (the converted weight tile as the dot's A operand, which Hopper's
    wgmma reads from registers instead of re-staging it through shared memory): the same products.

Large M (prefill chunks; `DEQUANT_MIN_ROWS`): the Triton entry point dequantizes W to bfloat16 once
(`dequantize_fp8_bf16`, exact for UE8M0 scales) and multiplies with cuBLAS: the same products, only the float32
summation order differs, at the bf16 matmul rate (the in-register kernel ran an 8,192-token prefill's FP8 linears
at ~a third of it on an H200 on 2026-12-05: 36 ms where cuBLAS took ~11 ms over the same shapes in bf16).

NOTE: activations stay in their dtype here (bf16 on the GPU). The official reference quantizes
activations to FP8 per token per 128 with power-of-two scales before its FP8 GEMM; transformers'
loader dequantizes the weights and runs the model in bf16/fp32, so bf16 activations are what matches
transformers. The official FP8-activation numbers are available as an option of `Fp8Linear`
(`engine/quant/act_quant.py`: activations rounded onto the FP8 grid, then this same GEMM; exact
products, no FP8 tensor-core speed-up yet).
"""

from __future__ import annotations

import os

import torch

from deepinfer.engine.quant.formats import e8m0_to_float, fp8_scale_shape
from deepinfer.kernels.registry import check_triton_launch, register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_gemm_args(name: str, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int], groups: int = 1) -> None:
    """Raise a ValueError naming `name` and the offending argument unless the arguments fit the op."""
    if x.dim() != 2 or w8.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K] and w8 [N, K], got {list(x.shape)} and {list(w8.shape)}")
    if groups < 1 or (groups > 1 and (w8.shape[0] % groups or (w8.shape[0] // groups) % block[0])):
        raise ValueError(f"{name}: groups={groups} must split w8's {w8.shape[0]} rows into groups of whole "
                         f"{block[0]}-row scale blocks")
    if x.shape[1] != groups * w8.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but w8 is [{w8.shape[0]}, {w8.shape[1]}]"
                         + (f" with {groups} row groups (x must be [M, {groups} x {w8.shape[1]}])" if groups > 1
                            else ""))
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


def _row_groups(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], groups: int):
    """(x's columns, w8's rows, scale's rows) of each of `groups` row groups (views)."""
    r, k = w8.shape[0] // groups, w8.shape[1]
    rb = r // block[0]
    return [(x[:, g * k:(g + 1) * k], w8[g * r:(g + 1) * r], scale[g * rb:(g + 1) * rb]) for g in range(groups)]


@register_op("fp8_gemm", "torch", in_op_table=False)
def fp8_gemm_torch(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                   groups: int = 1) -> torch.Tensor:
    """Exact reference: x [M, K] @ dequant(w8, scale).T -> [M, N] in x's dtype, one bn-row block of W at a time.

    `groups` > 1: W's rows in `groups` equal groups of whole scale blocks, x [M, groups * K] and output group g
    (columns g N/groups ..) = x's g-th K columns @ group g's rows.T (V4's grouped `wo_a`: a block-diagonal
    product without the zeros)."""
    check_fp8_gemm_args("fp8_gemm_torch", x, w8, scale, block, groups)
    if groups > 1:
        return torch.cat([fp8_gemm_torch(xg.contiguous(), wg, sg, block)
                          for xg, wg, sg in _row_groups(x, w8, scale, block, groups)], dim=1)
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


DEQUANT_MIN_ROWS_ENV = "DEEPINFER_FP8_DEQUANT_MIN_ROWS"
DEQUANT_MIN_ROWS = int(os.environ.get(DEQUANT_MIN_ROWS_ENV, "1024"))
"""From this many rows `fp8_gemm_triton` takes the dequantize-then-cuBLAS route (bf16 activations, UE8M0 scales);
0 turns it off. Read at import (assign the module attribute to change it later)."""


def dequantize_fp8_bf16(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W = w8 * scale as bfloat16 [N, K] for UE8M0 `scale`: e4m3 values and powers of two are bf16 values, so every
    element is exact (barring products below bf16's subnormal range, which no real scale reaches)."""
    if scale.dtype != torch.float8_e8m0fnu:
        raise ValueError(f"dequantize_fp8_bf16: UE8M0 scales only (a float32 scale's products round), got {scale.dtype}")
    bn, bk = block
    n, k = w8.shape
    w = w8.to(torch.bfloat16)
    s = e8m0_to_float(scale).to(torch.bfloat16).repeat_interleave(bn, 0)[:n]  # [N, ceil(K/bk)]
    full = k // bk
    if full:
        w[:, :full * bk].view(n, full, bk).mul_(s[:, :full, None])
    if k % bk:
        w[:, full * bk:].mul_(s[:, full:full + 1])
    return w


def _dequant_route(x: torch.Tensor, scale: torch.Tensor) -> bool:
    return 0 < DEQUANT_MIN_ROWS <= x.shape[0] and x.dtype == torch.bfloat16 and scale.dtype == torch.float8_e8m0fnu


@register_default_impl("fp8_gemm")
def _default_fp8_gemm(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


_TUNE_ENV = "DEEPINFER_QGEMM_TUNE"
"""Set to 0 to skip the first-call timing of candidate configs (then the first candidate is used)."""
TUNED: dict[tuple, tuple] = {}
"""(op, device index, key...) -> the config `tune_pick` chose (read by `benchmarks/quantized_gemm.py`)."""


def m_bucket(m: int) -> int:
    """Row-count bucket of a tuning key: 16, 32 or 64 at decode sizes, 0 (one bucket) above 64 rows."""
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 0


def fp8_gemm_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows: the first (untuned) candidate of `fp8_gemm_candidates`."""
    return fp8_gemm_candidates(m)[0][:4]


def fp8_gemm_candidates(m: int) -> list[tuple[int, int, int, int, int, int, int]]:
    """Configs tried for M rows: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, waves, swap), where `waves`
    is the number of 132-SM waves of programs a K split aims at (decode: few output tiles, so K is split
    until ~waves x SMs programs stream the weights) and `swap` 1 picks the swap-AB kernel (decode sizes: the
    weight tile is the dot's A operand: `_fp8_gemm_kernel`'s SWAP). The first one is the default without tuning."""
    bm = m_bucket(m)
    if bm:
        return [(bm, 64, 128, 4, 3, 2, 0), (bm, 128, 128, 4, 4, 2, 0), (bm, 64, 128, 4, 4, 4, 0),
                (bm, 128, 128, 8, 4, 4, 0), (bm, 64, 128, 4, 3, 2, 1), (bm, 64, 128, 4, 4, 4, 1),
                (bm, 128, 128, 8, 3, 2, 1), (bm, 128, 128, 8, 4, 4, 1)]
    return [(128, 128, 64, 8, 3, 1, 0)]


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (132 on an H200; that figure for the CPU interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def pick_split_k(num_programs: int, k_steps: int, sms: int, waves: int = 2, min_steps: int = 4,
                 max_split: int = 1 << 30) -> int:
    """How many slices to split K into so that a launch of `num_programs` output tiles fills ~`waves` waves of
    `sms` multiprocessors (decode: few rows, few tiles), keeping >= `min_steps` `BLOCK_K` steps per slice and
    at most `max_split` slices; a power of two."""
    split = 1
    while num_programs * split < waves * sms and k_steps // (split * 2) >= min_steps and split * 2 <= max_split:
        split *= 2
    return split


def _time_launches(fn, reps: int = 10) -> float:
    """Milliseconds of one `fn()` (CUDA events around `reps` calls queued behind a sleep kernel, so the
    host's launch overhead is not timed: the calls run back to back, as in a captured graph)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time: the host queues the calls meanwhile
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def tune_pick(key: tuple, candidates: list, launch, device: torch.device):
    """The candidate config for `key` that ran fastest on `device` (each run by `launch(cfg)`, timed twice,
    best of two), cached in `TUNED`. Untimed (first candidate, not cached) on the CPU interpreter, during
    a CUDA graph capture, for a single candidate, or with DEEPINFER_QGEMM_TUNE=0.

    NOTE: timing launches the kernel (writing its output) a few dozen times on the first call per key;
    a config changes only the summation order (float32), never which products are summed.
    """
    if key in TUNED:
        return TUNED[key]
    if (len(candidates) == 1 or device.type != "cuda" or os.environ.get(_TUNE_ENV) == "0"
            or torch.cuda.is_current_stream_capturing()):
        return candidates[0]
    ok = []
    for cfg in candidates:  # compile and warm up every candidate first; one the device cannot run is skipped
        try:
            launch(cfg)
            ok.append(cfg)
        except Exception as exc:  # noqa: BLE001 - e.g. triton's OutOfResources (shared memory) for one config
            print(f"# tune_pick {key}: config {cfg} skipped ({type(exc).__name__})")
    candidates = ok or candidates[:1]
    times = [min(_time_launches(lambda c=cfg: launch(c)) for _ in range(2)) for cfg in candidates]
    TUNED[key] = candidates[min(range(len(candidates)), key=times.__getitem__)]
    return TUNED[key]


if triton is not None:

    @triton.jit
    def _e8m0_decode(b):
        """UE8M0 bytes (int32) -> float32 2**(b - 127): the byte becomes the exponent field."""
        f = (b << 23).to(tl.float32, bitcast=True)
        return tl.where(b == 0, 5.877471754111438e-39, f)  # byte 0: 2**-127, a subnormal

    @triton.jit
    def _store_split_k(acc, out_ptr, part_ptr, lock_ptr, rm, rn, M, N, stride_om, SPLIT: tl.constexpr):
        """Store a program's [BLOCK_M, BLOCK_N] float32 sums: directly (no split), or as split
        program_id(2)'s partial, the last split of the tile to finish adding all SPLIT partials in split
        order (deterministic) and writing out_ptr. One launch, no second reduction kernel.

        NOTE: part_ptr is float32 [SPLIT, M, N] contiguous, lock_ptr int32 [tiles] zeroed by the caller;
        the barrier before the release orders every thread's partial store before the counter's increment,
        and the partials are read past L1 (.cg).
        """
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if SPLIT == 1:
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            off = rm[:, None] * N + rn[None, :]
            tl.store(part_ptr + tl.program_id(2) * M * N + off, acc, mask=mask)
            tl.debug_barrier()
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            if tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel") == SPLIT - 1:
                total = tl.zeros_like(acc)
                for s in tl.static_range(SPLIT):
                    total += tl.load(part_ptr + s * M * N + off, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
                # the tile's counter back to zero (every split has counted): the next launch on this stream
                # reuses the zeroed counters (`split_k_buffers`) without a fill kernel of its own
                tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed")

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, K_SLICE: tl.constexpr,
                         stride_xm, stride_wn, stride_sn, stride_om, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                         SCALE_E8M0: tl.constexpr, IEEE_DOT: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                         GROUP_N: tl.constexpr = 0):
        # NOTE: BLOCK_K divides BK_SCALE (one K step lies in one scale column) and K_SLICE, the K range of
        # program_id(2)'s split (SPLIT of them; `_store_split_k` adds their partial sums).
        # SWAP: out.T = W @ x.T, the converted weight tile [BLOCK_N, BLOCK_K] (loaded in W's row-major order) the
        # dot's A operand, which Hopper's wgmma reads from registers, and the few tokens its N dimension (BLOCK_M
        # 16..64); the accumulator is transposed until the store. Same products, same K order.
        # GROUP_N > 0: W's rows form groups of GROUP_N (a multiple of BLOCK_N) and group g reads x's columns
        # [g K, (g + 1) K) (x rows of stride_xm >= groups x K): the grouped `wo_a` in one launch.
        if GROUP_N > 0:
            x_ptr += (tl.program_id(1) * BLOCK_N // GROUP_N) * K
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = tl.program_id(2) * K_SLICE
        s_row = s_ptr + (rn // BN_SCALE) * stride_sn  # [BLOCK_N] scale row pointers, one per output column
        for step in range(0, K_SLICE, BLOCK_K):  # NOTE: a compile-time trip count; steps past K load nothing
            k0 = k_lo + step
            kk = k0 + rk
            k_ok = kk < K
            if SWAP:
                w_bits = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                 other=0)  # [BLOCK_N, BLOCK_K] e4m3 bytes
                b = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=k_ok[:, None] & m_ok[None, :],
                            other=0.0)  # [BLOCK_K, BLOCK_M]
                a = w_bits.to(tl.float8e4nv, bitcast=True).to(b.dtype)  # exact
            else:
                a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                w_bits = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                                 other=0)  # [BLOCK_K, BLOCK_N] e4m3 bytes, 16-byte runs along K
                b = w_bits.to(tl.float8e4nv, bitcast=True).to(a.dtype)  # exact
            # a step past K (last split) reads a valid scale column and multiplies zero partial sums
            s = tl.load(s_row + tl.minimum(k0, K - 1) // BK_SCALE, mask=n_ok, other=0)  # [BLOCK_N], once per step
            if SCALE_E8M0:
                s = _e8m0_decode(s.to(tl.int32))
            if IEEE_DOT:
                part = tl.dot(a, b, input_precision="ieee")
            else:
                part = tl.dot(a, b)
            if SWAP:
                acc += part * s[:, None]
            else:
                acc += part * s[None, :]
        if SWAP:
            acc = tl.trans(acc)
        _store_split_k(acc, out_ptr, part_ptr, lock_ptr, rm, rn, M, N, stride_om, SPLIT)

    _LOCKS: dict[int, torch.Tensor] = {}
    """Zeroed int32 tile counters per CUDA device: `_store_split_k` leaves every counter it used at zero again, so
    launches that run one after another share them (a fill launch a GEMM less: 57 of them, ~57 us, in the H100
    profile of a published-weights decode step). NOTE: the engine runs its GEMMs on one stream (graph replays
    included); two split-K launches running concurrently on two streams must not share the buffer."""

    def _zeroed_locks(tiles: int, device: torch.device) -> torch.Tensor:
        """`tiles` zeroed int32 counters for a split-K launch: a view of the device's cached buffer (made and grown
        outside CUDA-graph captures, where its zeros are written at once), or a fresh zeroed tensor (a fill launch)
        where the cache cannot serve (the CPU interpreter; a capture needing more counters than the buffer has)."""
        if device.type != "cuda":
            return torch.zeros(tiles, dtype=torch.int32, device=device)
        buf = _LOCKS.get(device.index)
        if buf is None or buf.numel() < tiles:
            if torch.cuda.is_current_stream_capturing():
                return torch.zeros(tiles, dtype=torch.int32, device=device)
            buf = _LOCKS[device.index] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
        return buf[:tiles]

    def split_k_buffers(grid_mn: tuple[int, int], split: int, m: int, n: int, out: torch.Tensor):
        """(part, lock) buffers for a launch over grid_mn output tiles and `split` K slices:
        float32 [split, M, N] partial sums and zeroed int32 tile counters (dummies without a split)."""
        if split == 1:
            return out, out
        part = torch.empty(split, m, n, dtype=torch.float32, device=out.device)
        return part, _zeroed_locks(grid_mn[0] * grid_mn[1], out.device)

    @register_op("fp8_gemm", "triton", in_op_table=False)
    def fp8_gemm_triton(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                        split_k: int | None = None, config: tuple | None = None, groups: int = 1) -> torch.Tensor:
        """Triton FP8 block-scaled GEMM: x [M, K] (bf16/fp16/fp32, rows contiguous) @ dequant(w8, scale).T.

        w8 float8_e4m3fn [N, K] and scale [ceil(N/bn), ceil(K/bk)] (UE8M0 or float32) contiguous; bk a power
        of two >= 16. On CUDA, or the CPU under `TRITON_INTERPRET=1`. Returns [M, N] in x's dtype.
        `split_k` (default: from the tuned config, `pick_split_k`) splits K across programs when there are
        few output tiles (decode); the float32 partial sums are then added in split order (deterministic)
        by the tile's last program, in the same launch. The tile config is timed per (M bucket, N, K,
        dtype) on the first call on CUDA (`tune_pick`); `config` (one of `fp8_gemm_candidates`) forces one.
        `groups` as in `fp8_gemm_torch` (one launch: each N block reads its group's columns of x).
        """
        check_fp8_gemm_args("fp8_gemm_triton", x, w8, scale, block, groups)
        if split_k is None and config is None and _dequant_route(x, scale):  # large M: cuBLAS (module docstring)
            w = dequantize_fp8_bf16(w8, scale, block)
            if groups == 1:
                return x @ w.T
            m, k = x.shape[0], w8.shape[1]
            y = torch.bmm(x.reshape(m, groups, k).transpose(0, 1), w.view(groups, -1, k).transpose(1, 2))  # [G, M, R]
            return y.transpose(0, 1).reshape(m, w8.shape[0])
        bn, bk = block
        check_triton_launch("fp8_gemm_triton", x, "x's rows, w8 and scale", w8, scale, block=bk,
                            block_what="K block", min_block=16)
        m, n = x.shape[0], w8.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        k = w8.shape[1]
        group_n = n // groups if groups > 1 else 0
        is_e8m0 = scale.dtype == torch.float8_e8m0fnu
        sms = num_sms(x.device)

        def launch(cfg):
            block_m, block_n, block_k, warps, stages, waves, swap = cfg
            block_k = min(block_k, bk)
            while group_n % block_n:  # NOTE: an N block never straddles two groups (group_n: whole bn blocks)
                block_n //= 2
            grid_mn = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
            k_steps = triton.cdiv(k, block_k)
            # NOTE: the float32 partials written (split x M x N x 4 bytes) stay <= half of w8's bytes
            split = split_k or pick_split_k(grid_mn[0] * grid_mn[1], k_steps, sms, waves, min_steps=2,
                                            max_split=max(1, k // (8 * m)))
            k_slice = triton.cdiv(k_steps, split) * block_k
            split = triton.cdiv(k, k_slice)
            part, lock = split_k_buffers(grid_mn, split, m, n, out)
            _fp8_gemm_kernel[grid_mn + (split,)](
                x, w8.view(torch.uint8), scale.view(torch.uint8) if is_e8m0 else scale, out, part, lock, m, n, k,
                k_slice, x.stride(0), w8.stride(0), scale.stride(0), out.stride(0), BN_SCALE=bn, BK_SCALE=bk,
                SCALE_E8M0=is_e8m0, IEEE_DOT=x.dtype == torch.float32, SPLIT=split, BLOCK_M=block_m,
                BLOCK_N=block_n, BLOCK_K=block_k, SWAP=bool(swap), GROUP_N=group_n, num_warps=warps,
                num_stages=stages)

        idx = x.device.index if x.device.type == "cuda" else -1
        key = ("fp8_gemm", idx, m_bucket(m), n, k, bk, x.dtype, split_k) + ((groups,) if groups > 1 else ())
        launch(config or tune_pick(key, fp8_gemm_candidates(m), launch, x.device))
        return out
