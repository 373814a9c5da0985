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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.engine.attention.base import AttentionMetadata, PrefillChunk


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
