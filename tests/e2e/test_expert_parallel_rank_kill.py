"""A rank killed (issue 25): SIGKILL of rank 1 of a 2-rank decode instance while streams run on it.

Real processes on loopback: one prefill instance, a 2-rank decode instance (`decode-ep`, gloo ranks in
processes) and a one-rank decode instance (`decode-one`), both balancers and the entrypoint, every engine in
batch-invariant mode so any pair gives the offline engine's greedy tokens. Once every stream has started and
`decode-ep` holds some of them, its rank 1 process is killed. The instance fails as a whole (its engine loop
dies on the broken group, its process exits so a supervisor restarts the group), the decode balancer drops it,
the streams it served migrate (the entrypoint's migration on decode loss) and every stream, those on
`decode-one` included, ends with the offline tokens; new requests are served by the survivor."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import torch

from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, decode_pb2_grpc, entrypoint_pb2_grpc, loadbalancer_pb2, loadbalancer_pb2_grpc
from deepinfer.protos.metadata import STATS_METADATA_KEY
from tests.e2e._cluster import running_cluster

pytest.importorskip("nixl")
pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 10.0
DECODES = ("decode-ep", "decode-one")


def _wait_for(what: str, fn, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _decode_stats(address: str) -> dict | None:
    """The decode instance's Health stats, or None when it does not answer (gone) or reports unhealthy."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply, call = decode_pb2_grpc.DecodeStub(channel).Health.with_call(common_pb2.HealthRequest(),
                                                                               timeout=RPC_TIMEOUT_S)
    except grpc.RpcError:
        return None
    return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY]) if reply.is_healthy else None


def _entrypoint_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as channel:
        _, call = entrypoint_pb2_grpc.EntrypointStub(channel).Health.with_call(common_pb2.HealthRequest(),
                                                                              timeout=RPC_TIMEOUT_S)
    return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])


def _pickable_decodes(lb_address: str) -> set[str]:
    with grpc.insecure_channel(lb_address) as channel:
        listed = loadbalancer_pb2_grpc.LoadBalancerStub(channel).ListInstances(
            loadbalancer_pb2.ListInstancesRequest(), timeout=RPC_TIMEOUT_S)
    return {i.instance_id for i in listed.instances if i.load.is_healthy and not i.load.is_draining}


def _rank_processes(pid: int) -> list[psutil.Process]:
    """The rank processes (ranks 1..N-1) a worker process started: its `multiprocessing` spawn children."""
    return [c for c in psutil.Process(pid).children() if "spawn_main" in " ".join(c.cmdline())]


class _Streams:
    """Client streams in threads; `num_tokens[i]` is what stream i has received so far."""

    def __init__(self, client: Client, prompts, max_tokens) -> None:
        self.num_tokens = [0] * len(prompts)
        self._pool = ThreadPoolExecutor(len(prompts))
        self._futures = [self._pool.submit(self._run, client, i, p, n) for i, (p, n) in
                         enumerate(zip(prompts, max_tokens))]

    def _run(self, client: Client, i: int, prompt, max_tokens):
        tokens = []
        for delta in client.stream(prompt, temperature=0.0, max_tokens=max_tokens, ignore_eos=True):
            tokens += delta["token_ids"]
            self.num_tokens[i] = len(tokens)
        return tokens

    def results(self, timeout_s: float = 180.0) -> list[list[int]]:
        out = [f.result(timeout_s) for f in self._futures]
        self._pool.shutdown()
        return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    worker_args = ["--max-num-seqs", "8", "--num-blocks", "128", "--max-num-batched-tokens", "64", "--batch-invariant"]
    with running_cluster(tmp_path_factory, ckpt, worker_args, STARTUP_TIMEOUT_S, 180.0,
                         lb_args={"decode": ["--heartbeat-timeout-s", "2"]},
                         decodes={name: ["--expert-parallel-size", ranks] for name, ranks in zip(DECODES, ("2", "1"))},
                         entrypoint_args=["--migration-limit", "3", "--liveness-interval-s", "0.25",
                                          "--liveness-probe-timeout-s", "0.5"]) as (processes, client):
        _wait_for("both decode instances registered",
                  lambda: _pickable_decodes(processes.info["decode_lb"]["address"]) == set(DECODES))
        yield ckpt, processes, client


def test_killed_rank_fails_its_instance_and_its_streams_migrate(cluster):
    from deepinfer.engine import LLM, SamplingParams

    ckpt, processes, client = cluster
    info = processes.info
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    max_tokens = [40] * len(prompts)
    llm = LLM(ckpt, batch_invariant=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens], use_tqdm=False)]

    victim = processes.procs["decode-ep"]
    (rank1,) = _rank_processes(victim.pid)
    streams = _Streams(client, prompts, max_tokens)
    _wait_for("every stream started", lambda: min(streams.num_tokens) >= 2, timeout_s=120)
    stats = _decode_stats(info["decode-ep"]["address"])
    assert stats is not None and stats["num_unfinished_requests"] > 0, stats
    rank1.kill()

    assert streams.results() == ref  # the victim's streams migrated, the survivor's were unaffected
    # the instance failed as a whole: its process exits (the supervisor restarts the group) ...
    assert victim.wait(timeout=60) != 0
    # ... and its balancer no longer offers it
    _wait_for("the decode balancer dropped decode-ep",
              lambda: _pickable_decodes(info["decode_lb"]["address"]) == {"decode-one"})
    assert _entrypoint_stats(info["entrypoint"]["address"])["num_migrations_total"] > 0
    # new requests are served (by the survivor) with the offline tokens
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda p: client.generate(p, temperature=0.0, max_tokens=40, ignore_eos=True),
                             prompts[:4]))
    assert [o["token_ids"] for o in outs] == ref[:4]
