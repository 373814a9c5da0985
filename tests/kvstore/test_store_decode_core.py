"""Decode-side store writes, in-process (prefill and decode cores on separate engines, KV moved by NIXL between
two agents of this process, one embedded store): a finished conversation turn's prompt and answer blocks reach
the store (the prefill stored the prompt's; decode adds the answer's), a request not marked as a conversation and
an aborted one add nothing, and the next turn's prefill loads the whole previous turn and answers as a cold run.
The same through real processes and the entrypoint: test_store_cluster.py."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from deepinfer.kvstore import KVStore, KVStoreConfig
from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork

pytest.importorskip("nixl")


def _serve(prefill: PrefillCore, decode: DecodeCore, rid: str, prompt: list[int], params: SamplingParams,
           **reserve_kw):
    """Reserve on D, prefill on P, decode until the request finished; returns (decode output, PrefillDone)."""
    res = decode.reserve(rid, prompt, params, lease_s=60.0, **reserve_kw)
    dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)
    prefill.submit(PrefillWork(rid, prompt, params, dest))
    out = done = None
    deadline = time.monotonic() + 120
    while out is None:
        assert time.monotonic() < deadline, "P/D run did not finish"
        for d in prefill.step():
            assert d.error is None, d.error
            done = d
        for ev in decode.step():
            assert not isinstance(ev, DecodeFailed), ev.error
            if ev.finished:
                out = ev
    return out, done


def test_conversation_turn_written_by_decode(tmp_path):
    path = str(make_checkpoint(tmp_path / "tiny", preset="tiny", seed=5))
    config = KVStoreConfig(directories=(str(tmp_path / "store"),))
    p_store, d_store = KVStore(config), KVStore(config)  # two processes' stores over one directory, as on one host
    p_eng, d_eng = Engine(EngineConfig(model=path, max_num_seqs=4)), Engine(EngineConfig(model=path, max_num_seqs=4))
    p_agent = KVTransferAgent("prefill-s", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent("decode-s", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    p_agent.add_peer("decode-s", d_agent.metadata(), d_agent.pool_layout())
    try:
        prefill = PrefillCore(p_eng, p_agent, store=p_store)
        decode = DecodeCore(d_eng, d_agent, "decode-s", store=d_store)
        g = torch.Generator().manual_seed(4)
        turn1 = torch.randint(2, 512, (150,), generator=g).tolist()
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

        # not a conversation: decode writes nothing (the prefill stores the prompt's 2 full blocks)
        plain, _ = _serve(prefill, decode, "plain", turn1, long)
        assert p_store.flush(20.0) and d_store.flush(20.0)
        assert decode.num_conversation_blocks_saved == 0 and len(d_store.index) == 2
        # a conversation turn aborted mid-decode: nothing either
        decode.reserve("gone", turn1, long, lease_s=60.0, traffic_class="agent", is_conversation=True)
        decode.abort("gone")
        assert decode.step() == [] and decode.num_conversation_blocks_saved == 0

        # a conversation turn: 249 computed tokens, 3 full blocks; the store had 2, decode adds the third
        out1, _ = _serve(prefill, decode, "turn-1", turn1, long, traffic_class="agent", is_conversation=True)
        answer = out1.outputs[0].token_ids
        assert answer == plain.outputs[0].token_ids and decode.num_conversation_blocks_saved == 1
        assert d_store.flush(20.0) and len(d_store.index) == 3
        classes = d_store.stats()["classes"]  # the answer's block under the turn's class, the prompt's as stored
        assert classes["agent"]["blocks"] == 1 and classes["chat"]["blocks"] == 2

        turn2 = turn1 + answer + torch.randint(2, 512, (40,), generator=g).tolist()
        short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        cold = LLM(path).generate([{"prompt_token_ids": turn2}], short, use_tqdm=False)[0].outputs[0].token_ids
        out2, done2 = _serve(prefill, decode, "turn-2", turn2, short, is_conversation=True)
        assert done2.num_cached_tokens == 3 * 64  # the whole first turn (its prompt alone: 2 blocks, local)
        assert out2.outputs[0].token_ids == cold
    finally:
        p_agent.close()
        d_agent.close()
        p_store.close()
        d_store.close()
