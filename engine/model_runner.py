"""Turns a `SchedulerOutput` into one model step over the instance's cache.

The runner owns the model and the cache tensors (`V4KVCache`) and mirrors, per request, what
the model needs: its slot, block table and the bounded-replay window of its current life. It
builds each step's `engine.attention.AttentionMetadata` once, when it prepares the batch.

`ScratchModelRunner` drives the model without a scheduler over a private cache (side passes such
as prompt logprobs; the test driver builds on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.engine.cache.kv_cache import V4KVCache, make_kv_cache
from deepinfer.engine.cache.layout import exact_replay_tokens  # noqa: F401  (re-export: the layout owns it)
from deepinfer.engine.cuda_graph import CudaGraphRunner, graph_batch_sizes, graph_blockers
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.scheduler import SchedulerOutput


@dataclass
class _RunnerReq:
    slot: int
    block_ids: list[int]
    state_start: int
    """First position computed in this life (bounded state valid from here)."""
    num_frozen_tokens: int
    """Prefix-hit tokens: their compressed entries are cached and must not be rewritten."""
    image_spans: tuple = ()
    """`engine.multimodal.ImageSpan`s of the prompt (with embeddings): replace those input rows."""
    num_prompt_tokens: int | None = None
    """The request's prompt length (`SeqChunk.num_prompt_tokens`)."""


class ModelRunner:
    """Executes scheduled steps: builds the flat batch, runs the model, returns logits to sample."""

    def __init__(self, model, cache: V4KVCache, *, enforce_eager: bool = False,
                 cuda_graph_batch_sizes: tuple[int, ...] | None = None, max_num_seqs: int | None = None) -> None:
        """`enforce_eager`: never use CUDA graphs; `cuda_graph_batch_sizes`: decode buckets (None: the
        defaults of `engine.cuda_graph`), capped at `max_num_seqs` (None: the cache's slots)."""
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.reqs: dict[str, _RunnerReq] = {}
        self.cuda_graph_blockers = ["enforce_eager"] if enforce_eager else graph_blockers(model, cache, cache.device)
        """Why decode steps run eagerly (empty: they run as CUDA graphs)."""
        self.cuda_graphs: CudaGraphRunner | None = None
        """The graph runner of pure-decode steps, or None (every step eager)."""
        if not self.cuda_graph_blockers:
            sizes = graph_batch_sizes(max_num_seqs or cache.num_slots, cuda_graph_batch_sizes)
            self.cuda_graphs = CudaGraphRunner(model, cache, sizes)
            if hasattr(model, "static_decode"):  # DeepSeek-V4.1: graphs need its static decode rows (docs/V4_1.md §16)
                model.static_decode = True
        self.defer_verify_metadata = False
        """Speculative decoding with verify graphs (`SpecDecoding.make_executor` sets it): a pure verify step (every
        request samples its `1 + L` tokens) gets no ragged `attn_metadata` here; the verify graph runner builds the
        static form, and an eager fallback builds the ragged one when it runs (`SpecDecoding.verify_local`)."""

    def capture_cuda_graphs(self, sizes: tuple[int, ...] | None = None) -> None:
        """Blocks while every bucket (or `sizes`) is captured from all-dummy batches, largest first (start-up).

        A no-op when graphs are off. The warm-up runs touch only the cache's dummy slot and block.
        """
        if self.cuda_graphs is None:
            return
        for size in sorted(sizes or self.cuda_graphs.batch_sizes, reverse=True):
            self.cuda_graphs.capture_dummy(size)

    def update_states(self, out: SchedulerOutput, num_hit_tokens: dict[str, int]) -> None:
        """Drop finished/preempted requests, register new ones, extend block tables."""
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for req_id in out.preempted_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = _RunnerReq(
                slot=new.state_slot_id,
                block_ids=list(new.block_ids),
                state_start=new.num_computed_tokens if new.state_start is None else new.state_start,
                num_frozen_tokens=num_hit_tokens.get(new.req_id, 0),
                image_spans=new.image_spans,
                num_prompt_tokens=new.num_prompt_tokens,
            )
        for run in out.scheduled_running_reqs:
            self.reqs[run.req_id].block_ids.extend(run.new_block_ids)

    def execute(self, out: SchedulerOutput, token_ids_of: dict[str, list[int]]) -> torch.Tensor:
        """Run the step; returns float32 logits [len(out.sampling_req_ids), vocab] in that order."""
        return self.run(self.prepare(out, token_ids_of))

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Blocks while the model runs `batch` (a graph replay when it can); float32 logits of its `logits_indices`."""
        if self.cuda_graphs is not None:
            logits = self.cuda_graphs.run(batch)
            if logits is not None:
                return logits
        return self.model.step(batch, self.cache)

    def prepare(self, out: SchedulerOutput, token_ids_of: dict[str, list[int]]) -> ForwardBatch:
        """The flat batch of a step, with copies of the block tables (safe to run on another thread).

        `token_ids_of[req_id]` are all known token ids of each scheduled request.
        """
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        starts.update({r.req_id: r.num_computed_tokens for r in out.scheduled_running_reqs})
        order = [n.req_id for n in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_running_reqs]
        seqs, chunks, last_index, off = [], [], {}, 0
        image_rows: list[tuple[int, torch.Tensor]] = []  # (flat row, embeds [k, hidden]) of image positions
        for req_id in order:
            n = out.num_scheduled_tokens[req_id]
            p0 = starts[req_id]
            st = self.reqs[req_id]
            seqs.append(SeqChunk(st.slot, list(st.block_ids), p0, n, st.state_start, st.num_frozen_tokens,
                                 st.num_prompt_tokens))
            chunks.append(token_ids_of[req_id][p0:p0 + n])
            for span in st.image_spans:  # NOTE: a chunk may cover any part of a span
                a, b = max(p0, span.offset), min(p0 + n, span.offset + span.num_tokens)
                if a < b:
                    if span.embeds is None:
                        raise RuntimeError(f"request {req_id}: image at {span.offset} has no embeddings")
                    image_rows.append((off + a - p0, span.embeds[a - span.offset:b - span.offset]))
            off += n
            last_index[req_id] = off - 1
        logits_idx = [last_index[r] for r in out.sampling_req_ids]
        num_dummy_rows = 0
        if self.cuda_graphs is not None and not image_rows and 0 < off == len(seqs):  # pure decode: pad to a bucket
            size = self.cuda_graphs.bucket(off)
            if size is not None:
                num_dummy_rows = size - off
                chunks, seqs = self.cuda_graphs.pad(chunks, seqs, size)
        batch = ForwardBatch.build(chunks, seqs, device=self.device, logits=logits_idx)
        batch.num_dummy_rows = num_dummy_rows
        if image_rows:
            embeds = torch.zeros(off, image_rows[0][1].shape[-1], dtype=image_rows[0][1].dtype, device=self.device)
            mask = torch.zeros(off, dtype=torch.bool, device=self.device)
            for row, e in image_rows:
                embeds[row:row + e.shape[0]] = e
                mask[row:row + e.shape[0]] = True
            batch.input_embeds, batch.embeds_mask = embeds, mask  # [num_tokens, hidden], [num_tokens]
        if self.defer_verify_metadata and not image_rows and len(out.sampling_req_ids) == len(order) and all(
                out.num_scheduled_tokens[r] == 1 + len(out.scheduled_spec_token_ids.get(r, ())) for r in order):
            return batch  # a pure verify step: its metadata is the verify graph runner's (or the eager fallback's)
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)  # once per step
        return batch


class ScratchModelRunner:
    """Runs the model for up to `max_seqs` sequences of up to `max_len` tokens over a private cache.

    No scheduler: each sequence gets its own slot and a contiguous run of blocks, and `run` takes
    `(seq_index, new_token_ids)` pairs as one flat batch. For side computations that must not touch
    the instance's cache (`Engine.prompt_logprobs`), and the base of the test driver.
    """

    def __init__(self, model, max_seqs: int = 4, max_len: int = 512, block_size: int | None = None) -> None:
        cfg = model.config
        self.block_size = block_size or math.lcm(*cfg.compress_rates.values())
        blocks_per_seq = -(-max_len // self.block_size)
        embed = getattr(model, "embed", None) or model.model.embed_tokens  # V4.1's embedding is top level
        dtype, device = embed.weight.dtype, embed.weight.device
        self.model = model
        self.cache = make_kv_cache(cfg, blocks_per_seq * max_seqs, self.block_size, max_seqs, dtype=dtype,
                                   device=device)  # V4's or V4.1's anatomy
        self.tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(max_seqs)]
        """Per sequence: its block table."""
        self.lens = [0] * max_seqs
        """Per sequence: tokens computed so far."""
        self.device = device

    def batch(self, work: list[tuple[int, list[int]]], logits: str | list[int] = "last") -> ForwardBatch:
        """The flat batch of `(seq, new_token_ids)` pairs (with its attention metadata); runs nothing."""
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], len(ids)) for i, ids in work]
        batch = ForwardBatch.build([ids for _, ids in work], seqs, device=self.device, logits=logits)
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        return batch

    def run_batch(self, batch: ForwardBatch) -> torch.Tensor:
        """Blocks while the model runs `batch` (from `batch`) over the private cache; float32 logits of its
        `logits_indices`. Advances each sequence's length."""
        out = self.model.step(batch, self.cache)
        for s in batch.seqs:
            self.lens[s.slot] += s.num_new_tokens
        return out

    def run(self, work: list[tuple[int, list[int]]], logits: str | list[int] = "last") -> torch.Tensor:
        """One step over `(seq, new_token_ids)` pairs; returns float32 logits (last token of each, or all)."""
        return self.run_batch(self.batch(work, logits))

    def prefill(self, seq: int, ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Feed `ids` in chunks; return the last token's logits [vocab]."""
        chunk = chunk or len(ids)
        out = None
        for a in range(0, len(ids), chunk):
            out = self.run([(seq, ids[a:a + chunk])])
        return out[0]
