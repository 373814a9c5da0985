"""Verify chunks as one batch: the attention metadata of "decode rows with `1 + L` tokens".

A speculative step computes every verifying request as a `1 + L`-token chunk (the last known token
and its drafts). `build_attention_metadata` makes each of them a `PrefillChunk`, which a backend runs
alone (the torch backend's `_attend_one`, one small attention per request and layer).
`batch_verify_chunks` moves them out of `meta.prefill` into one `VerifyRows`: the requests padded to
`N = max(1 + L)` queries, so a backend that sets `supports_verify_rows` attends for all of them at once
(`TorchAttentionBackend._verify_batched`: the compressors, the indexer, the window gather and the
attention core, each once for all the verify tokens).

NOTE: `1 + L <= min ring length <= W` (`rollback.max_draft_tokens`, checked when speculative decoding
is built), so a verify chunk's positions hit distinct window-ring rows and every key it computes is
among the last `W` (it is all of the ring write). Padding queries see no key (their window is masked:
the sink alone keeps their softmax finite) and their outputs are dropped.

**The static form** (`static_verify_metadata`, what CUDA graphs of verify steps replay,
`engine.cuda_graph.VerifyGraphRunner`): the step padded to `B_pad` requests of `N_pad` queries, request b's
query i at flat row `b * N_pad + i`; every tensor is shaped by `(B_pad, N_pad, max_blocks)` (the graph key)
and the cache geometry (buffered compressor rows padded to `ring_len - 1` per request, completed windows to
`ceil(N_pad / rate)` per request, entries to `max_blocks * entries_per_block`), its only host values
(`num_queries`, `num_windows`, `is_static`) are fixed by the key, and padding rows mirror real writes (see the
function).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.attention.base import AttentionMetadata, LayerSpec, PrefillChunk, RopeFn
from deepinfer.engine.forward_batch import SeqChunk, host_to_device


@dataclass
class VerifyWindow:
    """The verify rows' sliding-window geometry for one window size W."""

    hist_rows: torch.Tensor  # [B, W - 1] ring rows of positions p - W + 1 .. p - 1
    hist_alive: torch.Tensor  # [B, W - 1] bool: the row holds a key of the request (after its state_start)
    allowed: torch.Tensor  # [B, N, W] bool: query i sees key j of its window (False on padding queries)
    write_rows: torch.Tensor  # [T] ring row of every verify token (pos % W), in `flat_rows` order


@dataclass
class VerifyCompressor:
    """The verify rows' work for one compressor geometry `(rate, is_overlap)`, all chunks together.

    Each chunk's compressor reads a span `[its buffered tokens (positions h0 .. p - 1) | its own
    tokens]`; the spans of all chunks are laid end to end as `[every chunk's buffered rows | every verify
    token in `flat_rows` order]`, and `cur_rows` / `prev_rows` index that."""

    hist_slots: torch.Tensor  # [H] slot of each buffered row read
    hist_rows: torch.Tensor  # [H] its ring row
    num_windows: int
    """Windows the chunks complete (host int; the tensors below have this many rows)."""
    windows: torch.Tensor  # [nw]
    cur_rows: torch.Tensor  # [nw, rate] span rows of each window's tokens
    prev_rows: torch.Tensor  # [nw, rate] span rows of the previous window's tokens
    write_rows: torch.Tensor  # [nw] flat pool rows of the new entries
    entry_rope: tuple[torch.Tensor, torch.Tensor]  # [nw, rope_head_dim // 2] at positions windows * rate
    tail_rows: torch.Tensor  # [T] ring row of every verify token (pos % ring_len), in `flat_rows` order
    entry_rows: torch.Tensor | None  # [B, C] flat pool rows of each request's entries (0 past its own), or None
    visible: torch.Tensor | None  # [B, N, C] bool: entry c is visible to query i of request b
    write_src: torch.Tensor | None = None
    """Static form only (`static_verify_metadata`): [nw] the window whose new entry row i writes (itself, or the
    real window a padding row mirrors); None in the ragged form (every row writes its own entry)."""
    write_keep: torch.Tensor | None = None
    """Static form only: [nw] bool, False where row i rewrites its target's current value (a padding row in a step
    in which no request completes a window: a no-op write)."""


@dataclass
class VerifyRows:
    """B verify chunks, padded to N queries each (built by `batch_verify_chunks`)."""

    chunks: list[PrefillChunk]
    """The chunks, in batch order (their per-chunk compressor geometry is still used)."""
    num_queries: int
    """N: the longest chunk's token count."""
    token_index: torch.Tensor  # [B, N] flat token row of query i of request b (padding: the request's first)
    is_valid: torch.Tensor  # [B, N] bool
    flat_rows: torch.Tensor  # [T] flat token rows of the valid queries, request by request
    slots: torch.Tensor  # [B]
    write_slots: torch.Tensor  # [T] the slot of every verify token, in `flat_rows` order
    windows: dict[int, VerifyWindow]
    compressors: dict[tuple[int, bool], VerifyCompressor]
    write_src: torch.Tensor | None = None
    """Static form only (`static_verify_metadata`): [T] the flat row whose key (and compressor input) every token
    writes: itself, or for a padding query the real query it mirrors; None in the ragged form."""
    is_static: bool = False
    """The static form: `flat_rows` is every row of the padded `[B, N]` batch (padding included) and a backend
    returns all `B * N` outputs (no boolean compaction: nothing sized from a device value)."""


def batch_verify_chunks(meta: AttentionMetadata, seq_ids: set[int]) -> AttentionMetadata:
    """Move the prefill chunks of `seq_ids` (verify chunks) into `meta.verify` (in place; returns `meta`).

    Raises ValueError for a chunk longer than a window (not a verify chunk: see the module docstring)."""
    chunks = [c for c in meta.prefill if c.seq_id in seq_ids]
    if not chunks:
        return meta
    device = meta.positions.device
    N = max(c.num_tokens for c in chunks)
    token_index, is_valid, flat_rows, write_slots = [], [], [], []
    for c in chunks:
        for W in c.windows:
            if c.num_tokens > W:
                raise ValueError(f"a verify chunk of {c.num_tokens} tokens exceeds the window ({W})")
        rows = list(range(c.start, c.start + c.num_tokens))
        token_index.append(rows + [c.start] * (N - c.num_tokens))
        is_valid.append([True] * c.num_tokens + [False] * (N - c.num_tokens))
        flat_rows += rows
        write_slots += [c.slot] * c.num_tokens

    def t(values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    windows = {}
    for W in chunks[0].windows:
        geos = [c.windows[W] for c in chunks]
        allowed = torch.zeros((len(chunks), N, W), dtype=torch.bool, device=device)
        for b, (c, g) in enumerate(zip(chunks, geos)):
            allowed[b, :c.num_tokens] = g.allowed
        hist_alive = torch.arange(W - 1, device=device)[None, :] >= t([g.num_dead_hist for g in geos])[:, None]
        windows[W] = VerifyWindow(
            hist_rows=torch.stack([g.hist_rows for g in geos]), hist_alive=hist_alive, allowed=allowed,
            write_rows=torch.cat([g.tail_rows for g in geos]),
        )
    compressors = {key: _compressor(chunks, key, N, device) for key in chunks[0].compressors}
    meta.verify = VerifyRows(
        chunks=chunks, num_queries=N, token_index=t(token_index), is_valid=t(is_valid, torch.bool),
        flat_rows=t(flat_rows), slots=t([c.slot for c in chunks]), write_slots=t(write_slots), windows=windows,
        compressors=compressors,
    )
    meta.prefill = [c for c in meta.prefill if c.seq_id not in seq_ids]
    meta.is_pure_decode = False
    return meta


def _compressor(chunks: list[PrefillChunk], key: tuple[int, bool], N: int, device) -> VerifyCompressor:
    """The chunks' per-chunk compressor geometries (`ChunkCompressor`) laid end to end (see `VerifyCompressor`)."""
    geos = [c.compressors[key] for c in chunks]
    for c, g in zip(chunks, geos):
        if g.tail_rows.shape[0] != c.num_tokens:
            raise ValueError(f"a verify chunk of {c.num_tokens} tokens exceeds a compressor ring")
    num_hist = [0 if g.hist_rows is None else g.hist_rows.shape[0] for g in geos]
    H = sum(num_hist)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    hist_slots = torch.cat([torch.full((h,), c.slot, dtype=torch.long, device=device)
                            for c, h in zip(chunks, num_hist)] + [empty])
    hist_rows = torch.cat([g.hist_rows for g in geos if g.hist_rows is not None] + [empty])
    cur, prev = [], []
    h_off = t_off = 0
    for c, g, h in zip(chunks, geos, num_hist):
        def to_span(rows: torch.Tensor, h=h, h_off=h_off, t_off=t_off) -> torch.Tensor:
            return torch.where(rows < h, h_off + rows, H + t_off + rows - h)
        cur.append(to_span(g.cur_rows))
        prev.append(to_span(g.prev_rows))
        h_off, t_off = h_off + h, t_off + c.num_tokens
    C = max(0 if g.entry_rows is None else g.entry_rows.shape[0] for g in geos)
    entry_rows = visible = None
    if C:
        entry_rows = torch.zeros((len(chunks), C), dtype=torch.long, device=device)
        visible = torch.zeros((len(chunks), N, C), dtype=torch.bool, device=device)
        for b, (c, g) in enumerate(zip(chunks, geos)):
            if g.entry_rows is not None:
                entry_rows[b, :g.entry_rows.shape[0]] = g.entry_rows
                visible[b, :c.num_tokens, :g.visible.shape[1]] = g.visible
    windows = torch.cat([g.windows for g in geos])
    return VerifyCompressor(
        hist_slots=hist_slots, hist_rows=hist_rows, num_windows=windows.shape[0], windows=windows,
        cur_rows=torch.cat(cur), prev_rows=torch.cat(prev), write_rows=torch.cat([g.write_rows for g in geos]),
        entry_rope=(torch.cat([g.entry_rope[0] for g in geos]), torch.cat([g.entry_rope[1] for g in geos])),
        tail_rows=torch.cat([g.tail_rows for g in geos]), entry_rows=entry_rows, visible=visible,
    )


# --------------------------------------------------------------------------- the static form (CUDA graphs)


@dataclass
class StaticVerifyInputs:
    """What a static verify step's metadata is computed from (`static_verify_metadata_from`): per padded request
    `[B_pad]` its first new position `p0` (padding: 0), its new tokens `n` (padding: 0), `slot` (padding: request
    0's), `state_start`, `frozen` (its frozen tokens), `is_real`; `tables` `[B_pad, max_blocks]` its block table,
    zero-padded (None without a compressed layer). Host tensors from `static_verify_inputs`, or a CUDA graph's
    static buffers (`engine.cuda_graph.VerifyGraphRunner` builds the metadata inside the graph)."""

    p0: torch.Tensor
    n: torch.Tensor
    slot: torch.Tensor
    state_start: torch.Tensor
    frozen: torch.Tensor
    is_real: torch.Tensor
    tables: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [self.p0, self.n, self.slot, self.state_start, self.frozen, self.is_real] + (
            [self.tables] if self.tables is not None else [])

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> StaticVerifyInputs:
        return cls(*tensors[:6], tensors[6] if len(tensors) > 6 else None)


def static_verify_inputs(seqs: list[SeqChunk], num_reqs: int, num_queries: int, specs: tuple[LayerSpec, ...], cache,
                         max_blocks: int | None = None) -> StaticVerifyInputs:
    """The host tensors `static_verify_metadata_from` reads for `seqs` padded to `num_reqs` requests of `num_queries`
    queries (see `static_verify_metadata`); raises ValueError where the step does not fit that form."""
    B, Bp, N = len(seqs), num_reqs, num_queries
    if not 0 < B <= Bp:
        raise ValueError(f"a static verify batch needs 1..{Bp} requests; got {B}")
    if any(s.num_new_tokens > N for s in seqs):
        raise ValueError(f"a verify chunk is longer than num_queries={N}")
    max_blocks = cache.max_blocks_per_seq if max_blocks is None else max_blocks
    is_compressed = any(s.is_compressed for s in specs)
    # NOTE: without a compressed layer (the MTP drafter's window cache) no block is read: no bound, no table
    if is_compressed and any(s.num_computed_tokens + s.num_new_tokens > max_blocks * cache.block_size for s in seqs):
        raise ValueError(f"a verify chunk runs past max_blocks_per_seq ({max_blocks}) blocks")
    for W in {s.window for s in specs}:
        if N > W:
            raise ValueError(f"num_queries={N} exceeds the window ({W})")
    for s in specs:
        if s.is_compressed and N > (2 if s.is_overlap else 1) * s.compress_rate:
            ring_len = (2 if s.is_overlap else 1) * s.compress_rate
            raise ValueError(f"num_queries={N} exceeds a compressor ring ({ring_len})")
    pad = Bp - B

    def t(values, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    tables = (t([s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks])) for s in seqs]
                + [[0] * max_blocks] * pad) if is_compressed else None)
    return StaticVerifyInputs(
        p0=t([s.num_computed_tokens for s in seqs] + [0] * pad), n=t([s.num_new_tokens for s in seqs] + [0] * pad),
        slot=t([s.slot for s in seqs] + [seqs[0].slot] * pad),  # padding requests read request 0's slot (masked)
        state_start=t([s.state_start for s in seqs] + [0] * pad),
        frozen=t([s.num_frozen_tokens for s in seqs] + [0] * pad),
        is_real=torch.arange(Bp) < B, tables=tables)


def static_verify_metadata(seqs: list[SeqChunk], num_reqs: int, num_queries: int, positions: torch.Tensor,
                           specs: tuple[LayerSpec, ...], rope_fns: dict[str, RopeFn], cache,
                           max_blocks: int | None = None) -> AttentionMetadata:
    """The `AttentionMetadata` of a verify step padded to `num_reqs` requests of `num_queries` queries, every
    tensor shaped by `(num_reqs, num_queries, max_blocks)` and the cache geometry alone (what a CUDA graph replays).

    `seqs`: the step's requests (each `1 + L_r <= num_queries` tokens at `num_computed_tokens`); `positions`:
    the padded batch's positions `[num_reqs * num_queries]` (request b's query i is flat row `b * N + i`);
    `max_blocks`: blocks of compressed entries each request may see (its entries are gathered densely, padded
    to `max_blocks * entries_per_block`), at most and by default `cache.max_blocks_per_seq` (unused without a
    compressed layer in `specs`). The inputs (`static_verify_inputs`) move to `positions`' device in one transfer
    and the metadata is computed there (`static_verify_metadata_from`, which a verify graph runs inside itself).

    NOTE: padding never touches memory a request owns, and never the cache's `dummy_slot` / `dummy_block`
    either (they own no memory, and this path is plain torch indexing: an index past a pool would fault).
    A padding query (past its request's `1 + L_r`, or of a padding request) *mirrors* a real query: it
    writes the same value (`write_src`) to the same ring row as the first query of its request (padding
    requests: of request 0), so the duplicate writes are identical and the result does not depend on which
    one lands. Padding windows mirror the step's first real window the same way, or, in a step where no
    request completes a window, rewrite row 0 of the pool with its own value (`write_keep` False). Their
    reads (rings of the mirrored slot, entry row 0) are masked: padding queries see no key (`allowed`,
    `visible` False) and their outputs are dropped.
    """
    max_blocks = cache.max_blocks_per_seq if max_blocks is None else max_blocks
    inp = static_verify_inputs(seqs, num_reqs, num_queries, specs, cache, max_blocks)
    inp = StaticVerifyInputs.of(packed_to_device(inp.tensors(), positions.device))  # NOTE: one transfer on CUDA
    return static_verify_metadata_from(inp, num_queries, specs, rope_fns, cache.block_size, max_blocks, positions)


def static_verify_metadata_from(inp: StaticVerifyInputs, num_queries: int, specs: tuple[LayerSpec, ...],
                                rope_fns: dict[str, RopeFn], block_size: int, max_blocks: int,
                                positions: torch.Tensor | None = None) -> AttentionMetadata:
    """`static_verify_metadata` from its inputs, with tensor ops on their device alone (no host value read: a CUDA
    graph captures it). `positions` None: the padded batch's (`p0 + i` for query i of each padded request)."""
    Bp, N = inp.p0.shape[0], num_queries
    device, T = inp.p0.device, Bp * N
    p0, n, slot, state_start, frozen, is_real, tables = (inp.p0, inp.n, inp.slot, inp.state_start, inp.frozen,
                                                         inp.is_real, inp.tables)

    def ar(k: int) -> torch.Tensor:
        return torch.arange(k, device=device)

    b, i = ar(Bp), ar(N)
    valid = i[None, :] < n[:, None]  # [Bp, N]
    qpos = p0[:, None] + i[None, :]  # [Bp, N]
    if positions is None:
        positions = qpos.flatten()
    mirror = torch.where(is_real, b, 0) * N  # the flat row of each request's first query (padding: request 0's)
    src = torch.where(valid, b[:, None] * N + i[None, :], mirror[:, None]).flatten()  # [T]
    wpos, wslot = qpos.flatten()[src], slot[src // N]  # [T] position and slot each token writes

    windows = {}
    for W in sorted({s.window for s in specs}):
        j = ar(W - 1)
        h0 = torch.maximum(state_start, p0 - W + 1)
        dead = (h0 - (p0 - W + 1)).clamp(min=0)
        key_pos = qpos[..., None] - (W - 1) + ar(W)  # [Bp, N, W]
        windows[W] = VerifyWindow((p0[:, None] - W + 1 + j[None, :]) % W,
                                  (j[None, :] >= dead[:, None]) & is_real[:, None],
                                  (key_pos >= h0[:, None, None]) & valid[..., None], wpos % W)

    compressors = {}
    for rate, is_overlap in sorted({(s.compress_rate, s.is_overlap) for s in specs if s.is_compressed}):
        ring_len = (2 if is_overlap else 1) * rate
        epb = block_size // rate
        Hb, K, C = ring_len - 1, -(-N // rate), max_blocks * epb  # buffered rows, windows, entries per request
        C0, C1 = p0 // rate, (p0 + n) // rate
        h0 = ((C0 - (1 if is_overlap else 0)) * rate).clamp(min=0)
        h = p0 - h0  # [Bp] buffered tokens before the chunk (< ring_len)
        jh = ar(Hb)
        hist_rows = torch.where(jh[None, :] < h[:, None], (h0[:, None] + jh[None, :]) % ring_len, 0)
        w = torch.maximum(C0, frozen // rate)[:, None] + ar(K)[None, :]  # [Bp, K]
        live = (w < C1[:, None]) & is_real[:, None]
        sc = (w * rate - h0[:, None])[..., None] + ar(rate)  # [Bp, K, rate] request-relative span rows
        cur = _static_span(sc, h, Hb, N).flatten(0, 1)
        prev = _static_span((sc - rate).clamp(min=0), h, Hb, N).flatten(0, 1)
        wrows = (tables.gather(1, (w // epb).clamp(max=max_blocks - 1)) * epb + w % epb).flatten()
        w, live = w.flatten(), live.flatten()
        # padding windows mirror the first real one (identical value, same row); where no request completes a
        # window, every row rewrites pool row 0 with its current value (`keep` False): device ops, no host branch
        any_live = live.any()
        first = live.to(torch.int8).argmax()
        wsrc = torch.where(live | ~any_live, ar(Bp * K), first)
        keep = live | any_live
        cur, prev, w, wrows = (torch.where(any_live, x[wsrc], 0) for x in (cur, prev, w, wrows))
        cur, prev = cur.clamp(0, Bp * Hb + T - 1), prev.clamp(0, Bp * Hb + T - 1)
        c = ar(C)
        entry_rows = torch.where(c[None, :] < C1[:, None],
                                 tables.gather(1, (c // epb)[None, :].expand(Bp, -1)) * epb + c % epb, 0)
        visible = (c[None, None, :] < ((qpos + 1) // rate)[..., None]) & valid[..., None]  # [Bp, N, C]
        compressors[(rate, is_overlap)] = VerifyCompressor(
            hist_slots=slot.repeat_interleave(Hb), hist_rows=hist_rows.flatten(), num_windows=Bp * K, windows=w,
            cur_rows=cur, prev_rows=prev, write_rows=wrows, entry_rope=rope_fns["compress"](w * rate),
            tail_rows=wpos % ring_len, entry_rows=entry_rows, visible=visible, write_src=wsrc, write_keep=keep)
    verify = VerifyRows(chunks=[], num_queries=N, token_index=ar(T).view(Bp, N), is_valid=valid, flat_rows=ar(T),
                        slots=slot, write_slots=wslot, windows=windows, compressors=compressors, write_src=src,
                        is_static=True)
    return AttentionMetadata(num_tokens=T, positions=positions, rope={k: fn(positions) for k, fn in rope_fns.items()},
                             block_size=block_size, decode=None, prefill=[], is_pure_decode=False, verify=verify)


def static_window_step_metadata(positions: torch.Tensor, slots: torch.Tensor, state_starts: torch.Tensor,
                                is_real: torch.Tensor, specs: tuple[LayerSpec, ...], rope_fns: dict[str, RopeFn],
                                block_size: int) -> AttentionMetadata:
    """`static_verify_metadata(seqs, B_pad, 1, ...)` for sliding-window layers only, computed from device tensors with
    device ops alone (no host value read), so that a CUDA graph can build it for positions it computes itself.

    `positions`, `slots`, `state_starts`, `is_real`: `[B_pad]` per padded request (a padding request: position 0,
    request 0's slot, state start 0, `is_real` False). The MTP drafter's graph builds its chained steps' metadata
    this way from the last committed positions (`draft_graph`), instead of the host building one per step.
    Equal, tensor for tensor, to the host builder's (tests/engine/spec_decode/test_draft_graph.py)."""
    if any(s.is_compressed for s in specs):
        raise ValueError("static_window_step_metadata covers sliding-window layers only")
    Bp, device = positions.shape[0], positions.device
    b = torch.arange(Bp, device=device)
    valid = is_real[:, None]  # [Bp, 1]: one query per request
    src = torch.where(is_real, b, 0)  # padding queries mirror request 0's
    wpos, wslot = positions[src], slots[src]
    windows = {}
    for W in sorted({s.window for s in specs}):
        j = torch.arange(W - 1, device=device)
        h0 = torch.maximum(state_starts, positions - W + 1)
        dead = (h0 - (positions - W + 1)).clamp(min=0)
        key_pos = positions[:, None, None] - (W - 1) + torch.arange(W, device=device)  # [Bp, 1, W]
        windows[W] = VerifyWindow((positions[:, None] - W + 1 + j[None, :]) % W, (j[None, :] >= dead[:, None]) & valid,
                                  (key_pos >= h0[:, None, None]) & valid[..., None], wpos % W)
    verify = VerifyRows(chunks=[], num_queries=1, token_index=b.view(Bp, 1), is_valid=valid, flat_rows=b.clone(),
                        slots=slots, write_slots=wslot, windows=windows, compressors={}, write_src=src, is_static=True)
    return AttentionMetadata(num_tokens=Bp, positions=positions, rope={k: fn(positions) for k, fn in rope_fns.items()},
                             block_size=block_size, decode=None, prefill=[], is_pure_decode=False, verify=verify)


def packed_to_device(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """`tensors` (host tensors) on `device` with one transfer: packed into one pinned byte buffer (each tensor at a
    16-byte aligned offset, as Triton specialises on), copied without blocking the host, and viewed back as the
    original dtypes and shapes.

    NOTE: a static step's metadata is a few dozen small tensors; a pinned staging copy and a transfer for each
    (`host_to_device`) cost more host time than the graph replay that reads them (~30 per verify or drafting step)."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // 16) * 16
    device = torch.device(device)
    buf = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for t, off in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            buf[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))
    moved = host_to_device(buf, device) if device.type == "cuda" else buf
    return [moved[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, off in zip(tensors, offsets)]


def _static_span(rows: torch.Tensor, num_hist: torch.Tensor, Hb: int, N: int) -> torch.Tensor:
    """Request-relative compressor span rows `[Bp, K, rate]` (request b's span: its `num_hist[b]` buffered tokens,
    then its chunk) -> rows of the static span `[Bp * Hb buffered rows | Bp * N tokens]`."""
    Bp = num_hist.shape[0]
    b, h = torch.arange(Bp, device=rows.device)[:, None, None], num_hist[:, None, None]
    return torch.where(rows < h, b * Hb + rows, Bp * Hb + b * N + rows - h)
