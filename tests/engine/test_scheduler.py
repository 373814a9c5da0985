"""Unit tests of the continuous-batching scheduler, driven by a fake engine (no model)."""

from __future__ import annotations

import itertools
import random
import zlib
from collections import Counter, deque

import pytest

from deepinfer.engine.cache.block_pool import BlockPool, KVCacheManager, StateSlotPool
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.scheduler import (
    ImageSpan,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

_arrival = itertools.count()


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_num_seqs: int = 8,
    max_model_len: int = 1024,
    chunked: bool = True,
    policy: str = "fcfs",
    num_slots: int = 16,
    prefix_caching: bool = True,
    replay_tokens_fn=None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    kv = KVCacheManager(BlockPool(num_blocks, block_size, prefix_caching))
    return Scheduler(config, kv, StateSlotPool(num_slots), replay_tokens_fn=replay_tokens_fn)


def make_request(
    req_id: str, num_prompt_tokens: int = 6, *, max_tokens: int = 4, priority: int = 0, prompt=None
) -> Request:
    if prompt is None:
        rng = random.Random(req_id)
        prompt = [rng.randrange(5000) for _ in range(num_prompt_tokens)]
    return Request(req_id, prompt, max_tokens=max_tokens, priority=priority, arrival_time=float(next(_arrival)))


def token_for(req_id: str, i: int) -> int:
    return 10_000 + zlib.crc32(f"{req_id}/{i}".encode()) % 10_000


class FakeEngine:
    """Samples `token_for(req_id, i)` as the i-th token of a request and reports "length" at max_tokens.

    Like a real engine it samples for every `sampling_req_ids` entry, even for a request that was
    finished while the step was in flight (the scheduler must ignore those).
    """

    def __init__(self, requests: list[Request]) -> None:
        self.max_tokens = {r.req_id: r.max_tokens for r in requests}
        self.num_sampled: Counter[str] = Counter()

    def run(self, out: SchedulerOutput) -> tuple[dict[str, list[int]], dict[str, str]]:
        new_token_ids, finished = {}, {}
        for req_id in out.sampling_req_ids:
            i = self.num_sampled[req_id]
            self.num_sampled[req_id] += 1
            new_token_ids[req_id] = [token_for(req_id, i)]
            if i + 1 >= self.max_tokens[req_id]:
                finished[req_id] = "length"
        return new_token_ids, finished


def check_invariants(sched: Scheduler, out: SchedulerOutput, next_start: dict[str, int]) -> None:
    cfg = sched.config
    kv = sched.kv_cache_manager
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    assert len(sched.running) <= cfg.max_num_seqs
    refs: Counter[int] = Counter()
    slot_ids = []
    for req in sched.requests.values():
        block_ids = kv.get_block_ids(req)
        refs.update(block_ids)
        slot_id = sched.state_slot_pool.get_slot_id(req.req_id)
        if req.status == RequestStatus.RUNNING:
            assert slot_id is not None
            slot_ids.append(slot_id)
            assert len(block_ids) * kv.block_size >= req.num_computed_tokens
            assert req.num_computed_tokens <= req.num_tokens_with_placeholders
        else:
            assert slot_id is None and not block_ids
    assert len(set(slot_ids)) == len(slot_ids)
    for block_id in range(kv.num_blocks):
        assert kv.block_pool.ref_count(block_id) == refs[block_id]
    # positions scheduled for a request are contiguous, except when it (re)starts as a new request
    new_ids = {d.req_id for d in out.scheduled_new_reqs}
    for data in out.scheduled_running_reqs:
        # (a drive that starts mid-way has not seen a request's earlier steps)
        assert data.num_computed_tokens == next_start.get(data.req_id, data.num_computed_tokens)
    for data in [*out.scheduled_new_reqs, *out.scheduled_running_reqs]:
        next_start[data.req_id] = data.num_computed_tokens + out.num_scheduled_tokens[data.req_id]
    assert new_ids.isdisjoint(d.req_id for d in out.scheduled_running_reqs)


def drive(sched: Scheduler, engine: FakeEngine, *, lag: int = 0, max_steps: int = 5_000) -> list[SchedulerOutput]:
    """Run schedule -> engine -> update until every request finished; `lag` steps stay in flight."""
    outputs: list[SchedulerOutput] = []
    pending: deque = deque()
    next_start: dict[str, int] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            while pending:
                sched.update_from_output(*pending.popleft())
            return outputs
        out = sched.schedule()
        check_invariants(sched, out, next_start)
        outputs.append(out)
        pending.append((out, *engine.run(out)))
        while len(pending) > lag:
            sched.update_from_output(*pending.popleft())
    raise AssertionError(f"requests still unfinished after {max_steps} steps: the scheduler is stuck")


def finish_prefill(sched: Scheduler, engine: FakeEngine) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, *engine.run(out))
    return out


# ---------------------------------------------------------------------------------------- config and request


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="enable_chunked_prefill=True"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=1000, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=1000, max_model_len=1000, enable_chunked_prefill=False)
    with pytest.raises(ValueError):
        SchedulerConfig(policy="lifo")
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_token=5)  # typo: unknown field
    cfg = SchedulerConfig()
    with pytest.raises(ValueError):
        cfg.max_num_seqs = 3  # frozen


def test_request_status_and_finish_reasons():
    assert not RequestStatus.RUNNING.is_finished and not RequestStatus.PREEMPTED.is_finished
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.FINISHED_ERROR.finish_reason == "error"
    assert RequestStatus.WAITING.finish_reason is None
    assert RequestStatus.from_finish_reason("stop") is RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="unknown finish reason"):
        RequestStatus.from_finish_reason("eos")
    req = make_request("a", 3)
    req.append_output_token_ids([7, 8])
    assert req.num_tokens == 5 and req.all_token_ids[-2:] == [7, 8] and req.num_prompt_tokens == 3
    spans = Request("b", list(range(12)), image_spans=(ImageSpan(3, 6, "h1"), ImageSpan(9, 2, "h2")))
    assert spans.extra_keys_for_block(0, 4) == ("h1",)
    assert spans.extra_keys_for_block(4, 8) == ("h1",)
    assert spans.extra_keys_for_block(8, 12) == ("h1", "h2")


def test_add_request_refuses_bad_requests():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    sched.add_request(make_request("a", 3))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add_request(make_request("a", 3))
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(make_request("e", 0))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        sched.add_request(make_request("long", 32))
    with pytest.raises(InvalidRequestError, match="cache blocks"):
        sched.add_request(make_request("big", 20))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        sched.add_request(make_request("z", 3, max_tokens=0))
    assert sched.num_waiting == 1


# ---------------------------------------------------------------------------------------- batching policy


def test_budget_and_invariants_hold_every_step():
    sched = make_scheduler(num_blocks=40, budget=16, max_num_seqs=5)
    reqs = [make_request(f"r{i}", 3 + (i * 7) % 23, max_tokens=1 + i % 6) for i in range(12)]
    for r in reqs:
        sched.add_request(r)
    outputs = drive(sched, FakeEngine(reqs))
    assert all(o.total_num_scheduled_tokens <= 16 for o in outputs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == [token_for(r.req_id, i) for i in range(r.max_tokens)]
    assert sched.kv_cache_manager.num_free_blocks == 40
    assert sched.state_slot_pool.num_free_slots == 16


def test_decode_first_then_partial_prefill_then_waiting():
    sched = make_scheduler(budget=8)
    a, b, c, d = (make_request(x, n, max_tokens=10) for x, n in (("a", 3), ("b", 3), ("c", 20), ("d", 5)))
    engine = FakeEngine([a, b, c, d])
    sched.add_request(a)
    sched.add_request(b)
    out = finish_prefill(sched, engine)
    assert out.num_scheduled_tokens == {"a": 3, "b": 3} and out.sampling_req_ids == ["a", "b"]
    sched.add_request(c)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    assert out.sampling_req_ids == ["a", "b"]  # c is mid-prefill: no token
    sched.update_from_output(out, *engine.run(out))
    sched.add_request(d)
    out = sched.schedule()
    # decodes, then c's next chunk fills the budget; d waits
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]
    assert sched.num_waiting == 1


def test_decodes_take_the_budget_before_prefills():
    sched = make_scheduler(budget=2)
    a, b, c = make_request("a", 2, max_tokens=5), make_request("b", 2, max_tokens=5), make_request("c", 5)
    engine = FakeEngine([a, b, c])
    sched.add_request(a)
    finish_prefill(sched, engine)
    sched.add_request(b)
    finish_prefill(sched, engine)  # a decodes 1, b prefills 1 (chunked)
    finish_prefill(sched, engine)  # a decodes 1, b finishes its prompt
    sched.add_request(c)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_of_a_long_prompt(budget):
    sched = make_scheduler(budget=budget, num_blocks=64)
    req = make_request("long", 100, max_tokens=2)
    engine = FakeEngine([req])
    sched.add_request(req)
    chunks, sampled = [], []
    while req.num_computed_tokens < 100:
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["long"])
        sampled.append(bool(out.sampling_req_ids))
        new_token_ids, finished = engine.run(out)
        sched.update_from_output(out, new_token_ids, finished)
    expected = [min(budget, 100 - i) for i in range(0, 100, budget)]
    assert chunks == expected
    assert sampled == [False] * (len(expected) - 1) + [True]
    assert req.output_token_ids == [token_for("long", 0)]
    drive(sched, engine)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_step():
    sched = make_scheduler(budget=10, max_model_len=10, chunked=False)
    a, c, b = make_request("a", 2, max_tokens=2), make_request("c", 2, max_tokens=2), make_request("b", 9)
    engine = FakeEngine([a, b, c])
    sched.add_request(a)
    sched.add_request(c)
    finish_prefill(sched, engine)
    sched.add_request(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}  # b's 9 tokens do not fit the 8 left, unsplit
    sched.update_from_output(out, *engine.run(out))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 9}


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    reqs = [make_request(f"r{i}", 4, max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [d.req_id for d in out.scheduled_new_reqs] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 3
    sched.update_from_output(out, *FakeEngine(reqs).run(out))
    outputs = drive(sched, FakeEngine(reqs))
    assert all(len(o.num_scheduled_tokens) <= 2 for o in outputs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


def test_state_slots_cap_running_requests():
    sched = make_scheduler(max_num_seqs=8, num_slots=1)
    reqs = [make_request(f"r{i}", 4, max_tokens=2) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    outputs = drive(sched, FakeEngine(reqs))
    assert all(len(o.num_scheduled_tokens) <= 1 for o in outputs)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in reqs)


@pytest.mark.parametrize("policy, expected", [("priority", ["r1", "r2", "r0"]), ("fcfs", ["r0", "r1", "r2"])])
def test_admission_order_by_policy(policy, expected):
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    reqs = [make_request("r0", 4, priority=2), make_request("r1", 4, priority=0), make_request("r2", 4, priority=1)]
    for r in reqs:
        sched.add_request(r)
    outputs = drive(sched, FakeEngine(reqs))
    assert [d.req_id for o in outputs for d in o.scheduled_new_reqs] == expected


# ---------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("policy, victim", [("fcfs", "b"), ("priority", "a")])
def test_preemption_victim(policy, victim):
    sched = make_scheduler(num_blocks=3, block_size=4, policy=policy)
    a = make_request("a", 4, max_tokens=3, priority=1)  # arrives first, lower priority
    b = make_request("b", 8, max_tokens=3, priority=0)
    engine = FakeEngine([a, b])
    sched.add_request(a)
    sched.add_request(b)
    finish_prefill(sched, engine)  # 1 + 2 blocks: the pool is full
    out = sched.schedule()  # both need a new block for their first decode
    assert out.preempted_req_ids == [victim]
    survivor = "a" if victim == "b" else "b"
    assert out.num_scheduled_tokens == {survivor: 1}
    victim_req = a if victim == "a" else b
    assert victim_req.status == RequestStatus.PREEMPTED and victim_req.num_computed_tokens == 0
    assert sched.waiting[0] is victim_req
    assert sched.kv_cache_manager.num_blocks_held(victim_req) == 0
    assert sched.state_slot_pool.get_slot_id(victim) is None
    sched.update_from_output(out, *engine.run(out))
    drive(sched, engine)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert victim_req.num_preemptions >= 1


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_tiny_pool_completes_everything(lag, prefix_caching):
    sched = make_scheduler(num_blocks=6, block_size=4, budget=8, prefix_caching=prefix_caching)
    reqs = [make_request(f"r{i}", 5 + i, max_tokens=9 - i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    outputs = drive(sched, FakeEngine(reqs), lag=lag)
    assert sched.num_preemptions > 0
    assert any(d.is_resumed for o in outputs for d in o.scheduled_new_reqs)
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH, r.error_message
        assert r.output_token_ids == [token_for(r.req_id, i) for i in range(r.max_tokens)]
    assert sched.kv_cache_manager.num_free_blocks == 6
    assert sched.state_slot_pool.num_free_slots == 16


def test_resumed_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=3, block_size=4, prefix_caching=False)
    a = make_request("a", 4, max_tokens=6)
    b = make_request("b", 8, max_tokens=6)
    engine = FakeEngine([a, b])
    sched.add_request(a)
    sched.add_request(b)
    finish_prefill(sched, engine)
    out = sched.schedule()
    assert out.preempted_req_ids == ["b"]
    sched.update_from_output(out, *engine.run(out))
    while b.status != RequestStatus.RUNNING:
        out = sched.schedule()
        sched.update_from_output(out, *engine.run(out))
    (data,) = [d for d in out.scheduled_new_reqs if d.req_id == "b"]
    assert data.is_resumed and data.num_computed_tokens == 0
    assert data.token_ids == b.prompt_token_ids + [token_for("b", 0)]


def test_request_that_can_never_fit_finishes_with_error():
    sched = make_scheduler(num_blocks=2, block_size=4)
    req = make_request("a", 5, max_tokens=10)
    sched.add_request(req)
    outputs = drive(sched, FakeEngine([req]))
    assert req.status == RequestStatus.FINISHED_ERROR and req.finish_reason == "error"
    assert "cache blocks" in req.error_message and "more cache" in req.error_message
    assert req.num_output_tokens == 4  # positions 0..7 fit the two blocks
    assert any(o.error_messages.get("a") for o in outputs)
    assert any("a" in o.finished_req_ids for o in outputs)
    assert sched.kv_cache_manager.num_free_blocks == 2
    assert sched.state_slot_pool.num_free_slots == 16


# ---------------------------------------------------------------------------------------- abort and finish


def test_abort_frees_blocks_and_slot():
    sched = make_scheduler(num_blocks=8)
    a, b = make_request("a", 9, max_tokens=5), make_request("b", 4, max_tokens=5)
    engine = FakeEngine([a, b])
    sched.add_request(a)
    out = sched.schedule()
    assert sched.kv_cache_manager.num_free_blocks == 5
    sched.add_request(b)
    assert sched.abort_request("a") and sched.abort_request("b")
    assert not sched.abort_request("a") and not sched.abort_request("nobody")
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert sched.kv_cache_manager.num_free_blocks == 8
    assert sched.state_slot_pool.num_free_slots == 16
    assert sched.num_waiting == sched.num_running == 0
    assert sched.update_from_output(out, *engine.run(out)) == []  # the step in flight is ignored
    assert a.num_output_tokens == 0
    out = sched.schedule()
    assert out.finished_req_ids == ["a", "b"] and out.total_num_scheduled_tokens == 0
    assert sched.schedule().finished_req_ids == []


def test_engine_reported_stop_and_length_cap():
    sched = make_scheduler(max_model_len=8)
    a, b = make_request("a", 3, max_tokens=10), make_request("b", 5, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    finished = sched.update_from_output(out, {"a": [1], "b": [2]}, {"a": "stop"})
    assert finished == [a] and a.status == RequestStatus.FINISHED_STOPPED
    while not b.is_finished:
        out = sched.schedule()
        sched.update_from_output(out, {"b": [3]}, {})
    assert b.status == RequestStatus.FINISHED_LENGTH and b.num_tokens == 8


def test_update_from_output_checks_its_input():
    sched = make_scheduler(budget=4)
    a = make_request("a", 6)
    sched.add_request(a)
    out1 = sched.schedule()
    out2 = sched.schedule()
    with pytest.raises(ValueError, match="oldest step in flight"):
        sched.update_from_output(out2, {}, {})
    with pytest.raises(ValueError, match="samples none"):
        sched.update_from_output(out1, {"a": [5]}, {})
    sched.update_from_output(out1, {}, {})
    with pytest.raises(ValueError, match="got no token"):
        sched.update_from_output(out2, {}, {})
    with pytest.raises(ValueError, match="unknown finish reason"):
        sched.update_from_output(out2, {"a": [5]}, {"a": "eos"})


# ---------------------------------------------------------------------------------------- prefix cache, replay, import


def test_prefix_hit_reuses_block_ids():
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 110))
    a = make_request("a", prompt=prompt, max_tokens=3)
    engine = FakeEngine([a])
    sched.add_request(a)
    out = finish_prefill(sched, engine)
    a_block_ids = out.scheduled_new_reqs[0].block_ids
    b = make_request("b", prompt=prompt[:8] + [1, 2, 3], max_tokens=3)
    engine.max_tokens["b"] = 3
    sched.add_request(b)
    out = sched.schedule()
    (data,) = out.scheduled_new_reqs
    assert data.num_computed_tokens == 8 and out.num_scheduled_tokens["b"] == 3
    assert data.block_ids[:2] == a_block_ids[:2] and data.block_ids[2] != a_block_ids[2]
    pool = sched.kv_cache_manager.block_pool
    assert [pool.ref_count(i) for i in a_block_ids[:2]] == [2, 2]
    sched.update_from_output(out, *engine.run(out))
    drive(sched, engine)
    assert [pool.ref_count(i) for i in a_block_ids] == [0, 0, 0]
    assert sched.kv_cache_manager.num_prefix_hit_tokens == 8


def test_prefix_hit_with_bounded_replay_keeps_hit_blocks():
    sched = make_scheduler(block_size=4, replay_tokens_fn=lambda num_hit: min(num_hit, 3))
    prompt = list(range(200, 213))
    a = make_request("a", prompt=prompt, max_tokens=1)
    engine = FakeEngine([a])
    sched.add_request(a)
    drive(sched, engine)
    b = make_request("b", prompt=prompt, max_tokens=2)
    engine.max_tokens["b"] = 2
    sched.add_request(b)
    out = sched.schedule()
    (data,) = out.scheduled_new_reqs
    assert data.num_computed_tokens == 12 - 3  # hit of 3 full blocks, 3 tokens replayed
    assert out.num_scheduled_tokens["b"] == 13 - 9
    assert len(data.block_ids) == 4
    assert sched.kv_cache_manager.block_pool.num_cached_blocks == 3
    sched.update_from_output(out, *engine.run(out))
    drive(sched, engine)
    assert b.status == RequestStatus.FINISHED_LENGTH


def test_imported_kv_starts_at_its_computed_tokens():
    sched = make_scheduler(block_size=4, replay_tokens_fn=lambda num_hit: 2)
    kv = sched.kv_cache_manager
    req = make_request("d", 8, max_tokens=3)
    req.append_output_token_ids([42])  # prefill sampled the first token
    block_ids = kv.import_blocks(req, 9)
    req.num_computed_tokens = 8  # the transfer wrote the prompt's KV
    sched.add_request(req)
    out = sched.schedule()
    (data,) = out.scheduled_new_reqs
    assert data.block_ids == block_ids
    assert data.num_computed_tokens == 6 and out.num_scheduled_tokens["d"] == 3
    assert out.sampling_req_ids == ["d"]
    assert kv.block_pool.num_cached_blocks == 2


# ---------------------------------------------------------------------------------------- async scheduling


def test_async_schedules_the_next_decode_before_the_update():
    sched = make_scheduler()
    a = make_request("a", 5, max_tokens=3)
    engine = FakeEngine([a])
    sched.add_request(a)
    out1 = sched.schedule()
    assert out1.sampling_req_ids == ["a"] and a.num_output_placeholders == 1
    out2 = sched.schedule()  # step 1 still in flight
    assert out2.num_scheduled_tokens == {"a": 1}
    assert out2.scheduled_running_reqs[0].num_computed_tokens == 5
    assert a.num_output_placeholders == 2
    sched.update_from_output(out1, *engine.run(out1))
    assert a.output_token_ids == [token_for("a", 0)] and a.num_output_placeholders == 1
    out3 = sched.schedule()
    assert out3.num_scheduled_tokens == {"a": 1}
    # the third token reaches max_tokens: nothing more is scheduled while it is in flight
    assert sched.schedule().total_num_scheduled_tokens == 0
    sched.update_from_output(out2, *engine.run(out2))
    finished = sched.update_from_output(out3, *engine.run(out3))
    assert finished == [a] and a.num_output_tokens == 3


def test_async_and_sync_give_the_same_outputs():
    def run(lag):
        sched = make_scheduler(num_blocks=10, block_size=4, budget=6, max_num_seqs=3)
        reqs = [make_request(f"r{i}", 3 + 2 * i, max_tokens=2 + i) for i in range(6)]
        for r in reqs:
            sched.add_request(r)
        drive(sched, FakeEngine(reqs), lag=lag)
        return [(r.req_id, r.status, r.output_token_ids) for r in reqs]

    assert run(0) == run(1)


def test_results_of_an_aborted_request_do_not_reach_a_new_one_with_its_id():
    sched = make_scheduler()
    old = make_request("a", 4)
    sched.add_request(old)
    out = sched.schedule()
    sched.abort_request("a")
    new = make_request("a", 4)
    sched.add_request(new)
    assert sched.update_from_output(out, {"a": [9]}, {"a": "stop"}) == []
    assert new.status == RequestStatus.WAITING and new.num_output_tokens == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_workloads_finish_and_every_step_reads_its_own_kv(seed):
    """Random pools, budgets, policies, lags, aborts and shared prefixes; a fake tensor side checks
    that every scheduled request's cached positions hold its own tokens (prefix hits, replay and
    preemption included) and that everything finishes and is freed."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = rng.randint(2, 30)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        budget=rng.randint(1, 40),
        max_num_seqs=rng.randint(1, 6),
        max_model_len=rng.randint(20, 80),
        policy=rng.choice(["fcfs", "priority"]),
        num_slots=rng.randint(1, 6),
        prefix_caching=rng.random() < 0.7,
        replay_tokens_fn=rng.choice([None, lambda num_hit: min(num_hit, 3), lambda num_hit: num_hit]),
    )
    lag = rng.choice([0, 1, 2])
    shared_prefix = [rng.randrange(50) for _ in range(60)]
    reqs: list[Request] = []
    engine = FakeEngine([])
    pending: deque = deque()
    next_start: dict[str, int] = {}
    block_contents: dict[int, dict[int, int]] = {}  # block id -> offset -> token written there

    def expected_token(req: Request, pos: int) -> int:
        if pos < req.num_prompt_tokens:
            return req.prompt_token_ids[pos]
        return token_for(req.req_id, pos - req.num_prompt_tokens)

    for _ in range(3000):
        if len(reqs) < 25 and rng.random() < 0.3:
            n = rng.randint(1, sched.config.max_model_len - 1)
            num_shared = rng.randint(0, min(n, 60))
            prompt = shared_prefix[:num_shared] + [rng.randrange(50) for _ in range(n - num_shared)]
            req = Request(f"r{len(reqs)}", prompt, max_tokens=rng.randint(1, 10), priority=rng.randint(0, 3))
            try:
                sched.add_request(req)
            except InvalidRequestError:
                continue
            reqs.append(req)
            engine.max_tokens[req.req_id] = req.max_tokens
        if reqs and rng.random() < 0.03:
            sched.abort_request(rng.choice(reqs).req_id)
        out = sched.schedule()
        check_invariants(sched, out, next_start)
        for req_id, n in out.num_scheduled_tokens.items():  # the fake tensor side runs the step
            req = sched.requests[req_id]
            start = req.num_computed_tokens - n
            table = sched.kv_cache_manager.get_block_ids(req)
            for pos in range(start):
                assert block_contents[table[pos // bs]][pos % bs] == expected_token(req, pos)
            for pos in range(start, start + n):
                block_contents.setdefault(table[pos // bs], {})[pos % bs] = expected_token(req, pos)
        pending.append((out, *engine.run(out)))
        while len(pending) > lag:
            sched.update_from_output(*pending.popleft())
        if len(reqs) == 25 and not sched.has_unfinished_requests():
            break
    while pending:
        sched.update_from_output(*pending.popleft())
    assert not sched.has_unfinished_requests()
    for req in reqs:
        assert req.is_finished
        assert req.output_token_ids == [token_for(req.req_id, i) for i in range(req.num_output_tokens)]
        if req.status == RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == min(req.max_tokens, sched.config.max_model_len - req.num_prompt_tokens)
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
    assert sched.state_slot_pool.num_free_slots == sched.state_slot_pool.num_slots
