"""CUDA graphs of the MTP drafter: a step's whole drafting (committed pass and chained drafts) as one replay.

Why: after the verify step became a graph replay (`engine.cuda_graph.VerifyGraphRunner`), the drafter was most of a
speculative step's host time on a GPU: `k` eager forwards of the MTP block (a full decoder layer, ~265 kernels
each on the built-in model), each with its own metadata build, and a device-to-host read of every draft before
the next chained step could start. On the built-in model (H100, bf16, batch 1) a speculative step took ~15 ms
against ~2.8 ms for a plain (graphed) decode step, so speculation ran at half the plain speed although it
emitted three tokens a step.

What one graph computes, for a key `(B_pad, N_pad, keep_features)` (requests padded to a decode bucket, each
request's committed rows padded to the widest one, at most `1 + num_draft_tokens`; with or without the confidence
features):

1. the committed pass over `B_pad * N_pad` rows (request b's row i at flat row `b * N_pad + i`) with the static
   verify metadata of `verify_rows.static_verify_metadata` over the drafter's own window cache (padding rows
   mirror a real row's write, so they change nothing), computed inside the graph from a few per-request inputs
   (`static_verify_metadata_from`, as the verify graphs do: the host copies those, not the metadata);
2. draft 1 from the hidden state at each request's last committed row (`last_rows`, a graph input), its
   probability and (with `keep_features`) its confidence features;
3. the ring rows the chained positions will overwrite, saved (`snap_slots`, `snap_positions`: graph inputs);
4. `k - 1` chained steps, one row per request, each reading the previous draft from the device (no host read
   between them), each with its static metadata computed in the graph from the last committed positions
   (`verify_rows.static_window_step_metadata`);
5. the saved rows written back (the chained positions are speculative: `RingRollback`'s job in the eager path).

The graph's outputs are the drafts `[B_pad, k]`, their probabilities and features; the caller reads the real
rows once, after the replay. The LM head runs inside the graph (the argmax feeds the next chained step), so a
graph's pool holds a few `[B_pad, vocab]` float32 intermediates: graphs are kept to `max_requests` requests
(larger batches draft eagerly, where the device work dominates anyway).

A step is *eligible* when every request of the drafter's batch drafts and commits at most `max_queries` rows (a
pure verify or decode step); prefill and replay chunks draft eagerly (`stats["eager_steps"]`). Captures are lazy,
from the step itself (its eager run on the static buffers is the warm-up and gives its results), as for verify
steps; all of this runner's graphs share one pool (one drafting runs at a time, and each replay's outputs are
read before the next one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.cuda_graph import CudaGraphRunner, UnsupportedLeaf, clone_tensors, flatten
from deepinfer.engine.forward_batch import SeqChunk
from deepinfer.engine.spec_decode.verify_rows import (
    StaticVerifyInputs,
    packed_to_device,
    static_verify_inputs,
    static_verify_metadata_from,
    static_window_step_metadata,
)


@dataclass
class DraftRows:
    """The batch the MTP layer reads inside a drafting graph: its next-token ids only (`MTPLayer.forward` and the
    block's MoE read `batch.input_ids`, nothing else; positions and rows are in the metadata)."""

    input_ids: torch.Tensor  # [num_rows] int64


@dataclass
class DraftInputs:
    """What a drafting graph reads that changes between steps (every tensor a static buffer of the graph)."""

    input_ids: torch.Tensor  # [B_pad * N_pad] the next token of every committed row (padding: 0)
    streams: torch.Tensor  # [B_pad * N_pad, hc, H] the target's streams at those rows (padding: zeros)
    last_rows: torch.Tensor  # [B_pad] each request's last committed row (padding: request 0's)
    snap_slots: torch.Tensor  # [B_pad * (k - 1)] the slot of every chained position (padding: request 0's)
    snap_positions: torch.Tensor  # [B_pad * (k - 1)] the chained positions (padding: request 0's)
    committed: StaticVerifyInputs  # what the committed pass's static metadata is computed from (in the graph)
    chain_positions: torch.Tensor  # [B_pad] each request's last committed position (padding: 0)
    chain_slots: torch.Tensor  # [B_pad] (padding: request 0's)
    chain_state_starts: torch.Tensor  # [B_pad] (padding: 0)
    chain_is_real: torch.Tensor  # [B_pad] bool


@dataclass
class CapturedDraft:
    """One key's graph and its buffers."""

    graph: torch.cuda.CUDAGraph
    structure: tuple
    static_tensors: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]
    """tokens [B_pad, k] int64, probabilities [B_pad, k] float32 (and features [B_pad, k, F]), overwritten by every
    replay."""


class DraftGraphRunner(CudaGraphRunner):
    """Captures and replays whole draftings of `drafter` (an `MTPDrafter`), one graph per key `(B_pad, N_pad,
    keep_features)` (see the module docstring; at most `len(buckets) * (1 + num_draft_tokens)` keys per setting).
    `run(streams, seqs)` returns the device tensors `MTPDrafter._draft_eager` returns, or None: draft eagerly."""

    MAX_GRAPHS = 32
    MAX_REQUESTS = 64
    """Default `max_requests`: the largest bucket drafted as a graph (bounds the `[B_pad, vocab]` logits the pool
    holds)."""

    def __init__(self, drafter, batch_sizes: Sequence[int], max_queries: int, max_graphs: int | None = None,
                 max_requests: int | None = None) -> None:
        cap = self.MAX_REQUESTS if max_requests is None else max_requests
        sizes = [s for s in batch_sizes if s <= cap]
        super().__init__(drafter.layer, drafter.cache, sizes)
        self.drafter = drafter
        self.max_queries = max_queries
        """The widest committed chunk drafted as a graph (`1 + num_draft_tokens`: a fully accepted block)."""
        self.max_graphs = self.MAX_GRAPHS if max_graphs is None else max_graphs
        self.graphs: dict[tuple[int, int, bool], CapturedDraft] = {}  # type: ignore[assignment]
        self.stats.update(eager_steps=0, over_cap=0, capture_failures=0)
        self.disabled: str | None = None
        """Why drafting graphs are off for the rest of this runner's life (a capture failed), or None."""
        self._keep_shapes_off_eager_routes(self.batch_sizes[-1] * max_queries if self.batch_sizes else 0)

    def key(self, seqs) -> tuple[int, int, bool] | None:
        """`(B_pad, N_pad, keep_features)` of a drafting over `seqs` (`DraftSeq`s), or None (too many requests or
        rows: eager). `keep_features` is part of it: a graph computes the confidence features or not."""
        size = self.bucket(len(seqs))
        num_queries = max(len(s.stream_rows) for s in seqs)
        if size is None or num_queries > self.max_queries:
            return None
        return size, num_queries, self.drafter.keep_features

    def inputs(self, streams: torch.Tensor, seqs, key: tuple[int, int, bool]) -> DraftInputs:
        """The padded graph inputs of a drafting over `seqs` (host work and non-blocking copies; no device read)."""
        Bp, N = key[:2]
        B, k, device = len(seqs), self.drafter.num_draft_tokens, streams.device
        src, ids, last = [0] * (Bp * N), [0] * (Bp * N), []
        for b, s in enumerate(seqs):
            c = len(s.stream_rows)
            src[b * N:b * N + c] = s.stream_rows
            ids[b * N:b * N + c] = s.next_token_ids
            last.append(b * N + c - 1)
        last += [last[0]] * (Bp - B)
        # NOTE: padding rows take row 0's streams (any finite value: their writes mirror real rows, their outputs
        # are dropped)
        first = seqs[0]
        last_pos = [s.first_pos + len(s.stream_rows) - 1 for s in seqs]
        pairs = [(s.slot, p + j) for s, p in zip(seqs, last_pos) for j in range(1, k)]
        pairs += pairs[:k - 1] * (Bp - B)
        pad = Bp - B
        real = [SeqChunk(s.slot, [], s.first_pos, len(s.stream_rows), s.state_start) for s in seqs]
        # the committed pass's metadata inputs (sliding only: no block table); its padded positions are `p0 + i`
        committed = static_verify_inputs(real, Bp, N, (self.drafter.layer.attn.spec,), self.cache, 1)
        host = [torch.tensor(src), torch.tensor(ids), torch.tensor(last),
                torch.tensor(pairs, dtype=torch.long).view(-1, 2).t().contiguous(),
                torch.tensor(last_pos + [0] * pad), torch.tensor([s.slot for s in seqs] + [first.slot] * pad),
                torch.tensor([s.state_start for s in seqs] + [0] * pad), torch.arange(Bp) < B, *committed.tensors()]
        moved = packed_to_device(host, device)  # NOTE: one transfer for all of them
        src_rows, input_ids, last_rows, snap, chain_pos, chain_slots, chain_starts, is_real = moved[:8]
        return DraftInputs(input_ids=input_ids, streams=streams.index_select(0, src_rows), last_rows=last_rows,
                           snap_slots=snap[0], snap_positions=snap[1], committed=StaticVerifyInputs.of(moved[8:]),
                           chain_positions=chain_pos, chain_slots=chain_slots, chain_state_starts=chain_starts,
                           chain_is_real=is_real)

    def _rope_fns(self) -> dict:
        inner = self.drafter.model.model
        return {"main": inner.rotary_main, "compress": inner.rotary_compress}

    @torch.inference_mode()
    def run(self, streams: torch.Tensor, seqs):  # type: ignore[override]
        """Blocks while the drafting replays (or is captured); `(tokens [B, k], probabilities [B, k], features
        [B, k, F] or None)` of `seqs` on the device, or None when it must run eagerly."""
        key = self.key(seqs) if seqs and self.disabled is None else None
        if self._runs_eagerly(key):
            return None
        inputs = self.inputs(streams, seqs, key)
        try:
            structure, tensors = flatten(inputs)
        except UnsupportedLeaf:
            self.stats["eager_fallbacks"] += 1
            return None
        step = self.graphs.get(key)
        if step is None:
            outputs = self.capture_draft(inputs, key, structure, tensors)
        else:
            if not self._replay(step, structure, tensors):
                return None
            outputs = step.outputs
        B = len(seqs)  # NOTE: copies: the next replay overwrites the graph's outputs (a caller may keep features)
        tok, prob = outputs[0][:B].clone(), outputs[1][:B].clone()
        return tok, prob, (outputs[2][:B].clone() if len(outputs) > 2 else None)

    def capture_draft(self, inputs: DraftInputs, key: tuple[int, int, bool], structure: tuple,
                      tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Blocks while the drafting of `inputs` runs eagerly on the static buffers (the warm-up: the step itself)
        and `key` is captured; returns that eager run's outputs (fresh tensors, not the graph's)."""
        static_tensors = [t.clone() for t in tensors]  # outside the graph pool: never reused by a capture
        memo = {id(t): s for t, s in zip(tensors, static_tensors)}
        static: DraftInputs = clone_tensors(inputs, memo)
        eager = self._draft(static)
        recorded = self.record_or_disable(lambda: self._draft(static), key, "drafting")
        if recorded is None:
            return eager
        graph, outputs = recorded
        self.graphs[key] = CapturedDraft(graph, structure, static_tensors, outputs)
        self.stats["captures"] += 1
        return eager

    def _draft(self, x: DraftInputs) -> tuple[torch.Tensor, ...]:
        """The drafting's device work over static inputs (no host value read: what the graph records)."""
        d = self.drafter
        layer, cache, embed = d.layer, d.cache, d.model.model.embed_tokens
        # NOTE: outside the numerics, as the host built it before (its RoPE tables are the eager path's)
        num_queries = x.input_ids.shape[0] // x.chain_is_real.shape[0]  # N_pad committed rows per padded request
        committed = static_verify_metadata_from(x.committed, num_queries, (layer.attn.spec,), self._rope_fns(),
                                                cache.block_size, 1)
        with d.numerics():
            hidden, streams = layer(x.streams, DraftRows(x.input_ids), cache, committed, embed, return_streams=True)
            tok, prob, feat = d._greedy(hidden.index_select(0, x.last_rows), 0)
            toks, probs, feats = [tok], [prob], [feat]
            cur = streams.index_select(0, x.last_rows)  # [B_pad, hc, H]
            if d.num_draft_tokens > 1:
                rings = d.rollback.tensors
                saved = [t[:, x.snap_slots, x.snap_positions % t.shape[2]] for t in rings]
                specs, rope_fns = (layer.attn.spec,), self._rope_fns()
                for j in range(1, d.num_draft_tokens):
                    # the chained step's metadata, built on the device from the last committed positions
                    positions = torch.where(x.chain_is_real, x.chain_positions + j, 0)
                    meta = static_window_step_metadata(positions, x.chain_slots, x.chain_state_starts, x.chain_is_real,
                                                       specs, rope_fns, cache.block_size)
                    hidden, cur = layer(cur, DraftRows(toks[-1]), cache, meta, embed, return_streams=True)
                    tok, prob, feat = d._greedy(hidden, j)
                    toks.append(tok)
                    probs.append(prob)
                    feats.append(feat)
                for t, rows in zip(rings, saved):
                    t[:, x.snap_slots, x.snap_positions % t.shape[2]] = rows
        out = (torch.stack(toks, dim=1), torch.stack(probs, dim=1))
        return out + (torch.stack(feats, dim=1),) if d.keep_features else out

    def capture_dummy(self, size: int) -> None:
        """Not for draftings: they are captured lazily, from real steps (padding mirrors real rows)."""
        raise NotImplementedError("drafting graphs are captured by their first step (DraftGraphRunner.run)")

