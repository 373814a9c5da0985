"""Disaggregated serving across real processes on loopback: two balancers, one prefill and one decode
instance (NIXL over UCX loopback) and the entrypoint, each started as `python -m ...`.

Outputs equal the offline engine's token for token, the KV moved through NIXL, bad requests are
refused with INVALID_ARGUMENT while the system keeps serving, aborts and deadlines free the KV
blocks on both workers, and a stage without instances answers UNAVAILABLE.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client, GenerateError
from deepinfer.protos import common_pb2, decode_pb2_grpc, loadbalancer_pb2, loadbalancer_pb2_grpc, prefill_pb2_grpc

pytest.importorskip("nixl")

STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"
PREFILL_HEARTBEAT_S = 30
DECODE_HEARTBEAT_S = 2.5
"""The decode instance's heartbeat interval here (its balancer expires it after 3 s of silence): long, so that what
the balancer learns sooner comes from the reports the instance sends when a request ends."""


@dataclass
class Cluster:
    checkpoint: str
    procs: dict[str, subprocess.Popen]
    info: dict[str, dict]
    """Each process's JSON address line."""
    client: Client
    channels: dict[str, grpc.Channel] = field(default_factory=dict)

    def stub(self, name: str):
        if name not in self.channels:
            self.channels[name] = grpc.insecure_channel(self.info[name]["address"])
        channel = self.channels[name]
        stubs = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
                 "prefill_lb": loadbalancer_pb2_grpc.LoadBalancerStub,
                 "decode_lb": loadbalancer_pb2_grpc.LoadBalancerStub}
        return stubs[name](channel)

    def stats(self, name: str) -> dict:
        """A worker's Health, with the stats JSON from its trailing metadata."""
        reply, call = self.stub(name).Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
        assert reply.is_healthy, reply.message
        return json.loads(dict(call.trailing_metadata())[STATS_KEY])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    logdir = tmp_path_factory.mktemp("logs")
    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    cluster = None
    try:
        # the prefill instance heartbeats rarely (PREFILL_HEARTBEAT_S): what its balancer learns between
        # heartbeats comes from the reports it sends when its queue drains
        for stage, policy, timeout_s in (("prefill", "prefix_aware", 3 * PREFILL_HEARTBEAT_S), ("decode", "kv_load", 3)):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy,
                                            "--heartbeat-timeout-s", str(timeout_s)])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", "8", "--num-blocks", "256"]
        for stage in ("prefill", "decode"):
            extra = ["--heartbeat-interval-s", str(PREFILL_HEARTBEAT_S if stage == "prefill" else DECODE_HEARTBEAT_S)]
            processes.spawn(stage, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                    "--instance-id", f"{stage}-0", *worker_args, *extra])
        processes.spawn("entrypoint", [
            "entrypoint", "--model", ckpt, "--prefill-lb-address", info["prefill_lb"]["address"],
            "--decode-lb-address", info["decode_lb"]["address"]])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=60.0)
        cluster = Cluster(ckpt, processes.procs, info, client)
        yield cluster
    finally:
        if client is not None:
            client.close()
        for channel in cluster.channels.values() if cluster is not None else ():
            channel.close()
        processes.stop(STOP_TIMEOUT_S)  # front to back, so the workers can still deregister


def _wait_for(what: str, fn, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _blocks_freed(cluster: Cluster) -> bool:
    p, d = cluster.stats("prefill"), cluster.stats("decode")
    return p["num_kv_blocks_used"] == 0 and d["num_kv_blocks_used"] == 0 and d["num_unfinished_requests"] == 0


def test_outputs_equal_offline_engine_and_kv_moved_by_nixl(cluster):
    from deepinfer.engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = (5, 17, 33, 64, 65, 100, 130, 9)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]
    kwargs = [
        dict(temperature=0.0, max_tokens=12, ignore_eos=True),
        dict(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
        dict(temperature=0.0, max_tokens=1, ignore_eos=True),
        dict(temperature=1.0, top_k=20, seed=3, max_tokens=9, ignore_eos=True),
        dict(temperature=0.0, max_tokens=8),
        dict(temperature=0.7, top_p=0.9, seed=5, max_tokens=11, ignore_eos=True),
        dict(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.2),
        dict(temperature=0.9, seed=1, max_tokens=7, stop_token_ids=[100]),
    ]
    ref = LLM(cluster.checkpoint).generate([{"prompt_token_ids": p} for p in prompts],
                                           [SamplingParams(**k) for k in kwargs], use_tqdm=False)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pk: cluster.client.generate(pk[0], **pk[1]), zip(prompts, kwargs)))
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out["token_ids"] == r.outputs[0].token_ids, f"request {i}"
        assert out["finish_reason"] == r.outputs[0].finish_reason, f"request {i}"
        assert out["usage"]["prompt_tokens"] == len(prompts[i])
        assert out["usage"]["completion_tokens"] == len(r.outputs[0].token_ids)

    p, d = cluster.stats("prefill"), cluster.stats("decode")
    assert p["kv_transfer_sends_done_total"] >= len(prompts)
    assert p["kv_transfer_sent_bytes_total"] > 0
    assert d["kv_transfer_received_bytes_total"] == p["kv_transfer_sent_bytes_total"]
    assert d["kv_transfer_recvs_done_total"] == p["kv_transfer_sends_done_total"]
    assert p["num_peers"] == 1  # the decode agent was added once and then reused

    # the prefill's heartbeats carry its prefix-cache hashes to the (prefix-aware) prefill balancer
    lb = cluster.stub("prefill_lb")
    _wait_for("cached hashes at the prefill balancer", lambda: [
        i.num_cached_block_hashes > 0 for i in lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                                timeout=RPC_TIMEOUT_S).instances] == [True])
    assert cluster.client.health()["is_healthy"]

    # the same long prompt again: the prefill serves its full blocks from the prefix cache
    again = cluster.client.generate(prompts[6], **kwargs[6])
    assert again["token_ids"] == outs[6]["token_ids"]
    assert again["usage"]["cached_prompt_tokens"] > 0
    _wait_for("blocks freed", lambda: _blocks_freed(cluster))


def test_prefill_reports_its_drained_queue_at_once(cluster):
    """A pick adds the prompt to the instance's queued tokens at the balancer until a report replaces
    them; the prefill instance reports when its queue drains, not only every PREFILL_HEARTBEAT_S, so
    the prefix-aware balancer does not keep an idle cache owner looking busy (or miss its new blocks)."""
    lb = cluster.stub("prefill_lb")

    def load():
        [instance] = lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=RPC_TIMEOUT_S).instances
        return instance

    before = load().num_cached_block_hashes
    cluster.client.generate(list(range(300, 400)), temperature=0.0, max_tokens=2, ignore_eos=True)
    _wait_for("the drained queue at the balancer", lambda: (
        (i := load()).load.num_queued_prefill_tokens == 0 and i.load.num_waiting_requests == 0
        and i.num_cached_block_hashes > before), timeout_s=5.0)


def test_decode_reports_an_ended_request_at_once(cluster):
    """A pick counts a state slot and the request's blocks at the decode balancer until a report replaces them; the
    decode instance reports when a request ends, not only every DECODE_HEARTBEAT_S, so requests that end quickly one
    after the other never find the instance full at the balancer (sequential requests on a 4-slot instance used to
    wait ~0.4 s each for room: `benchmarks/pd_gpu.py`, H100, 2026-12-05)."""
    lb = cluster.stub("decode_lb")

    def idle() -> bool:
        [instance] = lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=RPC_TIMEOUT_S).instances
        load = instance.load
        return load.num_running_requests == load.num_waiting_requests == load.num_kv_blocks_used == 0

    _wait_for("an idle decode instance", idle, timeout_s=10.0)
    for i in range(3):
        cluster.client.generate(list(range(400 + i, 440 + i)), temperature=0.0, max_tokens=2, ignore_eos=True)
        _wait_for("the ended request at the decode balancer", idle, timeout_s=0.5)


def test_bad_requests_are_refused_and_the_system_keeps_serving(cluster):
    sent_before = cluster.stats("prefill")["kv_transfer_sends_done_total"]
    with pytest.raises(GenerateError) as e:
        cluster.client.generate([5, 6, 512, 7], max_tokens=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "512" in e.value.message and "vocabulary" in e.value.message
    assert e.value.field == "prompt_token_ids"
    with pytest.raises(GenerateError) as e:
        cluster.client.generate([], max_tokens=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(GenerateError) as e:
        cluster.client.generate([5, 6, 7], max_tokens=4, top_p=1.5)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "top_p"
    assert cluster.stats("prefill")["kv_transfer_sends_done_total"] == sent_before  # no stage worked

    out = cluster.client.generate([5, 6, 7, 8], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"


def test_abort_mid_stream_frees_blocks_on_both_workers(cluster):
    prompt = list(range(10, 80))
    # the client goes away: closing the stream cancels the call
    stream = cluster.client.stream(prompt, max_tokens=2000, temperature=0.0, ignore_eos=True)
    got = [next(stream), next(stream)]
    assert all(d["finish_reason"] is None for d in got)
    assert cluster.stats("decode")["num_kv_blocks_used"] > 0
    stream.close()
    _wait_for("blocks freed after cancel", lambda: _blocks_freed(cluster))

    # an Abort call: the stream ends with finish_reason "abort"
    deltas = cluster.client.stream(prompt, request_id="to-abort", max_tokens=2000, temperature=0.0, ignore_eos=True)
    assert next(deltas)["finish_reason"] is None
    assert cluster.client.abort("to-abort")
    rest = list(deltas)
    assert rest and rest[-1]["finish_reason"] == "abort"
    assert rest[-1]["usage"]["prompt_tokens"] == len(prompt)
    assert not cluster.client.abort("to-abort")  # idempotent: no longer in flight
    _wait_for("blocks freed after Abort", lambda: _blocks_freed(cluster))

    # the decode balancer hears it from the heartbeats too
    lb = cluster.stub("decode_lb")
    _wait_for("decode load report at 0 blocks", lambda: [
        i.load.num_kv_blocks_used for i in lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                            timeout=RPC_TIMEOUT_S).instances] == [0])


def test_retry_supersedes_an_earlier_attempts_reservation(cluster):
    """A request id that still holds a reservation on decode (an earlier attempt whose Abort has not arrived,
    e.g. sent while the instance was lost) does not fail the new attempt: the entrypoint aborts it there and
    reserves again; the output is the offline engine's."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.protos import decode_pb2

    prompt = list(range(40, 110))
    stale = cluster.stub("decode").Reserve(decode_pb2.ReserveRequest(
        request_id="retried", prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(max_tokens=4),
        num_kv_tokens=len(prompt), lease_ms=500), timeout=RPC_TIMEOUT_S)
    assert not stale.error.code, stale.error
    out = cluster.client.generate(prompt, request_id="retried", max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(cluster.checkpoint).generate([{"prompt_token_ids": prompt}],
                                           [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
                                           use_tqdm=False)
    assert out["token_ids"] == ref[0].outputs[0].token_ids
    # the superseded reservation's blocks come back after its quarantine (lease 0.5 s + margin)
    _wait_for("blocks freed after the superseded reservation's quarantine", lambda: _blocks_freed(cluster), 15.0)


def test_request_waits_for_capacity_held_by_quarantined_reservations(cluster):
    """Every state slot of the decode instance held by aborted reservations in quarantine (what a burst of
    migrations leaves behind): a new request waits for their leases to end and is served, instead of failing
    with RESOURCE_EXHAUSTED."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.protos import decode_pb2

    decode = cluster.stub("decode")
    for i in range(8):  # --max-num-seqs 8: one state slot each
        prompt = [3 + i, 5, 7, 11]
        r = decode.Reserve(decode_pb2.ReserveRequest(
            request_id=f"quarantined-{i}", prompt_token_ids=prompt, sampling_params=common_pb2.SamplingParams(),
            num_kv_tokens=len(prompt), lease_ms=1000), timeout=RPC_TIMEOUT_S)
        assert not r.error.code, r.error
        decode.Abort(common_pb2.AbortRequest(request_id=f"quarantined-{i}", reason="test"), timeout=RPC_TIMEOUT_S)
    assert cluster.stats("decode")["num_quarantined"] == 8  # nothing wrote them: held until lease + margin
    prompt = list(range(200, 240))
    t0 = time.monotonic()
    out = cluster.client.generate(prompt, max_tokens=5, temperature=0.0, ignore_eos=True)
    ref = LLM(cluster.checkpoint).generate([{"prompt_token_ids": prompt}],
                                           [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)],
                                           use_tqdm=False)
    assert out["token_ids"] == ref[0].outputs[0].token_ids
    assert time.monotonic() - t0 > 0.5  # it did wait for the quarantines
    _wait_for("blocks freed", lambda: _blocks_freed(cluster), 15.0)


def test_deadline_aborts_the_request(cluster):
    with pytest.raises(GenerateError) as e:
        cluster.client.generate(list(range(3, 40)), max_tokens=3000, temperature=0.0, ignore_eos=True,
                                deadline_ms=300)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for("blocks freed after the deadline", lambda: _blocks_freed(cluster))


def test_call_without_a_deadline_is_served(cluster):
    """A Generate call with no gRPC deadline (gRPC reports a huge remaining time) runs normally."""
    with Client(cluster.info["entrypoint"]["address"]) as client:  # no timeout_s: no deadline
        out = client.generate([5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"


def test_structured_output_is_honoured_by_prefill_and_decode_like_offline(cluster):
    """The prefill samples the first token under the constraint, decode replays it into its own matcher
    and constrains the rest: outputs equal the offline engine's, and they match the constraint."""
    from deepinfer.engine import LLM, SamplingParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99,
              "minimum": 0}}, "required": ["ok", "n"], "additionalProperties": False}
    constraints = [{"json_schema": json.dumps(schema), "disable_any_whitespace": True}, {"regex": "(cat|dog) [0-9]{2}"}]
    kwargs = [dict(temperature=0.0, max_tokens=40, structured_output=constraints[0]),
              dict(temperature=0.9, seed=4, max_tokens=20, structured_output=constraints[1])]
    prompts = [[5, 6, 7, 8, 9], list(range(30, 70))]
    ref = LLM(cluster.checkpoint).generate([{"prompt_token_ids": p} for p in prompts],
                                           [SamplingParams(**k) for k in kwargs], use_tqdm=False)
    outs = [cluster.client.generate(p, **k) for p, k in zip(prompts, kwargs)]
    for out, r in zip(outs, ref):
        assert out["token_ids"] == r.outputs[0].token_ids and out["finish_reason"] == "stop"
    assert json.loads(outs[0]["text"]).keys() == {"ok", "n"}
    assert outs[1]["text"].split(" ")[0] in ("cat", "dog") and len(outs[1]["text"]) == 6
    with pytest.raises(GenerateError) as e:  # refused by decode's reservation, before the prefill worked
        cluster.client.generate([5, 6, 7], max_tokens=4, structured_output={"regex": "(unclosed"})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.field == "structured_output"
    _wait_for("blocks freed", lambda: _blocks_freed(cluster))


def test_drained_decode_stage_answers_unavailable(cluster):
    """Last: drains the only decode instance (the process exits) and checks the UNAVAILABLE answer."""
    reply = cluster.stub("decode").Drain(common_pb2.DrainRequest(timeout_ms=5000), timeout=RPC_TIMEOUT_S)
    assert reply.num_unfinished_requests == 0
    assert cluster.procs["decode"].wait(STOP_TIMEOUT_S) == 0
    with pytest.raises(GenerateError) as e:
        cluster.client.generate([5, 6, 7], max_tokens=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "decode" in e.value.message
