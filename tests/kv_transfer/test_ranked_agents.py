"""Rank-aware KV transfer (`kv_transfer.ranked`): a 2-rank decode instance (gloo ranks in processes, one NIXL
agent per rank over its own pools) receives a one-process prefill's KV straight into the pools of the rank that
reserved it. In one test process (torch.distributed allows one group per process, so the prefill side is one
rank here; tests/e2e/test_expert_parallel_cluster.py runs a 2-rank prefill into a 2-rank decode):

* reservations name the rank's agent and its local block ids and slot; a balancer's rank is taken;
* greedy tokens equal the offline engine's (expert_parallel_size = 1), batch-invariant mode on both sides;
* an aborted reservation on rank 1 stays quarantined until the prefill's WRITE landed there, then every block
  and slot of every rank is free;
* a connector over one agent is refused by a multi-rank engine.
"""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent, PDConnector
from deepinfer.kv_transfer.ranked import RankedAgents, open_instance_agent
from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork

pytest.importorskip("nixl")

KW = dict(max_num_seqs=8, max_model_len=256, batch_invariant=True)


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    path = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=5))
    p_eng = Engine(EngineConfig(model=path, **KW))
    d_eng = Engine(EngineConfig(model=path, expert_parallel_size=2, **KW))
    p_agent = d_agent = None
    try:
        p_agent = open_instance_agent(p_eng, "prefill-r", send_state=True, ucx_env=LOOPBACK_UCX_ENV)
        d_agent = open_instance_agent(d_eng, "decode-r", send_state=True, ucx_env=LOOPBACK_UCX_ENV)
        assert isinstance(d_agent, RankedAgents) and isinstance(p_agent, KVTransferAgent)
        for info in d_agent.agent_infos().values():  # what the prefill server does on a destination it does not know
            p_agent.add_peer(info.name, info.metadata, info.layout)
        yield path, PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, "decode-r")
    finally:
        for agent in (p_agent, d_agent):
            if agent is not None:
                agent.close()
        d_eng.shutdown()
        p_eng.shutdown()


def _reserve_and_submit(prefill, decode, rid, prompt, params, rank=None):
    res = decode.reserve(rid, prompt, params, lease_s=60.0, rank=rank)
    prefill.submit(PrefillWork(rid, prompt, params,
                               KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)))
    return res


def test_decode_ranks_receive_the_kv_and_decode_like_the_offline_engine(pd):
    path, prefill, decode = pd
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 33, 70, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = LLM(path, **KW).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    blocks_per_rank = decode.engine.kv_manager.block_pool.blocks_per_rank
    reservations = [_reserve_and_submit(prefill, decode, f"r{i}", p, params, rank=i % 2) for i, p in enumerate(prompts)]
    for i, res in enumerate(reservations):  # the balancer's rank, in that rank's own ids
        assert res.peer == ("decode-r" if i % 2 == 0 else "decode-r-rank1")
        assert all(0 <= b < blocks_per_rank for b in res.block_ids) and res.state_slot is not None
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
    assert [outs[f"r{i}"] for i in range(len(prompts))] == [r.outputs[0].token_ids for r in ref]
    stats = decode.agent.stats()
    assert stats["kv_transfer_rank0_recvs_done_total"] == stats["kv_transfer_rank1_recvs_done_total"] == 2
    assert stats["kv_transfer_recvs_done_total"] == 4


def test_an_aborted_reservation_on_rank_1_is_quarantined_until_the_write_landed(pd):
    _, prefill, decode = pd
    prompt = list(range(3, 80))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    res = _reserve_and_submit(prefill, decode, "late", prompt, params, rank=1)
    assert res.peer == "decode-r-rank1"
    decode.abort("late")
    assert decode.num_quarantined == 1
    deadline = time.monotonic() + 30
    sent = False
    while not sent or decode.num_quarantined:
        assert time.monotonic() < deadline, "the quarantine was not lifted by the WRITE's notification"
        sent |= any(d.request_id == "late" and d.error is None for d in prefill.step())
        decode.step()
    kv = decode.engine.kv_manager
    assert [kv.block_pool.num_free_blocks_of(r) for r in (0, 1)] == [kv.num_blocks] * 2
    assert decode.engine.slots.num_free_slots == decode.engine.config.max_num_seqs
    assert decode.agent.num_pending_recvs == 0


def test_a_one_agent_connector_is_refused_by_a_multi_rank_engine(pd):
    _, _, decode = pd
    with pytest.raises(ValueError, match="expert_parallel_size=2"):
        decode.engine.set_kv_connector(PDConnector(decode.agent.local))
    assert PDConnector(decode.agent).serves_ranks(2)
