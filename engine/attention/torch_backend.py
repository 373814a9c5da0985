"""The `torch` attention backend: plain PyTorch, the readable reference and the oracle for kernels.

Per layer and step:

* decode rows (one new token each) run as one batch: write the key into the window ring, advance
  the compressors by one token (every row computes the entry its window would complete; only rows
  whose window ended write it), gather the visible compressed entries, select with the indexer
  (CSA), and attend over window + entries + the per-head sink;
* each prefill chunk runs alone: compress the windows the chunk completes (from the ring's buffered
  tokens plus the chunk's), write them, then attend over the window (an `unfold` view per query)
  plus the selected entries, and write the chunk's last keys into the ring;
* verify rows (speculative decoding, `AttentionMetadata.verify`: `1 + L` tokens per request) run as one
  batch padded to the longest: the compressors, the indexer, the window gather and the attention core
  each once for all their queries (`_verify_batched`), in the per-chunk path's order of operations. The
  same code reads the static form (`verify_rows.static_verify_metadata`, CUDA graphs of verify steps):
  no host value decided per step, no boolean compaction, padding writes mirroring real ones.

NOTE: the arithmetic order is the model's reference; a kernel backend is tested against this one.
"""

from __future__ import annotations

import torch

from deepinfer.engine.attention.base import (
    AttentionBackend,
    AttentionInputs,
    AttentionMetadata,
    DecodeCompressorRows,
    DecodeRows,
    LayerSpec,
    PrefillChunk,
    register_attention_backend,
)
from deepinfer.engine.cache.kv_cache import V4KVCache

LOGITS_BLOCK_BYTES = 1 << 30
"""A prefill chunk's queries are attended in blocks whose float32 logits (queries x heads x keys) stay under this
(`_attend_one`): a 4,096-token chunk over 32k compressed entries and 64 heads would otherwise need 32 GiB at once."""


def _pools(spec: LayerSpec, cache: V4KVCache):
    """(main pool [blocks, epb, D], main ring kv, main ring gate, index pool, index ring kv, index ring gate)
    of the layer; slots are dim 0 of the rings; the index ones are None outside CSA layers."""
    j = spec.kind_index
    if spec.kind == "csa":
        return (cache.csa_entries[j], cache.csa_buf_kv[j], cache.csa_buf_gate[j],
                cache.index_entries[j], cache.index_buf_kv[j], cache.index_buf_gate[j])
    return cache.hca_entries[j], cache.hca_buf_kv[j], cache.hca_buf_gate[j], None, None, None


@register_attention_backend("torch")
class TorchAttentionBackend(AttentionBackend):
    """Today's math in plain torch ops (CPU and GPU alike)."""

    def forward(self, spec: LayerSpec, inputs: AttentionInputs, cache: V4KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        dm = meta.decode
        out = None if meta.is_pure_decode else torch.empty_like(inputs.q)  # a pure decode step fills none
        if dm is not None:
            # a pure decode step (every row is a decode row, in order): no gather / scatter copies
            r = slice(None) if meta.is_pure_decode else dm.rows
            o = self._decode_batched(spec, dm, inputs, r, cache)
            if meta.is_pure_decode:
                out = o
            else:
                out[r] = o
        for chunk in meta.prefill:
            sl = chunk.rows
            extra = self._compressed(spec, chunk, inputs, sl, cache, meta) if spec.is_compressed else None
            out[sl] = self._attend_one(spec, chunk, inputs.q[sl], inputs.kv[sl], inputs.sink, cache, extra)
        if meta.verify is not None:
            vr = meta.verify
            out[vr.flat_rows] = self._verify_batched(spec, vr, inputs, cache, meta)
        return out

    # -- verify rows (speculative decoding: 1 + L tokens per request), batched ------------------------

    supports_verify_rows = True
    """Reads `AttentionMetadata.verify` (`engine.spec_decode.verify_rows`)."""

    def _verify_batched(self, spec: LayerSpec, vr, inputs: AttentionInputs, cache: V4KVCache,
                        meta: AttentionMetadata) -> torch.Tensor:
        """All verify chunks at once, as `_attend_one` computes each: query i of request b (position
        p_b + i) sees the window keys p_b + i - W + 1 .. p_b + i and its (selected) compressed entries.
        The compressors, the indexer, the window gather, the logits, the softmax and the weighted sums
        each run once over all [B, N] queries. Returns [T, NH, D] in `vr.flat_rows` order."""
        extras = self._verify_compressed(spec, vr, inputs, cache, meta) if spec.is_compressed else None
        W = spec.window
        geo = vr.windows[W]
        q, kv = inputs.q[vr.token_index], inputs.kv[vr.token_index]  # [B, N, NH, D], [B, N, D]
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        hist = ring[vr.slots[:, None], geo.hist_rows].to(kv.dtype)  # [B, W - 1, D]
        hist = torch.where(geo.hist_alive[..., None], hist, torch.zeros((), dtype=hist.dtype, device=hist.device))
        keys = torch.cat([hist, kv], dim=1)  # [B, W - 1 + N, D]
        windows = keys.unfold(1, W, 1)  # [B, N, D, W]: query i's window
        scale = q.shape[-1]**-0.5
        logits = torch.einsum("bnhd,bndw->bnhw", q, windows) * scale
        parts = [logits.masked_fill(~geo.allowed[:, :, None, :], float("-inf"))]
        if extras is not None:
            entries, mask = extras
            cl = torch.einsum("bnhd,bcd->bnhc", q, entries) * scale
            parts.append(cl.masked_fill(~mask[:, :, None, :], float("-inf")))
        parts.append(inputs.sink.to(logits.dtype).view(1, 1, -1, 1).expand(*q.shape[:3], 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite (padding included)
        o = torch.einsum("bnhw,bndw->bnhd", probs[..., :W].to(keys.dtype), windows)
        if extras is not None:
            C = entries.shape[1]
            o = o + torch.einsum("bnhc,bcd->bnhd", probs[..., W:W + C].to(entries.dtype), entries)
        src = vr.flat_rows if vr.write_src is None else vr.write_src  # static form: padding mirrors a real key
        ring[vr.write_slots, geo.write_rows] = inputs.kv[src].to(ring.dtype)  # after the history read
        return o.flatten(0, 1) if vr.is_static else o[vr.is_valid]  # static: every row (no device-sized mask)

    def _verify_compressed(self, spec: LayerSpec, vr, inputs: AttentionInputs, cache: V4KVCache,
                           meta: AttentionMetadata):
        """Run the verify tokens' compressors (entries of the windows they complete written first), then
        return (entries [B, C, D], mask [B, N, C]: visible and, in CSA layers, selected), or None."""
        pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
        geo = vr.compressors[(spec.compress_rate, spec.is_overlap)]
        entries = self._verify_compressor(inputs.compressor, inputs.compressor_kv, inputs.compressor_gate,
                                          buf_kv, buf_gate, vr, geo, pool)
        keys = None
        if spec.has_indexer:
            keys = self._verify_compressor(inputs.indexer.compressor, inputs.index_kv, inputs.index_gate,
                                           ibuf_kv, ibuf_gate, vr, geo, ipool)
        if entries is None:
            return None
        if keys is None:
            return entries, geo.visible
        # the indexer's `select`, for [B, N] queries over each request's own keys
        indexer, ti = inputs.indexer, vr.token_index
        B, N = ti.shape
        cos, sin = meta.rope[spec.rope]
        q = indexer._queries(inputs.q_res[ti].flatten(0, 1), cos[ti].flatten(0, 1), sin[ti].flatten(0, 1))
        q = q.view(B, N, *q.shape[1:])  # [B, N, heads, index_head_dim]
        scores = torch.relu(torch.einsum("bnhd,bcd->bnhc", q.float(), keys.float())) * (indexer.head_dim**-0.5)
        weights = indexer.weights_proj(inputs.x[ti]).float() * (indexer.num_heads**-0.5)  # [B, N, heads]
        scores = (scores * weights[..., None]).sum(dim=2)  # [B, N, C]
        return entries, indexer.select_topk(scores, geo.visible)

    @staticmethod
    def _verify_compressor(comp, kv, gate, buf_kv, buf_gate, vr, geo, pool) -> torch.Tensor | None:
        """`_run_compressor` for every verify chunk at once: entries of the windows they complete, the
        ring update, and each request's entries [B, C, D] (None while none has one)."""
        kv, gate = kv[vr.flat_rows], gate[vr.flat_rows]  # [T, width]
        if geo.num_windows:  # a host int: no sync (the static form: fixed by its shape)
            span_kv = torch.cat([buf_kv[geo.hist_slots, geo.hist_rows], kv], dim=0)
            span_gate = torch.cat([buf_gate[geo.hist_slots, geo.hist_rows], gate], dim=0)
            new = comp.compress_gathered(span_kv[geo.cur_rows], span_gate[geo.cur_rows], span_kv[geo.prev_rows],
                                         span_gate[geo.prev_rows], geo.windows, geo.entry_rope)
            flat, new = pool.view(-1, pool.shape[-1]), new.to(pool.dtype)
            if geo.write_src is not None:  # static form: padding windows mirror a real one, or keep the row's value
                new = torch.where(geo.write_keep[:, None], new[geo.write_src], flat[geo.write_rows])
            flat[geo.write_rows] = new
        if vr.write_src is not None:  # static form: padding tokens write what the token they mirror writes
            kv, gate = kv[vr.write_src], gate[vr.write_src]
        buf_kv[vr.write_slots, geo.tail_rows] = kv.to(buf_kv.dtype)
        buf_gate[vr.write_slots, geo.tail_rows] = gate.to(buf_gate.dtype)
        if geo.entry_rows is None:
            return None
        return pool.view(-1, pool.shape[-1])[geo.entry_rows]

    # -- decode rows, batched ------------------------------------------------------------------

    def _decode_batched(self, spec: LayerSpec, dm: DecodeRows, inputs: AttentionInputs, r,
                        cache: V4KVCache) -> torch.Tensor:
        """One new token for each of B requests in one go. q [B, NH, D], kv [B, D] -> [B, NH, D]."""
        q, kv = inputs.q[r], inputs.kv[r]
        W = spec.window
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        ring[dm.slots, dm.window_rows[W]] = kv.to(ring.dtype)
        keys = ring[dm.slots]  # [B, W, D]
        valid = dm.window_valid[W]
        scale = q.shape[-1]**-0.5
        logits = torch.einsum("bhd,bwd->bhw", q, keys) * scale
        parts = [logits.masked_fill(~valid[:, None, :], float("-inf"))]
        entries = None
        if spec.is_compressed:
            entries, mask = self._decode_compressed(spec, dm, inputs, r, cache)
            if entries is not None:
                cl = torch.einsum("bhd,bcd->bhc", q, entries) * scale
                parts.append(cl.masked_fill(~mask[:, None, :], float("-inf")))
        parts.append(inputs.sink.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite
        o = torch.einsum("bhw,bwd->bhd", probs[..., :W].to(keys.dtype), keys)
        if entries is not None:
            C = entries.shape[1]
            o = o + torch.einsum("bhc,bcd->bhd", probs[..., W:W + C].to(entries.dtype), entries)
        return o

    def _decode_compressed(self, spec: LayerSpec, dm: DecodeRows, inputs: AttentionInputs, r, cache: V4KVCache):
        """Advance the compressors by one token per row; return (entries [B, C, D], mask [B, C]) or (None, None)."""
        pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
        rows = dm.compressors[(spec.compress_rate, spec.is_overlap)]
        self._decode_compressor(inputs.compressor, inputs.compressor_kv[r], inputs.compressor_gate[r],
                                buf_kv, buf_gate, dm, rows, pool)
        if spec.has_indexer:
            self._decode_compressor(inputs.indexer.compressor, inputs.index_kv[r], inputs.index_gate[r],
                                    ibuf_kv, ibuf_gate, dm, rows, ipool)
        index = dm.compressed[spec.compress_rate]
        if index is None:
            return None, None
        entries = pool.view(-1, pool.shape[-1])[index.pool_rows]  # [B, C, D]
        if not spec.has_indexer:
            return entries, index.visible
        keys = ipool.view(-1, ipool.shape[-1])[index.pool_rows]  # [B, C, ID]
        cos, sin = dm.rope[spec.rope]
        scores = self._decode_index_scores(inputs.indexer, inputs.q_res[r], inputs.x[r], keys, cos, sin)
        return entries, inputs.indexer.select_topk(scores, index.visible)

    @staticmethod
    def _decode_index_scores(indexer, q_res, x, keys, cos, sin) -> torch.Tensor:
        """The indexer's scores [B, C] of decode rows over their own keys [B, C, ID] (a subclass may change
        the reduction order: `engine.batch_invariant`)."""
        return indexer.score_batched(q_res, x, keys, cos, sin)

    @staticmethod
    def _decode_compressor(comp, kv, gate, buf_kv, buf_gate, dm: DecodeRows, rows: DecodeCompressorRows,
                           pool) -> None:
        """Write each row's new token into its ring; emit the entry of every window that just ended."""
        buf_kv[dm.slots, rows.ring_rows] = kv.to(buf_kv.dtype)
        buf_gate[dm.slots, rows.ring_rows] = gate.to(buf_gate.dtype)
        if rows.num_done == 0:  # a host int from the metadata: no sync
            return
        slots = rows.slots[:, None]
        new = comp.compress_gathered(buf_kv[slots, rows.cur_rows], buf_gate[slots, rows.cur_rows],
                                     buf_kv[slots, rows.prev_rows], buf_gate[slots, rows.prev_rows],
                                     rows.windows, rows.entry_rope)
        pool.view(-1, pool.shape[-1])[rows.pool_rows] = new.to(pool.dtype)

    # -- per request ------------------------------------------------------------------------

    @staticmethod
    def _attend_one(spec: LayerSpec, chunk: PrefillChunk, q, kv, sink, cache: V4KVCache, extra) -> torch.Tensor:
        """Attention of one request's new tokens over window + (selected) compressed entries.

        Query i (position p0 + i) sees exactly the W keys at positions p0 + i - W + 1 .. p0 + i: the
        ring's history (positions before p0, from `h0` on) followed by this chunk's keys, padded in
        front to W - 1 history rows; `unfold` gives every query its W-row window as a view, so the
        cost is n * W per head instead of n * (n + W).
        """
        W, n = spec.window, chunk.num_tokens
        geo = chunk.windows[W]
        ring = cache.window_kv[spec.layer_idx, chunk.slot]  # [W, D]
        hist = ring[geo.hist_rows].to(kv.dtype)
        if geo.num_dead_hist:  # rows before h0 hold no key of this request: zero them (masked below)
            hist[: geo.num_dead_hist] = 0
        keys = torch.cat([hist, kv], dim=0)  # [W - 1 + n, D]
        windows = keys.unfold(0, W, 1)  # [n, D, W]: row i = positions p0 + i - W + 1 .. p0 + i
        scale = q.shape[-1]**-0.5
        entries, mask = extra if extra is not None else (None, None)  # [C, D], [n, C]
        C = 0 if extra is None else entries.shape[0]
        # queries in blocks whose float32 logits stay under LOGITS_BLOCK_BYTES (a 32k-entry chunk would need tens of
        # GB at once); one block (the whole chunk) in all but long contexts
        step = max(1, LOGITS_BLOCK_BYTES // (4 * q.shape[1] * (W + C + 1)))
        outs = []
        for a in range(0, n, step):
            b = min(n, a + step)
            logits = torch.einsum("nhd,ndw->nhw", q[a:b], windows[a:b]) * scale  # [b - a, NH, W]
            logits = logits.masked_fill(~geo.allowed[a:b, None, :], float("-inf"))
            parts = [logits]
            if extra is not None:
                cl = torch.einsum("nhd,cd->nhc", q[a:b], entries) * scale
                parts.append(cl.masked_fill(~mask[a:b, None, :], float("-inf")))
            parts.append(sink.to(logits.dtype).view(1, -1, 1).expand(b - a, -1, 1))
            probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite
            o = torch.einsum("nhw,ndw->nhd", probs[..., :W].to(keys.dtype), windows[a:b])
            if extra is not None:
                o = o + torch.einsum("nhc,cd->nhd", probs[..., W:W + C].to(entries.dtype), entries)
            outs.append(o)
        # write the new tokens' K=V into the ring (only the last W matter)
        ring[geo.tail_rows] = kv[-geo.tail_rows.shape[0]:]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _compressed(self, spec: LayerSpec, chunk: PrefillChunk, inputs: AttentionInputs, sl: slice,
                    cache: V4KVCache, meta: AttentionMetadata):
        """Run this request's compressors, store new entries, return (entries [C, D], mask [n, C])."""
        pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
        geo = chunk.compressors[(spec.compress_rate, spec.is_overlap)]
        s = chunk.slot
        entries = self._run_compressor(inputs.compressor, inputs.compressor_kv[sl], inputs.compressor_gate[sl],
                                       buf_kv[s], buf_gate[s], geo, pool)
        if not spec.has_indexer:
            return entries, geo.visible
        keys = self._run_compressor(inputs.indexer.compressor, inputs.index_kv[sl], inputs.index_gate[sl],
                                    ibuf_kv[s], ibuf_gate[s], geo, ipool)
        cos, sin = meta.rope[spec.rope]
        return entries, self._prefill_index_mask(inputs.indexer, inputs.q_res[sl], inputs.x[sl], keys, geo.visible,
                                                 cos[sl], sin[sl])

    @staticmethod
    def _prefill_index_mask(indexer, q_res, x, keys, visible, cos, sin) -> torch.Tensor:
        """The entries [n, C] a prefill chunk's queries attend to, over the request's keys [C, ID] (a subclass
        may change the reduction order: `engine.batch_invariant`)."""
        return indexer.select(q_res, x, keys, visible, cos, sin)

    @staticmethod
    def _run_compressor(comp, kv, gate, buf_kv, buf_gate, geo, pool) -> torch.Tensor:
        """Compress the windows this chunk completes, write them to the pool, return all C1 entries."""
        if geo.windows.numel() > 0:
            if geo.hist_rows is not None:
                span_kv = torch.cat([buf_kv[geo.hist_rows], kv], dim=0)
                span_gate = torch.cat([buf_gate[geo.hist_rows], gate], dim=0)
            else:
                span_kv, span_gate = kv, gate
            new = comp.compress_gathered(span_kv[geo.cur_rows], span_gate[geo.cur_rows], span_kv[geo.prev_rows],
                                         span_gate[geo.prev_rows], geo.windows, geo.entry_rope)
            pool.view(-1, pool.shape[-1])[geo.write_rows] = new.to(pool.dtype)
        keep = geo.tail_rows.shape[0]
        buf_kv[geo.tail_rows] = kv[-keep:].to(buf_kv.dtype)
        buf_gate[geo.tail_rows] = gate[-keep:].to(buf_gate.dtype)
        if geo.entry_rows is None:
            return pool.new_zeros((0, pool.shape[-1]))
        return pool.view(-1, pool.shape[-1])[geo.entry_rows]
