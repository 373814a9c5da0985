"""The P/D cores as a GPU runs them, checked on the CPU: both engines with overlapped scheduling (the threaded
executor, `async_scheduling=True`: the default on a CUDA device, off on the CPU, so the CPU cluster tests never
run it), the prefill sending the bounded state (the workers' default). Outputs equal the offline engine's (also
async) token for token, every block and slot comes back, and the sender counts its bytes by memory type
(DRAM -> DRAM here; VRAM -> VRAM on a GPU: tests/e2e/test_pd_gpu.py).

Why it matters: with overlapped scheduling the prefill engine posts the WRITE from step N's outputs while step
N+1 may already run (the pinned blocks and slot of a finished, `max_tokens=1`, request are not touched by it); and
on the decode side a reservation may take blocks and a slot that a step still in flight writes (a request it
finished), so `DecodeCore.reserve` hands the destination out only after `Engine.wait_steps_in_flight`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from deepinfer.decode_worker.core import DecodeCore
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from deepinfer.prefill_worker.core import PrefillCore
from tests.decode_worker.test_pd_cores import _run, checkpoint  # noqa: F401  (the module's checkpoint fixture)

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def pd_async(checkpoint):  # noqa: F811
    p_eng = Engine(EngineConfig(model=checkpoint, max_num_seqs=8, async_scheduling=True))
    d_eng = Engine(EngineConfig(model=checkpoint, max_num_seqs=8, async_scheduling=True))
    assert p_eng.executor.max_inflight > 1 and d_eng.executor.max_inflight > 1  # steps really overlap
    p_agent = KVTransferAgent("prefill-async", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent("decode-async", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    p_agent.add_peer("decode-async", d_agent.metadata(), d_agent.pool_layout())
    try:
        yield checkpoint, PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, "decode-async")
    finally:
        p_agent.close()
        d_agent.close()
        p_eng.shutdown()
        d_eng.shutdown()


def test_async_disaggregated_equals_async_offline(pd_async):
    path, prefill, decode = pd_async
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 40, 64, 129, 77, 18)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (14, 9, 1, 12, 16, 2)]
    llm = LLM(path, async_scheduling=True)
    try:
        ref = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    outs, firsts, errors = _run(prefill, decode, [(f"a{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert not errors
    for i, r in enumerate(ref):
        got = outs[f"a{i}"].outputs[0]
        assert got.token_ids == r.outputs[0].token_ids, f"request {i}"
        assert got.token_ids[0] == firsts[f"a{i}"]
    for eng in (prefill.engine, decode.engine):  # nothing stranded
        assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
        assert eng.slots.num_free_slots == eng.config.max_num_seqs
    s, d = prefill.agent.stats(), decode.agent.stats()
    assert s["kv_transfer_sends_done_total"] == len(prompts)
    assert s["kv_transfer_sent_bytes_dram_to_dram_total"] == s["kv_transfer_sent_bytes_total"]
    assert d["kv_transfer_received_bytes_total"] == s["kv_transfer_sent_bytes_total"]
    assert s["kv_transfer_registered_vram_bytes"] == d["kv_transfer_registered_vram_bytes"] == 0


def test_wait_steps_in_flight_blocks_until_they_ran(pd_async):
    """An engine step still in flight may write blocks / a slot that a reservation just took (freed by a request it
    finished): `Engine.wait_steps_in_flight` returns only once every submitted step has run."""
    engine = pd_async[2].engine
    step = Future()
    order = []

    def finish():
        time.sleep(0.2)
        order.append("step ran")
        step.set_result(None)

    engine._inflight.append(SimpleNamespace(result=step))  # a stand-in step in flight
    try:
        threading.Thread(target=finish, daemon=True).start()
        engine.wait_steps_in_flight()
        order.append("returned")
    finally:
        engine._inflight.pop()
    assert order == ["step ran", "returned"]


def test_reserve_hands_out_its_destination_only_after_the_steps_in_flight(pd_async, monkeypatch):
    _, _, decode = pd_async
    seen = []
    real = decode.engine.wait_steps_in_flight

    def wait():
        seen.append(decode.connector.destination("w1")[1])  # the blocks are reserved, not yet handed out
        real()

    monkeypatch.setattr(decode.engine, "wait_steps_in_flight", wait)
    res = decode.reserve("w1", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=2), lease_s=5.0)
    assert seen == [res.block_ids] and res.block_ids
    decode.abort("w1")
    assert decode.release_quarantine(res.transfer_id)
