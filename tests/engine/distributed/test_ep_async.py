"""Overlapped scheduling on a multi-rank instance (`async_scheduling=True` with `expert_parallel_size=2`, gloo
ranks in processes): rank 0's command rounds run on one worker thread (`MultiRankExecutor`), the engine schedules
and postprocesses while the ranks compute, and the tokens equal the one-process engine's, token for token
(batch-invariant mode: bit-equal MoE numerics across rank layouts and batch compositions).

The overlap is checked on the executor's own counters and by holding a step on rank 0's worker thread (an event,
not a timing): the engine returns the previous step's outputs while the held step is in flight, and a command
called meanwhile (EPLB re-placement) runs after it, before the next step.
"""

from __future__ import annotations

import logging
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.distributed.executor import MultiRankExecutor
from deepinfer.engine.engine import Engine, _InflightStep
from deepinfer.engine.executor import PreparedStep, StepResult
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """The `tiny` preset with 8 routed experts and one random MTP layer (the speculative test drafts with it)."""
    hf = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8, "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny8async")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=6, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


def _prompts(num: int, seed: int, lo: int = 3, hi: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (int(n),), generator=g).tolist() for n in torch.randint(lo, hi, (num,), generator=g)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _reference(kw: dict, prompts, max_tokens) -> dict[str, list[int]]:
    """The one-process engine's greedy tokens (no overlap, no speculation), per request."""
    eng = Engine(**kw)
    try:
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            eng.add_request(str(i), p, _greedy(n))
        out = {}
        while eng.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        return out
    finally:
        eng.shutdown()


class _Hold:
    """Holds the next step on rank 0's worker thread until released (wraps `RankState.run`), and logs the
    command kinds rank 0 ran, in order."""

    def __init__(self, executor) -> None:
        self.run, self.log = executor.state.run, []
        self.armed, self.entered, self.release = False, threading.Event(), threading.Event()
        self.held_at = -1
        """The held step's index in `log`."""
        executor.state.run = self

    def __call__(self, cmd):
        self.log.append(cmd.kind)
        if cmd.kind == "step" and self.armed:
            self.armed = False
            self.held_at = len(self.log) - 1
            self.entered.set()
            self.release.wait(60)  # NOTE: a failed check releases it at once (`finally`), never a silent hang
        return self.run(cmd)

    def arm(self) -> None:
        self.entered.clear()
        self.release.clear()
        self.armed = True


def test_ep2_async_equals_one_process_with_joins_abort_preemption_and_eplb(tiny8):
    """EP = 2, async scheduling, short per-rank pools (preemptions), chunked prefills, redundant experts and EPLB
    every 4 steps: requests join and finish mid-run and one is aborted; the tokens equal one process's."""
    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=48, batch_invariant=True, block_size=8,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    prompts = _prompts(6, seed=3, lo=12, hi=24)
    prompts[0] = (prompts[0] * 2)[:22]  # two prefill chunks of at most 16 tokens
    max_tokens = [14, 6, 18, 9, 12, 16]
    ref = _reference(kw, prompts, max_tokens)

    ep = Engine(expert_parallel_size=2, async_scheduling=True, num_blocks=6, num_redundant_experts=2,
                eplb_interval_steps=4, **kw)
    ex = ep.executor
    hold = _Hold(ex)
    try:
        assert ex.max_inflight == 2 and ex.async_scheduling
        # 1. two steps in flight on the executor: the first two prefill chunks of request 0 (neither needs the
        #    other's tokens), the first held on rank 0's worker thread while the second is submitted
        ep.add_request("0", prompts[0], _greedy(max_tokens[0]))
        hold.arm()
        out1, touched1 = ep._schedule()
        f1 = ex.submit(ep._prepare(out1, {}))
        assert hold.entered.wait(60)
        out2, touched2 = ep._schedule()
        f2 = ex.submit(ep._prepare(out2, {}))
        assert ex.num_inflight == 2 and ex.max_steps_in_flight == 2 and not f1.done() and not f2.done()
        assert out2.num_scheduled_tokens == {"0": 6}  # the rest of the prompt, scheduled while chunk 1 runs
        hold.release.set()
        ep._inflight.extend([_InflightStep(out1, touched1, f1), _InflightStep(out2, touched2, f2)])

        # 2. continuous batching with the engine's own loop: requests join while others run, one is aborted
        got: dict[str, list[int]] = {}
        partial: dict[str, list[int]] = {}
        n_steps, joined, checked = 0, 1, False
        while ep.has_unfinished_requests() or joined < len(prompts):
            if joined < len(prompts) and n_steps % 3 == 0:
                ep.add_request(str(joined), prompts[joined], _greedy(max_tokens[joined]))
                joined += 1
            if n_steps == 10 and "2" not in got:
                assert ep.abort_request("2")
            if n_steps == 6:  # 3. the overlap: outputs of step N come back while step N + 1 is held in flight
                while ex.num_inflight:  # step N has run (the engine has not collected it): hold the next one
                    threading.Event().wait(0.01)
                hold.arm()
                outs = ep.step()
                # returned without waiting for step N + 1, which cannot finish before it is released
                assert hold.entered.wait(60) and ex.num_inflight == 1 and len(ep._inflight) == 1
                assert not ep._inflight[0].result.done()
                assert outs  # step N postprocessed meanwhile
                # 4. EPLB called while the held step is in flight: it waits for it and runs before the next step
                placed = []
                t = threading.Thread(target=lambda p=placed: p.append(ex.rebalance_experts()))
                t.start()
                while ex._pool._work_queue.qsize() < 1:
                    t.join(0.01)
                assert not placed
                hold.release.set()
                t.join(60)
                assert placed and all(p == placed[0][0] for p in placed[0])
                assert set(hold.log[hold.held_at + 1:]) == {"rebalance"}  # after the held step, before the next
                checked = True
            else:
                outs = ep.step()
            n_steps += 1
            for o in outs:
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
                else:
                    partial[o.request_id] = o.outputs[0].token_ids
        assert checked and sorted(got) == [str(i) for i in range(len(prompts)) if i != 2]
        assert partial.get("2", []) == ref["2"][:len(partial.get("2", []))]  # aborted mid-run
        assert {r: t for r, t in got.items() if r != "2"} == {r: t for r, t in ref.items() if r != "2"}
        assert ep.scheduler.num_preemptions > 0
        assert hold.log.count("rebalance") >= 3  # EPLB every 4 steps ran between overlapped steps, and the call
        assert ex.num_finished == ex.num_submitted > n_steps // 2
        assert ep.kv_manager.num_free_blocks == ep.kv_manager.num_blocks
    finally:
        hold.release.set()
        ep.shutdown()
    assert not any(t.is_alive() for t in ex._pool._threads)


def test_ep2_async_speculative_hands_tokens_before_drafts_and_equals_one_process(tiny8):
    """EP = 2, async scheduling and MTP speculation with oracle drafts (every accepted length on both ranks): the
    step's future is done once the ranks' tokens are in while rank 0 still drafts (`PendingSpecStepResult`), and
    the greedy tokens equal one process's without speculation."""
    from deepinfer.engine.spec_decode.executor import PendingSpecStepResult

    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=64, batch_invariant=True, block_size=8)
    prompts = _prompts(4, seed=5, lo=12, hi=22)
    max_tokens = [12, 8, 16, 14]
    ref = _reference(kw, prompts, max_tokens)
    full = {str(i): p + ref[str(i)] for i, p in enumerate(prompts)}
    rng = random.Random(7)

    ep = Engine(expert_parallel_size=2, async_scheduling=True, speculative="mtp", num_draft_tokens=3, num_blocks=6,
                **kw)
    ex = ep.executor
    release = threading.Event()
    try:
        assert ex.max_inflight == 1 and ex.async_scheduling
        results: list = []
        submit = ex.submit

        def recording_submit(step):
            fut = submit(step)
            fut.add_done_callback(lambda f: results.append(f.exception() or f.result()))
            return fut

        ex.submit = recording_submit
        spec = ex.state.spec
        draft_local, drafting = spec.draft_local, threading.Event()
        futures_at_draft: list[bool] = []

        def held_draft_local(step, verified):  # rank 0 drafting: the step's tokens are already handed over
            futures_at_draft.append(len(results))
            if not drafting.is_set():
                drafting.set()
                release.wait(60)
            return draft_local(step, verified)

        spec.draft_local = held_draft_local
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            ep.add_request(str(i), p, _greedy(n))
        got = {}
        first = threading.Thread(target=lambda: got.update(
            {o.request_id: o.outputs[0].token_ids for o in ep.step() if o.finished}))
        first.start()
        assert drafting.wait(60)
        assert len(results) == 1 and isinstance(results[0], PendingSpecStepResult)  # tokens in, drafts held
        release.set()
        first.join(60)
        while ep.has_unfinished_requests():
            got.update({o.request_id: o.outputs[0].token_ids for o in ep.step() if o.finished})
            for req in ep.scheduler.running.values():  # oracle drafts with errors: every accepted length
                if req.spec_token_ids:
                    seq = full[req.req_id]
                    req.spec_token_ids = [(t + 1 if t < 100 else t - 1) if rng.random() < 0.25 else t
                                          for t in seq[req.num_tokens:req.num_tokens + 3]] or [3]
        assert got == ref
        assert all(isinstance(r, PendingSpecStepResult) for r in results)
        assert futures_at_draft == list(range(1, len(futures_at_draft) + 1))  # each step: tokens before drafting
        m = ep.spec.metrics
        assert 0 < m.num_accepted_drafts < m.num_verified_drafts and m.accepted_per_position[2] > 0
        assert ep.scheduler.num_preemptions > 0
    finally:
        release.set()
        ep.shutdown()


def test_ep2_async_close_cancels_the_queued_step_at_once(tiny8):
    """`close` while a step is held in flight and another is queued behind it: the queued step's future is
    cancelled before `close` waits for the running one (a caller waiting on it does not hang), the running one
    still completes, and every submitted step counts as finished."""
    from concurrent.futures import CancelledError

    kw = dict(model=tiny8, max_num_seqs=4, max_model_len=48, batch_invariant=True, block_size=8,
              enable_prefix_caching=False, max_num_batched_tokens=16)
    ep = Engine(expert_parallel_size=2, async_scheduling=True, **kw)
    ex = ep.executor
    hold = _Hold(ex)
    closer = threading.Thread(target=ex.close)
    try:
        ep.add_request("0", (_prompts(1, seed=4, lo=12, hi=13)[0] * 2)[:22], _greedy(4))  # two prefill chunks
        hold.arm()
        out1, _ = ep._schedule()
        f1 = ex.submit(ep._prepare(out1, {}))
        assert hold.entered.wait(60)
        out2, _ = ep._schedule()
        f2 = ex.submit(ep._prepare(out2, {}))
        assert ex.num_inflight == 2 and not f1.done() and not f2.done()
        closer.start()
        with pytest.raises(CancelledError):
            f2.result(timeout=30)  # NOTE: while step 1 is still held: close cancelled it before waiting
        assert not f1.done() and closer.is_alive()
        with pytest.raises(RuntimeError, match="closed"):
            ex.submit(ep._prepare(out2, {}))
        hold.release.set()
        closer.join(60)
        assert not closer.is_alive()
        assert f1.result(timeout=0).token_ids == []  # chunk 1 of 2 samples nothing
        assert ex.num_finished == ex.num_submitted == 2 and ex.num_inflight == 0
        assert hold.log == ["step"]  # the cancelled step never ran on rank 0
    finally:
        hold.release.set()
        if closer.is_alive():
            closer.join(60)
        ep.shutdown()


def _bare_executor(**attrs) -> MultiRankExecutor:
    """A `MultiRankExecutor` without ranks (no process, no group): `_run_step` and the command rounds are
    replaced by the test, for the executor's own bookkeeping around them."""
    ex = object.__new__(MultiRankExecutor)
    ex.__dict__.update(_pool=None, eplb_interval_steps=0, _count_lock=threading.Lock(), _queued=set(),
                       num_submitted=0, num_finished=0, max_steps_in_flight=0, _num_steps=0, _is_closed=False,
                       _failure=None, _step_payloads=None, _procs=[])
    ex.__dict__.update(attrs)
    return ex


def test_automatic_eplb_failure_is_logged_and_fails_the_next_step(caplog):
    """An automatic EPLB re-placement that fails (after the step's result is handed over, so no future carries
    it) is logged and fails the executor: the next step raises it, as a rank failure does."""
    ex = _bare_executor(eplb_interval_steps=1)
    boom = ValueError("boom: re-placement failed")

    def run_step(step, payloads, *rest):
        if ex._failure is not None:
            return MultiRankExecutor._run_all(ex, [])  # the command round's check of an earlier failure
        ex._num_steps += 1
        return StepResult([7], [None], 0.0, 0.0)

    def rebalance():
        raise boom

    ex._run_step, ex.rebalance_experts = run_step, rebalance
    with caplog.at_level(logging.ERROR, logger="deepinfer.engine.distributed.executor"):
        assert ex.submit(PreparedStep(None, None)).result(timeout=0).token_ids == [7]
    assert ex._failure is boom
    assert any("EPLB" in r.getMessage() and r.exc_info and r.exc_info[1] is boom for r in caplog.records)
    with pytest.raises(RuntimeError, match="failed earlier") as info:
        ex.submit(PreparedStep(None, None)).result(timeout=0)
    assert info.value.__cause__ is boom
    assert ex.num_finished == ex.num_submitted == 2


def test_speculative_step_without_its_tokens_round_fails_its_future():
    """Async scheduling, a speculative step whose run ends without the tokens round (`on_tokens` never ran):
    its future fails instead of leaving the engine waiting on it."""
    ex = _bare_executor(_pool=ThreadPoolExecutor(max_workers=1))
    try:
        ex._run_step = lambda step, payloads, tokens_fut, drafts: "merged result"  # hands no tokens over
        fut = ex.submit(SimpleNamespace(verify=None, batch=None, sampling_batch=None))
        assert isinstance(fut.exception(timeout=30), RuntimeError) and "tokens round" in str(fut.exception())
        ex._pool.shutdown(wait=True)
        assert ex.num_finished == ex.num_submitted == 1
    finally:
        ex._pool.shutdown(wait=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL all-to-all between ranks)")
def test_ep2_async_on_two_gpus_matches_one_gpu(tiny8):
    """The NCCL path with overlapped scheduling (the GPU default): rank 0's collectives on its worker thread
    (`torch.cuda.set_device` there), with and without speculation; greedy tokens equal one GPU's."""
    kw = dict(model=tiny8, device="cuda", max_num_seqs=4, max_model_len=128)
    prompts = _prompts(4, seed=2)
    max_tokens = [3, 9, 4, 7]
    ref = _reference(dict(kw, async_scheduling=False), prompts, max_tokens)
    for extra in ({}, {"speculative": "mtp", "num_draft_tokens": 3}):
        ep = Engine(expert_parallel_size=2, **extra, **kw)  # async_scheduling: the CUDA default (on)
        try:
            assert ep.executor.async_scheduling
            for i, (p, n) in enumerate(zip(prompts, max_tokens)):
                ep.add_request(str(i), p, _greedy(n))
            got = {}
            while ep.has_unfinished_requests():
                got.update({o.request_id: o.outputs[0].token_ids for o in ep.step() if o.finished})
            assert got == ref
        finally:
            ep.shutdown()
