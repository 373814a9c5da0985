"""DeepSeek-V4.1's static decode rows: the paged step's decode rows in the form a CUDA graph captures (docs/V4_1.md §16).

With `DeepseekV41ForCausalLM.static_decode` (set by the engine's `ModelRunner` when it runs graphs) the step metadata's
decode rows are V4's static `DecodeRows` (`is_static`), and `deepseek_v41.PagedAttention` runs them through
`StaticDecodeMixin._decode_static`, the model's Engram history through `engram_grams_static`: shapes come from the
batch size and the cache geometry only and every decision is taken on the device, so a pure-decode step is captured and
replayed as a CUDA graph (`engine.cuda_graph.CudaGraphRunner`):

* every request's block table is padded to `cache.max_blocks_per_seq` (C = that many blocks' entries per row, masked
  by position);
* a KV source updates its buffer and emits the group its token completes under a mask (`_write_rows`);
* an index source scores all C index keys (causal visibility and the candidate mask as masks), and attention gathers
  the `index_topk` selected entries of the row;
* padding rows (`cache.dummy_slot`, a table of `cache.dummy_block`, position 0; ids one past the pools, which own no
  memory for them) read clamped rows, are masked out and write nothing a real row reads.

The host-decided rows (the default) stay in `deepseek_v41` (`PagedAttention._decode_compressed` /
`_decode_attend`); both kinds of rows share the attention math (`attend_decode_rows`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from deepinfer.engine.models.deepseek_v4 import apply_rope

if TYPE_CHECKING:
    from deepinfer.engine.models.deepseek_v41 import Attention


def attend_decode_rows(q, keys, valid, sink, extra) -> torch.Tensor:
    """Decode rows' attention -> [B, NH, D] float32: queries q [B, NH, D] over their window keys [B, W, D] (ring rows,
    the rows' own keys already written) masked by valid [B, W], the selected entries `extra` ((entries [B, K, D],
    mask [B, K]) or None) and the per-head sink. The host-decided rows' math (`PagedAttention._decode_attend`) and the
    static rows' (`StaticDecodeMixin._decode_static`)."""
    keys = keys.float()
    W, scale = keys.shape[1], q.shape[-1]**-0.5
    parts = [(torch.einsum("bhd,bwd->bhw", q, keys) * scale).masked_fill(~valid[:, None, :], float("-inf"))]
    if extra is not None:
        entries, mask = extra
        entries = entries.float()
        parts.append((torch.einsum("bhd,bcd->bhc", q, entries) * scale).masked_fill(~mask[:, None, :],
                                                                                    float("-inf")))
    parts.append(sink.view(1, -1, 1).expand(q.shape[0], -1, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite (padding rows too)
    o = torch.einsum("bhw,bwd->bhd", probs[..., :W], keys)
    if extra is not None:
        o = o + torch.einsum("bhc,bcd->bhd", probs[..., W:W + entries.shape[1]], entries)
    return o


class StaticDecodeMixin:
    """`deepseek_v41.PagedAttention`'s static decode rows (this module's docstring).

    The host class provides the step's published state and hooks: `selection` / `candidates` (per group; the static
    rows publish under "decode"), `selection_topk`, `_index_scores`, and two per-step caches cleared by its `reset`:
    `_static_rows` (`_static_index`) and `_picked` (a selection's gathered entry rows).
    """

    def _decode_static(self, attn: Attention, layer: int, r: int, x, qr, q, kv, cos, sin, sink, dm, cache,
                       pools) -> torch.Tensor:
        """Static decode rows [B] of one layer: the window ring write, the compressed branch (`_static_compressed`) and
        the attention over the ring + the selected entries + the sink -> [B, NH, D] float32."""
        ring = cache.window_kv[layer]  # [slots, W, D]
        S, W = ring.shape[0], attn.window
        _ring_write(ring, dm.slots, dm.pos, kv)  # padding slots (>= S) write nothing
        extra = self._static_compressed(attn, r, x, qr, cos, sin, dm, cache, pools) if r else None
        keys = ring[dm.slots.clamp(max=S - 1)]  # [B, W, D]: a padding row reads a clamped slot, all masked
        valid = dm.window_valid[W] & (dm.slots < S)[:, None]
        return attend_decode_rows(q, keys, valid, sink, extra)

    def _static_index(self, dm, r: int, num_blocks: int, epb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat pool rows [B, C], visible [B, C]) of entries 0 .. C - 1 (C = the padded table's blocks x `epb`) of
        every row at ratio `r`: entry c is visible once its group ended at or before the row's token and its block is
        real (a padding row's tables are `dummy_block`: nothing). Built once per step and ratio (the layers share it)."""
        key = (id(dm), r)
        hit = self._static_rows.get(key)
        if hit is not None and hit[0] is dm:
            return hit[1], hit[2]
        C = dm.block_tables.shape[1] * epb
        c = torch.arange(C, device=dm.pos.device)
        blk = dm.block_tables[:, c // epb]  # [B, C]
        visible = (c[None, :] < ((dm.pos + 1) // r)[:, None]) & (blk < num_blocks)
        rows = torch.where(visible, blk * epb + c % epb, torch.zeros_like(blk))
        self._static_rows[key] = (dm, rows, visible)
        return rows, visible

    def _static_compressed(self, attn: Attention, r: int, x, qr, cos, sin, dm, cache, pools):
        """Static decode rows' compressed branch: a KV source buffers its token's projections and emits the group it
        completes (masked: rows whose token ends no group, ends a frozen one or is padding write nothing); an index
        source scores the C visible index keys and publishes its selection (the candidate source its block mask) as
        [B, C] masks; every compressed layer gathers the selection's entries: (entries [B, K, D], valid [B, K]) with
        K = min(index_topk, C), or None when no selection was published for the decode rows."""
        entries, keys_pool, row = pools
        N, epb = entries.shape[0], entries.shape[1]
        if attn.compressor is not None:
            ring_kv = cache.tensors[f"comp_kv_r{r}"][row]  # [slots, r, D]
            S = ring_kv.shape[0]
            kvp, gp = attn.compressor.project(x)
            _ring_write(ring_kv, dm.slots, dm.pos, kvp)
            ring_gate = None
            if gp is not None:
                ring_gate = cache.tensors[f"comp_gate_r{r}"][row]
                _ring_write(ring_gate, dm.slots, dm.pos, gp)
            w = (dm.pos + 1) // r - 1  # the group the row's token would complete (-1: none yet)
            wc = w.clamp(min=0)
            blk = dm.block_tables.gather(1, (wc // epb).clamp(max=dm.block_tables.shape[1] - 1)[:, None])[:, 0]
            done = ((dm.pos + 1) % r == 0) & (w >= dm.frozen // r) & (dm.slots < S) & (blk < N)
            s = dm.slots.clamp(max=S - 1)
            # NOTE: no overlap: the group's tokens are the slot's whole buffer, rows 0 .. r - 1 in position order
            latent = attn.compressor.pool(ring_kv[s], None if ring_gate is None else ring_gate[s])  # [B, D]
            ecos, esin = dm.entry_rope[r]
            _write_rows(entries.view(-1, entries.shape[-1]), blk * epb + wc % epb,
                        apply_rope(latent, ecos, esin), done)
            keys = attn.indexer.index_keys(latent.to(attn.indexer.wk.weight.dtype), ecos, esin)
            _write_rows(keys_pool.view(-1, keys_pool.shape[-1]), blk * epb + wc % epb, keys, done)
        rows, visible = self._static_index(dm, r, N, epb)
        C = rows.shape[1]
        if attn.indexer is not None:
            keys = keys_pool.view(-1, keys_pool.shape[-1])[rows]  # [B, C, ID]
            scores = self._index_scores(attn.indexer, x, qr, keys, cos, sin)
            cand = self.candidates.get("decode")
            sel, published = attn.indexer.select(scores, visible, (dm.pos + 1) // r,
                                                 None if cand is None else _fit_width(cand, C))
            self.selection["decode"] = sel
            self.selection_topk = attn.indexer.topk
            if attn.indexer.is_candidate_source:
                self.candidates["decode"] = published
        sel = self.selection.get("decode")
        if sel is None:  # a mixed step's decode rows after the decoder-replay cut with nothing visible
            return None
        picked = self._picked.get(id(sel))
        if picked is None or picked[0] is not sel or picked[1].shape[1] != C:
            mask = _fit_width(sel, C)
            K = min(self.selection_topk or C, C)
            if K < C:  # the (at most K) selected entries, in entry order (a stable sort puts them first)
                order = torch.sort(mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :K]
                picked = (sel, rows.gather(1, order), mask.gather(1, order))
            else:
                picked = (sel, rows, mask)
            self._picked[id(sel)] = picked
        return entries.view(-1, entries.shape[-1])[picked[1]], picked[2]


def engram_grams_static(dm, ids: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
    """Static decode rows' grams [B, m1 + 1] (tokens at t, t-1, .., t-m1; -1: none) from their slots' rings, read
    and written on the device: the history at positions `pos - m1 .. pos - 1` (none before `state_start`, before
    0 or in a padding slot), then the ring rows of `pos - m1 + 1 .. pos` rewritten with that history and the new
    token, as the host-decided path writes them (padding slots write nothing). ids [B] (-1: a dead token)."""
    S, m1 = ring.shape
    ok = dm.slots < S
    s = dm.slots.clamp(max=S - 1)[:, None]
    hp = dm.pos[:, None] - m1 + torch.arange(m1, device=ids.device)[None, :]  # [B, m1]
    hist = torch.where((hp >= dm.state_start[:, None]) & ok[:, None], ring[s, hp % m1], -1)
    ext = torch.cat([hist, ids[:, None]], dim=1)  # positions pos - m1 .. pos
    rows = s * m1 + (hp + 1) % m1  # the ring rows of positions pos - m1 + 1 .. pos
    _write_rows(ring.view(-1, 1), rows.reshape(-1), ext[:, 1:].reshape(-1, 1),
                ok[:, None].expand(-1, m1).reshape(-1))
    return ext.flip(1)


def _fit_width(mask: torch.Tensor, C: int) -> torch.Tensor:
    """A [B, C'] entry mask as [B, C]: cut, or padded with False (host shapes only; a pure decode step's are C)."""
    if mask.shape[1] == C:
        return mask
    if mask.shape[1] > C:
        return mask[:, :C]
    return F.pad(mask, (0, C - mask.shape[1]), value=False)


def _ring_write(ring: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, src: torch.Tensor) -> None:
    """`ring[slot, pos % R] = src` for every row whose slot is real ([S, R, width]; padding slots `>= S` write
    nothing): the registered `ring_write` op (one Triton launch on CUDA, `masked_row_write` elsewhere)."""
    op = _RING_WRITE.get(ring.device)
    if op is None:
        from deepinfer.kernels import decode_attention  # noqa: F401  (registers the op)
        from deepinfer.kernels.registry import default_impl, get_op

        op = _RING_WRITE[ring.device] = get_op("ring_write", default_impl("ring_write", ring.device))
    op(ring, slots, pos, src.to(ring.dtype).contiguous())


_RING_WRITE: dict[torch.device, object] = {}
"""The `ring_write` implementation picked per device (once)."""


def _write_rows(flat: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, ok: torch.Tensor) -> None:
    """`flat[rows[b]] = src[b]` where `ok[b]`, decided on the device (no host sync, no data-dependent shape).

    NOTE: `index_put_` keeps an arbitrary one of duplicate indices, so a masked-off row must not even write an old
    value back where a real row writes: every masked-off row repeats the first writing row's write (none writing:
    every row rewrites one row with its current value). The semantics of `kernels.decode_attention.masked_row_write`,
    with the first row taken by a [1]-shaped index instead of a 0-dim tensor (indexing by a 0-dim tensor may read it
    on the host)."""
    first = ok.to(torch.int64).argmax(dim=0, keepdim=True)  # [1]
    target = torch.where(ok, rows, rows.index_select(0, first)).clamp(min=0, max=flat.shape[0] - 1)
    src = src.to(flat.dtype)
    head = torch.where(ok.index_select(0, first)[:, None], src.index_select(0, first),
                       flat.index_select(0, target.index_select(0, first)))  # [1, width]
    flat[target] = torch.where(ok[:, None], src, head)

