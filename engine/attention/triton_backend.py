"""The `triton` attention backend: fused decode kernels, CUDA-graph safe.

Decode rows (one new token each) run in a few kernels per layer, every decision taken on the device:

1. `ring_write` — the row's K=V into its window ring;
2. `compressor_decode` (compressed layers; CSA twice: main and indexer) — the row's projected token
   into the compressor rings and, when it ends a window that is not frozen, that window's entry into
   the paged pool (`kernels.compressor`);
3. `indexer_topk` (CSA) — the lightning indexer's scores over the visible index keys and the top-k
   with `topk_mask`'s tie rule, as entry indices (`kernels.indexer`);
4. `decode_attention` — window + entries (all visible for HCA, the selection for CSA) + the per-head
   sink, flash-decoding over fixed-size splits (`kernels.decode_attention`).

Its metadata (`build_metadata`) has static decode rows (`DecodeRows.is_static`): block tables padded
to `cache.max_blocks_per_seq` with `cache.dummy_block`, no host value that changes between steps of
one batch size, so a CUDA graph captured for B rows replays with the next step's metadata copied in.
Padding rows (`cache.dummy_slot`, position 0) read and write nothing (the kernels mask them).

Prefill chunks (and the prefill part of a mixed step) run eagerly: per chunk the compressors as the
`torch` backend (entries written to the pools) and, for CSA, the indexer's selection of every query with
`indexer_topk` (each query a row at its own position); then the window + entries + sink of every chunk of
the step in one `prefill_attention` launch per layer (`kernels.prefill_attention`; its per-token table is
built once per step), and the chunks' last keys into their rings. Decode rows of metadata built elsewhere (not
static: the MTP layer's own builder) take the `torch` path.

Verify rows (speculative decoding, `AttentionMetadata.verify`, ragged or the static form of verify CUDA graphs) run
through the decode kernels, each verify query a decode row (`_verify_batched`): request b's query i is row
`b * N + i` with the request's slot and block table at position `p_b + i`; padding queries are padding rows (the
dummy slot, position 0). Per layer: the compressors' multi-token update as the `torch` backend (static form
included: the step's new entries are in the pools first); for CSA `indexer_topk` over the rows; then
`verify_attention` (`kernels.decode_attention`: the decode kernel whose window reads take the step's own keys
from the step's K=V rows, since the ring, written after attention as in the `torch` backend, still holds the
older ones); then the ring write. The rows' positions, slots, state starts and per-row block tables are built once
per forward (`_VerifyRowArgs`), not per layer.

Each kernel is a module op of `kernels.registry` with a torch reference: on a device without Triton
(the CPU) the backend runs those references, the same static-metadata arithmetic in plain torch;
`impl="triton"` forces the kernels (the CPU tests run them under `TRITON_INTERPRET=1`). The `torch`
backend is the oracle: the tests compare the two on the same inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.engine.attention.base import (
    AttentionInputs,
    AttentionMetadata,
    DecodeRows,
    LayerSpec,
    PrefillChunk,
    RopeFn,
    build_attention_metadata,
    register_attention_backend,
)
from deepinfer.engine.attention.indexer_quant import rotate_and_quant
from deepinfer.engine.attention.torch_backend import TorchAttentionBackend, _pools
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.kernels import compressor as _compressor  # noqa: F401  (registers the ops)
from deepinfer.kernels import decode_attention as _decode_attention
from deepinfer.kernels import indexer as _indexer  # noqa: F401
from deepinfer.kernels.prefill_attention import PrefillSpans
from deepinfer.kernels.registry import default_impl, get_op

_OPS = ("ring_write", "compressor_decode", "write_entries", "indexer_topk", "decode_attention", "prefill_attention",
        "verify_attention")


@dataclass(frozen=True)
class _DecodeOps:
    """The decode kernels picked for one device."""

    ring_write: object
    compressor_decode: object
    write_entries: object
    indexer_topk: object
    decode_attention: object
    prefill_attention: object
    verify_attention: object


@dataclass
class _ChunkEntries:
    """A prefill chunk's compressed entries as the prefill kernel reads them (what this backend's
    `_compressed` returns, in place of the `torch` backend's dense mask)."""

    comp: torch.Tensor  # [C1, D] the request's entries 0 .. C1 - 1
    selected: torch.Tensor | None  # [n, topk] int64 entry indices per query (-1 none; CSA), None: all visible


@dataclass
class _VerifyRowArgs:
    """A step's verify rows as decode-kernel rows (request b's query i is row `b * N + i`), shared by its layers."""

    pos: torch.Tensor  # [B * N] p_b + i (padding queries: 0)
    slots: torch.Tensor  # [B * N] the request's slot (padding queries: the cache's dummy slot, never read)
    state_start: dict[int, torch.Tensor]  # window W -> [B * N] the oldest position of the request's window keys
    tables: dict[tuple[int, bool], torch.Tensor | None]
    """Compressor geometry -> [B * N, blocks] the request's block table (the blocks of its entries; None while no
    request has an entry)."""
    no_entries: dict[tuple[int, bool], object]
    """Compressor geometry -> its `VerifyCompressor` without `entry_rows` (the torch update without the gather)."""
    no_table: torch.Tensor  # [B * N, 1] for layers without compressed entries (never read)


@register_attention_backend("triton")
class TritonAttentionBackend(TorchAttentionBackend):
    """Fused Triton decode kernels over static metadata; one prefill attention launch per layer and step."""

    cuda_graph_safe = True
    split_size: int = _decode_attention.DEFAULT_SPLIT_SIZE
    """Keys per flash-decoding split (fixed: a row's result does not depend on its batch)."""

    def __init__(self, impl: str | None = None) -> None:
        """`impl`: "triton" or "torch" for every op (decode and prefill), None for each op's default on the tensors'
        device (the kernels on CUDA, the torch references elsewhere)."""
        self.impl = impl
        self._ops: dict[torch.device, _DecodeOps] = {}
        self._spans_meta: AttentionMetadata | None = None
        self._spans: dict[int, PrefillSpans] = {}
        self._vrows: tuple[object, int, _VerifyRowArgs] | None = None  # (VerifyRows, last layer, its rows)

    @classmethod
    def build_metadata(cls, batch, specs: tuple[LayerSpec, ...], rope_fns: dict[str, RopeFn],
                       cache: V4KVCache) -> AttentionMetadata:
        """Static decode rows (shapes from B and the cache geometry only), prefill chunks as usual."""
        return build_attention_metadata(batch, specs, rope_fns, cache.block_size,
                                        static_decode=(cache.max_blocks_per_seq, cache.dummy_block))

    def ops_for(self, device: torch.device) -> _DecodeOps:
        """The decode ops used for tensors on `device` (picked once per device)."""
        ops = self._ops.get(device)
        if ops is None:
            ops = _DecodeOps(*(get_op(op, self.impl or default_impl(op, device)) for op in _OPS))
            self._ops[device] = ops
        return ops

    def _decode_batched(self, spec: LayerSpec, dm: DecodeRows, inputs: AttentionInputs, r,
                        cache: V4KVCache) -> torch.Tensor:
        if not dm.is_static:  # metadata of the host-decided form (the MTP layer's builder)
            return super()._decode_batched(spec, dm, inputs, r, cache)
        ops = self.ops_for(inputs.q.device)
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        q = inputs.q[r].to(ring.dtype).contiguous()  # [B, NH, D]
        ops.ring_write(ring, dm.slots, dm.pos, inputs.kv[r].contiguous())
        pool = entries = None
        rate = spec.compress_rate
        if spec.is_compressed:
            pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
            self._compress(ops, spec, dm, inputs.compressor, inputs.compressor_kv[r], inputs.compressor_gate[r],
                           buf_kv, buf_gate, pool)
            if spec.has_indexer:
                indexer = inputs.indexer
                self._compress(ops, spec, dm, indexer.compressor, inputs.index_kv[r], inputs.index_gate[r],
                               ibuf_kv, ibuf_gate, ipool)
                cos, sin = dm.rope[spec.rope]
                qi = indexer._queries(inputs.q_res[r], cos, sin).to(ipool.dtype).contiguous()  # [B, IH, ID]
                weights = (indexer.weights_proj(inputs.x[r]).float() * indexer.num_heads**-0.5).contiguous()
                entries = ops.indexer_topk(qi, weights, ipool, dm.pos, dm.block_tables, rate, indexer.topk)
        out = ops.decode_attention(q, ring, pool, dm.slots, dm.pos, dm.state_start, dm.block_tables, entries,
                                   rate, inputs.sink.float(), self.split_size)
        return out.to(inputs.q.dtype)

    # -- verify rows (speculative decoding) -------------------------------------------------------

    def _verify_batched(self, spec: LayerSpec, vr, inputs: AttentionInputs, cache: V4KVCache,
                        meta: AttentionMetadata) -> torch.Tensor:
        """Every verify query a decode row (see the module docstring), in the `torch` backend's order: the
        compressors (new entries written), the indexer's top-k, the attention over the ring's older keys, the
        step's own keys and the entries, then the step's keys into the ring. Returns [T, NH, D] in
        `vr.flat_rows` order (the static form: all `B * N` rows)."""
        ops = self.ops_for(inputs.q.device)
        rows = self._verify_rows(spec, vr, cache, meta)
        B, N = vr.token_index.shape
        ti = None if vr.is_static else vr.token_index.flatten()  # static: row b * N + i is token b * N + i

        def take(x: torch.Tensor) -> torch.Tensor:
            return x if ti is None else x[ti]

        pool = tables = entries = None
        rate = spec.compress_rate
        if spec.is_compressed:
            key = (rate, spec.is_overlap)
            pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
            geo = rows.no_entries[key]
            self._verify_compressor(inputs.compressor, inputs.compressor_kv, inputs.compressor_gate, buf_kv, buf_gate,
                                    vr, geo, pool)
            if spec.has_indexer:
                self._verify_compressor(inputs.indexer.compressor, inputs.index_kv, inputs.index_gate, ibuf_kv,
                                        ibuf_gate, vr, geo, ipool)
            tables = rows.tables[key]
            if tables is None:  # no request has an entry yet (ragged form)
                pool = None
            elif spec.has_indexer:
                indexer = inputs.indexer
                cos, sin = meta.rope[spec.rope]
                qi = indexer._queries(take(inputs.q_res), take(cos), take(sin)).to(ipool.dtype).contiguous()
                weights = (indexer.weights_proj(take(inputs.x)).float() * indexer.num_heads**-0.5).contiguous()
                entries = ops.indexer_topk(qi, weights, ipool, rows.pos, tables, rate, indexer.topk)
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        q = take(inputs.q).to(ring.dtype).contiguous()  # [B * N, NH, D]
        new_kv = take(inputs.kv).to(ring.dtype).contiguous()  # [B * N, D]
        out = ops.verify_attention(q, ring, pool, rows.slots, rows.pos, rows.state_start[spec.window],
                                   rows.no_table if tables is None else tables, entries, rate, inputs.sink.float(),
                                   new_kv, N, self.split_size)
        src = vr.flat_rows if vr.write_src is None else vr.write_src  # static form: padding mirrors a real key
        ring[vr.write_slots, vr.windows[spec.window].write_rows] = inputs.kv[src].to(ring.dtype)  # after the reads
        out = out.to(inputs.q.dtype)
        return out if vr.is_static else out.view(B, N, *out.shape[1:])[vr.is_valid]

    def _verify_rows(self, spec: LayerSpec, vr, cache: V4KVCache, meta: AttentionMetadata) -> _VerifyRowArgs:
        """The step's `_VerifyRowArgs`, built by the first layer of each forward over `vr` and reused by the
        later ones (keyed on `vr`, which a mixed step's per-layer copy of `meta` shares; a forward visits its layers
        in increasing order, so a layer index not above the last one seen starts a new forward, e.g. a re-run or a
        graph capture over the same static metadata with new values copied in)."""
        cached = self._vrows
        if cached is not None and cached[0] is vr and spec.layer_idx > cached[1]:
            self._vrows = (vr, spec.layer_idx, cached[2])
            return cached[2]
        args = _verify_row_args(vr, cache, meta)
        self._vrows = (vr, spec.layer_idx, args)
        return args

    @staticmethod
    def _compress(ops: _DecodeOps, spec: LayerSpec, dm: DecodeRows, comp, kv, gate, buf_kv, buf_gate,
                  pool) -> None:
        """One compressor's one-token update for every row (entries written where a window ends)."""
        cos, sin = dm.entry_rope[spec.compress_rate]
        args = (kv.to(buf_kv.dtype).contiguous(), gate.to(buf_gate.dtype).contiguous(), buf_kv, buf_gate,
                comp.ape.float(), comp.norm.weight.float(), comp.norm.eps, cos, sin, dm.slots, dm.pos, dm.frozen, dm.block_tables, pool,
                spec.compress_rate, comp.overlap)
        if not comp.rotate_quant:
            ops.compressor_decode(*args)
            return
        # the indexer's reference numerics: entries out, rotated + FP4-simulated here, then written
        new = torch.empty((kv.shape[0], comp.dim), dtype=pool.dtype, device=pool.device)
        done = ops.compressor_decode(*args, entries_out=new)
        ops.write_entries(pool, rotate_and_quant(new).contiguous(), done, dm.pos, dm.block_tables, spec.compress_rate)

    # -- prefill chunks --------------------------------------------------------------------------

    def _compressed(self, spec: LayerSpec, chunk: PrefillChunk, inputs: AttentionInputs, sl: slice,
                    cache: V4KVCache, meta: AttentionMetadata) -> _ChunkEntries | None:
        """Run the chunk's compressors (the `torch` backend's, entries written to the pools), then for CSA
        the indexer's selection per query as entry indices (`indexer_topk`, each query a row at its own
        position over the request's blocks). None while the request has no entry."""
        pool, buf_kv, buf_gate, ipool, ibuf_kv, ibuf_gate = _pools(spec, cache)
        geo = chunk.compressors[(spec.compress_rate, spec.is_overlap)]
        s = chunk.slot
        comp = self._run_compressor(inputs.compressor, inputs.compressor_kv[sl], inputs.compressor_gate[sl],
                                    buf_kv[s], buf_gate[s], geo, pool)
        if spec.has_indexer:
            self._run_compressor(inputs.indexer.compressor, inputs.index_kv[sl], inputs.index_gate[sl],
                                 ibuf_kv[s], ibuf_gate[s], geo, ipool)
        if geo.entry_rows is None:
            return None
        if not spec.has_indexer:
            return _ChunkEntries(comp, None)
        ops = self.ops_for(inputs.q.device)
        indexer, epb = inputs.indexer, ipool.shape[1]
        cos, sin = meta.rope[spec.rope]
        qi = indexer._queries(inputs.q_res[sl], cos[sl], sin[sl]).to(ipool.dtype).contiguous()  # [n, IH, ID]
        weights = (indexer.weights_proj(inputs.x[sl]).float() * indexer.num_heads**-0.5).contiguous()
        # the blocks holding entries 0 .. C1 - 1 (entry c is flat pool row block_table[c // epb] * epb + c % epb)
        blocks = geo.entry_rows[::epb] // epb
        tables = blocks[None, :].expand(chunk.num_tokens, -1).contiguous()
        selected = ops.indexer_topk(qi, weights, ipool, meta.positions[sl].contiguous(), tables, spec.compress_rate,
                                    indexer.topk)
        return _ChunkEntries(comp, selected)

    def forward(self, spec: LayerSpec, inputs: AttentionInputs, cache: V4KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Decode and verify rows as the base class; every prefill chunk of the step in one
        `prefill_attention` launch (after each chunk's compressors and indexer), then the chunks' last
        keys into their rings."""
        if not meta.prefill:
            return super().forward(spec, inputs, cache, meta)
        out = super().forward(spec, inputs, cache, dataclasses.replace(meta, prefill=[]))  # decode, verify rows
        rate = spec.compress_rate if spec.is_compressed else 0
        spans = self._prefill_spans(meta, rate, inputs.q.device)
        extras = [self._compressed(spec, c, inputs, c.rows, cache, meta) if rate else None for c in meta.prefill]
        ring = cache.window_kv[spec.layer_idx]  # [slots, W, D]
        dt = ring.dtype
        comp = entries = None
        if any(e is not None for e in extras):
            comp = torch.cat([e.comp for e in extras if e is not None]).to(dt).contiguous()
            if spec.has_indexer:
                k = inputs.indexer.topk
                entries = torch.cat([e.selected if e is not None else
                                     torch.full((c.num_tokens, k), -1, dtype=torch.long, device=ring.device)
                                     for c, e in zip(meta.prefill, extras)])
        q, kv = inputs.q.to(dt).contiguous(), inputs.kv.to(dt).contiguous()
        o = self.ops_for(q.device).prefill_attention(q, kv, ring, spans, comp, entries, inputs.sink.float(),
                                                    out=out if out.dtype == dt else None)
        if o is not out:
            for c in meta.prefill:
                out[c.rows] = o[c.rows].to(out.dtype)
        for c in meta.prefill:  # after the kernel has read the history
            tail = c.windows[spec.window].tail_rows
            ring[c.slot, tail] = kv[c.rows][-tail.shape[0]:]
        return out

    def _prefill_spans(self, meta: AttentionMetadata, rate: int, device: torch.device) -> PrefillSpans:
        """The step's chunks as the prefill kernel reads them, built once per step and rate (every layer of
        the step shares `meta`; the table is one host-to-device copy)."""
        if self._spans_meta is not meta:
            self._spans_meta, self._spans = meta, {}
        spans = self._spans.get(rate)
        if spans is None:
            ch = meta.prefill
            spans = PrefillSpans.build([c.start for c in ch], [c.num_tokens for c in ch],
                                       [c.num_computed_tokens for c in ch], [c.slot for c in ch],
                                       [c.state_start for c in ch], rate, device)
            self._spans[rate] = spans
        return spans


def _verify_row_args(vr, cache: V4KVCache, meta: AttentionMetadata) -> _VerifyRowArgs:
    """Verify rows (`engine.spec_decode.verify_rows.VerifyRows`, either form) as decode-kernel rows, from device
    tensors only (no host sync: it runs inside verify CUDA graphs).

    * position `p_b + i` (`meta.positions` of the query's token), 0 on padding queries, whose slot is the cache's
      dummy slot: the kernels read nothing for them (the `torch` backend's padding sees no key either);
    * the window's state start: the ring rows of positions `p_b - W + 1 .. p_b - 1` that hold a key of the request
      are its last `alive` ones (`VerifyWindow.hist_alive`), so keys at positions `>= p_b - alive` are valid;
    * block tables: request b's entry `c` is at flat pool row `entry_rows[b, c]` =
      `block_table[c // epb] * epb + c % epb` for every entry it has (`c < C1_b`), so the blocks are
      `entry_rows[b, ::epb] // epb`; a row reads only entries `c < (pos + 1) // rate <= C1_b`, so the blocks past
      the request's entries (0 in `entry_rows`) are never read.
    """
    ti, valid = vr.token_index, vr.is_valid
    B, N = ti.shape
    qpos = meta.positions[ti]  # [B, N]
    pos = torch.where(valid, qpos, torch.zeros_like(qpos)).flatten().contiguous()
    slots = torch.where(valid, vr.slots[:, None], torch.full_like(qpos, cache.dummy_slot)).flatten().contiguous()

    def per_row(x: torch.Tensor) -> torch.Tensor:  # [B, ...] -> [B * N, ...]
        return x[:, None].expand(B, N, *x.shape[1:]).reshape(B * N, *x.shape[1:]).contiguous()

    starts = {W: per_row(qpos[:, 0] - g.hist_alive.sum(dim=1)) for W, g in vr.windows.items()}
    tables, no_entries = {}, {}
    for key, geo in vr.compressors.items():
        epb = cache.block_size // key[0]
        tables[key] = None if geo.entry_rows is None else per_row(geo.entry_rows[:, ::epb] // epb)
        no_entries[key] = dataclasses.replace(geo, entry_rows=None)
    no_table = torch.full((B * N, 1), cache.dummy_block, dtype=torch.long, device=pos.device)
    return _VerifyRowArgs(pos, slots, starts, tables, no_entries, no_table)
