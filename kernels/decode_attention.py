"""DeepSeek-V4 decode attention (one new token per row) over the window ring and the compressed entries.

Module ops (`register_op(..., in_op_table=False)`; the `triton` attention backend picks them per device):

* `"decode_attention"`: `(q [B, NH, D], ring [S, W, D], pool [N, epb, D] | None, slots [B], pos [B],
  state_start [B], block_tables [B, MB], entries [B, K] | None, rate, sink [NH], split_size) -> [B, NH, D]`.
* `"ring_write"`: `(ring [S, R, width], slots [B], pos [B], src [B, width]) -> None`: row `pos % R` of
  each row's slot gets `src[b]` (the window ring's one-token write).
* `"verify_attention"`: `decode_attention`'s arguments plus `new_kv [B, D]` and `queries_per_request` (Q), before
  `split_size` -> [B, NH, D]: speculative verify rows (`verify_attention_torch` says how they differ).
* the batch-invariant mode's rows (`kernels.bi_attention`, op `"bi_rows_attention"`) run the same kernel with each
  row's first new position given per row (`ROW_START`): decode rows and prefill queries alike.

What a row attends to, all decided on the device from its own tensors (no host value per step):

* the window: ring row `j` of its slot holds position `pos - ((pos - j) mod W)`, a key iff that is
  `>= state_start` (the ring must already hold this step's key: `ring_write` first);
* compressed entries through the block table (entry `c` at `block_tables[b, c // epb] * epb + c % epb`):
  all visible ones, `c < (pos + 1) // rate` (HCA: `entries` is None), or the indexer's selection
  `entries[b]` (CSA: entry indices, valid ones first, -1 for none; `kernels.indexer`);
* the per-head sink: `exp(sink[h])` joins the softmax denominator and adds no value.

Logits are `q . k * D**-0.5`; softmax in float32; the output is cast to q's dtype.

Padding rows (CUDA-graph decode): a slot `>= S` (`V4KVCache.dummy_slot`) or a block `>= N`
(`dummy_block`) is never read nor written; such a row attends to the sink only (output 0).

The Triton kernel (flash-decoding): V4 attention is MQA with K = V (one shared head), so a program
loads each key tile once and multiplies it by all its heads at once (`BLOCK_H` heads are the M dim of
`tl.dot`, the same tile is the V operand). NOTE: the default is 32 heads per program, 8 warps, 32-key
tiles: compiled for sm_90a (triton 3.9, ptxas) 64 heads x 512 spill 0.5-1 KiB of registers per thread
(the float32 accumulator alone is 128 registers a thread), 32 heads about 20 bytes; the two head groups
of a row and split are neighbours in the grid, so the second reads the key tiles from L2. A row's keys (window first, then entries) are cut into
splits of a FIXED number of keys (`split_size`, independent of the batch: a row's arithmetic never
depends on its batch, the invariance DESIGN.md §7 asks for). A row with one split finishes in place;
a longer row writes per-split partial results (max, sum, unnormalised output, float32) that a small
reduce kernel combines with the sink. The grid is `(B, splits for the longest possible row, head
groups)`: fixed for a batch size and cache geometry (CUDA graphs), programs past a row's keys exit.
"""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

DEFAULT_SPLIT_SIZE = 512
"""Keys per split: V4-Flash's CSA rows (128 window + 512 selected) take two splits, HCA rows up to
48k tokens one. NOTE: a split's partial output is NH * D float32 (128 KiB at 64 x 512), so small
splits cost more partial traffic than they save in parallelism at large batches."""


# --------------------------------------------------------------------------- torch references


def _window_keys(ring: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, state_start: torch.Tensor):
    """(keys [B, W, D], valid [B, W]) of each row's window ring (padding slots: nothing valid)."""
    S, W = ring.shape[0], ring.shape[1]
    slot_ok = slots < S
    keys = ring[slots.clamp(max=S - 1)]
    j = torch.arange(W, device=ring.device)
    key_pos = pos[:, None] - ((pos[:, None] - j[None, :]) % W)
    return keys, (key_pos >= state_start[:, None]) & slot_ok[:, None]


def gather_entries(pool: torch.Tensor, block_tables: torch.Tensor, entries: torch.Tensor, valid: torch.Tensor):
    """Rows of `pool` [N, epb, width] for entry indices `entries` [B, C] (through the block tables) ->
    (values [B, C, width], valid [B, C]); invalid, -1 or padding-block entries read nothing useful."""
    N, epb = pool.shape[0], pool.shape[1]
    c = entries.clamp(min=0)
    blk = block_tables.gather(1, (c // epb).clamp(max=block_tables.shape[1] - 1))
    valid = valid & (entries >= 0) & (blk < N)
    rows = torch.where(valid, blk * epb + c % epb, torch.zeros_like(blk))
    return pool.reshape(N * epb, -1)[rows], valid


def decode_attention_torch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink,
                           split_size=DEFAULT_SPLIT_SIZE) -> torch.Tensor:
    """Reference decode attention (see the module docstring); float32 arithmetic, any device.
    `split_size` is accepted for a common signature and changes nothing here."""
    keys, valid = _window_keys(ring, slots, pos, state_start)
    return _attend_rows(q, keys, valid, pool, pos, block_tables, entries, rate, sink)


def _attend_rows(q, keys, valid, pool, pos, block_tables, entries, rate, sink) -> torch.Tensor:
    """Rows' window keys [B, W, D] (valid [B, W]) plus their compressed entries and the sink, float32 arithmetic."""
    B, NH, D = q.shape
    if pool is not None:
        epb = pool.shape[1]
        if entries is None:
            c = torch.arange(block_tables.shape[1] * epb, device=q.device)[None, :].expand(B, -1)
            vis = c < ((pos + 1) // rate)[:, None]
        else:
            c, vis = entries, entries >= 0
        ck, cv = gather_entries(pool, block_tables, c, vis)
        keys, valid = torch.cat([keys, ck], dim=1), torch.cat([valid, cv], dim=1)
    kf = keys.float()
    logits = torch.einsum("bhd,bnd->bhn", q.float(), kf) * D**-0.5
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    logits = torch.cat([logits, sink.float().view(1, NH, 1).expand(B, -1, -1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return torch.einsum("bhn,bnd->bhd", probs, kf).to(q.dtype)


def _verify_window_keys(ring, slots, pos, state_start, new_kv, queries_per_request):
    """`_window_keys` of verify rows: window keys at positions `>= pos - b % Q` (the step's own) come from
    `new_kv` rows (row `b - (pos - key_pos)`), the older ones from the ring (which has not been written yet)."""
    keys, valid = _window_keys(ring, slots, pos, state_start)
    B, W = keys.shape[0], keys.shape[1]
    j = torch.arange(W, device=ring.device)
    key_pos = pos[:, None] - ((pos[:, None] - j[None, :]) % W)  # [B, W]
    b = torch.arange(B, device=ring.device)[:, None]
    is_new = key_pos >= (pos[:, None] - b % queries_per_request)
    src = (b - (pos[:, None] - key_pos)).clamp(0, max(B - 1, 0))
    return torch.where(is_new[..., None], new_kv[src].to(keys.dtype), keys), valid


def verify_attention_torch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv,
                           queries_per_request, split_size=DEFAULT_SPLIT_SIZE) -> torch.Tensor:
    """Reference verify attention: `decode_attention` over rows that are the queries of speculative verify chunks.

    Rows come in groups of Q = `queries_per_request` (request b's query i is row `b * Q + i`, at position
    `pos[row] = p_b + i`); `new_kv [B, D]` holds every row's own key in the same layout. The window ring still
    holds the positions before the step (`p_b - W .. p_b - 1`: the step's keys are written after attention, since
    row i's oldest window keys share ring rows with the step's later keys), so a row's window keys at positions
    `>= p_b` come from `new_kv` (the key of position `p_b + t` is row `b * Q + t`), the older ones from the ring.
    Compressed entries and the sink are `decode_attention`'s (the entries the step completes must already be in the
    pool). Padding queries are padding rows (dummy slot, position 0: the sink alone)."""
    keys, valid = _verify_window_keys(ring, slots, pos, state_start, new_kv, queries_per_request)
    return _attend_rows(q, keys, valid, pool, pos, block_tables, entries, rate, sink)


def masked_row_write(flat: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, ok: torch.Tensor) -> None:
    """`flat[rows[b]] = src[b]` where `ok[b]`, without a host sync and without touching other rows.

    NOTE: a masked-off row must not write anything (not even an old value back: index_put with duplicate
    indices keeps an arbitrary one), so it repeats the first valid row's write, or, with none valid,
    every row rewrites one row with its own value.
    """
    first = ok.long().argmax()
    target = torch.where(ok, rows, rows[first]).clamp(min=0, max=flat.shape[0] - 1)
    keep = flat[target[first]]
    value = torch.where(ok[:, None], src.to(flat.dtype), torch.where(ok[first], src[first].to(flat.dtype), keep))
    flat[target] = value


def ring_write_torch(ring: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
    """Reference one-token ring write: `ring[slot, pos % R] = src[b]` for every row with a real slot."""
    S, R = ring.shape[0], ring.shape[1]
    masked_row_write(ring.view(S * R, -1), slots * R + pos % R, src, slots < S)


register_op("decode_attention", "torch", in_op_table=False)(decode_attention_torch)
register_op("verify_attention", "torch", in_op_table=False)(verify_attention_torch)
register_op("ring_write", "torch", in_op_table=False)(ring_write_torch)


def _pick(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


register_default_impl("decode_attention")(_pick)
register_default_impl("verify_attention")(_pick)
register_default_impl("ring_write")(_pick)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def _check_index(name: str, what: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype != torch.int64 or tuple(t.shape) != shape or not t.is_contiguous():
        raise ValueError(f"{name}: {what} must be a contiguous int64 tensor of shape {list(shape)}, "
                         f"got {t.dtype} {list(t.shape)}")


def _check_decode_args(op, q, ring, pool, slots, pos, state_start, block_tables, entries, sink) -> None:
    """The shape, dtype and contiguity checks of `decode_attention` / `verify_attention` (`op`: the op's name)."""
    if q.dim() != 3 or ring.dim() != 3 or ring.shape[2] != q.shape[2]:
        raise ValueError(f"{op}: q [B, NH, D] and ring [S, W, D] expected, got {list(q.shape)} and {list(ring.shape)}")
    B, NH, D = q.shape
    for name, t in (("q", q), ("ring", ring)) + ((("pool", pool),) if pool is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous (call .contiguous())")
        if t.dtype != q.dtype:
            raise ValueError(f"{op}: {name} is {t.dtype}, q is {q.dtype} (one dtype)")
    if pool is not None and (pool.dim() != 3 or pool.shape[2] != D):
        raise ValueError(f"{op}: pool must be [N, epb, {D}], got {list(pool.shape)}")
    if sink.shape != (NH,) or sink.dtype != torch.float32:
        raise ValueError(f"{op}: sink must be float32 [{NH}], got {sink.dtype} {list(sink.shape)}")
    for name, t in (("slots", slots), ("pos", pos), ("state_start", state_start)):
        _check_index(op, name, t, (B,))
    MB = block_tables.shape[1] if block_tables.dim() == 2 else -1
    _check_index(op, "block_tables", block_tables, (B, MB))
    if entries is not None:
        if pool is None:
            raise ValueError(f"{op}: entries without a pool")
        _check_index(op, "entries", entries, (B, entries.shape[-1]))


# --------------------------------------------------------------------------- Triton


if triton is not None:

    @triton.jit
    def online_softmax_step(q, k, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr, ACC_IN_DOT: tl.constexpr = False):
        """One key tile of the online softmax: k [BLOCK_N, BLOCK_D] is both K and V (shared with the prefill kernels).
        ACC_IN_DOT (the prefill "m64" kernel): the accumulator is rescaled, then handed to the P @ V dot as its
        accumulator, so no second [BLOCK_H, BLOCK_D] float32 tile (a fresh dot result) is live beside it."""
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if ACC_IN_DOT:
            acc = acc * alpha[:, None]
            if IEEE:
                acc = tl.dot(p.to(k.dtype), k, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(k.dtype), k, acc)
            return m_new, l_i, acc
        if IEEE:
            pv = tl.dot(p.to(k.dtype), k, input_precision="ieee")
        else:
            pv = tl.dot(p.to(k.dtype), k)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _num_keys(pos, W: tl.constexpr, RATE: tl.constexpr, HAS_POOL: tl.constexpr, SPARSE: tl.constexpr,
                  K):
        """Keys of a row: the window, plus the visible (HCA) or selected (CSA, valid first) entries."""
        n = W + 0 * pos
        if HAS_POOL:
            vis = (pos + 1) // RATE
            if SPARSE:
                n += tl.minimum(vis, K)
            else:
                n += vis
        return n

    @triton.jit(do_not_specialize=["new_off"])
    def _decode_attn_kernel(
        q_ptr, ring_ptr, pool_ptr, slots_ptr, pos_ptr, start_ptr, bt_ptr, idx_ptr, sink_ptr, new_ptr,
        out_ptr, part_o_ptr, part_ml_ptr, nstart_ptr,
        num_slots, num_blocks, max_blocks, K, NH, NQ, scale, new_off,
        D: tl.constexpr, W: tl.constexpr, RATE: tl.constexpr, EPB: tl.constexpr, HAS_POOL: tl.constexpr,
        SPARSE: tl.constexpr, SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, VERIFY: tl.constexpr,
        ROW_START: tl.constexpr,
    ):
        # VERIFY: rows are verify queries, NQ per request (`verify_attention_torch`): window keys of the step's own
        # positions (>= pos - b % NQ) are read from new_ptr [B, D] (row b - (pos - key_pos)), older ones from the ring.
        # ROW_START (with VERIFY): the first such position is the row's own nstart_ptr[b] instead, and the key of
        # position p is new_ptr row new_off + b - (pos - p) (rows of prefill chunks of any lengths, launched in
        # slices: `kernels.bi_attention`)
        hg = tl.program_id(0)  # head groups of one (row, split) run side by side: the key tile is read from HBM
        s = tl.program_id(1)  # once and from L2 by the others
        b = tl.program_id(2)
        pos = tl.load(pos_ptr + b)
        n_keys = _num_keys(pos, W, RATE, HAS_POOL, SPARSE, K)
        lo = s * SPLIT
        if lo < n_keys:
            hi = tl.minimum(lo + SPLIT, n_keys)
            slot = tl.load(slots_ptr + b)
            start_pos = tl.load(start_ptr + b)
            h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            h_ok = h < NH
            d_ok = d < D
            q = tl.load(q_ptr + (b * NH + h[:, None]) * D + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                        other=0.0)  # [BLOCK_H, BLOCK_D]
            m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: an all-masked tile gives p = 0, not NaN
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for k0 in range(lo, hi, BLOCK_N):
                i = k0 + tl.arange(0, BLOCK_N)  # virtual key index: window rows, then entries
                in_range = i < hi
                is_win = i < W
                key_pos = pos - ((pos - i + W) % W)
                # NOTE: the slot test is made per key (not a scalar &): the interpreter widens scalar-vector masks
                win_ok = is_win & (key_pos >= start_pos) & (slot + 0 * i < num_slots)
                win_ptrs = ring_ptr + (slot * W + i) * D
                if VERIFY:
                    if ROW_START:
                        is_new = key_pos >= tl.load(nstart_ptr + b)
                    else:
                        is_new = key_pos >= pos - b % NQ
                    win_ptrs = tl.where(is_new, new_ptr + (new_off + b - (pos - key_pos)) * D, win_ptrs)
                if HAS_POOL:
                    ci = i - W
                    comp = in_range & (i >= W)
                    if SPARSE:
                        c = tl.load(idx_ptr + b * K + ci, mask=comp, other=-1)
                    else:
                        c = ci
                    comp = comp & (c >= 0)
                    blk = tl.load(bt_ptr + b * max_blocks + c // EPB, mask=comp, other=num_blocks)
                    comp = comp & (blk < num_blocks)
                    pool_off = (blk * EPB + c % EPB) * D
                    ptrs = tl.where(is_win, win_ptrs, pool_ptr + pool_off)
                    valid = (win_ok | comp) & in_range  # comp is False on window rows
                else:
                    ptrs = win_ptrs
                    valid = win_ok & in_range
                k = tl.load(ptrs[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
                m_i, l_i, acc = online_softmax_step(q, k, valid, m_i, l_i, acc, scale, IEEE)
            if n_keys <= SPLIT:  # the row's only split: add the sink and finish here
                sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
                m = tl.maximum(m_i, sink)
                a = tl.exp(m_i - m)
                tot = l_i * a + tl.exp(sink - m)
                o = acc * (a / tot)[:, None]
                tl.store(out_ptr + (b * NH + h[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=h_ok[:, None] & d_ok[None, :])
            else:
                base = (b * NUM_SPLITS + s) * NH + h
                tl.store(part_o_ptr + base[:, None] * D + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
                tl.store(part_ml_ptr + base * 2, m_i, mask=h_ok)
                tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=h_ok)

    @triton.jit
    def _decode_reduce_kernel(
        pos_ptr, idx_ptr, sink_ptr, out_ptr, part_o_ptr, part_ml_ptr, K, NH,
        D: tl.constexpr, W: tl.constexpr, RATE: tl.constexpr, HAS_POOL: tl.constexpr, SPARSE: tl.constexpr,
        SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0)
        hg = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        n_keys = _num_keys(pos, W, RATE, HAS_POOL, SPARSE, K)
        if n_keys > SPLIT:  # rows of one split were finished by the split kernel
            n_splits = (n_keys + SPLIT - 1) // SPLIT
            h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            h_ok = h < NH
            mask = h_ok[:, None] & (d < D)[None, :]
            sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
            m = sink
            for s in range(0, n_splits):
                m = tl.maximum(m, tl.load(part_ml_ptr + ((b * NUM_SPLITS + s) * NH + h) * 2, mask=h_ok, other=0.0))
            tot = tl.exp(sink - m)
            o = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
            for s in range(0, n_splits):
                base = (b * NUM_SPLITS + s) * NH + h
                a = tl.exp(tl.load(part_ml_ptr + base * 2, mask=h_ok, other=0.0) - m)
                tot += tl.load(part_ml_ptr + base * 2 + 1, mask=h_ok, other=0.0) * a
                o += tl.load(part_o_ptr + base[:, None] * D + d[None, :], mask=mask, other=0.0) * a[:, None]
            o = o / tot[:, None]
            tl.store(out_ptr + (b * NH + h[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _ring_write_kernel(ring_ptr, slots_ptr, pos_ptr, src_ptr, num_slots, R, WIDTH: tl.constexpr,
                           BLOCK: tl.constexpr):
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b)
        if slot < num_slots:
            row = tl.load(pos_ptr + b) % R
            for c0 in range(0, WIDTH, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                v = tl.load(src_ptr + b * WIDTH + c, mask=c < WIDTH)
                tl.store(ring_ptr + (slot * R + row) * WIDTH + c, v.to(ring_ptr.dtype.element_ty), mask=c < WIDTH)

    @register_op("ring_write", "triton", in_op_table=False)
    def ring_write_triton(ring: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
        """Triton one-token ring write (see `ring_write_torch`): ring [S, R, width] contiguous, src [B, width]."""
        B = src.shape[0]
        if ring.dim() != 3 or src.dim() != 2 or src.shape[1] != ring.shape[2]:
            raise ValueError(f"ring_write: ring [S, R, width] and src [B, width] expected, got {list(ring.shape)} "
                             f"and {list(src.shape)}")
        if not ring.is_contiguous() or not src.is_contiguous():
            raise ValueError("ring_write: ring and src must be contiguous (call .contiguous())")
        _check_index("ring_write", "slots", slots, (B,))
        _check_index("ring_write", "pos", pos, (B,))
        _check_device("ring_write", ring)
        if B:
            width = ring.shape[2]
            _ring_write_kernel[(B,)](ring, slots, pos, src, ring.shape[0], ring.shape[1], WIDTH=width,
                                     BLOCK=min(triton.next_power_of_2(width), 1024))

    @register_op("decode_attention", "triton", in_op_table=False)
    def decode_attention_triton(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink,
                                split_size=DEFAULT_SPLIT_SIZE, block_h: int = 32, block_n: int | None = None,
                                num_warps: int | None = None) -> torch.Tensor:
        """Triton decode attention (see the module docstring) -> [B, NH, D] in q's dtype.

        q [B, NH, D], ring [S, W, D] and pool [N, epb, D] share q's dtype and are contiguous; the index
        tensors are int64 (entries [B, K], valid first, -1 padded; None for HCA and sliding layers);
        sink [NH] float32. `split_size`: keys per split, a multiple of `block_n` (fixed per deployment: a
        row's result does not depend on its batch). `block_h`: heads per program (the dot's M dim);
        `block_n`: keys per tile (default `min(32, split_size)`).
        """
        _check_decode_args("decode_attention", q, ring, pool, slots, pos, state_start, block_tables, entries, sink)
        return _launch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, None, 1, split_size,
                       block_h, block_n, num_warps)

    @register_op("verify_attention", "triton", in_op_table=False)
    def verify_attention_triton(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv,
                                queries_per_request, split_size=DEFAULT_SPLIT_SIZE, block_h: int = 32,
                                block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
        """Triton verify attention (`verify_attention_torch`; the decode kernel with its window reads switched
        to `new_kv` for the step's own positions) -> [B, NH, D] in q's dtype. new_kv [B, D] in q's dtype,
        contiguous; B a multiple of `queries_per_request`. The other arguments as `decode_attention_triton`."""
        _check_decode_args("verify_attention", q, ring, pool, slots, pos, state_start, block_tables, entries, sink)
        B, D = q.shape[0], q.shape[2]
        if tuple(new_kv.shape) != (B, D) or new_kv.dtype != q.dtype or not new_kv.is_contiguous():
            raise ValueError(f"verify_attention: new_kv must be a contiguous {q.dtype} [{B}, {D}] tensor, got "
                             f"{new_kv.dtype} {list(new_kv.shape)}")
        Q = int(queries_per_request)
        if Q < 1 or B % Q:
            raise ValueError(f"verify_attention: {B} rows are not a multiple of queries_per_request={Q}")
        return _launch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv, Q,
                       split_size, block_h, block_n, num_warps)

    def _launch(q, ring, pool, slots, pos, state_start, block_tables, entries, rate, sink, new_kv, nq, split_size,
                block_h, block_n, num_warps, new_start=None, new_off=0) -> torch.Tensor:
        """The split kernel (+ the reduce kernel for rows of several splits) over checked arguments.
        `new_start` [B] int64 (with `new_kv`): each row's first position read from `new_kv` (`ROW_START`), whose row
        `new_off + b` is row b's own key."""
        B, NH, D = q.shape
        S, W = ring.shape[0], ring.shape[1]
        MB = block_tables.shape[1]
        block_n = block_n or min(32, split_size)
        if split_size % block_n or block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"decode_attention: split_size ({split_size}) must be a multiple of block_n "
                             f"({block_n}), a power of two >= 16")
        _check_device("decode_attention", q)
        out = torch.empty_like(q)
        if B == 0:
            return out
        has_pool, sparse = pool is not None, entries is not None
        K = entries.shape[1] if sparse else 0
        epb = pool.shape[1] if has_pool else 1
        max_comp = (K if sparse else MB * epb) if has_pool else 0
        num_splits = triton.cdiv(W + max_comp, split_size)
        BLOCK_H = max(16, min(block_h, triton.next_power_of_2(NH)))
        BLOCK_D = max(16, triton.next_power_of_2(D))
        part_o = q.new_empty((B, num_splits, NH, D), dtype=torch.float32) if num_splits > 1 else out
        part_ml = q.new_empty((B, num_splits, NH, 2), dtype=torch.float32) if num_splits > 1 else out
        ieee = q.dtype == torch.float32
        warps = num_warps or (8 if BLOCK_H * BLOCK_D >= 32 * 512 else 4)
        pool_t = pool if has_pool else ring
        idx = entries if sparse else slots
        grid = (triton.cdiv(NH, BLOCK_H), num_splits, B)
        _decode_attn_kernel[grid](
            q, ring, pool_t, slots, pos, state_start, block_tables, idx, sink, ring if new_kv is None else new_kv, out,
            part_o, part_ml, slots if new_start is None else new_start, S, pool.shape[0] if has_pool else 0, MB, K,
            NH, nq, D**-0.5, new_off, D=D, W=W, RATE=rate if has_pool else 1, EPB=epb, HAS_POOL=has_pool, SPARSE=sparse,
            SPLIT=split_size, NUM_SPLITS=num_splits, BLOCK_N=block_n, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, IEEE=ieee,
            VERIFY=new_kv is not None, ROW_START=new_start is not None, num_warps=warps, num_stages=2,
        )
        if num_splits > 1:
            BLOCK_HR = min(BLOCK_H, 16)
            _decode_reduce_kernel[(B, triton.cdiv(NH, BLOCK_HR))](
                pos, idx, sink, out, part_o, part_ml, K, NH, D=D, W=W, RATE=rate if has_pool else 1,
                HAS_POOL=has_pool, SPARSE=sparse, SPLIT=split_size, NUM_SPLITS=num_splits, BLOCK_H=BLOCK_HR,
                BLOCK_D=BLOCK_D, num_warps=4,
            )
        return out
