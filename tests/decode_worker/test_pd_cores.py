"""Prefill and decode cores on separate engines, KV moved by NIXL (two agents in one process):
greedy and seeded outputs equal the offline engine's, token for token, in both bounded-state
modes: decode rebuilding the state by bounded replay, or the prefill sending it into a reserved slot.
The prefill agent registers its state in both; the replay-mode decode agent does not."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from deepinfer.prefill_worker.core import KVDestination, PrefillCore, PrefillWork, StillSending
from deepinfer.prefill_worker.server import PREFILL_REFUSALS
from deepinfer.protos import common_pb2
from deepinfer.serving.errors import error_of

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=5))


@pytest.fixture(scope="module", params=["replay", "send"])
def pd(request, checkpoint):
    path, mode = checkpoint, request.param
    p_eng = Engine(EngineConfig(model=path, max_num_seqs=8))
    d_eng = Engine(EngineConfig(model=path, max_num_seqs=8))
    p_agent = KVTransferAgent(f"prefill-{mode}", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent(f"decode-{mode}", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=mode == "send")
    p_agent.add_peer(f"decode-{mode}", d_agent.metadata(), d_agent.pool_layout())
    yield path, PrefillCore(p_eng, p_agent), DecodeCore(d_eng, d_agent, f"decode-{mode}")
    p_agent.close()
    d_agent.close()


def _run(prefill: PrefillCore, decode: DecodeCore, requests, timeout_s: float = 120.0):
    """Drive the P/D handshake the way the entrypoint will: reserve on D, prefill on P, start D."""
    for rid, prompt, params in requests:
        res = decode.reserve(rid, prompt, params, lease_s=60.0)
        dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)
        prefill.submit(PrefillWork(rid, prompt, params, dest))
    outs, firsts, errors = {}, {}, {}
    deadline = time.monotonic() + timeout_s
    while len(outs) + len(errors) < len(requests):
        assert time.monotonic() < deadline, "P/D run did not finish"
        for done in prefill.step():
            if done.error:
                errors[done.request_id] = done.error
                decode.abort(done.request_id)
            else:
                firsts[done.request_id] = done.first_token_id
        for ev in decode.step():
            if isinstance(ev, DecodeFailed):
                errors[ev.request_id] = ev.error
            elif ev.finished:
                outs[ev.request_id] = ev
    return outs, firsts, errors


def test_disaggregated_equals_offline(pd):
    path, prefill, decode = pd
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 33, 64, 130, 71)]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=9, ignore_eos=True)]
    ref = LLM(path).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens_before = decode.engine.timings["tokens"]
    outs, firsts, errors = _run(prefill, decode, [(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    assert not errors
    for i, r in enumerate(ref):
        got = outs[f"r{i}"].outputs[0]
        assert got.token_ids == r.outputs[0].token_ids, f"request {i}"
        assert got.token_ids[0] == firsts[f"r{i}"]
        assert got.finish_reason == r.outputs[0].finish_reason
    decode_tokens = sum(len(o.outputs[0].token_ids) - 1 for o in ref)  # the first comes from prefill
    computed = decode.engine.timings["tokens"] - tokens_before
    if decode.agent.send_state:
        assert computed == decode_tokens  # no replay
    else:
        assert computed > decode_tokens  # bounded replay of each prompt's tail
    stats = prefill.agent.stats()
    assert stats["kv_transfer_sends_done_total"] >= len(prompts)
    # nothing stranded on either side
    assert prefill.engine.kv_manager.num_free_blocks == prefill.engine.kv_manager.num_blocks
    assert decode.engine.kv_manager.num_free_blocks == decode.engine.kv_manager.num_blocks
    assert prefill.engine.slots.num_free_slots == prefill.engine.config.max_num_seqs
    assert decode.engine.slots.num_free_slots == decode.engine.config.max_num_seqs
    d_stats = decode.agent.stats()
    if decode.agent.send_state:  # the state moved with the KV: each transfer also carried one slot
        state_bytes = sum(t.numel() * t.element_size() for t in decode.engine.cache.state_tensors().values())
        assert d_stats["kv_transfer_received_bytes_total"] >= len(prompts) * state_bytes // decode.engine.cache.num_slots


def test_decode_lease_expires_when_prefill_never_sends(pd):
    _, _, decode = pd
    decode.reserve("lost", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4), lease_s=0.3)
    assert (decode.engine.slots.num_free_slots < decode.engine.config.max_num_seqs) == decode.agent.send_state
    deadline = time.monotonic() + 10
    failed = []
    while not failed:
        assert time.monotonic() < deadline
        failed = [e for e in decode.step() if isinstance(e, DecodeFailed)]
    assert failed[0].request_id == "lost"
    # held a short margin past the lease (a WRITE from a prefill with a skewed clock), then freed
    assert decode.num_quarantined == 1
    while decode.num_quarantined:
        assert time.monotonic() < deadline
        decode.step()
        time.sleep(0.05)
    assert decode.engine.kv_manager.num_free_blocks == decode.engine.kv_manager.num_blocks
    assert decode.engine.slots.num_free_slots == decode.engine.config.max_num_seqs


def test_abort_before_kv_arrives_keeps_blocks_until_the_write_landed(pd):
    """Decode aborts a reservation the prefill is about to write into: the blocks (and slot) stay out
    of circulation until the WRITE's notification arrives, then are freed; nothing stranded."""
    _, prefill, decode = pd
    prompt = list(range(3, 80))
    params = SamplingParams(temperature=0.0, max_tokens=4)
    res = decode.reserve("late", prompt, params, lease_s=60.0)
    prefill.submit(PrefillWork("late", prompt, params,
                               KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)))
    decode.abort("late")
    total = decode.engine.kv_manager.num_blocks
    assert decode.num_quarantined == 1
    assert decode.engine.kv_manager.num_free_blocks == total - len(res.block_ids)
    deadline = time.monotonic() + 30
    sent = False
    while not sent or decode.num_quarantined:
        assert time.monotonic() < deadline, "the quarantine was not lifted by the WRITE's notification"
        sent |= any(d.request_id == "late" and d.error is None for d in prefill.step())
        decode.step()
    assert decode.engine.kv_manager.num_free_blocks == total
    assert decode.engine.slots.num_free_slots == decode.engine.config.max_num_seqs
    assert prefill.engine.kv_manager.num_free_blocks == prefill.engine.kv_manager.num_blocks


def test_prefill_reports_sending_between_compute_and_write_done(pd, monkeypatch):
    """Between the computed prefill and the WRITE's completion a request is `is_sending` (the prefill
    server counts no queued tokens for it then: a slow link is no queued compute). The agent's real
    completion events are held back to widen that window, then delivered."""
    _, prefill, decode = pd
    held = []
    real_poll = prefill.agent.poll

    def held_poll():
        ev = real_poll()
        held.extend(ev.sent_ids)
        ev.sent_ids.clear()
        return ev

    monkeypatch.setattr(prefill.agent, "poll", held_poll)
    prompt, params = list(range(40, 80)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    res = decode.reserve("slow-link", prompt, params, lease_s=60.0)
    prefill.submit(PrefillWork("slow-link", prompt, params,
                               KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)))
    assert not prefill.is_sending("slow-link")  # queued: not computed yet
    deadline = time.monotonic() + 60
    outs = {}

    def step_decode():  # decode's progress drives the loopback WRITE too
        outs.update({e.request_id: e for e in decode.step() if not isinstance(e, DecodeFailed) and e.finished})

    while not held:
        assert time.monotonic() < deadline, "the WRITE never completed"
        assert prefill.step() == []
        step_decode()
    assert prefill.is_sending("slow-link") and prefill.num_inflight == 1
    # a retry of the same id while an earlier attempt's WRITE is in flight (`abort` keeps that attempt until the
    # send is reported) is refused as retryable (RESOURCE_EXHAUSTED: another instance, or later), not INTERNAL
    # (the CI chaos test, 2026-12-05: "already has a pending save" failed an accepted request)
    prefill.abort("slow-link")
    with pytest.raises(StillSending):
        prefill.submit(PrefillWork("slow-link", prompt, params,
                                   KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)))
    assert error_of(StillSending("x"), extra=PREFILL_REFUSALS).code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED

    def release_poll():
        ev = real_poll()
        ev.sent_ids[:0] = held
        held.clear()
        return ev

    monkeypatch.setattr(prefill.agent, "poll", release_poll)
    done = []
    while not done:
        assert time.monotonic() < deadline
        done = prefill.step()
        step_decode()
    assert done[0].request_id == "slow-link" and not done[0].error
    assert not prefill.is_sending("slow-link") and prefill.num_inflight == 0
    while "slow-link" not in outs:
        assert time.monotonic() < deadline
        step_decode()
    ref = LLM(decode.engine.config.model).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert outs["slow-link"].outputs[0].token_ids == ref.outputs[0].token_ids
