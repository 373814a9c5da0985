"""Speculative decoding with async scheduling (`EngineConfig.async_scheduling=True`): `SpecExecutor` with
`overlap_drafting` verifies inline and drafts on a worker thread while the engine postprocesses the step's
tokens; the next step is scheduled once the drafts are known (the one sync point per step). Greedy tokens,
logprobs and seeded samples equal the synchronous engine's without speculation."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.spec_decode.executor import PendingSpecStepResult, SpecExecutor
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The `tiny` preset (window 8, CSA rate 4, HCA rate 8) with one random MTP layer."""
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tinymtp")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


def _prompts(num: int, seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(1, 50, (num,), generator=g)]


def _run(engine: Engine, prompts, params, drafts_fn=None) -> list:
    """Each request's (token ids, logprobs) once finished; `drafts_fn(req)` replaces the drafts after each step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                outs[o.request_id] = (c.token_ids, [lp.logprob for lp in c.logprobs] if c.logprobs else None)
        if drafts_fn is not None:
            for req in engine.scheduler.running.values():
                if req.spec_token_ids:
                    req.spec_token_ids = drafts_fn(req)
    return [outs[str(i)] for i in range(len(prompts))]


def _same(got, ref) -> None:
    """Equal tokens; logprobs equal to float32 rounding (a verify chunk computes several positions at once)."""
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(got, ref):
        if a is not None or b is not None:
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-4)


def _oracle(prompts, ref, k: int, error_rate: float, seed: int):
    rng = random.Random(seed)
    full = {str(i): p + r for i, (p, (r, _)) in enumerate(zip(prompts, ref))}

    def drafts(req):
        seq = full[req.req_id]
        return [t + 1 if rng.random() < error_rate else t for t in seq[req.num_tokens:req.num_tokens + k]] or [3]
    return drafts


def test_async_speculative_equals_synchronous_without_speculation(tiny):
    prompts = _prompts(6, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8, async_scheduling=False)), prompts, greedy)
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative="mtp", num_draft_tokens=3,
                              async_scheduling=True))
    try:
        assert isinstance(eng.executor, SpecExecutor) and eng.executor.overlap_drafting
        _same(_run(eng, prompts, greedy), ref)  # the random MTP's drafts: nearly all rejected, rolled back
        # oracle drafts with errors: every accepted length, max_tokens landing inside an accepted block
        mixed = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (20, 7, 20, 5,
                                                                                                       20, 11)]
        ref_mixed = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8, async_scheduling=False)), prompts, mixed)
        _same(_run(eng, prompts, mixed, _oracle(prompts, ref_mixed, 3, 0.25, seed=1)), ref_mixed)
        m = eng.spec.metrics
        assert 0 < m.num_accepted_drafts < m.num_verified_drafts and m.accepted_per_position[2] > 0
    finally:
        eng.shutdown()


def test_async_confidence_schedule_and_seeded_sampling(tiny):
    """The confidence schedule (decided on the drafting thread) and seeded sampling with penalties: the same
    tokens as the synchronous engine without speculation; a step's result carries its drafts lazily."""
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=12, ignore_eos=True, repetition_penalty=1.2)
              for i in range(len(prompts))]
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8, async_scheduling=False)), prompts, params)
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative="mtp", num_draft_tokens=2,
                              verify_schedule="confidence", async_scheduling=True))
    try:
        _same(_run(eng, prompts, params), ref)
        eng.add_request("x", prompts[0], SamplingParams(temperature=0.0, max_tokens=3))
        out, _ = eng._schedule()
        result = eng.executor.submit(eng._prepare(out, {})).result()
        assert isinstance(result, PendingSpecStepResult) and len(result.draft_token_ids) == 1
        eng._postprocess(out, result, set())
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_speculative_on_a_gpu_equals_synchronous(tiny):
    """On CUDA async scheduling is the default: the drafter's kernels (worker thread) and the engine's
    postprocessing overlap on one device stream; greedy tokens equal the synchronous engine without speculation."""
    prompts = _prompts(4, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = _run(Engine(EngineConfig(model=tiny, device="cuda", max_num_seqs=8, async_scheduling=False)), prompts,
               greedy)
    eng = Engine(EngineConfig(model=tiny, device="cuda", max_num_seqs=8, speculative="mtp", num_draft_tokens=3))
    try:
        assert eng.executor.overlap_drafting  # the CUDA default
        got = _run(eng, prompts, greedy, _oracle(prompts, ref, 3, 0.25, seed=2))
        assert [t for t, _ in got] == [t for t, _ in ref]
        assert eng.spec.metrics.num_accepted_drafts > 0
    finally:
        eng.shutdown()
