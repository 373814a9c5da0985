"""`batch_invariant` in the cluster config (one switch for both stages) and `deepinfer up --batch-invariant`."""

from __future__ import annotations

import pytest

from deepinfer.deploy.cli import _config_from_args, build_parser
from deepinfer.deploy.config import ClusterConfig


def test_yaml_key_reaches_prefill_and_decode_engines(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("batch_invariant: true\n")
    config = ClusterConfig.load(path)
    for role in ("prefill", "decode"):
        assert config.role_config(role).engine_config().batch_invariant
    assert not ClusterConfig().role_config("decode").engine_config().batch_invariant


def test_per_stage_setting_is_refused():
    with pytest.raises(ValueError, match="batch_invariant"):
        ClusterConfig.model_validate({"decode": {"worker": {"batch_invariant": True}}})


def test_up_flag_sets_the_cluster_key():
    parser = build_parser()
    args = parser.parse_args(["up", "--batch-invariant"])
    assert _config_from_args(args, parser).batch_invariant
    args = parser.parse_args(["up"])
    assert not _config_from_args(args, parser).batch_invariant
