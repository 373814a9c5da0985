"""DeepSeek-V4.1 through the disaggregated cluster: two balancers, one prefill and one decode instance
(NIXL over UCX loopback) and the entrypoint, each started as `python -m ...`, on the published-layout tiny
V4.1 checkpoint (`make_checkpoint --format published-v41`).

V4.1's cache (`engine.cache.v41`, blocks of 64 tokens) moves as the transfer agent registers it: the KV sources' paged pools
(`entries_r{r}`, `index_keys_r{r}`) block by block, and with the request's slot its bounded state — every
layer's window ring, the sources' unfinished-group buffers and the Engram token history. Outputs equal the
offline engine's token for token, for prompts shorter than, of and longer than a block, with greedy and
seeded sampling; the same prompt again hits the prefill's prefix cache and gives the same tokens.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.engine.testing.make_checkpoint import TINY_V41_SPECIAL_TOKENS, TINY_V41_WORDS
from tests.e2e._cluster import running_cluster
from tests.e2e.test_disaggregated import STARTUP_TIMEOUT_S, STOP_TIMEOUT_S, Cluster, _blocks_freed, _wait_for

pytest.importorskip("nixl")

TOKENS = TINY_V41_SPECIAL_TOKENS + TINY_V41_WORDS
"""The tiny V4.1 checkpoint's tokenizer, by id."""


def v41_cluster(tmp_path_factory, ckpt: str, worker_args: list[str]):
    """Yields a `Cluster` of one prefill and one decode instance on `ckpt` with `worker_args` (balancers' heartbeat
    timeout 30 s); stops it all after."""
    lb_args = {stage: ["--heartbeat-timeout-s", "30"] for stage in ("prefill", "decode")}
    with running_cluster(tmp_path_factory, ckpt, ["--max-num-seqs", "8", *worker_args], STARTUP_TIMEOUT_S, 60.0,
                         STOP_TIMEOUT_S, lb_args=lb_args) as (processes, client):
        cluster = Cluster(ckpt, processes.procs, processes.info, client)
        try:
            yield cluster
        finally:
            for channel in cluster.channels.values():
                channel.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny_v41"), preset="tiny", seed=5, format="published-v41"))
    yield from v41_cluster(tmp_path_factory, ckpt, ["--num-blocks", "128"])


def test_v41_outputs_equal_offline_engine_and_state_moved_by_nixl(cluster):
    from deepinfer.engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = (2, 5, 17, 64, 70, 130)  # blocks of 64 tokens
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in lengths]
    kwargs = [
        dict(temperature=0.0, max_tokens=9, ignore_eos=True),
        dict(temperature=0.0, max_tokens=12, ignore_eos=True),
        dict(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
        dict(temperature=0.0, max_tokens=1, ignore_eos=True),
        dict(temperature=0.0, max_tokens=14, ignore_eos=True),
        dict(temperature=1.0, top_k=20, seed=3, max_tokens=8, ignore_eos=True),
    ]
    llm = LLM(cluster.checkpoint)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**k) for k in kwargs],
                       use_tqdm=False)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pk: cluster.client.generate(pk[0], **pk[1]), zip(prompts, kwargs)))
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out["token_ids"] == r.outputs[0].token_ids, f"request {i}"
        assert out["usage"]["prompt_tokens"] == len(prompts[i])

    p, d = cluster.stats("prefill"), cluster.stats("decode")
    assert p["kv_transfer_sends_done_total"] >= len(prompts)
    assert d["kv_transfer_received_bytes_total"] == p["kv_transfer_sent_bytes_total"] > 0
    # what moved is each prompt's blocks of the KV sources' pools plus one slot of bounded state (window rings,
    # unfinished groups, Engram history): the workers' cache is laid out as the offline engine's
    pools = llm.engine.cache.pool_layouts
    block_bytes = sum(q.num_layers * q.unit_nbytes for q in pools.values() if not q.is_state)
    slot_bytes = sum(q.num_layers * q.unit_nbytes for q in pools.values() if q.is_state)
    assert {n for n, q in pools.items() if q.is_state} >= {"window_kv", "engram_tokens"}
    bs = llm.engine.kv_block_size
    assert p["kv_transfer_sent_bytes_total"] == sum(-(-n // bs) * block_bytes + slot_bytes for n in lengths)

    # the same long prompt again: its full blocks come from the prefill's prefix cache
    again = cluster.client.generate(prompts[5], **kwargs[5])
    assert again["token_ids"] == outs[5]["token_ids"]
    assert again["usage"]["cached_prompt_tokens"] > 0
    _wait_for("blocks freed", lambda: _blocks_freed(cluster))


def test_v41_chat_with_a_system_turn_through_the_http_front(cluster):
    """The HTTP front (in-process, over this cluster's entrypoint) renders a system + user chat with recipe's V4.1
    encoding and the checkpoint's tokenizer; prefill and decode answer it as `LLM.chat` does offline."""
    import deepseek_recipe as recipe
    from fastapi.testclient import TestClient

    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.entrypoint.http.app import create_app
    from deepinfer.entrypoint.http.config import HttpConfig

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    options = recipe.ConversionOptions().with_model_versions_by_name({"m": recipe.ModelVersion.DeepseekV41Flash})
    conv = recipe.ChatCompletionRequest(json.dumps({"model": "m", "messages": messages})).convert(options).conversation
    ref = LLM(cluster.checkpoint).chat(conv, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                       use_tqdm=False)[0]
    assert 3 in ref.prompt_token_ids  # <｜System｜> of the tiny V4.1 tokenizer
    # `request`: greedy as asked in thinking mode too (the default, `official`, samples thinking at 1.0)
    app = create_app(HttpConfig(entrypoint=cluster.info["entrypoint"]["address"], model=cluster.checkpoint,
                                served_model_name="v41", thinking_sampling="request"))
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json={"model": "v41", "messages": messages, "temperature": 0.0,
                                                    "max_tokens": 6, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids) == 6
    # the same tokens: the word-level tokenizer's pieces, as the front's stream parser joins them (thinking first)
    message = body["choices"][0]["message"]
    words = [TOKENS[i] for i in ref.outputs[0].token_ids if TOKENS[i] not in ("<think>", "</think>")]
    got = (message.get("reasoning_content") or "") + (message.get("content") or "")
    assert got.replace(" ", "") == "".join(words)
