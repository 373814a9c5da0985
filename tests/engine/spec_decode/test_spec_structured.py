"""Structured outputs with speculative decoding: drafts are verified under the grammar, lossless.

A constrained request drafts like any other; its verify row `j` is masked as after its drafts `1 .. j`
(accepted tentatively, rolled back), drafts the grammar rejects are trimmed, and the matcher advances
over accepted tokens only. Greedy outputs must equal the non-speculative engine's token for token and
parse / validate. On the built-in model the MTP drafts are real; on a random `tiny` checkpoint an
oracle drafter (the reference continuation with errors, grammar-invalid ones included) forces every
accepted length, and `ignore_eos` makes an accepted EOS draft followed by a bonus token end the block.
"""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine import SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.sampling.params import StructuredOutputParams
from tests.engine.spec_decode.test_spec_engine import _chat_prompts, _prompts, tiny  # noqa: F401  (fixture)

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lisbon", "Berlin", "Rome"]},
        "sum": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "sum", "ok"],
    "additionalProperties": False,
}


def _json_params(**kw) -> SamplingParams:
    constraint = StructuredOutputParams(json_schema=json.dumps(SCHEMA), disable_any_whitespace=True)
    return SamplingParams(temperature=0.0, max_tokens=48, structured_output=constraint, **kw)


def _run(engine: Engine, prompts, params, drafts_fn=None):
    """Every request's `CompletionOutput`; `drafts_fn(req)` sets each decoding request's drafts after every step
    (those the drafter proposed, trimmed or not)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        if drafts_fn is not None:
            for req in engine.scheduler.running.values():
                if req.num_output_tokens:
                    req.spec_token_ids = drafts_fn(req)
    return [outs[str(i)] for i in range(len(prompts))]


def _check(got, want, params):
    for g, w, p in zip(got, want, params):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        if p.structured_output is not None and p.structured_output.kind == "json_schema":
            assert g.finish_reason == "stop", g.text
            jsonschema.validate(json.loads(g.text), SCHEMA)


def test_builtin_model_json_schema_greedy_equals_non_speculative():
    prompts = _chat_prompts()[:3]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    params = [_json_params(), free, _json_params()]
    want = _run(Engine(EngineConfig(max_num_seqs=4)), prompts, params)
    spec = Engine(EngineConfig(max_num_seqs=4, speculative="mtp", num_draft_tokens=3))
    got = _run(spec, prompts, params)
    _check(got, want, params)
    m = spec.spec.metrics
    assert m.num_accepted_drafts > 0 and m.num_verified_drafts > m.num_accepted_drafts


def test_oracle_drafts_under_a_grammar_every_accepted_length(tiny):  # noqa: F811
    prompts = _prompts(4, 3, 30, seed=9)
    regex = SamplingParams(temperature=0.0, max_tokens=24, structured_output=StructuredOutputParams(
        regex=r"(cat|dog|fish) [0-9]{2,6}"))
    for extra in (dict(), dict(ignore_eos=True)):
        params = [_json_params(**extra), regex, _json_params(**extra),
                  SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
        want = _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), prompts, params)
        assert want[0].finish_reason == "stop" and want[0].token_ids[-1] == 1  # ends with EOS
        full = {str(i): p + w.token_ids for i, (p, w) in enumerate(zip(prompts, want))}
        for k, error_rate in ((4, 0.0), (3, 0.3)):
            rng = random.Random(k)

            def oracle(req, k=k, error_rate=error_rate, rng=rng, full=full):
                seq = full[req.req_id]
                out = [(t + 1) % 512 if rng.random() < error_rate else t for t in seq[req.num_tokens:req.num_tokens + k]]
                return out or [3]
            eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative="mtp", num_draft_tokens=k))
            got = _run(eng, prompts, params, oracle)
            _check(got, want, params)
            m = eng.spec.metrics
            assert m.num_accepted_drafts > 10
            if error_rate == 0.0:
                assert m.accepted_per_position[k - 1] > 0  # whole blocks accepted under the grammar
