"""Speculative decoding in the offline engine: lossless against non-speculative runs.

Greedy (and seeded sampled) outputs with speculation must equal those without, token for token. On
the built-in model the MTP drafts are good (most are accepted); on random `tiny` checkpoints (window
8, CSA rate 4, HCA rate 8: verifications cross ring and compression boundaries all the time) the
MTP drafts are nearly always rejected, and an *oracle* drafter (the reference continuation with
errors injected) exercises every accepted length, so both the rollback and the commit paths run.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The `tiny` preset with one random MTP layer (`mtp.0.*`), in our writer's layout."""
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny")
    weights = random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True)
    _write_ours(out, hf, weights, torch.float32, 1 << 40)
    return str(out)


def _prompts(num: int, lo: int, hi: int, seed: int, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def _run(engine: Engine, prompts, params, drafts_fn=None, outputs: bool = False) -> list:
    """Drive `engine` to completion: each request's token ids (or, with `outputs`, its `CompletionOutput`).

    `drafts_fn(req)` (optional) replaces each running request's drafts after every step."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    outs: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0] if outputs else o.outputs[0].token_ids
        if drafts_fn is not None:
            for req in engine.scheduler.running.values():
                if req.spec_token_ids:
                    req.spec_token_ids = drafts_fn(req)
    return [outs[str(i)] for i in range(len(prompts))]


def _oracle(prompts, ref, k: int, error_rate: float, seed: int):
    """Drafts from the reference continuation (`ref`), each wrong with probability `error_rate`."""
    rng = random.Random(seed)
    full = {str(i): p + r for i, (p, r) in enumerate(zip(prompts, ref))}

    def drafts(req):
        seq = full[req.req_id.split("#")[0]]
        out = []
        for t in seq[req.num_tokens:req.num_tokens + k]:
            out.append(t + 1 if rng.random() < error_rate else t)
        return out or [3]
    return drafts


def _chat_prompts():
    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    qs = ["What is 37 + 48?", "Repeat these words: apple banana cherry Paris", "Reverse these words: red green blue",
          "What is 12 + 79?", "What's the weather like in Lisbon?"]
    return [enc.encode(recipe.Conversation([recipe.UserMessage(q)], thinking_mode=i % 2 == 0))
            for i, q in enumerate(qs)]


def test_builtin_model_greedy_equals_non_speculative_and_drafts_are_accepted():
    prompts = _chat_prompts()
    natural = SamplingParams(temperature=0.0, max_tokens=64)
    ref_engine = Engine(EngineConfig(max_num_seqs=8))
    ref = _run(ref_engine, prompts, natural)
    spec = Engine(EngineConfig(max_num_seqs=8, speculative_tokens=3))
    assert _run(spec, prompts, natural) == ref
    stats = spec.speculative_stats()
    assert stats["mean_accepted_length"] >= 2.0  # the built-in MTP layer is a good drafter in its domain
    assert stats["acceptance_rate_per_position"][0] >= 0.7
    assert stats["num_verified_tokens"] == stats["num_verifications"] + stats["num_verified_drafts"]
    # confidence-scheduled verification: fewer drafts verified, the same tokens
    conf = Engine(EngineConfig(max_num_seqs=8, speculative_tokens=3, verify_schedule="confidence"))
    assert _run(conf, prompts, natural) == ref
    c = conf.spec.metrics
    assert c.num_verified_drafts < c.num_proposed_drafts and c.num_accepted_drafts > 0
    # a structured-output request in the batch: its drafts are verified under its grammar, its output is unchanged
    from deepinfer.engine.sampling.params import StructuredOutputParams

    regex = SamplingParams(temperature=0.0, max_tokens=8, structured_output=StructuredOutputParams(regex="[0-9]{1,3}"))
    mixed = [natural, regex, natural]
    assert _run(spec, prompts[:3], mixed) == _run(ref_engine, prompts[:3], mixed)
    # 64+ tokens per request past the answers (ignore_eos), batch of 5, k = 2
    long = SamplingParams(temperature=0.0, max_tokens=72, ignore_eos=True)
    ref_long = _run(ref_engine, prompts, long)
    assert _run(Engine(EngineConfig(max_num_seqs=8, speculative_tokens=2)), prompts, long) == ref_long


def test_random_model_drafts_rejected_and_oracle_drafts_give_the_same_tokens(tiny):
    prompts = _prompts(4, 1, 50, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), prompts, params)
    # the random MTP layer's own drafts: (almost) all rejected, every rollback path runs
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
    assert _run(eng, prompts, params) == ref
    assert eng.spec.metrics.num_verified_drafts > 60
    # drafts that are always wrong
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=4))
    assert _run(eng, prompts, params, _oracle(prompts, ref, 4, 1.0, seed=0)) == ref
    assert eng.spec.metrics.num_accepted_drafts == 0
    # oracle drafts with errors: every accepted length; chunked prefill (small budget) mixes with verifies
    for k, budget in ((3, 2048), (7, 24)):
        eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=k, max_num_batched_tokens=budget))
        assert _run(eng, prompts, params, _oracle(prompts, ref, k, 0.25, seed=k)) == ref
        m = eng.spec.metrics
        assert 0 < m.num_accepted_drafts < m.num_verified_drafts
        assert m.accepted_per_position[k - 1] > 0  # full blocks accepted too


def test_prefix_hits_and_preemption_with_speculation(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    long_prompts = _prompts(3, 100, 130, seed=7)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), long_prompts, params)
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3, block_size=16))
    oracle = _oracle(long_prompts, ref, 3, 0.2, seed=3)
    assert _run(eng, long_prompts, params, oracle) == ref
    # the same prompts again: prefix-cache hits (with bounded replay), then verification on top
    computed = eng.num_computed_tokens_total
    assert _run(eng, long_prompts, params, oracle) == ref
    assert eng.num_computed_tokens_total - computed < 0.8 * computed
    # a pool too small for every request at once: preemptions, recomputes, drafts dropped and re-proposed
    prompts = _prompts(6, 30, 70, seed=2)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), prompts, params)
    small = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3, num_blocks=10, block_size=16,
                                max_model_len=140))
    assert _run(small, prompts, params, _oracle(prompts, ref, 3, 0.2, seed=3)) == ref
    assert small.scheduler.num_preemptions > 0


def test_seeded_sampling_with_penalties_equals_non_speculative(tiny):
    prompts = _prompts(4, 5, 40, seed=3)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=12, max_tokens=24, ignore_eos=True,
                       repetition_penalty=1.3, frequency_penalty=0.5),
        SamplingParams(temperature=1.2, presence_penalty=1.0, seed=13, max_tokens=24, min_tokens=10, stop_token_ids=[5, 9]),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={7: 5.0}),
    ]
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), prompts, params)
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
    assert _run(eng, prompts, params, _oracle(prompts, ref, 3, 0.2, seed=4)) == ref
    assert eng.spec.metrics.num_accepted_drafts > 20


def test_stops_limits_and_logprobs_inside_an_accepted_block(tiny):
    prompts = _prompts(4, 5, 30, seed=4)
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref_engine = Engine(EngineConfig(model=tiny, max_num_seqs=8))
    ref = _run(ref_engine, prompts, free, outputs=True)
    ref_ids = [o.token_ids for o in ref]
    text = ref[3].text
    cases = [
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),  # the cap lands inside a block
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[ref_ids[1][9]]),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[text[len(text) // 2:][:3]]),
    ]
    want = _run(ref_engine, prompts, cases, outputs=True)
    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=5))
    got = _run(eng, prompts, cases, _oracle(prompts, ref_ids, 5, 0.0, seed=0), outputs=True)  # blocks all accepted
    assert eng.spec.metrics.accepted_per_position[4] > 0
    for w, g in zip(want, got):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (w.token_ids, w.text, w.finish_reason,
                                                                         w.stop_reason)
    assert len(got[0].token_ids) == 7 and got[1].token_ids[-1] == ref_ids[1][9] and got[3].finish_reason == "stop"
    # logprobs of the accepted tokens: one per token, equal to the non-speculative ones (to rounding)
    assert len(got[2].logprobs) == len(want[2].logprobs) == 30
    for x, y in zip(want[2].logprobs, got[2].logprobs):
        assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids and x.rank == y.rank
        assert abs(x.logprob - y.logprob) < 1e-4


def test_config_refusals(tiny):
    with pytest.raises(ValueError, match="leave executor unset"):  # async scheduling and EP > 1: test_spec_async / _ep
        EngineConfig(model=tiny, speculative_tokens=2, async_scheduling=True, executor="threaded")
    with pytest.raises(ValueError, match="smallest state ring"):
        Engine(EngineConfig(model=tiny, speculative_tokens=8))
    off = Engine(EngineConfig(model=tiny))
    assert off.spec is None and off.speculative_stats() is None
