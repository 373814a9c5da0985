"""Speculative decoding's configuration: the canonical names, their aliases, the verify floor.

`speculative=None|"mtp"` and `num_draft_tokens` are the documented names (`EngineConfig`, `LLM(...)`,
the decode worker's `--speculative mtp --num-draft-tokens N`, `deepinfer up/serve`); the older
`speculative_tokens` / `speculative_method` still work when they agree and are refused when they do
not. `verify_floor` 0 lets the confidence schedule verify no draft of a request (outputs unchanged).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deepinfer.decode_worker.config import DecodeWorkerConfig
from deepinfer.deploy.cli import _config_from_args, build_parser
from deepinfer.engine import SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.spec_decode.config import resolve_speculative_fields
from deepinfer.serving.config_cli import config_from_args, make_parser
from tests.engine.spec_decode.test_spec_engine import _prompts, _run, tiny  # noqa: F401  (fixture)


def test_engine_config_canonical_names_and_aliases():
    on = EngineConfig(speculative="mtp")
    assert (on.speculative, on.num_draft_tokens, on.speculative_tokens, on.speculative_method) == ("mtp", 3, 3, "mtp")
    assert EngineConfig(speculative="mtp", num_draft_tokens=5).speculative_tokens == 5
    off = EngineConfig(num_draft_tokens=5)
    assert (off.speculative, off.speculative_tokens) == (None, 0)
    # the aliases: the same configs, in canonical fields only (a dump loads again)
    assert EngineConfig(speculative_tokens=5) == EngineConfig(speculative="mtp", num_draft_tokens=5)
    assert EngineConfig(speculative_tokens=0, speculative_method="mtp") == EngineConfig()
    assert EngineConfig(speculative="mtp", num_draft_tokens=2, speculative_tokens=2, speculative_method="mtp") == \
        EngineConfig(speculative="mtp", num_draft_tokens=2)
    assert EngineConfig(**EngineConfig(speculative_tokens=4).model_dump()).num_draft_tokens == 4
    assert "speculative_tokens" not in EngineConfig().model_dump()
    for kw, match in ((dict(speculative="mtp", speculative_tokens=0), "speculative_tokens=0 turns it off"),
                      (dict(num_draft_tokens=2, speculative_tokens=3), "num_draft_tokens=2 and its alias"),
                      (dict(speculative_tokens=-1), "non-negative"),
                      (dict(speculative_method="eagle"), "not a drafter"),
                      (dict(speculative="eagle"), "speculative"),  # "dspark" is a drafter (V4.1)
                      (dict(speculative="mtp", num_draft_tokens=0), "num_draft_tokens")):
        with pytest.raises(ValidationError, match=match):
            EngineConfig(**kw)


def test_verify_floor_is_validated():
    assert EngineConfig().verify_floor == 1
    assert EngineConfig(speculative="mtp", verify_schedule="confidence", verify_floor=0).verify_floor == 0
    with pytest.raises(ValidationError, match="verify_schedule='confidence'"):
        EngineConfig(speculative="mtp", verify_floor=0)  # "full" verifies every draft: the floor means nothing
    for bad in (2, -1):
        with pytest.raises(ValidationError, match="verify_floor"):
            EngineConfig(speculative="mtp", verify_schedule="confidence", verify_floor=bad)
    with pytest.raises(ValidationError, match="verify_schedule='confidence'"):
        DecodeWorkerConfig(speculative="mtp", verify_floor=0)


def test_worker_flags_yaml_and_up():
    parser = make_parser(DecodeWorkerConfig, "decode_worker", "")
    args = ["--speculative", "mtp", "--num-draft-tokens", "4", "--verify-schedule", "confidence", "--verify-floor", "0"]
    config = config_from_args(DecodeWorkerConfig, parser, args)
    engine = config.engine_config()
    assert (engine.speculative, engine.num_draft_tokens, engine.verify_floor) == ("mtp", 4, 0)
    assert not config.is_state_sent and (config.speculative_tokens, config.speculative_method) == (4, "mtp")
    assert DecodeWorkerConfig(**config.model_dump()) == config  # the mirrored aliases load again (actors do that)
    alias = config_from_args(DecodeWorkerConfig, parser, ["--speculative-tokens", "2"]).engine_config()
    assert (alias.speculative, alias.num_draft_tokens) == ("mtp", 2)
    plain = config_from_args(DecodeWorkerConfig, parser, ["--speculative", "mtp"]).engine_config()
    assert plain.num_draft_tokens == 3
    assert config_from_args(DecodeWorkerConfig, parser, []).engine_config().speculative is None
    with pytest.raises(SystemExit):  # disagreeing spellings: the parser's error, naming both
        config_from_args(DecodeWorkerConfig, parser, ["--num-draft-tokens", "4", "--speculative-tokens", "2"])
    # deepinfer up / serve: the flags override the YAML's setting name by name, whichever spelling it uses
    up = build_parser()
    cluster = _config_from_args(up.parse_args(["up", "--speculative", "mtp", "--num-draft-tokens", "5"]), up)
    decode = cluster.role_config("decode")
    assert (decode.speculative, decode.num_draft_tokens) == ("mtp", 5)
    prefill = cluster.role_config("prefill").engine_config()  # drafts the first block, sent with the KV
    assert (prefill.speculative, prefill.num_draft_tokens) == ("mtp", 5)
    assert _config_from_args(up.parse_args(["up"]), up).role_config("prefill").engine_config().speculative is None
    from deepinfer.prefill_worker.config import PrefillWorkerConfig

    pre = config_from_args(PrefillWorkerConfig, make_parser(PrefillWorkerConfig, "prefill_worker", ""),
                           ["--speculative", "mtp", "--num-draft-tokens", "2"]).engine_config()
    assert (pre.speculative, pre.num_draft_tokens) == ("mtp", 2)
    serve = _config_from_args(up.parse_args(["serve", "m", "--speculative", "mtp"]), up).role_config("decode")
    assert (serve.speculative, serve.num_draft_tokens) == ("mtp", 3)
    worker = resolve_speculative_fields({"speculative_tokens": 2, "max_num_seqs": 8}, fill_default=False)
    assert worker == {"speculative": "mtp", "num_draft_tokens": 2, "max_num_seqs": 8}
    assert resolve_speculative_fields({"speculative_tokens": 0}, fill_default=False) == {"speculative": None}


def test_yaml_aliases_and_flags_combine(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("decode:\n  balancer: {policy: kv_load}\n  worker: {speculative_tokens: 2}\n")
    up = build_parser()
    decode = _config_from_args(up.parse_args(["up", "--config", str(path), "--num-draft-tokens", "4"]),
                               up).role_config("decode")
    assert (decode.speculative, decode.num_draft_tokens) == ("mtp", 4)
    decode = _config_from_args(up.parse_args(["up", "--config", str(path), "--speculative-tokens", "0"]),
                               up).role_config("decode")
    assert decode.speculative is None and decode.is_state_sent
    path.write_text("decode:\n  balancer: {policy: kv_load}\n  worker: {speculative: mtp, num_draft_tokens: 2, "
                    "speculative_tokens: 3}\n")
    with pytest.raises(ValueError, match="disagree"):
        from deepinfer.deploy.config import ClusterConfig

        ClusterConfig.load(path).role_config("decode")


def test_verify_floor_zero_may_verify_no_draft_and_outputs_are_unchanged(tiny):  # noqa: F811
    # the random MTP layer's drafts have tiny probabilities: with floor 0 the confidence schedule verifies
    # (almost) none of them, with floor 1 every request verifies one per step; the tokens are the same
    prompts = _prompts(3, 5, 30, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = _run(Engine(EngineConfig(model=tiny, max_num_seqs=4)), prompts, params)
    verified = {}
    for floor in (0, 1):
        eng = Engine(EngineConfig(model=tiny, max_num_seqs=4, speculative="mtp", num_draft_tokens=3,
                                  verify_schedule="confidence", verify_floor=floor))
        assert eng.spec.verify_floor == floor
        assert _run(eng, prompts, params) == ref
        m = eng.spec.metrics
        verified[floor] = (m.num_verifications, m.num_verified_drafts)
    decode_steps = sum(len(r) - 1 for r in ref)  # request-steps after the first token
    assert verified[1][0] >= decode_steps - len(prompts)  # floor 1: (nearly) every decode verifies a draft
    assert verified[0][0] < verified[1][0] // 2  # floor 0: most decode steps verify none
    assert verified[0][1] < verified[1][1]
