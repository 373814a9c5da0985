"""Request migration across real processes on loopback (issue 26): one prefill instance, two decode
instances, both balancers and the entrypoint, each a `python -m ...` process.

- SIGSTOP of a decode instance while streams run on it (longer than its balancer's heartbeat timeout):
  the entrypoint finds it hung, moves its requests to the other instance, every stream completes with
  the offline engine's tokens; after SIGCONT the instance is fenced (its stale streams dropped, its
  blocks freed), rejoins its balancer and serves correct outputs again.
- A stop string spanning the migration point (a decode SIGSTOPped inside it): the migrated stream
  stops where the offline engine does, with its text (what the hung decode held back included).
- SIGKILL of a decode instance while 16 streams run: every stream completes with the offline engine's
  tokens (greedy, seeded top-k and seeded temperature-1 sampling), no duplicated or missing token,
  usage counts the client's prompt and every token it received, and no KV block stays held on the
  survivors.
- SIGKILL of the only prefill instance with requests queued on it, restarted seconds later: the
  decode reservations the dead prefill was to write into are released at once (not when their lease
  ends), the queued requests wait for the restarted instance and complete with the offline tokens.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, decode_pb2_grpc, loadbalancer_pb2, loadbalancer_pb2_grpc, prefill_pb2_grpc

pytest.importorskip("nixl")

STARTUP_TIMEOUT_S = 90.0
RPC_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"
DECODE_HEARTBEAT_TIMEOUT_S = 1.5
DECODES = ("decode-a", "decode-b")


class _Cluster:
    def __init__(self, ckpt: str, processes: ServiceProcesses, client: Client) -> None:
        self.checkpoint = ckpt
        self.processes = processes
        self.client = client
        self._channels: dict[str, grpc.Channel] = {}

    def channel(self, name: str) -> grpc.Channel:
        if name not in self._channels:
            self._channels[name] = grpc.insecure_channel(self.processes.info[name]["address"])
        return self._channels[name]

    def stats(self, name: str) -> dict:
        stub = (prefill_pb2_grpc.PrefillStub if name.startswith("prefill") else decode_pb2_grpc.DecodeStub)(
            self.channel(name))
        reply, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
        return json.loads(dict(call.trailing_metadata())[STATS_KEY])

    def decode_ids(self) -> set[str]:
        lb = loadbalancer_pb2_grpc.LoadBalancerStub(self.channel("decode_lb"))
        return {i.instance_id for i in lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                        timeout=RPC_TIMEOUT_S).instances}

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    logdir = tmp_path_factory.mktemp("logs")
    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = cluster = None
    try:
        processes.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware",
                                       "--heartbeat-timeout-s", "30"])
        processes.spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", "kv_load",
                                      "--heartbeat-timeout-s", str(DECODE_HEARTBEAT_TIMEOUT_S)])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", "16", "--num-blocks", "256"]
        processes.spawn("prefill", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"],
                                    "--instance-id", "prefill-0", *worker_args])
        for name in DECODES:
            processes.spawn(name, ["decode_worker", "--lb-address", info["decode_lb"]["address"],
                                   "--instance-id", name, *worker_args])
        processes.spawn("entrypoint", [
            "entrypoint", "--model", ckpt, "--prefill-lb-address", info["prefill_lb"]["address"],
            "--decode-lb-address", info["decode_lb"]["address"], "--migration-limit", "3",
            "--liveness-interval-s", "0.25", "--liveness-probe-timeout-s", "0.5"])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=120.0)
        cluster = _Cluster(ckpt, processes, client)
        _wait_for("both decode instances registered", lambda: cluster.decode_ids() == set(DECODES))
        yield cluster
    finally:
        for proc in processes.procs.values():  # a stopped process would not see SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        if client is not None:
            client.close()
        if cluster is not None:
            cluster.close()
        processes.stop(10.0)


def _wait_for(what: str, fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _prompts_and_params(n: int, seed: int, max_tokens: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 512, (int(torch.randint(5, 90, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    # greedy, seeded with top-k and a repetition penalty, and seeded plain temperature-1 sampling (issue 23)
    kinds = (dict(temperature=0.0),
             dict(temperature=0.9, top_k=40, repetition_penalty=1.1),
             dict(temperature=1.0))
    kwargs = [dict(kinds[i % 3], max_tokens=max_tokens, ignore_eos=True, **({"seed": 100 + i} if i % 3 else {}))
              for i in range(n)]
    return prompts, kwargs


def _offline(ckpt: str, prompts, kwargs):
    from deepinfer.engine import LLM, SamplingParams

    outs = LLM(ckpt).generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**k) for k in kwargs],
                              use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class _Streams:
    """`n` client streams in threads; `num_tokens[i]` is what stream i has received so far."""

    def __init__(self, client: Client, prompts, kwargs) -> None:
        self.num_tokens = [0] * len(prompts)
        self.deltas: list[list[dict]] = [[] for _ in prompts]
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(self._run, client, i, p, k) for i, (p, k) in
                         enumerate(zip(prompts, kwargs))]

    def _run(self, client: Client, i: int, prompt, kwargs):
        for delta in client.stream(prompt, **kwargs):
            self.deltas[i].append(delta)
            self.num_tokens[i] += len(delta["token_ids"])
        return self.deltas[i]

    def results(self, timeout_s: float = 120.0):
        out = [f.result(timeout_s) for f in self._futures]
        self._pool.shutdown()
        return out


def _check(results, prompts, ref) -> None:
    for i, deltas in enumerate(results):
        tokens = [t for d in deltas for t in d["token_ids"]]
        assert tokens == ref[i], f"stream {i}: {tokens} != {ref[i]}"
        last = deltas[-1]
        assert last["finish_reason"] == "length"
        assert last["usage"]["prompt_tokens"] == len(prompts[i])
        assert last["usage"]["completion_tokens"] == len(ref[i])
        assert last["usage"]["cached_prompt_tokens"] <= len(prompts[i])
        assert sum(d["usage"] is not None for d in deltas[:-1]) <= 1  # usage on the first and the last only


def _busiest_decode(cluster: _Cluster) -> str:
    return max(DECODES, key=lambda n: cluster.stats(n)["num_unfinished_requests"])


def _drained(cluster: _Cluster, names) -> bool:
    for name in names:
        s = cluster.stats(name)
        if s["num_kv_blocks_used"] or s.get("num_unfinished_requests", 0):
            return False
    return True


def test_hung_decode_requests_migrate_and_it_rejoins_fenced(cluster):
    prompts, kwargs = _prompts_and_params(8, seed=1, max_tokens=48)
    ref = _offline(cluster.checkpoint, prompts, kwargs)
    streams = _Streams(cluster.client, prompts, kwargs)
    _wait_for("every stream started", lambda: min(streams.num_tokens) >= 2, timeout_s=60)
    victim = _busiest_decode(cluster)
    proc = cluster.processes.procs[victim]
    proc.send_signal(signal.SIGSTOP)
    try:
        results = streams.results()
        _check(results, prompts, ref)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert cluster.client.health()["is_healthy"]
    # fenced: the stale streams were cancelled while it was stopped; back, it aborts them and frees its blocks
    _wait_for(f"{victim} rejoined the decode balancer", lambda: cluster.decode_ids() == set(DECODES))
    _wait_for("no KV block held after the migrations", lambda: _drained(cluster, (*DECODES, "prefill")))
    # it serves correct outputs again (its blocks reused by new requests)
    prompts2, kwargs2 = _prompts_and_params(6, seed=2, max_tokens=12)
    ref2 = _offline(cluster.checkpoint, prompts2, kwargs2)
    _check(_Streams(cluster.client, prompts2, kwargs2).results(), prompts2, ref2)


def test_stop_string_spanning_the_migration_point_is_found(cluster):
    """A stop string that starts before the migration point and ends after it stops the migrated
    stream where the offline engine stops; the text the hung decode held back (it could start the stop
    string) reaches the client."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.sampling.stop import IncrementalDetokenizer
    from deepinfer.engine.tokenizer import load_tokenizer

    prompt = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = LLM(cluster.checkpoint)
    free = llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(temperature=0.0, max_tokens=48,
                                                                        ignore_eos=True)], use_tqdm=False)
    detokenizer = IncrementalDetokenizer(load_tokenizer(cluster.checkpoint), prompt)
    ends = []  # text length after each output token
    for token in free[0].outputs[0].token_ids:
        detokenizer.append([token])
        ends.append(len(detokenizer.output_text))
    text = detokenizer.output_text
    stop = text[ends[11]:ends[39]]  # the text of tokens 12..40
    assert stop and text.find(stop) == ends[11]
    kwargs = dict(temperature=0.0, max_tokens=48, ignore_eos=True, stop=[stop])
    ref = llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(**kwargs)], use_tqdm=False)[0].outputs[0]
    assert ref.finish_reason == "stop"

    streams = _Streams(cluster.client, [prompt], [kwargs])
    _wait_for("the stream inside the stop string", lambda: streams.num_tokens[0] >= 14, timeout_s=60)
    victim = _busiest_decode(cluster)
    proc = cluster.processes.procs[victim]
    proc.send_signal(signal.SIGSTOP)  # found hung: the request migrates with 14+ tokens streamed
    try:
        (deltas,) = streams.results()
    finally:
        proc.send_signal(signal.SIGCONT)
    assert [t for d in deltas for t in d["token_ids"]] == ref.token_ids
    assert "".join(d["text"] for d in deltas) == ref.text
    assert deltas[-1]["finish_reason"] == "stop" and deltas[-1]["stop_reason"] == stop
    _wait_for(f"{victim} rejoined the decode balancer", lambda: cluster.decode_ids() == set(DECODES))
    _wait_for("no KV block held after the migration", lambda: _drained(cluster, (*DECODES, "prefill")))


def test_killed_decode_streams_continue_on_another_instance(cluster):
    prompts, kwargs = _prompts_and_params(16, seed=3, max_tokens=40)
    ref = _offline(cluster.checkpoint, prompts, kwargs)
    streams = _Streams(cluster.client, prompts, kwargs)
    _wait_for("every stream started", lambda: min(streams.num_tokens) >= 2, timeout_s=60)
    victim = _busiest_decode(cluster)
    assert cluster.stats(victim)["num_unfinished_requests"] > 0
    cluster.processes.procs[victim].kill()
    results = streams.results()
    _check(results, prompts, ref)
    survivor = next(n for n in DECODES if n != victim)
    _wait_for("no KV block stranded on the survivors", lambda: _drained(cluster, (survivor, "prefill")))


def test_queued_requests_wait_for_a_restarted_prefill(cluster):
    """Last: kills and restarts the only prefill instance (under the same id, on a new port)."""
    prompts, kwargs = _prompts_and_params(12, seed=4, max_tokens=8)
    ref = _offline(cluster.checkpoint, prompts, kwargs)
    prefill = cluster.processes.procs["prefill"]
    prefill.send_signal(signal.SIGSTOP)  # the requests queue on it (its balancer's heartbeat timeout is 30 s)
    streams = _Streams(cluster.client, prompts, kwargs)
    live_decodes = [n for n in DECODES if cluster.processes.procs[n].poll() is None]
    _wait_for("every request reserved on decode", lambda: sum(
        cluster.stats(n)["num_streams"] for n in live_decodes) == len(prompts))
    prefill.kill()
    prefill.wait()
    killed_at = time.monotonic()
    # the entrypoint finds the prefill gone (its port refuses) and has decode free the reservations now
    _wait_for("the dead prefill's reservations released", lambda: _drained(cluster, live_decodes), timeout_s=10)
    released_s = time.monotonic() - killed_at
    assert released_s < 10, released_s  # the lease is 30 s
    assert sum(streams.num_tokens) == 0
    time.sleep(max(0.0, 5.0 - released_s))  # down ~5 s, then back under its id (the launcher's restart)
    cluster.processes.info.pop("prefill")
    cluster._channels.pop("prefill", None)
    args = ["prefill_worker", "--lb-address", cluster.processes.info["prefill_lb"]["address"],
            "--instance-id", "prefill-0", "--model", cluster.checkpoint, "--loopback-ucx", "--max-num-seqs", "16",
            "--num-blocks", "256"]
    cluster.processes.spawn("prefill", args)
    cluster.processes.wait_ready(STARTUP_TIMEOUT_S)
    _check(streams.results(), prompts, ref)
    _wait_for("no KV block held after the restart", lambda: _drained(cluster, (*live_decodes, "prefill")))
