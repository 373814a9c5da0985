"""Speculative decoding on the disaggregated decode stage, across real processes on loopback: two
balancers, one prefill and one decode instance started with `--speculative mtp --num-draft-tokens 3`
(MTP drafts, the bounded state and the drafter's window rebuilt by bounded replay on decode; the
prefill drafts the first block and sends it with the KV, so each request's first decode step
verifies it), and the entrypoint.

The built-in model (its MTP layer agrees with the next-next token most of the time, so drafts are
accepted and whole blocks land in one step): greedy and seeded sampled outputs equal the offline
engine's without speculation token for token, stops and `max_tokens` inside an accepted block
included, and the decode instance's Health stats carry the acceptance figures.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, decode_pb2_grpc

pytest.importorskip("nixl")

STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"
NUM_DRAFT_TOKENS = 3


def _chat_prompts(num: int, seed: int) -> list[list[int]]:
    """The demo model's own tasks in its chat format (what its MTP layer drafts well)."""
    import random

    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    rng = random.Random(seed)
    words = ["red", "green", "blue", "apple", "river", "stone", "cloud", "table"]
    questions = [f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?",
                 "Repeat these words: " + " ".join(rng.sample(words, 4)),
                 "Reverse these words: " + " ".join(rng.sample(words, 3)),
                 "What's the weather like in Oslo?"]
    return [enc.encode(recipe.Conversation([recipe.UserMessage(questions[i % len(questions)])],
                                           thinking_mode=i % 2 == 0)) for i in range(num)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    try:
        for stage, policy in (("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--loopback-ucx", "--max-num-seqs", "8", "--num-blocks", "128"]
        spec_args = ["--speculative", "mtp", "--num-draft-tokens", str(NUM_DRAFT_TOKENS)]
        processes.spawn("prefill", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"],
                                    "--instance-id", "prefill-0", *worker_args, *spec_args])
        processes.spawn("decode", ["decode_worker", "--lb-address", info["decode_lb"]["address"],
                                   "--instance-id", "decode-0", *worker_args, *spec_args])
        processes.spawn("entrypoint", ["entrypoint", "--prefill-lb-address", info["prefill_lb"]["address"],
                                       "--decode-lb-address", info["decode_lb"]["address"]])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=120.0)
        with grpc.insecure_channel(info["decode"]["address"]) as channel:
            yield client, decode_pb2_grpc.DecodeStub(channel)
    finally:
        if client is not None:
            client.close()
        processes.stop(STOP_TIMEOUT_S)


def _decode_stats(stub) -> dict:
    reply, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
    assert reply.is_healthy, reply.message
    return json.loads(dict(call.trailing_metadata())[STATS_KEY])


def test_speculative_decode_stage_equals_offline_engine(cluster):
    from deepinfer.engine import LLM, SamplingParams

    client, decode = cluster
    g = torch.Generator().manual_seed(3)
    # chat prompts (accepted drafts), a random prompt longer than the bounded replay (4 * 127 + 32 tokens
    # on the built-in model: the decode replays only its tail) and a short random one
    prompts = _chat_prompts(4, seed=1) + [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (620, 7)]
    kwargs = [
        dict(temperature=0.0, max_tokens=40),
        dict(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
        dict(temperature=0.0, max_tokens=17, ignore_eos=True),  # max_tokens lands inside a block
        dict(temperature=1.0, top_k=20, seed=3, max_tokens=20),
        dict(temperature=0.0, max_tokens=8, ignore_eos=True),
        dict(temperature=0.7, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True),
    ]
    ref = LLM().generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**k) for k in kwargs],
                         use_tqdm=False)
    # a stop token that the greedy chat answer emits mid-stream: it must end the request inside a block
    stop_at = ref[0].outputs[0].token_ids[len(ref[0].outputs[0].token_ids) // 2]
    prompts.append(prompts[0])
    kwargs.append(dict(temperature=0.0, max_tokens=40, stop_token_ids=[stop_at]))
    ref += LLM().generate([{"prompt_token_ids": prompts[-1]}], [SamplingParams(**kwargs[-1])], use_tqdm=False)

    before = _decode_stats(decode)
    assert before["spec_decode_num_draft_tokens"] == NUM_DRAFT_TOKENS
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pk: client.generate(pk[0], **pk[1]), zip(prompts, kwargs)))
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out["token_ids"] == r.outputs[0].token_ids, f"request {i}"
        assert out["finish_reason"] == r.outputs[0].finish_reason, f"request {i}"
    assert outs[-1]["finish_reason"] == "stop" and outs[-1]["token_ids"][-1] == stop_at

    deadline = time.monotonic() + 10.0
    while (stats := _decode_stats(decode))["num_unfinished_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["num_kv_blocks_used"] == 0
    print(json.dumps({k: v for k, v in stats.items() if k.startswith("spec_decode_")}))  # shown with -s
    assert stats["spec_decode_verifications_total"] > before["spec_decode_verifications_total"]
    assert stats["spec_decode_accepted_drafts_total"] > 0
    # the prefill drafted every request's first block and sent it with the KV (the notice)
    imported = stats["spec_decode_imported_drafts_total"] - before["spec_decode_imported_drafts_total"]
    assert imported >= NUM_DRAFT_TOKENS * (len(prompts) - 2)  # (a request its first token ends gets none)
    # the built-in MTP layer drafts the chat answers well (the drafter's window was rebuilt on decode)
    assert stats["spec_decode_mean_accepted_length"] > 1.5
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1
    assert len(stats["spec_decode_acceptance_rate_per_position"]) == NUM_DRAFT_TOKENS
    assert 1 < stats["spec_decode_verified_tokens_per_step"]
