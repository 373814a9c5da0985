"""The confidence head and the step-cost table of confidence-scheduled verification (CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.spec_decode.confidence import (
    CONFIDENCE_HEAD_FILE,
    ConfidenceHead,
    confidence_features,
    load_confidence_head,
    num_features,
)
from deepinfer.engine.spec_decode.step_cost import (
    StepCostTable,
    default_cost_table_path,
    load_cost_table,
    profile_step_cost,
)
from deepinfer.engine.spec_decode.verify_schedule import choose_verify_lengths


def test_head_file_round_trips_and_the_builtin_head_loads(tmp_path):
    assert load_confidence_head(tmp_path, 16) is None  # no file: the draft-probability fallback
    assert load_confidence_head(None, 16) is None
    head = ConfidenceHead(16, width=8)
    head.save(tmp_path / CONFIDENCE_HEAD_FILE)
    back = load_confidence_head(tmp_path, 16)
    x = torch.randn(5, num_features(16))
    assert torch.equal(back(x), head(x))
    with pytest.raises(ValueError, match="hidden size"):
        load_confidence_head(tmp_path, 32)
    with pytest.raises(ValueError, match=r"features \[B, 27\]"):
        head(torch.randn(2, 5))
    # the built-in model ships one; it runs on real features and gives probabilities
    builtin = load_confidence_head(builtin_model_path(), 128)
    assert builtin is not None
    logits = torch.randn(4, 1000) * 3
    logits[:, 7] = float("-inf")  # a masked entry adds nothing to the entropy
    probs = torch.softmax(logits, dim=-1)
    feats = confidence_features(torch.randn(4, 128), logits, probs, 2)
    assert feats.shape == (4, num_features(128)) and feats[:, -8:].argmax(dim=-1).eq(2).all()
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    assert torch.allclose(feats[:, 130], entropy, atol=1e-4)
    assert torch.equal(feats[:, 128], probs.max(dim=-1).values)
    c = builtin(feats)
    assert c.shape == (4,) and ((c >= 0) & (c <= 1)).all()


def _chat_prompts():
    import deepseek_recipe as recipe

    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    qs = ["What is 23 + 58?", "Reverse these words: cat river gold", "What is the weather in Oslo?",
          "Copy this list: sun star table"]
    return [enc.encode(recipe.Conversation([recipe.UserMessage(q)], thinking_mode=i % 2 == 0))
            for i, q in enumerate(qs)]


def _run(engine: Engine, prompts, params) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return [outs[str(i)] for i in range(len(prompts))]


def test_confidence_head_schedule_is_lossless_greedy_and_seeded():
    prompts = _chat_prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=24)
    ref = Engine(EngineConfig(max_num_seqs=4))
    want_greedy, want_seeded = _run(ref, prompts, greedy), _run(ref, prompts, seeded)
    eng = Engine(EngineConfig(max_num_seqs=4, speculative_tokens=3, verify_schedule="confidence"))
    assert eng.spec.confidence_head is not None and eng.spec.drafter.keep_features
    assert eng.spec.cost_table is not None  # the shipped CPU table
    assert _run(eng, prompts, greedy) == want_greedy
    assert _run(eng, prompts, seeded) == want_seeded
    m = eng.spec.metrics
    assert m.num_accepted_drafts > 0 and m.num_verified_drafts < m.num_proposed_drafts
    # "full" never loads the head; "linear" is the stand-in cost
    full = Engine(EngineConfig(max_num_seqs=4, speculative_tokens=3, verify_cost_table="linear"))
    assert full.spec.confidence_head is None and full.spec.cost_table is None


def _table(seconds, draft_seconds=None) -> StepCostTable:
    return StepCostTable([1, 4], [1, 2, 3, 4], seconds, draft_seconds, meta={"device": "synthetic"})


def test_cost_table_round_trips_and_interpolates(tmp_path):
    t = _table([[1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0]], [0.5, 1.0])
    t.save(tmp_path / "t.json")
    back = StepCostTable.load(tmp_path / "t.json")
    assert back == t and load_cost_table(str(tmp_path / "t.json")) == t
    assert t.cost_fn(4)(8) == 5.0 and t.draft_seconds_for(2) == pytest.approx(2 / 3)
    assert t.seconds_for(1, 3) == 3.0 and t.seconds_for(4, 8) == 4.0
    assert t.seconds_for(1, 2) < t.seconds_for(2, 4) < t.seconds_for(4, 8)  # between rows: interpolated
    assert t.seconds_for(8, 16) == pytest.approx(8.0)  # past the largest batch: in proportion
    with pytest.raises(ValueError, match="grid"):
        StepCostTable([1, 2], [1], [[1.0]])
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="profile-cost"):
        StepCostTable.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="not a file"):
        load_cost_table(str(tmp_path / "missing.json"))
    assert load_cost_table("linear") is None
    assert load_cost_table(None, "cpu") == StepCostTable.load(default_cost_table_path())
    assert load_cost_table(None, "cuda") is None


def test_budget_follows_the_table():
    conf = [[0.95, 0.8, 0.6], [0.9, 0.5, 0.3], [0.99, 0.95, 0.9], [0.7, 0.7, 0.7]]
    flat = _table([[1.0] * 4, [1.0] * 4])
    assert choose_verify_lengths(conf, cost_table=flat) == [3, 3, 3, 3]
    steep = _table([[1.0, 3.0, 5.0, 7.0], [1.0, 3.0, 5.0, 7.0]])  # each draft per request costs 2 steps
    assert choose_verify_lengths(conf, cost_table=steep, floor=0) == [0, 0, 0, 0]
    assert choose_verify_lengths(conf, cost_table=steep, floor=1) == [1, 1, 1, 1]
    mild = _table([[1.0, 1.5, 2.0, 2.5], [1.0, 1.5, 2.0, 2.5]])  # a draft per request: +50% step time
    lengths = choose_verify_lengths(conf, cost_table=mild, floor=0)
    assert 0 < sum(lengths) < 12 and lengths[2] == max(lengths)  # the confident request verifies most
    # drafting that every step pays anyway makes verifying relatively cheaper: a larger budget
    diluted = _table(mild.seconds, [3.0, 3.0])
    assert sum(choose_verify_lengths(conf, cost_table=diluted, floor=0)) > sum(lengths)


def test_profile_step_cost_measures_a_small_grid():
    from deepinfer.engine.loader import load_checkpoint

    model, _ = load_checkpoint(builtin_model_path())
    t = profile_step_cost(model, [1, 2], max_drafts=1, context=16, repeats=1)
    assert t.num_reqs == [1, 2] and t.tokens_per_req == [1, 2]
    assert all(s > 0 for r in t.seconds for s in r) and t.meta["context"] == 16
    assert len(t.draft_seconds) == 2 and all(s > 0 for s in t.draft_seconds)  # the built-in model has an MTP layer
