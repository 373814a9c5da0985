"""The stages see ranks (issue 25): a 2-rank prefill instance and a 2-rank decode instance (gloo ranks in
processes, one NIXL agent per rank, `kv_transfer.ranked`) behind the balancers and the entrypoint, real
processes on loopback. Each request's KV goes from the prefill rank that computed it straight into the pools of
the decode rank that reserved it (both ranks of each instance carry requests), and greedy tokens equal the
offline engine's (expert_parallel_size = 1) token for token, in batch-invariant mode on both sides."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, decode_pb2_grpc, loadbalancer_pb2, loadbalancer_pb2_grpc, prefill_pb2_grpc
from deepinfer.protos.metadata import STATS_METADATA_KEY

pytest.importorskip("nixl")

STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    logdir = tmp_path_factory.mktemp("logs")
    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    try:
        for stage, policy in (("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", "8", "--num-blocks", "64",
                       "--max-num-batched-tokens", "64", "--batch-invariant", "--expert-parallel-size", "2"]
        for stage in ("prefill", "decode"):
            processes.spawn(stage, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                    "--instance-id", f"{stage}-0", *worker_args])
        processes.spawn("entrypoint", [
            "entrypoint", "--model", ckpt, "--prefill-lb-address", info["prefill_lb"]["address"],
            "--decode-lb-address", info["decode_lb"]["address"]])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=120.0)
        yield ckpt, client, info
    finally:
        if client is not None:
            client.close()
        processes.stop(STOP_TIMEOUT_S)


def test_two_rank_prefill_and_decode_equal_the_offline_engine(cluster):
    from deepinfer.engine import LLM, SamplingParams

    ckpt, client, _ = cluster
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (int(n),), generator=g).tolist() for n in (5, 40, 70, 17, 100, 33)]
    max_tokens = [8, 12, 6, 10, 7, 9]
    llm = LLM(ckpt, batch_invariant=True)
    refs = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens], use_tqdm=False)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pn: client.generate(pn[0], temperature=0.0, max_tokens=pn[1], ignore_eos=True),
                             zip(prompts, max_tokens)))
    for i, ref in enumerate(refs):
        assert outs[i]["token_ids"] == ref, f"request {i}"
    # every rank of each instance moved KV: prefill ranks sent from their own pools, decode ranks received into theirs
    info = cluster[2]
    prefill, decode = _stats(info["prefill"]["address"], "prefill"), _stats(info["decode"]["address"], "decode")
    for r in (0, 1):
        assert prefill[f"kv_transfer_rank{r}_sends_done_total"] > 0, prefill
        assert decode[f"kv_transfer_rank{r}_recvs_done_total"] > 0, decode
    assert sum(prefill[f"kv_transfer_rank{r}_sends_done_total"] for r in (0, 1)) == len(prompts)
    assert sum(decode[f"kv_transfer_rank{r}_recvs_done_total"] for r in (0, 1)) == len(prompts)
    # the decode balancer sees each rank's load (what its kv_load policy picks an (instance, rank) by)
    with grpc.insecure_channel(info["decode_lb"]["address"]) as channel:
        listed = loadbalancer_pb2_grpc.LoadBalancerStub(channel).ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                                              timeout=10)
    (inst,) = listed.instances
    assert [r.rank for r in inst.load.ranks] == [0, 1]
    assert all(r.num_kv_blocks_total == inst.load.num_kv_blocks_total for r in inst.load.ranks)


def test_requests_beyond_the_decode_slots_wait_for_room(cluster):
    """More concurrent requests than the decode instance's state slots (--max-num-seqs 8: 4 per rank, each request
    holds one from Reserve on): the decode balancer sees each rank's free slots and refuses full ranks, and the
    entrypoint waits for room (bounded by the deadline) instead of failing the requests beyond the eighth with
    RESOURCE_EXHAUSTED (`no free state slot`)."""
    _, client, _ = cluster
    prompts = [[7 + i, 11, 13, 17, 19, 23] for i in range(20)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: client.generate(p, max_tokens=16, temperature=0.0, ignore_eos=True,
                                                       deadline_ms=90_000), prompts))
    assert [len(o["token_ids"]) for o in outs] == [16] * len(prompts)


def _stats(address: str, stage: str) -> dict:
    stub_class = prefill_pb2_grpc.PrefillStub if stage == "prefill" else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(address) as channel:
        _, call = stub_class(channel).Health.with_call(common_pb2.HealthRequest(), timeout=10)
    return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])
