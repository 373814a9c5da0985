"""Structured outputs (constrained decoding with xgrammar) in the engine, and the sampler's penalties.

A random-weight tiny model decodes under a JSON schema / regex; its outputs must parse and validate.
Matchers are also driven directly with the real V4 tokenizer (reasoning prefix, termination,
rejection), and the KV-import path (`commit_kv`) must replay the first token into the matcher.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer.engine import LLM, InvalidRequestError, SamplingParams
from deepinfer.engine.sampling import Sampler, SamplingBatch, StructuredOutputParams
from deepinfer.engine.structured_output import GrammarCompiler, allocate_bitmask
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.tokenizer import load_tokenizer

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
}
"""A schema whose every value is bounded, so a random model must finish it within a few tokens."""
REGEX = r"(cat|dog|fish) [0-9]{2}"
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=2)), max_num_seqs=8)


@pytest.fixture(scope="module")
def v4_compiler():
    tokenizer = load_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [1])


def _texts(outs):
    return [o.outputs[0].text for o in outs]


def test_greedy_json_schema_output_parses_and_validates(llm):
    constraint = StructuredOutputParams(json_schema=json.dumps(SCHEMA), disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_output=constraint)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert completion.token_ids[-1] == 1  # EOS, the only token the completed grammar allows
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    # greedy constrained decoding is batch invariant: each request alone gives the same output
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
    assert _texts(alone) == _texts(outs)[1:2]


def test_any_json_with_free_whitespace_parses(llm):
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_output={"any_json": True})
    for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        json.loads(out.outputs[0].text)


def test_regex_output_matches_and_leaves_other_rows_alone(llm):
    constrained = SamplingParams(temperature=0.9, seed=7, max_tokens=20, structured_output={"regex": REGEX})
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [constrained, free], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert re.fullmatch(REGEX, outs[0].outputs[0].text), outs[0].outputs[0].text
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], free, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == alone


def test_async_scheduling_and_n_children_keep_the_constraint(llm):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20, n=2, structured_output={"regex": REGEX})
    sync = llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    assert all(re.fullmatch(REGEX, o.text) for o in sync.outputs) and sync.outputs[0].text != sync.outputs[1].text
    async_llm = LLM(llm.engine.config.model, max_num_seqs=8, async_scheduling=True)
    out = async_llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)[0]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in sync.outputs]


def test_constraint_ends_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, structured_output={"regex": "ab"})
    completion = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] == 1 and len(completion.token_ids) <= 3


@pytest.mark.parametrize(
    "constraint",
    [{"regex": "(unclosed"}, {"json_schema": '{"type": "no-such-type"}'}, {"grammar": "root ::= missing_rule"},
     {"structural_tag": '{"type": "structural_tag", "format": {"type": "nope"}}'}],
)
def test_bad_constraint_is_refused_before_compute(llm, constraint):
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("bad", [5, 6], SamplingParams(structured_output=constraint))
    assert info.value.field == "structured_output"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "constraint, message",
    [({}, "exactly one"), ({"regex": "a", "any_json": True}, "exactly one"), ({"json_schema": "{"}, "not valid JSON"),
     ({"regex": "a", "colour": 1}, "unknown field"), ({"regex": ""}, "non-empty")],
)
def test_constraint_params_validation(constraint, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        SamplingParams(structured_output=constraint)
    assert info.value.field == "structured_output"


def test_min_tokens_with_constraint_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(min_tokens=2, structured_output={"any_json": True})
    assert info.value.field == "min_tokens"


def test_compiled_grammars_are_cached(v4_compiler):
    _, compiler = v4_compiler
    before = compiler.num_compiled
    a = compiler.compile(StructuredOutputParams(regex="[0-9]+x"))
    b = compiler.compile(StructuredOutputParams(regex="[0-9]+x"))
    assert a is b and compiler.num_compiled == before + 1


def test_reasoning_prefix_then_constraint_with_the_v4_tokenizer(v4_compiler):
    tokenizer, compiler = v4_compiler
    state = compiler.new_state(StructuredOutputParams(regex="(yes|no)", reasoning_end="</think>"))
    reasoning = tokenizer.encode("Let me think: maybe x", add_special_tokens=False).ids
    assert state.advance_to(reasoning) and not state.is_completed  # free text before </think>
    think_end = tokenizer.token_to_id("</think>")
    ids = reasoning + [think_end]
    assert state.advance_to(ids)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    allowed = {tokenizer.decode([i]) for i in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert "yes" in allowed and "no" in allowed and "x" not in allowed and " maybe" not in allowed
    ids += tokenizer.encode("yes", add_special_tokens=False).ids
    assert state.advance_to(ids) and state.is_completed and not state.is_terminated
    assert not state.advance_to(ids + tokenizer.encode("!", add_special_tokens=False).ids)  # only EOS may follow
    state = compiler.new_state(StructuredOutputParams(regex="(yes|no)", reasoning_end="</think>"))
    assert state.advance_to(ids + [1]) and state.is_terminated


def test_special_tokens_are_never_allowed(v4_compiler):
    tokenizer, compiler = v4_compiler
    state = compiler.new_state(StructuredOutputParams(json_schema='{"type": "string"}'))
    assert state.advance_to(tokenizer.encode('"abc', add_special_tokens=False).ids)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)
    bos, pad = tokenizer.token_to_id("<｜begin▁of▁sentence｜>"), tokenizer.token_to_id("<｜▁pad▁｜>")
    assert logits[0, bos] == float("-inf") and logits[0, pad] == float("-inf")
    assert logits[0, tokenizer.token_to_id("</think>")] == 0  # a non-special added token is text


def test_commit_kv_replays_the_first_token_into_the_matcher(llm):
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_output={"regex": REGEX})
    reference = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    # a request whose prompt KV is "imported": here computed by a local prefill of the same engine
    prefill = SamplingParams(temperature=0.0, max_tokens=1, structured_output={"regex": REGEX})
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], prefill, use_tqdm=False)[0].outputs[0].token_ids
    assert first == reference.token_ids[:1]
    engine.reserve_kv("imported", PROMPTS[0], params, len(PROMPTS[0]))
    engine.commit_kv("imported", first)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].outputs[0].token_ids == reference.token_ids and outs[-1].outputs[0].finish_reason == "stop"
    # a first token that violates the constraint (sampled without it) fails the request with a clear error
    engine.reserve_kv("violating", PROMPTS[0], params, len(PROMPTS[0]))
    [out] = engine.commit_kv("violating", [ord("Z") - ord("!") + 3])  # "Z": no REGEX output starts with it
    assert out.finished and out.outputs[0].finish_reason == "error" and "violates" in out.error


# ---------------------------------------------------------------------------------------- penalties


def _batch(params: list[SamplingParams], outputs: list[list[int]], bitmask=None) -> SamplingBatch:
    batch = SamplingBatch.build(params, outputs, [[0] for _ in params])
    batch.token_bitmask = bitmask
    return batch


def test_presence_and_frequency_penalties_change_greedy_choices():
    logits = torch.tensor([[3.0, 2.5, 2.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert Sampler().sample(logits, _batch([greedy], [[0]])).sampled_token_ids.item() == 0  # no penalty: repeats
    presence = SamplingParams(temperature=0.0, presence_penalty=1.0)
    assert Sampler().sample(logits, _batch([presence], [[0]])).sampled_token_ids.item() == 1
    # frequency scales with the count: token 0 seen once still wins at 0.4, seen twice it does not
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert Sampler().sample(logits, _batch([frequency], [[0]])).sampled_token_ids.item() == 0
    assert Sampler().sample(logits, _batch([frequency], [[0, 0]])).sampled_token_ids.item() == 1
    # negative values encourage repeats; prompt tokens are never penalised by presence / frequency
    encourage = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    assert Sampler().sample(logits, _batch([encourage], [[2]])).sampled_token_ids.item() == 2
    prompt_only = SamplingBatch.build([presence], [[]], [[0, 0, 0]])
    assert Sampler().sample(logits, prompt_only).sampled_token_ids.item() == 0


def test_grammar_mask_applies_after_penalties():
    vocab = 64
    logits = torch.zeros(1, vocab)
    logits[0, 5] = 10.0
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 1 << 3  # only token 3 allowed
    params = SamplingParams(temperature=0.0, presence_penalty=-2.0, logit_bias={5: 5.0})
    processed = Sampler().process_logits(logits, _batch([params], [[5]], bitmask))
    assert processed[0, 3] == 0.0 and torch.isinf(processed[0, 5]) and processed[0].isfinite().sum() == 1
    assert Sampler().sample(logits, _batch([params], [[5]], bitmask)).sampled_token_ids.item() == 3
