"""Grouped MoE expert GEMMs with no host sync: the four launches of the `"triton"` MoE backend.

A MoE layer's routed part for T tokens and top-k routing is R = T * k (token, expert) *pairs*
(pair p = token p // k, slot p % k). Every shape below depends on T and k only, never on the routing,
so the whole sequence can be captured in a CUDA graph:

  1. `moe_align(topk_ids, E) -> (sorted_pairs [R] int32, counts [E] int32)`: the pairs grouped by
     expert (ascending), a stable order within an expert, and the rows per expert. On the device.
  2. `moe_up(x, w13, ..., sorted_pairs, counts, topk, limit) -> act [R, I]`: row r of the sorted
     pairs gathers its token's x row, multiplies it by its expert's gate (w1) and up (w3) rows and
     applies the clamped SwiGLU: act = silu(min(g, limit)) * clamp(u, -limit, limit).
  3. `moe_down(act, w2, ..., sorted_pairs, counts, topk_weights) -> y [R, H]`: act times the expert's
     down projection, times the pair's routing weight, stored at the *pair's* row (p = t * k + slot).
  4. `moe_combine(y, topk_ids, rows=None, weights=None) -> out [T, H]`: per token, its k rows added in
     ascending expert id (ties: ascending slot). No atomics: the sum order is fixed, the result deterministic.
     `rows` [R] (pair p's row of y; None: row p) and `weights` [T, k] (each row times its pair's weight rounded
     to y's dtype, the product rounded, before the adds) let a caller whose rows come out in expert order
     (the `_grouped_mm` route of `engine.moe.triton_backend`) skip putting them back and weighting them: one
     read of y instead of two reads and two writes of it.

The expert weights come in three formats (constexpr `WFMT`): float (bf16 / fp16 / fp32 like x:
w13 [E, 2I, H], w2 [E, H, I], as `engine.moe.torch_backend.pack_experts` stacks them), FP4 (E2M1 packed
[E, N, K/2] + UE8M0 scales [E, N, K/32], `engine.moe.fp4_backend.pack_fp4_experts`, decoded in registers
by `kernels.fp4_gemm._fp4_step`; `block` = 32) and FP8 (e4m3 [E, N, K] + block scales [E, N/bn, K/bk],
UE8M0 or float32, `block` = (bn, bk); each BLOCK_K slice's partial sums times their scale, as
`kernels.fp8_gemm`; the gate and up halves of w13 must each be whole scale blocks: I % bn == 0). The grouped tiles are found from `counts` by each program
(`_tile_of`, the map of `kernels.fp4_gemm.grouped_tile_map`): the launch has cdiv(R, BLOCK_M) + min(E, R)
row tiles, enough for any routing; programs past the last real tile exit at once.

Arithmetic (NOTE): every step rounds to x's dtype where the torch backends' ops round (each projection's
output, the clamps, silu, the product, the weighted output, each add of the combine), so in bf16 the
backend computes what `"torch"`/`"torch_loop"` compute, up to the float32 summation order inside the
dot products (and the last float32 bit of exp in silu).

Each op has a `"torch"` reference here (the oracle of the tests) and a `"triton"` implementation; all are
module ops (`in_op_table=False`) picked by the `"triton"` MoE backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.kernels import fp8_gemm as _fp8
from deepinfer.kernels.registry import check_triton_launch, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

WFMT_FLOAT, WFMT_FP4, WFMT_FP8 = 0, 1, 2
"""Expert weight formats (the kernels' `WFMT` constexpr)."""

ALIGN_MAX_PAIRS = 16384
"""Pairs up to which `moe_align_triton` runs its single-program kernel; above (long prefills, eager) the
sort is torch's (`argsort`, still no host sync)."""


# ---------------------------------------------------------------------------- torch references


def check_moe_ids(name: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise a ValueError naming `name` unless topk_ids is an integer [T, k] tensor and num_experts >= 1."""
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point:
        raise ValueError(f"{name}: topk_ids must be an integer [num_tokens, k] tensor, got {topk_ids.dtype} "
                         f"{list(topk_ids.shape)}")
    if num_experts < 1:
        raise ValueError(f"{name}: num_experts must be >= 1, got {num_experts}")


@register_op("moe_align", "torch", in_op_table=False)
def moe_align_torch(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (pairs sorted by expert, stable [R] int32, rows per expert [E] int32); no host sync."""
    check_moe_ids("moe_align_torch", topk_ids, num_experts)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    # NOTE: not bincount: on CUDA it reads the largest id back to the host to size its output
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    return order, counts


def _expert_rows(counts: torch.Tensor):
    """(expert, first row, end row) of every expert with rows, on the host (references only)."""
    off = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            yield e, off, off + c
        off += c


def _linear_rows(x: torch.Tensor, w: tuple[torch.Tensor, ...], e: int, rows: slice, wfmt: int,
                 block) -> torch.Tensor:
    """x @ W_e[rows].T in x's dtype, W_e from the stacked weights `w` (float (W,), FP4 or FP8 (weight, scale))."""
    if wfmt == WFMT_FLOAT:
        return F.linear(x, w[0][e, rows])
    if wfmt == WFMT_FP8:
        bn = block[0]
        return _fp8.fp8_gemm_torch(x, w[0][e, rows], w[1][e, rows.start // bn:-(-rows.stop // bn)], tuple(block))
    from deepinfer.kernels.fp4_gemm import fp4_gemm_torch

    return fp4_gemm_torch(x, w[0][e, rows], w[1][e, rows], block)


@register_op("moe_up", "torch", in_op_table=False)
def moe_up_torch(x: torch.Tensor, w13: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor, counts: torch.Tensor,
                 topk: int, limit: float, wfmt: int = WFMT_FLOAT, block=32) -> torch.Tensor:
    """Reference of step 2: act [R, I] in x's dtype, the torch backend's clamped SwiGLU per expert."""
    inter = w13[0].shape[1] // 2
    tok = sorted_pairs.long() // topk
    act = torch.zeros(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    for e, r0, r1 in _expert_rows(counts):
        xe = x[tok[r0:r1]]
        g = _linear_rows(xe, w13, e, slice(0, inter), wfmt, block).clamp(max=limit)
        u = _linear_rows(xe, w13, e, slice(inter, 2 * inter), wfmt, block).clamp(min=-limit, max=limit)
        act[r0:r1] = F.silu(g) * u
    return act


@register_op("moe_down", "torch", in_op_table=False)
def moe_down_torch(act: torch.Tensor, w2: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor, counts: torch.Tensor,
                   topk_weights: torch.Tensor, wfmt: int = WFMT_FLOAT, block=32) -> torch.Tensor:
    """Reference of step 3: y [R, H] at the pairs' rows, each times its routing weight (in act's dtype)."""
    hidden = w2[0].shape[1]
    y = torch.zeros(sorted_pairs.shape[0], hidden, dtype=act.dtype, device=act.device)
    wflat = topk_weights.reshape(-1).to(act.dtype)
    pairs = sorted_pairs.long()
    for e, r0, r1 in _expert_rows(counts):
        out = _linear_rows(act[r0:r1], w2, e, slice(0, hidden), wfmt, block)
        y[pairs[r0:r1]] = out * wflat[pairs[r0:r1], None]
    return y


@register_op("moe_combine", "torch", in_op_table=False)
def moe_combine_torch(y: torch.Tensor, topk_ids: torch.Tensor, rows: torch.Tensor | None = None,
                      weights: torch.Tensor | None = None) -> torch.Tensor:
    """Reference of step 4: out [T, H], each token's k rows of y added in ascending expert id (stable); pair p's
    row is `rows[p]` (None: p), times `weights` (rounded to y's dtype) first when given."""
    if rows is not None:
        y = y.index_select(0, rows.long())
    if weights is not None:
        y = y * weights.reshape(-1, 1).to(y.dtype)
    num_tokens, k = topk_ids.shape
    order = torch.argsort(topk_ids, dim=1, stable=True)  # [T, k] slots in ascending expert id
    rows = (torch.arange(num_tokens, device=y.device)[:, None] * k + order).reshape(num_tokens, k)
    out = y[rows[:, 0]].clone()
    for j in range(1, k):
        out = out + y[rows[:, j]]
    return out


# ---------------------------------------------------------------------------- Triton

if triton is not None:
    from deepinfer.kernels.fp4_gemm import _fp4_step
    from deepinfer.kernels.fp8_gemm import _e8m0_decode
    from deepinfer.kernels.rope import round_like as _rnd  # x rounded where the torch reference's op rounds

    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, counts_ptr, R, E, E_POW2: tl.constexpr, BLOCK: tl.constexpr):
        # NOTE: one program; two passes over the pairs, BLOCK at a time: the rows per expert, then each
        # pair's row = its expert's first row + the pairs of that expert before it (a one-hot prefix sum).
        e = tl.arange(0, E_POW2)[None, :]
        cnt = tl.zeros([E_POW2], tl.int32)
        for s in range(0, R, BLOCK):
            p = s + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + p, mask=p < R, other=-1).to(tl.int32)
            cnt += tl.sum((ids[:, None] == e).to(tl.int32), axis=0)
        tl.store(counts_ptr + tl.arange(0, E_POW2), cnt, mask=tl.arange(0, E_POW2) < E)
        fill = tl.cumsum(cnt, 0) - cnt  # [E_POW2] next free row of each expert
        for s in range(0, R, BLOCK):
            p = s + tl.arange(0, BLOCK)
            ids = tl.load(ids_ptr + p, mask=p < R, other=-1).to(tl.int32)
            onehot = (ids[:, None] == e).to(tl.int32)  # [BLOCK, E_POW2]
            before = tl.cumsum(onehot, 0) - onehot  # same-expert pairs earlier in this block
            row = tl.sum(onehot * (fill[None, :] + before), axis=1)
            tl.store(sorted_ptr + row, p, mask=p < R)
            fill += tl.sum(onehot, axis=0)

    @register_op("moe_align", "triton", in_op_table=False)
    def moe_align_triton(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pairs grouped by expert (stable) and rows per expert, as `moe_align_torch` (identical results),
        in one single-program launch up to `ALIGN_MAX_PAIRS` pairs (torch's sort beyond). No host sync."""
        check_moe_ids("moe_align_triton", topk_ids, num_experts)
        flat = topk_ids.reshape(-1).contiguous()
        num_pairs = flat.shape[0]
        if num_pairs > ALIGN_MAX_PAIRS:
            return moe_align_torch(topk_ids, num_experts)
        check_triton_launch("moe_align_triton", flat[:, None], "topk_ids", block=2)
        order = torch.empty(num_pairs, dtype=torch.int32, device=flat.device)
        counts = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
        e_pow2 = triton.next_power_of_2(num_experts)
        block = max(16, min(128, 8192 // e_pow2))
        _align_kernel[(1,)](flat, order, counts, num_pairs, num_experts, E_POW2=e_pow2, BLOCK=block,
                            num_warps=4 if e_pow2 <= 64 else 8)
        return order, counts

    @triton.jit
    def _tile_of(counts_ptr, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """(expert, first row, end row) of this program's row tile (program_id(0)); expert E past the last
        tile. Expert e owns tiles [sum_{i<e} ceil(c_i / BLOCK_M), sum_{i<=e} ...) (`grouped_tile_map`)."""
        t = tl.program_id(0)
        ie = tl.arange(0, E_POW2)
        cnt = tl.load(counts_ptr + ie, mask=ie < E, other=0).to(tl.int32)
        ntiles = (cnt + BLOCK_M - 1) // BLOCK_M
        e = tl.sum((tl.cumsum(ntiles, 0) <= t).to(tl.int32), 0)
        before = ie < e
        r0 = tl.sum(tl.where(before, cnt, 0), 0) + (t - tl.sum(tl.where(before, ntiles, 0), 0)) * BLOCK_M
        r1 = tl.sum(tl.where(before | (ie == e), cnt, 0), 0)
        return e, r0, r1

    @triton.jit
    def _acc_step(acc, x_ptr, rx, m_ok, w_base, s_base, rn, n_ok, k0, K, stride_xm, stride_wn, stride_sn,
                  WFMT: tl.constexpr, SCALE_BLOCK: tl.constexpr, BN_SCALE: tl.constexpr, SCALE_E8M0: tl.constexpr,
                  IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SWAP: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] += x[rx, k0 : k0 + BLOCK_K] @ W[rn, same k].T for one weight format.
        FP4: SCALE_BLOCK is the 1 x 32 scale run; FP8: BN_SCALE x SCALE_BLOCK scale blocks (BLOCK_K divides
        SCALE_BLOCK, so one K step lies in one scale column). SWAP: acc is [BLOCK_N, BLOCK_M], W's tile the
        dot's A operand (W @ x.T; `kernels.fp4_gemm._fp4_step`): the same products."""
        # One exit: the compiler (unlike the interpreter) also type-checks the code after an early `return`
        # inside a constexpr branch, where `w` is still the packed uint8 of FP4.
        if WFMT == 1:
            acc = _fp4_step(acc, x_ptr, w_base, s_base, rx, rn, m_ok, n_ok, k0 // 2, K, stride_xm, stride_wn,
                            stride_sn, SCALE_BLOCK, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_K // 2, SWAP)
        else:
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            if SWAP:
                a = tl.load(w_base + rn[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                            other=0)  # [BLOCK_N, BLOCK_K], W's rows as stored
                b = tl.load(x_ptr + rx[None, :] * stride_xm + kk[:, None], mask=k_ok[:, None] & m_ok[None, :],
                            other=0.0)  # [BLOCK_K, BLOCK_M]
                if WFMT == 2:
                    a = a.to(tl.float8e4nv, bitcast=True).to(b.dtype)  # exact
            else:
                a = tl.load(x_ptr + rx[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                b = tl.load(w_base + rn[None, :] * stride_wn + kk[:, None], mask=k_ok[:, None] & n_ok[None, :],
                            other=0)  # [BLOCK_K, BLOCK_N], runs along K
                if WFMT == 2:
                    b = b.to(tl.float8e4nv, bitcast=True).to(a.dtype)  # exact
            if IEEE_DOT:
                part = tl.dot(a, b, input_precision="ieee")
            else:
                part = tl.dot(a, b)
            if WFMT == 2:
                s = tl.load(s_base + (rn // BN_SCALE) * stride_sn + k0 // SCALE_BLOCK, mask=n_ok, other=0)
                if SCALE_E8M0:
                    s = _e8m0_decode(s.to(tl.int32))
                if SWAP:
                    part = part * s[:, None]
                else:
                    part = part * s[None, :]
            acc = acc + part
        return acc

    @triton.jit
    def _moe_up_kernel(x_ptr, w_ptr, s_ptr, pairs_ptr, counts_ptr, act_ptr, E, N, K: tl.constexpr, limit,
                       stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am, TOPK: tl.constexpr,
                       E_POW2: tl.constexpr, WFMT: tl.constexpr, SCALE_BLOCK: tl.constexpr, BN_SCALE: tl.constexpr,
                       SCALE_E8M0: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
        # NOTE: program_id(0) the row tile (fastest varying: an expert's tiles share its weights in L2),
        # program_id(1) the block of N = I output columns; gate rows n and up rows I + n in one program.
        e, r0, r1 = _tile_of(counts_ptr, E, E_POW2, BLOCK_M)
        if e >= E:
            return
        DT = x_ptr.dtype.element_ty
        rm = r0 + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < r1, rn < N
        tok = tl.load(pairs_ptr + rm, mask=m_ok, other=0) // TOPK  # the x row each sorted pair gathers
        w_g = w_ptr + e.to(tl.int64) * stride_we
        s_g = s_ptr + e.to(tl.int64) * stride_se
        w_u, s_u = w_g + N * stride_wn, s_g + (N // BN_SCALE) * stride_sn  # the up rows (w3) after the gate rows
        if SWAP:  # W @ x.T: the accumulators transposed until the epilogue
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc_g = _acc_step(acc_g, x_ptr, tok, m_ok, w_g, s_g, rn, n_ok, k0, K, stride_xm, stride_wn, stride_sn,
                              WFMT, SCALE_BLOCK, BN_SCALE, SCALE_E8M0, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
            acc_u = _acc_step(acc_u, x_ptr, tok, m_ok, w_u, s_u, rn, n_ok, k0, K, stride_xm, stride_wn, stride_sn,
                              WFMT, SCALE_BLOCK, BN_SCALE, SCALE_E8M0, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
        if SWAP:
            acc_g = tl.trans(acc_g)
            acc_u = tl.trans(acc_u)
        g = _rnd(tl.minimum(_rnd(acc_g, x_ptr), limit), x_ptr)
        u = _rnd(tl.minimum(tl.maximum(_rnd(acc_u, x_ptr), -limit), limit), x_ptr)
        silu = _rnd(tl.math.div_rn(g, 1.0 + tl.exp(-g)), x_ptr)
        tl.store(act_ptr + rm[:, None] * stride_am + rn[None, :], (silu * u).to(DT), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_down_kernel(a_ptr, w_ptr, s_ptr, pairs_ptr, counts_ptr, tw_ptr, y_ptr, E, N, K: tl.constexpr,
                         stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym, E_POW2: tl.constexpr,
                         WFMT: tl.constexpr, SCALE_BLOCK: tl.constexpr, BN_SCALE: tl.constexpr,
                         SCALE_E8M0: tl.constexpr, IEEE_DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr):
        e, r0, r1 = _tile_of(counts_ptr, E, E_POW2, BLOCK_M)
        if e >= E:
            return
        DT = a_ptr.dtype.element_ty
        rm = r0 + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = rm < r1, rn < N
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        if SWAP:  # W @ act.T: the accumulator transposed until the epilogue
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = _acc_step(acc, a_ptr, rm, m_ok, w_base, s_base, rn, n_ok, k0, K, stride_am, stride_wn, stride_sn,
                            WFMT, SCALE_BLOCK, BN_SCALE, SCALE_E8M0, IEEE_DOT, BLOCK_M, BLOCK_N, BLOCK_K, SWAP)
        if SWAP:
            acc = tl.trans(acc)
        pair = tl.load(pairs_ptr + rm, mask=m_ok, other=0)
        wt = _rnd(tl.load(tw_ptr + pair, mask=m_ok, other=0.0).to(tl.float32), a_ptr)  # topk_weights.to(x.dtype)
        y = _rnd(acc, a_ptr) * wt[:, None]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(DT),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_combine_kernel(y_ptr, ids_ptr, out_ptr, rows_ptr, w_ptr, N, TOPK: tl.constexpr, K_POW2: tl.constexpr,
                            BLOCK_N: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_W: tl.constexpr):
        DT = out_ptr.dtype.element_ty
        t = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        j = tl.arange(0, K_POW2)
        ids = tl.load(ids_ptr + t * TOPK + j, mask=j < TOPK, other=0)
        # rank of slot j: the slots with a smaller id, or the same id and an earlier slot (valid slots only)
        i2, j2 = j[:, None], j[None, :]
        earlier = ((ids[:, None] < ids[None, :]) | ((ids[:, None] == ids[None, :]) & (i2 < j2))) & (i2 < TOPK)
        rank = tl.sum(earlier.to(tl.int32), axis=0)  # [K_POW2]
        acc = tl.zeros([BLOCK_N], tl.float32)
        for r in tl.static_range(TOPK):
            slot = tl.sum(tl.where((rank == r) & (j < TOPK), j, 0), 0)
            pair = t * TOPK + slot
            row = tl.load(rows_ptr + pair) if HAS_ROWS else pair
            v = tl.load(y_ptr + row.to(tl.int64) * N + rn, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_W:  # y * weights.to(y.dtype), the product rounded to y's dtype (as torch's mul in that dtype)
                v = _rnd(v * _rnd(tl.load(w_ptr + pair).to(tl.float32), out_ptr), out_ptr)
            if r == 0:
                acc = v
            else:
                acc = _rnd(acc + v, out_ptr)
        tl.store(out_ptr + t.to(tl.int64) * N + rn, acc.to(DT), mask=n_ok)


def moe_gemm_candidates(rows_per_expert: int, kind: str) -> list[tuple[int, int, int, int, int, int]]:
    """Tile configs tried for a grouped MoE GEMM (`kind` "up" or "down") by ~rows per expert:
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap); the first is the default without tuning.
    `swap` 1 (decode sizes) computes W @ x.T, the weight tile as the dot's A operand (`_acc_step`).
    NOTE: "up" keeps two accumulators (gate and up), so its tiles are half as wide in N."""
    bm = _fp8.m_bucket(rows_per_expert)
    if bm:  # decode: the weights stream once; enough programs to fill the SMs
        if kind == "up":
            return [(bm, 32, 128, 4, 4, 0), (bm, 64, 128, 4, 3, 0), (bm, 16, 256, 4, 3, 0), (bm, 64, 128, 4, 3, 1),
                    (bm, 64, 256, 4, 3, 1), (bm, 128, 128, 8, 3, 1)]
        return [(bm, 64, 128, 4, 4, 0), (bm, 32, 128, 4, 4, 0), (bm, 128, 128, 4, 3, 0), (bm, 64, 128, 4, 4, 1),
                (bm, 64, 256, 4, 3, 1), (bm, 128, 128, 8, 3, 1)]
    if kind == "up":
        return [(128, 64, 64, 8, 3, 0), (64, 64, 64, 4, 3, 0)]
    return [(128, 128, 64, 8, 3, 0), (64, 128, 64, 4, 3, 0)]


def check_moe_gemm_args(name: str, x: torch.Tensor, w: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor,
                        counts: torch.Tensor, wfmt: int, k_dim: int, n_rows: int, block=32) -> None:
    """Raise a ValueError naming `name` unless x [*, K] and the stacked weights of format `wfmt` fit:
    float w = (W [E, n_rows, K],) in x's dtype; FP4 w = (packed int8 [E, n_rows, K/2], scale e8m0 [E, n_rows, K/32]);
    FP8 w = (e4m3 [E, n_rows, K], scale [E, n_rows/bn, K/bk]) with block = (bn, bk)."""
    if x.dim() != 2 or x.shape[1] != k_dim:
        raise ValueError(f"{name}: x must be [rows, {k_dim}], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: x must be bfloat16, float16 or float32, got {x.dtype}")
    if wfmt == WFMT_FLOAT:
        if len(w) != 1 or w[0].dim() != 3 or w[0].shape[1:] != (n_rows, k_dim) or w[0].dtype != x.dtype:
            raise ValueError(f"{name}: float weights must be one [E, {n_rows}, {k_dim}] stack in x's dtype "
                             f"{x.dtype}, got {[(t.dtype, list(t.shape)) for t in w]}")
    elif wfmt == WFMT_FP4:
        if (len(w) != 2 or w[0].dim() != 3 or w[0].shape[1:] != (n_rows, k_dim // 2) or w[0].dtype != torch.int8
                or w[1].dtype != torch.float8_e8m0fnu or w[1].shape[:2] != w[0].shape[:2]):
            raise ValueError(f"{name}: FP4 weights must be (int8 [E, {n_rows}, {k_dim // 2}], float8_e8m0fnu "
                             f"[E, {n_rows}, K/block]), got {[(t.dtype, list(t.shape)) for t in w]}")
    elif wfmt == WFMT_FP8:
        bn, bk = block
        expected = (w[0].shape[0], -(-n_rows // bn), -(-k_dim // bk)) if w[0].dim() == 3 else None
        if (len(w) != 2 or w[0].dim() != 3 or w[0].shape[1:] != (n_rows, k_dim) or w[0].dtype != torch.float8_e4m3fn
                or w[1].dtype not in (torch.float8_e8m0fnu, torch.float32) or tuple(w[1].shape) != expected):
            raise ValueError(f"{name}: FP8 weights must be (float8_e4m3fn [E, {n_rows}, {k_dim}], UE8M0 or float32 "
                             f"scales {expected} for block {tuple(block)}), got {[(t.dtype, list(t.shape)) for t in w]}")
        if bk < 16 or bk & (bk - 1):
            raise ValueError(f"{name}: the FP8 K block must be a power of two >= 16, got {bk}")
    else:
        raise ValueError(f"{name}: unknown weight format {wfmt}")
    num_experts = w[0].shape[0]
    if counts.shape != (num_experts,) or counts.dtype != torch.int32:
        raise ValueError(f"{name}: counts must be int32 [{num_experts}], got {counts.dtype} {list(counts.shape)}")
    if sorted_pairs.dim() != 1 or sorted_pairs.dtype != torch.int32:
        raise ValueError(f"{name}: sorted_pairs must be int32 [R], got {sorted_pairs.dtype} {list(sorted_pairs.shape)}")
    if not all(t.device == x.device for t in (*w, sorted_pairs, counts)):
        raise ValueError(f"{name}: every tensor must be on x's device {x.device}")


if triton is not None:

    def _launch_grouped(name: str, kernel, x: torch.Tensor, w: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor,
                        counts: torch.Tensor, out: torch.Tensor, n_out: int, k_dim: int, wfmt: int, block: int,
                        config: tuple | None, extra_args: tuple, extra_kw: dict) -> None:
        """Launch a grouped kernel (up or down) over cdiv(R, BLOCK_M) + min(E, R) row tiles, the tile config
        timed once per (rows-per-expert bucket, E, N, K, format, dtype) on CUDA (`fp8_gemm.tune_pick`)."""
        num_rows, num_experts = sorted_pairs.shape[0], w[0].shape[0]
        wt = w[0].view(torch.uint8) if wfmt != WFMT_FLOAT else w[0]
        st = w[0] if wfmt == WFMT_FLOAT else w[1].view(torch.uint8) if w[1].dtype == torch.float8_e8m0fnu else w[1]
        bn, bk = block if wfmt == WFMT_FP8 else (1, block)
        per_expert = max(1, num_rows // num_experts)
        kind = "up" if kernel is _moe_up_kernel else "down"

        def launch(cfg):
            block_m, block_n, block_k, warps, stages, swap = cfg
            if x.dtype == torch.float32:  # 4-byte tiles: the bf16 configs overflow shared memory
                block_k, stages = min(block_k, 64), 2
            if wfmt == WFMT_FP4:
                block_k = max(block_k, bk)  # NOTE: a scale block never straddles two K steps
            if wfmt == WFMT_FP8:
                block_k = min(block_k, bk)  # NOTE: one K step lies in one scale column
            grid = (triton.cdiv(num_rows, block_m) + min(num_experts, num_rows), triton.cdiv(n_out, block_n))
            kernel[grid](x, wt, st, sorted_pairs, counts, *extra_args, num_experts, n_out, k_dim, *extra_kw["pre"],
                         x.stride(0), wt.stride(0), wt.stride(1), st.stride(0), st.stride(1), out.stride(0),
                         **extra_kw["const"], E_POW2=triton.next_power_of_2(num_experts), WFMT=wfmt,
                         SCALE_BLOCK=bk, BN_SCALE=bn, SCALE_E8M0=st.dtype == torch.uint8,
                         IEEE_DOT=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         SWAP=bool(swap), num_warps=warps, num_stages=stages)

        idx = x.device.index if x.device.type == "cuda" else -1
        key = (name, idx, _fp8.m_bucket(per_expert), num_experts, n_out, k_dim, wfmt, x.dtype, block)
        launch(config or _fp8.tune_pick(key, moe_gemm_candidates(per_expert, kind), launch, x.device))

    @register_op("moe_up", "triton", in_op_table=False)
    def moe_up_triton(x: torch.Tensor, w13: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor, counts: torch.Tensor,
                      topk: int, limit: float, wfmt: int = WFMT_FLOAT, block=32,
                      config: tuple | None = None) -> torch.Tensor:
        """Step 2 in one launch: act [R, I] = clamped SwiGLU of each sorted pair's token row through its
        expert's w1 | w3 rows (`w13` stacked [E, 2I, ...]). x [T, H] rows contiguous; no host sync."""
        n2 = w13[0].shape[1] if w13[0].dim() == 3 else 0
        check_moe_gemm_args("moe_up_triton", x, w13, sorted_pairs, counts, wfmt, x.shape[1] if x.dim() == 2 else -1, n2,
                            block)
        check_triton_launch("moe_up_triton", x, "x's rows and the expert weights", *w13,
                            block=block[1] if wfmt == WFMT_FP8 else block)
        inter = n2 // 2
        if wfmt == WFMT_FP8 and inter % block[0]:
            raise ValueError(f"moe_up_triton: FP8 gate and up halves must be whole scale blocks: I={inter} is not a "
                             f"multiple of {block[0]}")
        act = torch.empty(sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
        if sorted_pairs.shape[0] and inter:
            _launch_grouped("moe_up", _moe_up_kernel, x, w13, sorted_pairs, counts, act, inter, x.shape[1], wfmt,
                            block, config, (act,), {"pre": (float(limit),), "const": {"TOPK": topk}})
        return act

    @register_op("moe_down", "triton", in_op_table=False)
    def moe_down_triton(act: torch.Tensor, w2: tuple[torch.Tensor, ...], sorted_pairs: torch.Tensor,
                        counts: torch.Tensor, topk_weights: torch.Tensor, wfmt: int = WFMT_FLOAT, block=32,
                        config: tuple | None = None) -> torch.Tensor:
        """Step 3 in one launch: y [R, H] at the pairs' rows = act @ W2_e.T times the pair's routing weight
        (`topk_weights` [T, k], rounded to act's dtype first). act rows contiguous; no host sync."""
        hidden = w2[0].shape[1] if w2[0].dim() == 3 else 0
        check_moe_gemm_args("moe_down_triton", act, w2, sorted_pairs, counts, wfmt,
                            act.shape[1] if act.dim() == 2 else -1, hidden, block)
        check_triton_launch("moe_down_triton", act, "act's rows and the expert weights", *w2,
                            block=block[1] if wfmt == WFMT_FP8 else block)
        if topk_weights.numel() != sorted_pairs.shape[0] or not topk_weights.is_contiguous():
            raise ValueError(f"moe_down_triton: topk_weights must be contiguous with one weight per pair "
                             f"({sorted_pairs.shape[0]}), got {list(topk_weights.shape)}")
        y = torch.empty(sorted_pairs.shape[0], hidden, dtype=act.dtype, device=act.device)
        if sorted_pairs.shape[0] and hidden:
            _launch_grouped("moe_down", _moe_down_kernel, act, w2, sorted_pairs, counts, y, hidden, act.shape[1],
                            wfmt, block, config, (topk_weights, y), {"pre": (), "const": {}})
        return y

    @register_op("moe_combine", "triton", in_op_table=False)
    def moe_combine_triton(y: torch.Tensor, topk_ids: torch.Tensor, rows: torch.Tensor | None = None,
                           weights: torch.Tensor | None = None) -> torch.Tensor:
        """Step 4 in one launch: out [T, H], each token's k rows of y (`y` [T*k, H] contiguous; pair p's row is
        `rows[p]`, p itself when None) times `weights` [T, k] when given (the product rounded to y's dtype),
        added in ascending expert id, rounding to y's dtype after each add; deterministic, no atomics."""
        if topk_ids.dim() != 2 or y.dim() != 2 or y.shape[0] != topk_ids.numel():
            raise ValueError(f"moe_combine_triton: y must be [T*k, H] for topk_ids [T, k], got {list(y.shape)} and "
                             f"{list(topk_ids.shape)}")
        if not (y.is_contiguous() and topk_ids.is_contiguous()):
            raise ValueError("moe_combine_triton: y and topk_ids must be contiguous (call .contiguous())")
        for name, t in (("rows", rows), ("weights", weights)):
            if t is not None and (t.numel() != y.shape[0] or not t.is_contiguous() or t.device != y.device):
                raise ValueError(f"moe_combine_triton: {name} must be contiguous with one entry per pair "
                                 f"({y.shape[0]}) on {y.device}, got {list(t.shape)} on {t.device}")
        if rows is not None and rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"moe_combine_triton: rows must be int32 or int64, got {rows.dtype}")
        check_triton_launch("moe_combine_triton", y, "y", block=2)
        num_tokens, k = topk_ids.shape
        out = torch.empty(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
        if num_tokens and y.shape[1]:
            block_n = min(1024, triton.next_power_of_2(y.shape[1]))
            _moe_combine_kernel[(num_tokens, triton.cdiv(y.shape[1], block_n))](
                y, topk_ids, out, topk_ids if rows is None else rows, y if weights is None else weights, y.shape[1],
                TOPK=k, K_POW2=triton.next_power_of_2(k), BLOCK_N=block_n, HAS_ROWS=rows is not None,
                HAS_W=weights is not None, num_warps=4)
        return out
