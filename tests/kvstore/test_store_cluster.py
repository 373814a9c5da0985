"""The store across a restart of every worker, with real processes on loopback (balancers, one prefill and one
decode instance, both on the embedded store in one directory, the entrypoint).

A long prompt is served; the prefill and decode instances are stopped and new ones started over the same store
directory (nothing of the first survives but the disk); the same prompt again reports its stored blocks as
cached prompt tokens and gives the cold run's tokens, token for token (greedy). Then requests with a
`kv_traffic_class` (agent, chat) through the entrypoint file their blocks under that class's TTL, and a two-turn
conversation (`is_conversation`): the decode instance writes the first turn's prompt and answer to the store, so
the second turn's prefill finds the whole first turn there, and answers as a cold run would.
"""

from __future__ import annotations

import json
import os
import sqlite3
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
        store_args = ["--kv-store", "embedded", "--kv-store-dirs", str(store_dir)]
        decode_args = ["decode_worker", "--lb-address", info["decode_lb"]["address"], *worker_args, *store_args]
        processes.spawn("decode", [*decode_args, "--instance-id", "decode-0"])
        processes.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--prefill-lb-address",
                                       info["prefill_lb"]["address"], "--decode-lb-address", info["decode_lb"]["address"]])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=60.0)
        ref = LLM(ckpt).generate([{"prompt_token_ids": prompt}], SamplingParams(**kwargs), use_tqdm=False)[0]

        t = time.monotonic()
        cold = client.generate(prompt, **kwargs)
        cold_s = time.monotonic() - t
        assert cold["token_ids"] == ref.outputs[0].token_ids and cold["usage"]["cached_prompt_tokens"] == 0

        # every worker goes (pools, prefix caches and processes with them); new ones come up on the same disk
        for name in ("prefill", "decode"):
            proc = processes.procs.pop(name)
            processes.info.pop(name, None)
            proc.terminate()
            proc.wait(30)
        assert any(store_dir.rglob("*.blk")), "the first prefill wrote no block files"
        processes.spawn("prefill2", [*prefill_args, "--instance-id", "prefill-1"])
        processes.spawn("decode2", [*decode_args, "--instance-id", "decode-1"])
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
        stats = _health_stats(processes.info["prefill2"]["address"], "prefill")
        assert stats["kvstore_hit_blocks_total"] == 4 and stats["kvstore_loads_total"] == 1
        assert stats["kvstore_classes"]["chat"]["hit_rate"] == 1.0  # per class: what /metrics exports
        _check_traffic_classes(client, store_dir, kwargs)
        _check_two_turns(client, ckpt, processes.info["decode2"]["address"], kwargs)
    finally:
        if client is not None:
            client.close()
        processes.stop(10.0)


def _check_traffic_classes(client: Client, store_dir, kwargs: dict) -> None:
    """`GenerateRequest.kv_traffic_class` (what the HTTP front sets per API key) reaches the store through the
    entrypoint and the prefill instance (`PrefillRequest.kv_traffic_class`): an `agent` prompt's blocks are
    filed under agent with its 3-day TTL, a `chat` prompt's under chat with 7 days."""
    from deepinfer.entrypoint.client import sampling_params_proto
    from deepinfer.kvstore import DEFAULT_CLASS_TTLS_S
    from deepinfer.protos import entrypoint_pb2

    prompts = {}
    for i, cls in enumerate(("agent", "chat")):
        prompt = torch.randint(2, 512, (200,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        request = entrypoint_pb2.GenerateRequest(request_id=f"class-{cls}", prompt_token_ids=prompt,
                                                 sampling_params=sampling_params_proto(**kwargs), kv_traffic_class=cls)
        assert [m for m in client._stub.Generate(request, timeout=60.0) if m.HasField("error")] == []
        prompts[cls] = prompt
    # the prefill's writer thread files the blocks after the request ended: read the index until they are there
    deadline = time.monotonic() + 30
    while True:
        with sqlite3.connect(f"file:{store_dir / 'index.sqlite'}?mode=ro", uri=True, timeout=10.0) as db:
            rows = db.execute("SELECT class, expires_at - last_used FROM entries").fetchall()
        by_class: dict[str, list[float]] = {}
        for cls, ttl in rows:
            by_class.setdefault(cls, []).append(ttl)
        if (len(by_class.get("agent", ())) >= 3 and len(by_class.get("chat", ())) >= 7) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # 3 full blocks of 64 per 200-token prompt; the restart test's prompt (no class: the default, chat) adds 4
    assert len(by_class.get("agent", ())) == 3, by_class.keys()
    assert len(by_class.get("chat", ())) == 3 + 4
    assert all(abs(t - DEFAULT_CLASS_TTLS_S["agent"]) < 1.0 for t in by_class["agent"])
    assert all(abs(t - DEFAULT_CLASS_TTLS_S["chat"]) < 1.0 for t in by_class["chat"])


def _health_stats(address: str, stage: str) -> dict:
    """A worker's Health stats (the JSON of its trailing metadata)."""
    import grpc

    from deepinfer.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    stub = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub}[stage]
    with grpc.insecure_channel(address) as channel:
        _, call = stub(channel).Health.with_call(common_pb2.HealthRequest(), timeout=10)
    return json.loads(dict(call.trailing_metadata())["deepinfer-stats-json"])


def _check_two_turns(client: Client, ckpt: str, decode_address: str, kwargs: dict) -> None:
    """A chat turn (`GenerateRequest.is_conversation`) of 150 prompt tokens and a 100-token answer: the decode
    instance writes its 3 full blocks (249 computed tokens; the prefill had stored 2) to the store when it
    finishes; the next turn (that prompt + that answer + 40 new tokens) reports the 3 blocks as cached, and its
    tokens equal the offline engine's cold run."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.entrypoint.client import sampling_params_proto
    from deepinfer.protos import entrypoint_pb2

    def turn(rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        request = entrypoint_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, is_conversation=True, kv_traffic_class="chat",
            sampling_params=sampling_params_proto(**{**kwargs, "max_tokens": max_tokens}))
        tokens, cached = [], None
        for m in client._stub.Generate(request, timeout=60.0):
            assert not m.HasField("error"), m.error
            tokens += list(m.token_ids)
            if m.HasField("usage"):
                cached = m.usage.cached_prompt_tokens
        return tokens, cached

    g = torch.Generator().manual_seed(21)
    turn1 = torch.randint(2, 512, (150,), generator=g).tolist()
    answer, cached1 = turn("conv-1", turn1, 100)
    assert len(answer) == 100 and cached1 == 0
    deadline = time.monotonic() + 30  # the decode instance's writer files the blocks after the turn ended
    while True:
        stats = _health_stats(decode_address, "decode")
        if stats["kvstore_written_bytes_total"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["kvstore_conversation_blocks_saved_total"] >= 1  # block 2 (0 and 1: the prefill wrote them)
    assert stats["kvstore_written_bytes_total"] > 0
    turn2 = turn1 + answer + torch.randint(2, 512, (40,), generator=g).tolist()
    ref = LLM(ckpt).generate([{"prompt_token_ids": turn2}], SamplingParams(**kwargs), use_tqdm=False)[0]
    tokens, cached2 = turn("conv-2", turn2, kwargs["max_tokens"])
    assert cached2 == 3 * 64  # the whole first turn's full blocks, not just its prompt's 2
    assert tokens == ref.outputs[0].token_ids
