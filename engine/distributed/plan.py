"""A step's plan per rank: attention data parallelism over one scheduler's batch.

Rank 0 holds the scheduler view: one `Scheduler` over one slot pool and one block-id space cut in
per-rank pools (`engine.distributed.kv_pools`: global id `rank * blocks_per_rank + local`; each rank's
cache holds `blocks_per_rank` blocks). A request belongs to the rank `rank_of_slot(slot)` for as long
as it holds its state slot, and its blocks are that rank's, so each rank owns its requests and their KV;
`split_step` hands a rank its requests' block tables in local ids. `split_step` cuts the engine's flat
batch into one `RankPlan` per rank; a rank builds its own batch and attention metadata from it
(`RankPlan.build`). A rank whose plan is empty joins the step's MoE collectives with zero rows
(`engine.distributed.expert_parallel.idle_step`).

NOTE: a preempted request that resumes in a slot of another rank recomputes its KV there (its blocks were
freed); a prefix hit is only taken on the rank holding the prefix (`kv_pools.RankedKVCacheManager`).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field

import torch

from deepinfer.engine.distributed.kv_pools import to_local_block_table
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.sampling.sampler import SamplingBatch


def rank_of_slot(slot: int, world_size: int) -> int:
    """The rank that owns a request holding state slot `slot` (slots interleave over the ranks, so the
    lowest free slots, which the pool hands out first, spread new requests over all ranks)."""
    return slot % world_size


@dataclass
class RankPlan:
    """One rank's share of a step (picklable: shipped from rank 0 to the rank)."""

    token_ids: list[list[int]] = field(default_factory=list)
    """Per request of the rank: the step's new token ids."""
    seqs: list[SeqChunk] = field(default_factory=list)
    """Per request of the rank: its cache handles (slot, block table, positions)."""
    logits_rows: list[int] = field(default_factory=list)
    """Flat indices (in the rank's batch) whose logits the step samples, in the order rank 0 expects them."""
    sampling: SamplingBatch | None = None
    """The sampling inputs of the rank's `logits_rows`, seeds resolved (`engine.distributed.sampling`); None when
    the step samples nothing here."""
    input_embeds: torch.Tensor | None = None
    """[num_tokens, hidden] image embeddings replacing rows where `embeds_mask` is set, or None."""
    embeds_mask: torch.Tensor | None = None

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def build(self, model, cache, device) -> ForwardBatch:
        """The rank's `ForwardBatch` with its attention metadata (built on the rank, over its cache)."""
        batch = ForwardBatch.build(self.token_ids, self.seqs, device=device, logits=self.logits_rows)
        if self.input_embeds is not None:
            batch.input_embeds, batch.embeds_mask = self.input_embeds.to(device), self.embeds_mask.to(device)
        batch.attn_metadata = model.build_attention_metadata(batch, cache)
        return batch


def split_step(batch: ForwardBatch, world_size: int,
               blocks_per_rank: int | None = None) -> tuple[list[RankPlan], list[list[int]]]:
    """The engine's flat batch as one plan per rank, and per rank the step's sampling rows its logits
    fill (`rows_of_rank[r][i]` is the row of `plans[r].logits_rows[i]`). `blocks_per_rank`: block tables
    are global ids of per-rank pools and become the rank's local ids, and slot `s` becomes the rank's local
    slot `s // world_size` (None: both left as they are)."""
    if batch.num_dummy_rows:
        raise ValueError("a multi-rank step cannot carry CUDA-graph padding rows (the engine runs it eagerly)")
    plans = [RankPlan() for _ in range(world_size)]
    ids = batch.input_ids.tolist()
    local_start: list[int] = []
    num_tokens = [0] * world_size
    for seq, start in zip(batch.seqs, batch.starts):
        r = rank_of_slot(seq.slot, world_size)
        if blocks_per_rank is not None:  # the rank's own pools: local block ids, local slot (slots interleave)
            seq = dataclasses.replace(seq, slot=seq.slot // world_size,
                                      block_table=to_local_block_table(seq.block_table, blocks_per_rank, r))
        plans[r].seqs.append(seq)
        plans[r].token_ids.append(ids[start:start + seq.num_new_tokens])
        local_start.append(num_tokens[r])
        num_tokens[r] += seq.num_new_tokens
    rows_of_rank: list[list[int]] = [[] for _ in range(world_size)]
    logits = batch.logits_indices.tolist() if batch.logits_indices is not None else []
    for row, flat in enumerate(logits):
        i = bisect.bisect_right(batch.starts, flat) - 1
        r = rank_of_slot(batch.seqs[i].slot, world_size)
        plans[r].logits_rows.append(local_start[i] + flat - batch.starts[i])
        rows_of_rank[r].append(row)
    if batch.input_embeds is not None:
        for r, plan in enumerate(plans):
            rows = [torch.arange(start, start + s.num_new_tokens) for s, start in zip(batch.seqs, batch.starts)
                    if rank_of_slot(s.slot, world_size) == r]
            if rows:
                idx = torch.cat(rows).to(batch.input_embeds.device)
                plan.input_embeds, plan.embeds_mask = batch.input_embeds[idx].cpu(), batch.embeds_mask[idx].cpu()
    return plans, rows_of_rank
