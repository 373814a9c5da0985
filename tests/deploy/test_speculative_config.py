"""Speculative decoding on the decode stage: the worker flags, the cluster YAML and `deepinfer up`."""

from __future__ import annotations

import pytest

from deepinfer.decode_worker.config import DecodeWorkerConfig
from deepinfer.deploy.cli import _config_from_args, build_parser
from deepinfer.deploy.config import ClusterConfig
from deepinfer.serving.config_cli import config_from_args, make_parser


def test_worker_flags_reach_the_engine_and_the_state_is_replayed():
    parser = make_parser(DecodeWorkerConfig, "decode_worker", "")
    config = config_from_args(DecodeWorkerConfig, parser, ["--speculative-tokens", "3", "--verify-schedule", "confidence"])
    engine = config.engine_config()
    assert (engine.speculative_tokens, engine.speculative_method, engine.verify_schedule) == (3, "mtp", "confidence")
    assert not config.is_state_sent  # the replay rebuilds the drafter's window
    assert DecodeWorkerConfig().is_state_sent and DecodeWorkerConfig().engine_config().speculative_tokens == 0
    assert not DecodeWorkerConfig(bounded_state="replay").is_state_sent
    with pytest.raises(ValueError, match="bounded_state='replay'"):
        DecodeWorkerConfig(speculative_tokens=3, bounded_state="send")


def test_yaml_and_up_flags_set_the_decode_stage(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("decode:\n  balancer: {policy: kv_load}\n  worker: {speculative_tokens: 2}\n")
    config = ClusterConfig.load(path)
    assert config.role_config("decode").engine_config().speculative_tokens == 2
    assert config.role_config("prefill").engine_config().speculative_tokens == 0
    parser = build_parser()
    args = parser.parse_args(["up", "--speculative-tokens", "3", "--verify-schedule", "confidence"])
    decode = _config_from_args(args, parser).role_config("decode")
    assert (decode.speculative_tokens, decode.verify_schedule) == (3, "confidence")
    assert _config_from_args(parser.parse_args(["up"]), parser).role_config("decode").speculative_tokens == 0
    path.write_text("decode:\n  balancer: {policy: kv_load}\n  worker: {speculative_tokens: 2, bounded_state: send}\n")
    with pytest.raises(ValueError, match="bounded_state"):
        ClusterConfig.load(path)


def test_verify_cost_table_flag_is_checked_at_start_and_reaches_the_engine(tmp_path):
    from deepinfer.engine.spec_decode.step_cost import StepCostTable, default_cost_table_path

    table = tmp_path / "cost.json"
    StepCostTable([1, 4], [1, 2], [[0.01, 0.02], [0.03, 0.05]]).save(table)
    parser = make_parser(DecodeWorkerConfig, "decode_worker", "")
    spec = ["--speculative-tokens", "3", "--verify-schedule", "confidence"]
    config = config_from_args(DecodeWorkerConfig, parser, [*spec, "--verify-cost-table", str(table)])
    assert config.engine_config().verify_cost_table == str(table)
    assert DecodeWorkerConfig(speculative_tokens=3, verify_schedule="confidence",
                              verify_cost_table="linear").engine_config().verify_cost_table == "linear"
    assert DecodeWorkerConfig().engine_config().verify_cost_table is None
    with pytest.raises(ValueError, match="is not a file"):
        DecodeWorkerConfig(speculative_tokens=3, verify_schedule="confidence", verify_cost_table=str(tmp_path / "no"))
    bad = tmp_path / "bad.json"
    for text, match in (("{not json", "not a valid step-cost table"),
                        ('{"format": "other"}', "not a step-cost table"),
                        ('{"format": "deepinfer-step-cost", "num_reqs": [1]}', "missing field 'tokens_per_req'"),
                        ('{"format": "deepinfer-step-cost", "num_reqs": [1], "tokens_per_req": [1, 2], '
                         '"seconds": [[0.1]]}', "grid")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            DecodeWorkerConfig(speculative_tokens=3, verify_schedule="confidence", verify_cost_table=str(bad))
    for kw in (dict(), dict(speculative_tokens=3)):  # the table prices only the confidence schedule
        with pytest.raises(ValueError, match="verify_schedule='confidence'"):
            DecodeWorkerConfig(verify_cost_table=str(default_cost_table_path()), **kw)
    # `deepinfer up` and the YAML pass it to the decode stage (checked there: a bad path fails at load)
    up = build_parser()
    args = up.parse_args(["up", *spec, "--verify-cost-table", str(table)])
    assert _config_from_args(args, up).role_config("decode").engine_config().verify_cost_table == str(table)
    path = tmp_path / "cluster.yaml"
    path.write_text("decode:\n  balancer: {policy: kv_load}\n  worker: {speculative_tokens: 2, verify_schedule: "
                    f"confidence, verify_cost_table: {tmp_path / 'missing.json'}}}\n")
    with pytest.raises(ValueError, match="(?s)decode settings.*is not a file"):
        ClusterConfig.load(path)
