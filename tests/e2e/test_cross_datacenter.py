"""Two emulated datacenters (`deploy.netns`): prefill and its balancer in `dc-a`, decode and its
balancer in `dc-b`, the entrypoint in `dc-a`; the KV crosses a tbf-capped veth link by NIXL over UCX
TCP. Outputs equal the offline engine's; the link carried the KV bytes. Skips with the reason where
this host cannot create network namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from deepinfer.deploy.netns import TwoDatacenters, can_create
from deepinfer.deploy.processes import ServiceProcesses

pytest.importorskip("nixl")
_OK, _WHY = can_create()
pytestmark = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_WHY}")

STARTUP_TIMEOUT_S = 90.0


CLIENT = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
import grpc
from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc
job = json.load(sys.stdin)
if job["kind"] == "generate":
    with Client(job["address"], timeout_s=120) as client, ThreadPoolExecutor(len(job["prompts"])) as pool:
        outs = list(pool.map(lambda pk: client.generate(pk[0], **pk[1]), zip(job["prompts"], job["kwargs"])))
    print(json.dumps(outs))
else:
    stub = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}[job["kind"]]
    with grpc.insecure_channel(job["address"]) as channel:
        _, call = stub(channel).Health.with_call(common_pb2.HealthRequest(), timeout=10)
    print(dict(call.trailing_metadata())["deepinfer-stats-json"])
"""


def _in(link: TwoDatacenters, netns: str, job: dict):
    """Run CLIENT inside `netns` (gRPC's own threads must live there too: a subprocess, not setns)."""
    r = subprocess.run(link.command(netns, [sys.executable, "-c", CLIENT]), input=json.dumps(job),
                       capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _link_bytes(link: TwoDatacenters, name: str) -> int:
    """Bytes sent out of namespace `name` on the link."""
    r = subprocess.run(["ip", "-n", name, "-j", "-s", "link", "show", link.device(name)], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"]


def test_prefill_in_dc_a_decode_in_dc_b_over_a_capped_link(tmp_path):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path / "tiny", preset="tiny", seed=7))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (9, 40, 77, 130)]
    kwargs = [dict(temperature=0.0, max_tokens=8, ignore_eos=True),
              dict(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True)] * 2
    ref = LLM(ckpt).generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**k) for k in kwargs],
                             use_tqdm=False)

    link = TwoDatacenters(bandwidth_mbit=200, names=(f"dc-a-{os.getpid()}", f"dc-b-{os.getpid()}"),
                          subnet="10.79.0").create()
    a, b = link.names
    procs = ServiceProcesses(tmp_path / "logs", {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        procs.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware",
                                   "--host", link.address(a)], netns=a)
        procs.spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", "kv_load",
                                  "--host", link.address(b)], netns=b)
        info = procs.wait_ready(STARTUP_TIMEOUT_S)
        worker = ["--model", ckpt, "--max-num-seqs", "8", "--num-blocks", "256"]
        procs.spawn("prefill", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"], "--host",
                                link.address(a), "--datacenter", "dc-a", *worker], netns=a, env=link.ucx_env(a))
        procs.spawn("decode", ["decode_worker", "--lb-address", info["decode_lb"]["address"], "--host",
                               link.address(b), "--datacenter", "dc-b", *worker], netns=b, env=link.ucx_env(b))
        procs.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--host", link.address(a),
                                   "--prefill-lb-address", info["prefill_lb"]["address"],
                                   "--decode-lb-address", info["decode_lb"]["address"]], netns=a)
        procs.wait_ready(STARTUP_TIMEOUT_S)
        sent_before = _link_bytes(link, a)

        time.sleep(1.0)  # the decode instance's first heartbeat
        outs = _in(link, a, {"kind": "generate", "address": info["entrypoint"]["address"], "prompts": prompts,
                             "kwargs": kwargs})
        for i, (out, r) in enumerate(zip(outs, ref)):
            assert out["token_ids"] == r.outputs[0].token_ids, f"request {i}"
        p = _in(link, a, {"kind": "prefill", "address": info["prefill"]["address"]})
        d = _in(link, b, {"kind": "decode", "address": info["decode"]["address"]})
        assert p["kv_transfer_sent_bytes_total"] > 0
        assert d["kv_transfer_received_bytes_total"] == p["kv_transfer_sent_bytes_total"]
        # the KV crossed the link: dc-a sent at least the KV bytes over the veth
        assert _link_bytes(link, a) - sent_before >= p["kv_transfer_sent_bytes_total"]
    finally:
        procs.stop(10.0)
        link.destroy()
