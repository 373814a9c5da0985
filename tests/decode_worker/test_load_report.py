"""The decode work a decode instance reports (`decode_worker.load_report`): output tokens left per request, summed
per rank and in all, and the free state slots, on the wire's `LoadReport` the balancer reads."""

from __future__ import annotations

from types import SimpleNamespace

from deepinfer.decode_worker.load_report import (
    RequestWork,
    engine_free_slots,
    engine_rank_of,
    fill_decode_work,
    output_tokens_left,
)
from deepinfer.engine.cache.block_pool import StateSlotPool
from deepinfer.engine.distributed.kv_pools import RankedStateSlotPool
from deepinfer.loadbalancer.server import load_from_proto
from deepinfer.protos import loadbalancer_pb2


def test_output_tokens_left():
    assert output_tokens_left(48, 10, 5, 4096) == 43
    assert output_tokens_left(None, 10, 5, 100) == 85  # no max_tokens: up to the context length
    assert output_tokens_left(200, 10, 5, 100) == 85  # the context caps max_tokens
    assert output_tokens_left(4, 10, 9, 100) == 0  # never negative


def test_fill_decode_work_per_rank_and_in_all():
    report = loadbalancer_pb2.LoadReport(ranks=[loadbalancer_pb2.RankLoad(rank=r) for r in range(2)])
    work = [RequestWork(0, 10), RequestWork(1, 7), RequestWork(1, 3), RequestWork(5, 100)]  # rank 5: total only
    load = load_from_proto(fill_decode_work(report, work, [0, 3]))
    assert [(r.num_output_tokens_left, r.num_free_slots) for r in load.ranks] == [(10, 0), (10, 3)]
    assert (load.num_output_tokens_left, load.num_free_slots) == (120, 3)
    one = load_from_proto(fill_decode_work(loadbalancer_pb2.LoadReport(), [RequestWork(0, 9)], [2]))
    assert (one.ranks, one.num_output_tokens_left, one.num_free_slots) == ((), 9, 2)


def test_engine_slots_and_ranks():
    ranked = RankedStateSlotPool(4, 2)
    ranked.rank_of_request = lambda req_id: 1
    ranked.allocate("a")
    engine = SimpleNamespace(slots=ranked, config=SimpleNamespace(expert_parallel_size=2),
                             kv_manager=SimpleNamespace(rank_of={"a": 1}.get))
    assert engine_free_slots(engine) == [2, 1]
    assert engine_rank_of(engine)("a") == 1 and engine_rank_of(engine)("gone") is None
    plain = StateSlotPool(3)
    plain.allocate("a")
    one = SimpleNamespace(slots=plain, config=SimpleNamespace(expert_parallel_size=1), kv_manager=SimpleNamespace())
    assert engine_free_slots(one) == [2] and engine_rank_of(one)("a") == 0
