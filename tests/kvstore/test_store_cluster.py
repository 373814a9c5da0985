"""The store across a prefill restart, with real processes on loopback (balancers, one prefill instance with
the embedded store, one decode instance, the entrypoint).

A long prompt is served; the prefill instance is stopped and a new one started over the same store directory
(nothing of the first survives but the disk); the same prompt again reports its stored blocks as cached
prompt tokens and gives the cold run's tokens, token for token (greedy).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client

pytest.importorskip("nixl")

STARTUP_TIMEOUT_S = 90.0


def test_store_hit_after_prefill_restart(tmp_path):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path / "tiny", preset="tiny", seed=7))
    store_dir = tmp_path / "kvstore"
    processes = ServiceProcesses(tmp_path / "logs", {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    prompt = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    kwargs = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        for stage, policy in (("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", "4", "--num-blocks", "128"]
        prefill_args = ["prefill_worker", "--lb-address", info["prefill_lb"]["address"], *worker_args,
                        "--kv-store", "embedded", "--kv-store-dirs", str(store_dir)]
        processes.spawn("prefill", [*prefill_args, "--instance-id", "prefill-0"])
        processes.spawn("decode", ["decode_worker", "--lb-address", info["decode_lb"]["address"],
                                   "--instance-id", "decode-0", *worker_args])
        processes.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--prefill-lb-address",
                                       info["prefill_lb"]["address"], "--decode-lb-address", info["decode_lb"]["address"]])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=60.0)
        ref = LLM(ckpt).generate([{"prompt_token_ids": prompt}], SamplingParams(**kwargs), use_tqdm=False)[0]

        t = time.monotonic()
        cold = client.generate(prompt, **kwargs)
        cold_s = time.monotonic() - t
        assert cold["token_ids"] == ref.outputs[0].token_ids and cold["usage"]["cached_prompt_tokens"] == 0

        # the prefill instance goes (its pools, prefix cache and process with it); a new one comes up
        proc = processes.procs.pop("prefill")
        processes.info.pop("prefill", None)
        proc.terminate()
        proc.wait(30)
        assert any(store_dir.rglob("*.blk")), "the first prefill wrote no block files"
        processes.spawn("prefill2", [*prefill_args, "--instance-id", "prefill-1"])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        deadline = time.monotonic() + 30
        while True:  # until the balancer knows the new instance
            try:
                t = time.monotonic()
                warm = client.generate(prompt, **kwargs)
                warm_s = time.monotonic() - t
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert warm["token_ids"] == ref.outputs[0].token_ids
        assert warm["usage"]["cached_prompt_tokens"] == 4 * 64  # the stored blocks (the last 44 tokens computed)
        print(f"cold {cold_s:.3f} s, after restart with a store hit {warm_s:.3f} s")
        # the new instance's Health stats carry the store's counters
        import grpc

        from deepinfer.protos import common_pb2, prefill_pb2_grpc

        with grpc.insecure_channel(processes.info["prefill2"]["address"]) as channel:
            _, call = prefill_pb2_grpc.PrefillStub(channel).Health.with_call(common_pb2.HealthRequest(), timeout=10)
        stats = json.loads(dict(call.trailing_metadata())["deepinfer-stats-json"])
        assert stats["kvstore_hit_blocks_total"] == 4 and stats["kvstore_loads_total"] == 1
    finally:
        if client is not None:
            client.close()
        processes.stop(10.0)
