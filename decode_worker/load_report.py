"""The decode work a decode instance reports to its balancer, beyond KV blocks: free state slots and the output
tokens its requests may still generate, per rank of a multi-rank instance and in all (`LoadReport`'s
`num_free_slots` / `num_output_tokens_left`, read by the `decode_work` and `kv_load` policies).

Why: KV blocks track the prompt (and the tokens so far), not the work left; a request's remaining output is known
at pick time (its max_tokens less the tokens it has), so the balancer can place decode work rather than memory.
And each decode request holds a state slot from Reserve to its end (`max_num_seqs` per instance, split over the
ranks): a rank with no free slot refuses a Reserve whatever its free blocks, so the balancer must see the slots.

`fill_decode_work` is pure (the report, the requests' progress, the free slots): the shell calls it on its loop
thread with what it tracks per reserved request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from deepinfer.protos import loadbalancer_pb2


@dataclass(frozen=True)
class RequestWork:
    """One unfinished request on the instance, as the load report counts it."""

    rank: int
    """The rank whose pools hold it (0 on a one-rank instance)."""
    num_output_tokens_left: int
    """Output tokens it may still generate (never negative)."""


def output_tokens_left(max_tokens: int | None, num_prompt_tokens: int, num_output_tokens: int,
                       max_model_len: int) -> int:
    """Output tokens a request may still generate: its `max_tokens` (else the context left after the prompt) less the
    tokens it has, capped by the context length."""
    budget = max_model_len - num_prompt_tokens
    if max_tokens is not None:
        budget = min(budget, max_tokens)
    return max(0, budget - num_output_tokens)


def fill_decode_work(report: loadbalancer_pb2.LoadReport, requests: Iterable[RequestWork],
                     free_slots: Sequence[int]) -> loadbalancer_pb2.LoadReport:
    """Set `num_free_slots` and `num_output_tokens_left` on `report` (and on each of its `ranks`, a multi-rank
    instance's) from the unfinished requests and the free state slots per rank (`free_slots[rank]`; one entry for
    a one-rank instance); returns `report`. A request of a rank the report does not list counts in the total only."""
    per_rank = [0] * max(len(free_slots), 1)
    total = 0
    for r in requests:
        total += r.num_output_tokens_left
        if 0 <= r.rank < len(per_rank):
            per_rank[r.rank] += r.num_output_tokens_left
    for rank_load in report.ranks:
        if rank_load.rank < len(free_slots):
            rank_load.num_free_slots = free_slots[rank_load.rank]
            rank_load.num_output_tokens_left = per_rank[rank_load.rank]
    report.num_free_slots = sum(free_slots)
    report.num_output_tokens_left = total
    return report


def engine_free_slots(engine) -> list[int]:
    """Free state slots per rank of the engine (`RankedStateSlotPool`), or one figure for a one-rank engine."""
    slots = engine.slots
    world = engine.config.expert_parallel_size
    if world > 1 and hasattr(slots, "num_free_slots_of"):
        return [slots.num_free_slots_of(r) for r in range(world)]
    return [slots.num_free_slots]


def engine_rank_of(engine) -> Callable[[str], int | None]:
    """The rank a request's blocks live on (`RankedKVCacheManager.rank_of`); None for a request not placed now
    (e.g. preempted); always 0 on a one-rank engine."""
    rank_of = getattr(engine.kv_manager, "rank_of", None)
    return rank_of if rank_of is not None else (lambda req_id: 0)
