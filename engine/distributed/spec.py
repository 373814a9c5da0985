"""Speculative decoding over the ranks of an instance: each rank verifies and drafts its own requests (SPMD).

With `EngineConfig.speculative` and `expert_parallel_size > 1`, the engine's `SpecDecoding` (rank 0's: its
drafter and ring rollback over rank 0's cache) prepares each step as in one process (`SpecPreparedStep`:
the `1 + L`-token verify chunks, one sampling row per verified position), and the multi-rank executor runs it:

1. `split_spec_step` cuts the step into one `SpecRankPlan` per rank: the `RankPlan` of the plain split (a
   request runs on the rank owning its state slot, in rank-local slot and block ids; its sampling rows with
   seeds resolved by rank 0, `engine.distributed.sampling`) plus what the rank's `SpecDecoding.run_local`
   needs for its requests: their verify entries (local seq index, local first sampling row, drafts), the
   known next tokens, the MTP state starts and which want drafts;
2. every rank runs `SpecDecoding.run_local` on its plan (the same code as one process): snapshot its ring
   rows, one target forward (the MoE layers' dispatch / combine are the collectives; a rank without requests
   joins them with zero rows, `expert_parallel.idle_step`), sample its rows, accept, roll back its rejected
   rows, then its MTP drafter's committed pass and chained drafts over its own drafter cache;
3. rank 0 gathers the `LocalSpecResult`s (token ids, logprobs, drafts, their probabilities and confidence
   features: a few numbers per draft, never logits) and `merge_spec_results` puts them back in the step's
   sampling order; `SpecDecoding.finish` (rank 0 only) records the metrics and decides the verify schedule
   over the whole batch. The decision travels as the drafts handed to the scheduler, so the next step's plan
   carries it to every rank: no rank decides anything on its own.

Async scheduling (`async_scheduling`, the default on CUDA) follows the one-process path
(`SpecExecutor(overlap_drafting=True)`): the plans are `tokens_first`, so each rank hands rank 0 its tokens in a
round of their own right after step 2's acceptance and rollback (`tokens_only`), and drafts after it; rank 0's
executor completes the step's future with the merged tokens (a `PendingSpecStepResult`) and the engine
postprocesses them while every rank drafts; the drafts (and rank 0's verify schedule) arrive with the step's
final round. Reading them is the step's one sync point: the next step is scheduled from them, so speculative
steps do not overlap each other (`MultiRankExecutor.max_inflight` is 1 with speculation).

NOTE: the MTP layer's routed experts are loaded whole on every rank (`expert_parallel.rank_load_kwargs(...,
load_mtp=True)`) and its MoE runs locally, without collectives: a rank drafts only its own requests, and a rank
without requests drafts nothing (no dummy drafter pass is needed). The cost is one MoE layer's experts per rank
(for V4-Flash about 1/43 of the routed weights); splitting them too would add `num_draft_tokens` dispatch /
combine rounds per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.distributed.plan import RankPlan, rank_of_slot, split_step
from deepinfer.engine.spec_decode.executor import LocalSpecResult, SpecPreparedStep, _Verified, _Verify


@dataclass
class SpecRankPlan(RankPlan):
    """A rank's share of a speculative step (picklable): its `RankPlan` plus its requests' verify inputs."""

    verify: list[_Verify] = field(default_factory=list)
    """Per sampling request of the rank, in the step's sampling order: local seq index, local first row, drafts."""
    next_token_ids: list[int | None] = field(default_factory=list)
    """Per request of the rank (its `seqs` order): the known token after its chunk, None for sampling ones."""
    mtp_state_starts: list[int] = field(default_factory=list)
    wants_drafts: list[bool] = field(default_factory=list)
    tokens_first: bool = False
    """Async scheduling: the rank hands rank 0 its tokens right after the verification, in a round of their own,
    and drafts after it (`worker.RankState.tokens_round`); False: one result with tokens and drafts."""

    def build_step(self, model, cache, device) -> SpecPreparedStep:
        """The rank's `SpecPreparedStep` over its own cache (local slots and block ids)."""
        from deepinfer.engine.distributed.sampling import to_device

        sampling = to_device(self.sampling, device) if self.sampling is not None else None
        return SpecPreparedStep(batch=self.build(model, cache, device), sampling_batch=sampling, verify=self.verify,
                                next_token_ids=self.next_token_ids, mtp_state_starts=self.mtp_state_starts,
                                wants_drafts=self.wants_drafts)


def split_spec_step(step: SpecPreparedStep, world_size: int, blocks_per_rank: int | None = None
                    ) -> tuple[list[SpecRankPlan], list[list[int]], list[tuple[int, int]]]:
    """`step` as one `SpecRankPlan` per rank, the sampling rows each rank's logits fill (as `split_step`), and
    per entry of `step.verify` where its result comes back: `(rank, index in that rank's verify list)`.

    NOTE: the sampling rows of the rank plans are left unset here (the executor selects them after resolving
    the seeds, as for a plain step)."""
    batch = step.batch
    plain, rows_of_rank = split_step(batch, world_size, blocks_per_rank)
    plans = [SpecRankPlan(token_ids=p.token_ids, seqs=p.seqs, logits_rows=p.logits_rows, input_embeds=p.input_embeds,
                          embeds_mask=p.embeds_mask) for p in plain]
    local_seq: list[tuple[int, int]] = []  # per seq of the batch: (rank, index among the rank's seqs)
    for i, seq in enumerate(batch.seqs):
        r = rank_of_slot(seq.slot, world_size)
        local_seq.append((r, len(plans[r].next_token_ids)))
        plans[r].next_token_ids.append(step.next_token_ids[i])
        plans[r].mtp_state_starts.append(step.mtp_state_starts[i])
        plans[r].wants_drafts.append(step.wants_drafts[i])
    local_row = [{row: n for n, row in enumerate(rows)} for rows in rows_of_rank]
    verify_at: list[tuple[int, int]] = []
    for v in step.verify:
        r, li = local_seq[v.seq_idx]
        # NOTE: a request's rows are consecutive in the step's sampling order, and a rank's rows keep that order
        first = local_row[r][v.first_row]
        verify_at.append((r, len(plans[r].verify)))
        plans[r].verify.append(_Verify(li, first, list(v.drafts)))
    return plans, rows_of_rank, verify_at


def merge_spec_results(results: list[LocalSpecResult | None], verify_at: list[tuple[int, int]]) -> LocalSpecResult:
    """The ranks' `LocalSpecResult`s (None: a rank without requests) as one, in the step's sampling order
    (`verify_at` from `split_spec_step`); the step's times are the slowest rank's."""
    sampled = any(r is not None and r.token_ids for r in results)
    out = LocalSpecResult([], [], [], [], [], max((r.model_s for r in results if r is not None), default=0.0),
                          max((r.sample_s for r in results if r is not None), default=0.0))
    for r, n in verify_at:
        part = results[r]
        if sampled:
            out.token_ids.append(part.token_ids[n])
            out.logprobs.append(part.logprobs[n])
        out.draft_token_ids.append(part.draft_token_ids[n])
        out.draft_probs.append(part.draft_probs[n])
        out.draft_features.append(part.draft_features[n])
    return out


def tokens_only(verified: _Verified, num_verify: int) -> LocalSpecResult:
    """What a rank hands rank 0 after its verification under async scheduling: its tokens and logprobs, with
    empty drafts (`num_verify` entries: its `verify` list's length), mergeable by `merge_spec_results`."""
    return LocalSpecResult(verified.token_ids, verified.logprobs, [[] for _ in range(num_verify)],
                           [[] for _ in range(num_verify)], [None] * num_verify, verified.model_s, verified.sample_s)


def to_host(result: LocalSpecResult) -> LocalSpecResult:
    """`result` with its confidence features on the host (what a rank ships to rank 0)."""
    result.draft_features = [f.cpu() if f is not None else None for f in result.draft_features]
    return result
