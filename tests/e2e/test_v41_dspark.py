"""DeepSeek-V4.1 with DSpark speculation through the disaggregated cluster: two balancers, one prefill and one decode
instance started with `--speculative dspark --num-draft-tokens 3 --engram-placement device` (NIXL over UCX
loopback) and the entrypoint, each as `python -m ...`, on the published-layout tiny V4.1 checkpoint with DSpark
stages (`make_checkpoint --format published-v41 --dspark`).

The decode takes the bounded state with the KV (its default with DSpark), and the state now holds the DSpark
stages' window rings (`dspark_keys`, seeded on the prefill from the prompt's `main_x`); the prefill drafts the
first block and sends it in the transfer notice, which the decode's first step verifies. Greedy and seeded
sampled outputs equal the offline engine's *without* speculation, token for token; every transfer carried the
rings (bytes counted on both sides). That the decode's blocks are the offline speculative engine's is
tests/engine/v41/test_dspark_cluster.py's (in process, where the drafts can be read).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.e2e.test_disaggregated import _blocks_freed, _wait_for
from tests.e2e.test_disaggregated_v41 import v41_cluster

pytest.importorskip("nixl")

NUM_DRAFT_TOKENS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import main as make_checkpoint_main

    ckpt = str(make_checkpoint_main([str(tmp_path_factory.mktemp("tiny_v41_dspark")), "--format", "published-v41",
                                     "--dspark", "--seed", "3", "--overwrite"]))
    yield from v41_cluster(tmp_path_factory, ckpt, ["--num-blocks", "64", "--speculative", "dspark",
                                                    "--num-draft-tokens", str(NUM_DRAFT_TOKENS),
                                                    "--engram-placement", "device"])


def test_v41_dspark_cluster_equals_offline_engine_without_speculation(cluster):
    from deepinfer.engine import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    lengths = (3, 13, 29, 70)  # window 4, blocks of 64 tokens
    prompts = [torch.randint(3, 63, (n,), generator=g).tolist() for n in lengths]
    kwargs = [
        dict(temperature=0.0, max_tokens=9, ignore_eos=True),
        dict(temperature=0.0, max_tokens=12, ignore_eos=True),
        dict(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
        dict(temperature=0.0, max_tokens=7, ignore_eos=True),
    ]
    llm = LLM(cluster.checkpoint, max_num_seqs=8, num_blocks=64)
    ref = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                           [SamplingParams(**k) for k in kwargs], use_tqdm=False)
    before = cluster.stats("decode")
    assert before["spec_decode_num_draft_tokens"] == NUM_DRAFT_TOKENS
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda pk: cluster.client.generate(pk[0], **pk[1]), zip(prompts, kwargs)))
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out["token_ids"] == r.outputs[0].token_ids, f"request {i}"
    _wait_for("blocks freed", lambda: _blocks_freed(cluster))

    p, d = cluster.stats("prefill"), cluster.stats("decode")
    # every request's first block came from the prefill (the notice) and was verified on decode
    imported = d["spec_decode_imported_drafts_total"] - before["spec_decode_imported_drafts_total"]
    assert imported == NUM_DRAFT_TOKENS * len(prompts)
    assert d["spec_decode_verifications_total"] > before["spec_decode_verifications_total"]
    # each transfer: the prompt's blocks plus one slot of state, the DSpark rings (stages x window x head_dim, float32)
    # included, as the engine lays it out
    pools, mc = llm.engine.cache.pool_layouts, llm.engine.model_config
    block_bytes = sum(q.num_layers * q.unit_nbytes for q in pools.values() if not q.is_state)
    ring_bytes = mc.num_nextn_predict_layers * mc.sliding_window * mc.head_dim * 4
    slot_bytes = sum(q.num_layers * q.unit_nbytes for q in pools.values() if q.is_state) + ring_bytes
    bs = 64
    assert d["kv_transfer_received_bytes_total"] == p["kv_transfer_sent_bytes_total"] == sum(
        -(-n // bs) * block_bytes + slot_bytes for n in lengths)
