"""Speculative decoding on a multi-rank decode instance behind the P/D handshake (worker cores, in process): a
one-process speculative prefill (it drafts the first block and sends it with the KV) and a 2-rank speculative decode
instance (gloo ranks in processes, one NIXL agent per rank, `kv_transfer.ranked`; the bounded state and the MTP
drafter's window rebuilt by bounded replay on the rank that owns the request). Greedy tokens equal the offline
engine's without speculation and expert_parallel_size = 1, batch-invariant mode on every side; both decode ranks
verify drafts the prefill or their own drafter proposed. tests/e2e/test_expert_parallel_cluster.py covers the same
with real processes, without speculation."""

from __future__ import annotations

import time

import pytest

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV
from deepinfer.kv_transfer.ranked import RankedAgents, open_instance_agent
from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork

pytest.importorskip("nixl")

KW = dict(max_num_seqs=4, max_model_len=256, batch_invariant=True)


def _chat_prompts() -> list[list[int]]:
    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    qs = ["What is 37 + 48?", "Repeat these words: apple banana cherry Paris", "What is 12 + 79?",
          "Reverse these words: red green blue"]
    return [enc.encode(recipe.Conversation([recipe.UserMessage(q)])) for q in qs]


def test_two_rank_speculative_decode_equals_the_offline_engine():
    prompts = _chat_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24)
    ref = [o.outputs[0].token_ids for o in LLM(**KW).generate([{"prompt_token_ids": p} for p in prompts], params,
                                                               use_tqdm=False)]
    spec = dict(speculative="mtp", num_draft_tokens=3, **KW)
    p_eng = Engine(EngineConfig(**spec))
    d_eng = Engine(EngineConfig(expert_parallel_size=2, **spec))
    p_agent = d_agent = None
    try:
        p_agent = open_instance_agent(p_eng, "prefill-s", send_state=True, ucx_env=LOOPBACK_UCX_ENV)
        # NOTE: with speculation the decode side rebuilds the bounded state (and the drafter's window) by replay
        d_agent = open_instance_agent(d_eng, "decode-s", send_state=False, ucx_env=LOOPBACK_UCX_ENV)
        assert isinstance(d_agent, RankedAgents)
        for info in d_agent.agent_infos().values():
            p_agent.add_peer(info.name, info.metadata, info.layout)
        prefill, decode = PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, "decode-s")
        for i, p in enumerate(prompts):
            res = decode.reserve(f"r{i}", p, params, lease_s=60.0, rank=i % 2)
            assert res.state_slot is None
            prefill.submit(PrefillWork(f"r{i}", p, params, KVDestination(res.peer, res.block_ids, res.transfer_id,
                                                                         30.0)))
        outs, errors = {}, {}
        deadline = time.monotonic() + 120
        while len(outs) + len(errors) < len(prompts):
            assert time.monotonic() < deadline, "the P/D run did not finish"
            errors.update({d.request_id: d.error for d in prefill.step() if d.error})
            for ev in decode.step():
                if isinstance(ev, DecodeFailed):
                    errors[ev.request_id] = ev.error
                elif ev.finished:
                    outs[ev.request_id] = ev.outputs[0].token_ids
        assert not errors
        assert [outs[f"r{i}"] for i in range(len(prompts))] == ref
        m = d_eng.spec.metrics
        assert m.num_imported_drafts > 0 and m.num_accepted_drafts > 0
        assert decode.agent.stats()["kv_transfer_rank1_recvs_done_total"] == 2
    finally:
        for agent in (p_agent, d_agent):
            if agent is not None:
                agent.close()
        d_eng.shutdown()
        p_eng.shutdown()
