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
