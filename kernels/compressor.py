"""The compressors' one-token update for decode rows (CSA main, CSA indexer, HCA).

Module op `"compressor_decode"` (`register_op(..., in_op_table=False)`; the `triton` attention backend
picks it per device):

    compressor_decode(kv [B, width], gate [B, width], buf_kv [S, ring_len, width], buf_gate, ape
                      [rate, width] f32, norm_weight [dim] f32, eps, cos [B, rd/2], sin [B, rd/2], slots [B],
                      pos [B], frozen [B], block_tables [B, MB], pool [N, epb, dim], rate, overlap,
                      entries_out=None) -> done [B] bool

For every row: write its projected token (kv, gate) into ring row `pos % ring_len` of its slot. A row
whose token ends a window, `(pos + 1) % rate == 0`, for window `w = (pos + 1) // rate - 1` not
frozen (`w >= frozen // rate`, a shared entry is read, never rewritten), emits that window's entry
exactly as `Compressor.compress_gathered` (engine/models/deepseek_v4.py) does:

* the tokens: window `w`'s `rate` tokens; with `overlap` (CSA, width = 2 * dim) also window `w - 1`'s,
  whose first `dim` channels join this window's last `dim` channels as `2 * rate` tokens (window -1
  does not exist: its gates are -inf);
* per channel, softmax over the tokens of `gate + ape` (float32), the weighted sum of kv;
* RMSNorm (float32, the norm's weight), then RoPE on the trailing `2 * cos.shape[1]` channels
  (interleaved pairs) at the window's first position (`cos`/`sin`, the caller's);

and writes it to pool row `block_tables[b, w // epb] * epb + w % epb`. Whether a row emits is decided on
the device; rows that do not write nothing. With `entries_out` [B, dim] the entries go there instead of
the pool (the caller transforms them, then `write_entries`; the indexer's reference numerics).
Padding rows (`V4KVCache.dummy_slot` / `dummy_block`) write nothing anywhere.

NOTE: the Triton kernel computes the softmax online over token tiles (a V4-Flash HCA window is 128
tokens x 512 channels, too many for registers at once) and keeps the sums in float32, where the torch
model rounds the softmax weights and products to the cache dtype: bit-equal in float32 up to the
summation order, within bf16 rounding in bf16. One program per row: the ring write, a barrier, then
the (rare: one step in `rate`) entry.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deepinfer.kernels.decode_attention import masked_row_write
from deepinfer.kernels.registry import register_default_impl, register_op
from deepinfer.kernels.rope import apply_rope_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


def _done_rows(pos, frozen, slots, block_tables, num_slots, num_blocks, rate, epb):
    """(done [B] bool, window [B], pool row [B]) of the rows whose token ends a writable window."""
    w = (pos + 1) // rate - 1
    wc = w.clamp(min=0)
    blk = block_tables.gather(1, (wc // epb).clamp(max=block_tables.shape[1] - 1)[:, None])[:, 0]
    done = ((pos + 1) % rate == 0) & (w >= frozen // rate) & (slots < num_slots) & (blk < num_blocks)
    return done, w, blk * epb + wc % epb


def compress_rows_torch(buf_kv, buf_gate, ape, norm_weight, eps, cos, sin, slots, w, rate, overlap):
    """Entries [B, dim] of windows `w` [B] from each row's ring (garbage where w < 0 or the slot is padding)."""
    S, ring_len, width = buf_kv.shape
    dim = width // 2 if overlap else width
    s = slots.clamp(max=S - 1)[:, None]
    cur = (w.clamp(min=0)[:, None] * rate + torch.arange(rate, device=w.device)[None, :])  # [B, r] positions
    prev = (cur - rate).clamp(min=0)
    ck, cg = buf_kv[s, cur % ring_len].float(), buf_gate[s, cur % ring_len].float() + ape
    if overlap:
        pk, pg = buf_kv[s, prev % ring_len].float(), buf_gate[s, prev % ring_len].float() + ape
        pg = torch.where((w > 0)[:, None, None], pg[..., :dim], torch.full_like(pg[..., :dim], float("-inf")))
        kv_all = torch.cat([pk[..., :dim], ck[..., dim:]], dim=1)
        g_all = torch.cat([pg, cg[..., dim:]], dim=1)
    else:
        kv_all, g_all = ck, cg
    e = (kv_all * g_all.softmax(dim=1)).sum(dim=1).to(buf_kv.dtype)
    e = F.rms_norm(e.float(), (dim,), norm_weight, eps).to(buf_kv.dtype)
    return apply_rope_torch(e, cos, sin)


def write_entries_torch(pool, entries, done, rows) -> None:
    """Write `entries[b]` to flat pool row `rows[b]` where `done[b]` (no read or write elsewhere)."""
    masked_row_write(pool.view(-1, pool.shape[-1]), rows, entries, done)


@register_op("compressor_decode", "torch", in_op_table=False)
def compressor_decode_torch(kv, gate, buf_kv, buf_gate, ape, norm_weight, eps, cos, sin, slots, pos, frozen,
                            block_tables, pool, rate, overlap, entries_out=None) -> torch.Tensor:
    """Reference one-token compressor update (see the module docstring) -> done [B] bool."""
    S, ring_len, width = buf_kv.shape
    rows, ok = slots * ring_len + pos % ring_len, slots < S
    masked_row_write(buf_kv.view(-1, width), rows, kv, ok)
    masked_row_write(buf_gate.view(-1, width), rows, gate, ok)
    done, w, rows = _done_rows(pos, frozen, slots, block_tables, S, pool.shape[0], rate, pool.shape[1])
    entries = compress_rows_torch(buf_kv, buf_gate, ape, norm_weight, eps, cos, sin, slots, w, rate, overlap)
    if entries_out is not None:
        entries_out.copy_(entries)
    else:
        write_entries_torch(pool, entries, done, rows)
    return done


@register_op("write_entries", "torch", in_op_table=False)
def write_entries_op_torch(pool, entries, done, pos, block_tables, rate) -> None:
    """Write `entries[b]` to window `(pos + 1) // rate - 1`'s pool row where `done[b]` (after
    `compressor_decode(..., entries_out=...)`)."""
    epb = pool.shape[1]
    w = ((pos + 1) // rate - 1).clamp(min=0)
    blk = block_tables.gather(1, (w // epb).clamp(max=block_tables.shape[1] - 1)[:, None])[:, 0]
    write_entries_torch(pool, entries, done, blk * epb + w % epb)


def _pick(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


register_default_impl("compressor_decode")(_pick)
register_default_impl("write_entries")(_pick)


if triton is not None:

    @triton.jit
    def _compressor_decode_kernel(
        kv_ptr, gate_ptr, buf_kv_ptr, buf_gate_ptr, ape_ptr, normw_ptr, cos_ptr, sin_ptr, slots_ptr, pos_ptr,
        frozen_ptr, bt_ptr, pool_ptr, out_ptr, done_ptr, num_slots, num_blocks, max_blocks, eps,
        DIM: tl.constexpr, WIDTH: tl.constexpr, RATE: tl.constexpr, RING: tl.constexpr, EPB: tl.constexpr,
        HALF_RD: tl.constexpr, OVERLAP: tl.constexpr, TO_POOL: tl.constexpr, NT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        b = tl.program_id(0)
        slot = tl.load(slots_ptr + b)
        pos = tl.load(pos_ptr + b)
        slot_ok = slot < num_slots
        # 1. the ring write (kv and gate of this token)
        cw = tl.arange(0, BLOCK_W)
        for c0 in range(0, WIDTH, BLOCK_W):
            c = c0 + cw
            m = (c < WIDTH) & (slot + 0 * c < num_slots)
            dst = (slot * RING + pos % RING) * WIDTH + c
            tl.store(buf_kv_ptr + dst, tl.load(kv_ptr + b * WIDTH + c, mask=m).to(buf_kv_ptr.dtype.element_ty),
                     mask=m)
            tl.store(buf_gate_ptr + dst,
                     tl.load(gate_ptr + b * WIDTH + c, mask=m).to(buf_gate_ptr.dtype.element_ty), mask=m)
        # 2. does the token end a writable window?
        w = (pos + 1) // RATE - 1
        wc = tl.maximum(w, 0)
        blk = tl.load(bt_ptr + b * max_blocks + wc // EPB)
        done = ((pos + 1) % RATE == 0) & (w >= tl.load(frozen_ptr + b) // RATE) & slot_ok & (blk < num_blocks)
        tl.store(done_ptr + b, done.to(tl.int8))
        if done:
            tl.debug_barrier()  # this program's ring write above is read back below
            d = tl.arange(0, DIM)
            m_i = tl.full([DIM], float("-inf"), tl.float32)
            l_i = tl.zeros([DIM], tl.float32)
            acc = tl.zeros([DIM], tl.float32)
            for t0 in range(0, NT, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)  # token index: [prev window (overlap) |] this window
                if OVERLAP:
                    is_prev = t < RATE
                    tok = tl.where(is_prev, t, t - RATE)  # index inside its window
                    p = tl.where(is_prev, (w - 1) * RATE + tok, w * RATE + tok)
                    p = tl.maximum(p, 0)
                    ch = tl.where(is_prev, 0, DIM)  # first or second half of the width
                    ok = (t < NT) & ((~is_prev) | (w + 0 * t > 0))  # per token: see decode_attention.py
                else:
                    tok = t
                    p = w * RATE + tok
                    ch = 0 * t
                    ok = t < NT
                off = (slot * RING + p % RING) * WIDTH + ch  # [BLOCK_T]
                kvt = tl.load(buf_kv_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                g = tl.load(buf_gate_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
                g += tl.load(ape_ptr + (tok * WIDTH + ch)[:, None] + d[None, :], mask=ok[:, None], other=0.0)
                g = tl.where(ok[:, None], g, float("-inf"))  # [BLOCK_T, DIM]
                m_new = tl.maximum(m_i, tl.max(g, axis=0))
                alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_new))
                e = tl.where(ok[:, None], tl.exp(g - m_new[None, :]), 0.0)
                l_i = l_i * alpha + tl.sum(e, axis=0)
                acc = acc * alpha + tl.sum(e * kvt, axis=0)
                m_i = m_new
            x = (acc / l_i).to(pool_ptr.dtype.element_ty).to(tl.float32)  # the weighted sum, in the cache dtype
            ms = tl.sum(x * x, axis=0) / DIM
            y = x * tl.rsqrt(ms + eps) * tl.load(normw_ptr + d)
            y = y.to(pool_ptr.dtype.element_ty).to(tl.float32)
            # RoPE on the trailing 2 * HALF_RD channels: pairs (2i, 2i + 1)
            ya, yb = tl.split(tl.reshape(y, [DIM // 2, 2]))
            i = tl.arange(0, DIM // 2) - (DIM // 2 - HALF_RD)
            rope = i >= 0
            cs = tl.load(cos_ptr + b * HALF_RD + i, mask=rope, other=1.0)
            sn = tl.load(sin_ptr + b * HALF_RD + i, mask=rope, other=0.0)
            y = tl.reshape(tl.join(ya * cs - yb * sn, yb * cs + ya * sn), [DIM])
            if TO_POOL:
                tl.store(pool_ptr + (blk * EPB + wc % EPB) * DIM + d, y.to(pool_ptr.dtype.element_ty))
            else:
                tl.store(out_ptr + b * DIM + d, y.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _write_entries_kernel(pool_ptr, src_ptr, done_ptr, pos_ptr, bt_ptr, max_blocks, DIM: tl.constexpr,
                              RATE: tl.constexpr, EPB: tl.constexpr):
        b = tl.program_id(0)
        if tl.load(done_ptr + b) != 0:
            w = tl.maximum((tl.load(pos_ptr + b) + 1) // RATE - 1, 0)
            blk = tl.load(bt_ptr + b * max_blocks + w // EPB)
            d = tl.arange(0, DIM)
            v = tl.load(src_ptr + b * DIM + d)
            tl.store(pool_ptr + (blk * EPB + w % EPB) * DIM + d, v.to(pool_ptr.dtype.element_ty))

    def _check(name: str, **tensors) -> None:
        for k, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"{name}: {k} must be contiguous (call .contiguous())")
        first = next(iter(tensors.values()))
        if first.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1), got {first.device}")

    @register_op("compressor_decode", "triton", in_op_table=False)
    def compressor_decode_triton(kv, gate, buf_kv, buf_gate, ape, norm_weight, eps, cos, sin, slots, pos, frozen,
                                 block_tables, pool, rate, overlap, entries_out=None) -> torch.Tensor:
        """Triton one-token compressor update (see the module docstring) -> done [B] bool.

        dim must be a power of two (V4: 512 and 128); ape and the norm weight float32; the index tensors
        int64; everything contiguous; ring and pool in one dtype.
        """
        B, width = kv.shape
        S, ring_len, _ = buf_kv.shape
        dim = width // 2 if overlap else width
        if gate.shape != kv.shape or buf_gate.shape != buf_kv.shape or buf_kv.shape[2] != width:
            raise ValueError(f"compressor_decode: kv/gate [B, width] and rings [S, ring_len, width] expected, got "
                             f"{list(kv.shape)}, {list(gate.shape)}, {list(buf_kv.shape)}, {list(buf_gate.shape)}")
        if ring_len != (2 if overlap else 1) * rate or tuple(ape.shape) != (rate, width):
            raise ValueError(f"compressor_decode: ring_len {ring_len} / ape {list(ape.shape)} do not fit rate {rate}, "
                             f"overlap {overlap}")
        if pool.dim() != 3 or pool.shape[2] != dim or pool.dtype != buf_kv.dtype:
            raise ValueError(f"compressor_decode: pool must be [N, epb, {dim}] in {buf_kv.dtype}, got "
                             f"{pool.dtype} {list(pool.shape)}")
        if dim & (dim - 1) or dim < 16:
            raise ValueError(f"compressor_decode: dim must be a power of two >= 16, got {dim}")
        if ape.dtype != torch.float32 or norm_weight.dtype != torch.float32 or norm_weight.shape != (dim,):
            raise ValueError("compressor_decode: ape and norm_weight must be float32 (norm_weight [dim])")
        half_rd = cos.shape[-1]
        if cos.shape != (B, half_rd) or sin.shape != cos.shape or 2 * half_rd > dim:
            raise ValueError(f"compressor_decode: cos/sin must be [B, rd/2] with rd <= dim, got {list(cos.shape)}")
        for k, t in (("slots", slots), ("pos", pos), ("frozen", frozen), ("block_tables", block_tables)):
            if t.dtype != torch.int64 or t.shape[0] != B:
                raise ValueError(f"compressor_decode: {k} must be int64 with B rows, got {t.dtype} {list(t.shape)}")
        _check("compressor_decode", kv=kv, gate=gate, buf_kv=buf_kv, buf_gate=buf_gate, ape=ape, pool=pool,
               cos=cos, sin=sin, slots=slots, pos=pos, frozen=frozen, block_tables=block_tables)
        if entries_out is not None and (entries_out.shape != (B, dim) or not entries_out.is_contiguous()):
            raise ValueError(f"compressor_decode: entries_out must be contiguous [B, {dim}]")
        done = torch.empty(B, dtype=torch.int8, device=kv.device)
        nt = 2 * rate if overlap else rate  # tokens per entry
        if B:
            _compressor_decode_kernel[(B,)](
                kv, gate, buf_kv, buf_gate, ape, norm_weight, cos.float(), sin.float(), slots, pos, frozen,
                block_tables, pool, entries_out if entries_out is not None else pool, done, S, pool.shape[0],
                block_tables.shape[1], eps, DIM=dim, WIDTH=width, RATE=rate, RING=ring_len, EPB=pool.shape[1],
                HALF_RD=half_rd, OVERLAP=overlap, TO_POOL=entries_out is None, NT=nt,
                BLOCK_T=max(1, min(triton.next_power_of_2(nt), 8192 // dim)),
                BLOCK_W=min(triton.next_power_of_2(width), 1024), num_warps=4 if dim <= 128 else 8,
            )
        return done.bool()

    @register_op("write_entries", "triton", in_op_table=False)
    def write_entries_triton(pool, entries, done, pos, block_tables, rate) -> None:
        """Triton masked entry write (see `write_entries_op_torch`): entries [B, dim], done [B] bool."""
        B, dim = entries.shape
        if pool.dim() != 3 or pool.shape[2] != dim or dim & (dim - 1):
            raise ValueError(f"write_entries: pool [N, epb, {dim}] (dim a power of two) expected, got {list(pool.shape)}")
        _check("write_entries", pool=pool, entries=entries, pos=pos, block_tables=block_tables)
        if B:
            _write_entries_kernel[(B,)](pool, entries, done.to(torch.int8), pos, block_tables, block_tables.shape[1],
                                        DIM=dim, RATE=rate, EPB=pool.shape[1])
