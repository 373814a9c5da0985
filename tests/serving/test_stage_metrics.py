"""The workers' per-stage figures on the HTTP front's /metrics (issue 31), each shown to move when its
event happens, through real cores (a prefill and a decode engine on a tiny checkpoint, KV moved by NIXL
between two agents in this process) and the shell's stats code the workers' `Health` runs:

* `deepinfer_stage_latency_seconds{phase}`: queue and prefill (prefill instance), kv_transfer (its sends),
  step (both; the decode step time on decode), queue on decode counted from the KV's landing;
* the prefix-cache hit rate of an instance (a repeated prompt hits);
* preemptions (a pool too small for every request at once);
* errors by cause (`serving.errors`), also in a real shell's `Health` over gRPC.
"""

from __future__ import annotations

import json
import time
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import generate_latest

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import SamplingParams
from deepinfer.engine.cache.block_pool import NoFreeBlocksError
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.latency import LatencyHistograms
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.entrypoint.http.metrics import HttpMetrics
from deepinfer.protos import common_pb2
from deepinfer.serving import errors
from deepinfer.serving.shell import EngineShell

nixl = pytest.importorskip("nixl")


def _shell_stats(engine, agent) -> dict:
    """What a worker's `Health` reports from its engine and agent (`EngineShell._transfer_stats`)."""
    shell = SimpleNamespace(engine=engine, agent=agent, emb_agent=None)
    shell._latency_stats = partial(EngineShell._latency_stats, shell)
    return json.loads(json.dumps(EngineShell._transfer_stats(shell)))  # as it travels


def _count(stats: dict, phase: str) -> int:
    return stats["latency_seconds"].get(phase, {}).get("count", 0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=5))


@pytest.fixture(scope="module")
def pd(checkpoint):
    from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
    from deepinfer.prefill_worker.core import PrefillCore

    p_eng = Engine(EngineConfig(model=checkpoint, max_num_seqs=4))
    d_eng = Engine(EngineConfig(model=checkpoint, max_num_seqs=4))
    p_agent = KVTransferAgent("prefill-metrics", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent("decode-metrics", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    p_agent.add_peer("decode-metrics", d_agent.metadata(), d_agent.pool_layout())
    yield PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, "decode-metrics")
    p_agent.close()
    d_agent.close()


def _run(prefill, decode, requests, timeout_s: float = 120.0) -> None:
    """Reserve on decode, prefill, start decode (as the entrypoint does) until every request finished."""
    from deepinfer.prefill_worker.core import KVDestination, PrefillWork

    for rid, prompt, params in requests:
        res = decode.reserve(rid, prompt, params, lease_s=60.0)
        dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)
        prefill.submit(PrefillWork(rid, prompt, params, dest))
    finished: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(finished) < len(requests):
        assert time.monotonic() < deadline, "P/D run did not finish"
        for done in prefill.step():
            assert not done.error, done.error
        for ev in decode.step():
            assert not isinstance(ev, DecodeFailed), ev.error
            if ev.finished:
                finished.add(ev.request_id)


PROMPT = torch.randint(2, 512, (150,), generator=torch.Generator().manual_seed(0)).tolist()
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_latency_histograms_move_with_requests(pd):
    prefill, decode = pd
    p0, d0 = _shell_stats(prefill.engine, prefill.agent), _shell_stats(decode.engine, decode.agent)
    _run(prefill, decode, [("lat-0", PROMPT[:70], PARAMS), ("lat-1", PROMPT[70:], PARAMS)])
    p1, d1 = _shell_stats(prefill.engine, prefill.agent), _shell_stats(decode.engine, decode.agent)
    for phase in ("queue", "prefill", "kv_transfer"):  # one each per request on the prefill instance
        assert _count(p1, phase) - _count(p0, phase) == 2, phase
    assert _count(p1, "step") > _count(p0, "step")
    assert _count(d1, "queue") - _count(d0, "queue") == 2  # counted from the KV's landing
    assert _count(d1, "step") - _count(d0, "step") >= 5  # the decode steps (5 tokens after prefill's first)
    assert _count(d1, "prefill") == _count(d0, "prefill")  # decode computes no prompt of its own here
    h = p1["latency_seconds"]["prefill"]
    assert h["buckets"][-1] == h["count"] and h["sum"] > 0 and h["buckets"] == sorted(h["buckets"])
    # the front's export of the same figures
    metrics = HttpMetrics()
    metrics.set_stages({("prefill", "prefill-0"): p1, ("decode", "decode-0"): d1})
    text = generate_latest(metrics.registry).decode()
    for stage, phase, n in (("prefill", "queue", _count(p1, "queue")), ("prefill", "kv_transfer", _count(p1, "kv_transfer")),
                            ("decode", "step", _count(d1, "step"))):
        line = (f'deepinfer_stage_latency_seconds_count{{instance="{stage}-0",phase="{phase}",stage="{stage}"}} '
                f'{float(n)}')
        assert line in text, line
    assert 'deepinfer_stage_latency_seconds_bucket{instance="prefill-0",le="+Inf",phase="prefill",stage="prefill"}' in text
    assert len(json.dumps(p1)) < 6000  # Health carries the stats in gRPC trailing metadata (8 KiB by default)


def test_prefix_cache_hit_rate_moves_on_a_repeated_prompt(pd):
    prefill, decode = pd
    _run(prefill, decode, [("hit-0", PROMPT, PARAMS)])
    before = _shell_stats(prefill.engine, prefill.agent)
    _run(prefill, decode, [("hit-1", PROMPT, PARAMS)])
    after = _shell_stats(prefill.engine, prefill.agent)
    assert after["prefix_cache_queried_tokens_total"] - before["prefix_cache_queried_tokens_total"] == len(PROMPT)
    assert after["prefix_cache_hit_tokens_total"] - before["prefix_cache_hit_tokens_total"] > 0
    assert after["prefix_cache_hit_rate"] > before["prefix_cache_hit_rate"]
    metrics = HttpMetrics()
    metrics.set_stages({("prefill", "prefill-0"): after})
    text = generate_latest(metrics.registry).decode()
    assert f'deepinfer_stage_prefix_cache_hit_rate{{instance="prefill-0",stage="prefill"}} ' \
           f'{after["prefix_cache_hit_rate"]}' in text


def test_preemptions_move_when_the_pool_is_too_small(checkpoint):
    engine = Engine(EngineConfig(model=checkpoint, max_num_seqs=6, num_blocks=10, block_size=16, max_model_len=140))
    before = _shell_stats(engine, SimpleNamespace(stats=dict))["num_preemptions_total"]
    g = torch.Generator().manual_seed(5)
    for i in range(6):
        engine.add_request(f"pre-{i}", {"prompt_token_ids": torch.randint(2, 512, (60,), generator=g).tolist()},
                           SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    stats = _shell_stats(engine, SimpleNamespace(stats=dict))
    assert stats["num_preemptions_total"] > before
    metrics = HttpMetrics()
    metrics.set_stages({("decode", "decode-0"): stats})
    assert (f'deepinfer_stage_num_preemptions_total{{instance="decode-0",stage="decode"}} '
            f'{float(stats["num_preemptions_total"])}') in generate_latest(metrics.registry).decode()


def test_errors_are_counted_by_cause():
    before = errors.errors_by_cause()
    errors.error_of(NoFreeBlocksError("no blocks"))
    errors.error_of(errors.Refused(common_pb2.ERROR_CODE_UNAVAILABLE, "the KV write failed", "destination"))
    errors.count_error(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
    after = errors.errors_by_cause()
    for cause in ("resource_exhausted", "unavailable/destination", "deadline_exceeded"):
        assert after.get(cause, 0) - before.get(cause, 0) == 1, cause
    metrics = HttpMetrics()
    metrics.set_stages({("prefill", "prefill-0"): {"errors_by_cause": after}})
    text = generate_latest(metrics.registry).decode()
    assert (f'deepinfer_stage_errors_total{{cause="unavailable/destination",instance="prefill-0",stage="prefill"}} '
            f'{float(after["unavailable/destination"])}') in text


def test_health_of_a_real_shell_carries_errors_by_cause():
    import grpc

    from deepinfer.protos import prefill_pb2_grpc
    from deepinfer.protos.metadata import STATS_METADATA_KEY
    from tests.serving.test_shell import FakeWorker, _config

    worker = FakeWorker(_config())
    worker.start()
    try:
        errors.error_of(TimeoutError())
        with grpc.insecure_channel(worker.address) as channel:
            _, call = prefill_pb2_grpc.PrefillStub(channel).Health.with_call(common_pb2.HealthRequest(), timeout=5)
        stats = json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])
        assert stats["errors_by_cause"]["unavailable"] >= 1
    finally:
        worker.stop()


def test_latency_histograms_bucket_bounds():
    h = LatencyHistograms((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 2.0):
        h.observe("x", seconds)
    assert h.as_dict()["x"] == {"le": [0.1, 1.0], "buckets": [2, 3, 4], "sum": 2.65, "count": 4}
    assert h.count("x") == 4 and h.count("y") == 0
    with pytest.raises(ValueError):
        LatencyHistograms((1.0, 0.5))
