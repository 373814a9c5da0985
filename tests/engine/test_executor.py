"""The executor seam (engine/executor.py): the registry and factory, both executors on their own, and
`Engine.step` driving the in-process and threaded executors to identical tokens."""

from __future__ import annotations

import threading

import pytest
import torch
from pydantic import ValidationError

from deepinfer.engine import SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.executor import (
    EXECUTORS,
    Executor,
    InProcessExecutor,
    PreparedStep,
    ThreadedExecutor,
    executor_name,
    make_executor,
)
from deepinfer.engine.sampling import Sampler, SamplingBatch
from deepinfer.engine.testing.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=2))


def _prompts(num: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


# ---------------------------------------------------------------------------------------------------
# registry and factory


@pytest.mark.parametrize(("executor", "async_scheduling", "cls"), [
    (None, False, InProcessExecutor), (None, True, ThreadedExecutor),
    ("inprocess", False, InProcessExecutor), ("threaded", True, ThreadedExecutor),
])
def test_factory_picks_the_executor_from_the_config(executor, async_scheduling, cls):
    config = EngineConfig(executor=executor, async_scheduling=async_scheduling)
    assert EXECUTORS[executor_name(config.executor, config.async_scheduling)] is cls
    ex = make_executor(config, runner=None, sampler=Sampler(seed=0))
    try:
        assert type(ex) is cls and isinstance(ex, Executor)
    finally:
        ex.close()


def test_unknown_or_contradictory_executor_is_a_clear_error():
    with pytest.raises(ValidationError, match="unknown executor 'ray'; known executors: inprocess, threaded"):
        EngineConfig(executor="ray")
    with pytest.raises(ValidationError, match="set async_scheduling=True or leave executor unset"):
        EngineConfig(executor="threaded")
    with pytest.raises(ValidationError, match="set async_scheduling=False or leave executor unset"):
        EngineConfig(executor="inprocess", async_scheduling=True)


# ---------------------------------------------------------------------------------------------------
# the executors alone (a fake runner)


class _FixedLogitsRunner:
    """Returns preset logits and records the thread each run ran on."""

    def __init__(self, logits: torch.Tensor, error: Exception | None = None) -> None:
        self.logits = logits  # [num_reqs, vocab]
        self.error = error
        self.thread_names: list[str] = []

    def run(self, batch) -> torch.Tensor:
        self.thread_names.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return self.logits


def _sampling_step(num_reqs: int, vocab: int) -> PreparedStep:
    params = [SamplingParams(temperature=0.0, logprobs=2)] + [SamplingParams(temperature=0.8, seed=5)] * (num_reqs - 1)
    sbatch = SamplingBatch.build(params, [[] for _ in params], [[1, 2, 3] for _ in params])
    return PreparedStep(batch=None, sampling_batch=sbatch)


@pytest.mark.parametrize("cls", [InProcessExecutor, ThreadedExecutor])
def test_executor_runs_forward_and_sampling(cls):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    runner = _FixedLogitsRunner(logits)
    ex = cls(runner, Sampler(seed=0))
    try:
        res = ex.execute(_sampling_step(3, 40))
        again = ex.submit(_sampling_step(3, 40)).result()
        empty = ex.execute(PreparedStep(batch=None, sampling_batch=None))
    finally:
        ex.close()
        ex.close()  # idempotent
    ref = Sampler(seed=0).sample(logits, _sampling_step(3, 40).sampling_batch)
    assert res.token_ids == ref.sampled_token_ids.tolist() == again.token_ids
    assert res.token_ids[0] == int(logits[0].argmax())
    assert res.logprobs[0] is not None and res.logprobs[1:] == [None, None]
    assert res.model_s >= 0 and res.sample_s >= 0
    assert empty.token_ids == [] and empty.logprobs == []
    on_caller = [n == threading.current_thread().name for n in runner.thread_names]
    assert on_caller == [cls is InProcessExecutor] * 3
    with pytest.raises(RuntimeError):
        ex.submit(_sampling_step(3, 40))


@pytest.mark.parametrize("cls", [InProcessExecutor, ThreadedExecutor])
def test_executor_delivers_a_run_failure_through_the_future(cls):
    ex = cls(_FixedLogitsRunner(torch.zeros(1, 8), error=ValueError("forward failed")), Sampler(seed=0))
    try:
        fut = ex.submit(_sampling_step(1, 8))  # never raises itself
        with pytest.raises(ValueError, match="forward failed"):
            fut.result()
    finally:
        ex.close()


# ---------------------------------------------------------------------------------------------------
# the engine over both executors


def _run_engine(ckpt: str, async_scheduling: bool) -> tuple[dict, list[int]]:
    """Drive an engine step by step; a late request joins after the third `step()`. Returns each request's
    (token ids, finish reason) and how many outputs each `step()` returned."""
    eng = Engine(EngineConfig(model=ckpt, async_scheduling=async_scheduling, max_num_seqs=8,
                              max_num_batched_tokens=96))
    vocab = eng.model_config.vocab_size
    prompts = _prompts(5, vocab, lo=3, hi=150, seed=21)
    params = [
        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),  # finishes early
        SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=10, ignore_eos=True, n=2),
        SamplingParams(temperature=0.7, seed=11, max_tokens=9, ignore_eos=True, presence_penalty=0.5),
    ]
    for i in range(4):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params[i])
    results, num_outputs = {}, []
    try:
        while eng.has_unfinished_requests():
            outs = eng.step()
            num_outputs.append(len(outs))
            for o in outs:
                if o.finished:
                    results[o.request_id] = [(c.token_ids, c.finish_reason) for c in o.outputs]
            if len(num_outputs) == 3:
                eng.add_request("late", {"prompt_token_ids": prompts[4]}, params[4])
        assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    finally:
        eng.shutdown()
    return results, num_outputs


def test_inprocess_and_threaded_give_identical_tokens(ckpt):
    sync, sync_counts = _run_engine(ckpt, async_scheduling=False)
    threaded, threaded_counts = _run_engine(ckpt, async_scheduling=True)
    assert sorted(sync) == ["late", "r0", "r1", "r2", "r3"]
    assert threaded == sync
    assert [len(t) for t, _ in sync["r2"][:1]] == [2] and sync["r2"][0][1] == "length"
    assert [len(t) for t, _ in sync["r0"]] == [14] and [len(t) for t, _ in sync["late"]] == [9]
    assert sync["r3"][0][0] != sync["r3"][1][0]
    # the threaded engine's outputs lag one step: its first step returns nothing, it needs one more step
    assert sync_counts[0] > 0 and threaded_counts[0] == 0
    assert len(threaded_counts) == len(sync_counts) + 1


def test_threaded_step_in_flight_counts_as_unfinished(ckpt):
    eng = Engine(EngineConfig(model=ckpt, async_scheduling=True))
    try:
        eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert eng.step() == []  # submitted, not yet postprocessed
        eng.abort_request("a")
        assert eng.num_unfinished_requests == 0 and eng.has_unfinished_requests()
        while eng.has_unfinished_requests():
            assert eng.step() == []
        assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
        workers = list(eng.executor._pool._threads)
        assert workers and all(t.is_alive() for t in workers)
    finally:
        eng.shutdown()
    eng.shutdown()  # idempotent
    assert not any(t.is_alive() for t in workers)  # the worker thread has ended


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_model_failure_propagates_out_of_step(ckpt, async_scheduling, monkeypatch):
    eng = Engine(EngineConfig(model=ckpt, async_scheduling=async_scheduling))
    try:
        eng.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        eng.step()
        eng.step()

        def fail(batch):
            raise RuntimeError("device fell over")

        monkeypatch.setattr(eng.runner, "run", fail)
        with pytest.raises(RuntimeError, match="device fell over"):
            for _ in range(3):  # the threaded engine raises when it collects the failed step
                eng.step()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_after_shutdown_is_refused(ckpt, async_scheduling):
    eng = Engine(EngineConfig(model=ckpt, async_scheduling=async_scheduling))
    eng.shutdown()
    eng.add_request("a", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2))
    with pytest.raises(RuntimeError):
        eng.step()
