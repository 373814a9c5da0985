"""The cluster config (YAML -> validated models), the controller's scale validation and the CLI's
argument errors: no Ray cluster, no model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deepinfer.deploy import cli
from deepinfer.deploy.config import ClusterConfig, datacenter_resource
from deepinfer.deploy.controller import ClusterController
from deepinfer.deploy.launcher import read_state, remove_state, write_state

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def test_laptop_yaml_is_the_default():
    """laptop.yaml says it is what `deepinfer up` runs with no arguments: every role's config agrees (issue 31:
    its block counts used to differ)."""
    laptop = ClusterConfig.load(CONFIGS / "laptop.yaml")
    default = ClusterConfig(kv_store_dir=laptop.kv_store_dir)
    for role in ("vision", "prefill", "decode", "vision_lb", "prefill_lb", "decode_lb", "entrypoint"):
        kwargs = dict(instance_id="x-0", lb_address="127.0.0.1:9", lb_addresses=("127.0.0.1:1", "127.0.0.1:2"))
        assert laptop.role_config(role, **kwargs) == default.role_config(role, **kwargs), role
    assert laptop.http == default.http and laptop.host == default.host
    assert [s.groups for s in (laptop.vision, laptop.prefill, laptop.decode)] == \
        [s.groups for s in (default.vision, default.prefill, default.decode)]


def test_example_configs_load():
    laptop = ClusterConfig.load(CONFIGS / "laptop.yaml")
    # the built-in model (the default) has a vision tower: one vision instance by default
    assert laptop.num_instances() == {"vision": 1, "prefill": 1, "decode": 1} == ClusterConfig().num_instances()
    assert laptop.prefill.groups[0].bundles() == [{"CPU": 1.0}]
    assert laptop.role_config("decode", instance_id="decode-0", lb_address="127.0.0.1:9").loopback_ucx

    node = ClusterConfig.load(CONFIGS / "one_node_8gpu.yaml")
    assert node.num_instances() == {"prefill": 2, "decode": 6}
    assert node.decode.groups[0].bundles() == [{"GPU": 1.0, "CPU": 8.0}]
    assert not node.role_config("prefill", instance_id="p", lb_address="h:1").loopback_ucx  # host 0.0.0.0
    assert node.role_config("entrypoint", lb_addresses=("a:1", "b:2")).port == 7000

    two = ClusterConfig.load(CONFIGS / "two_datacenters.yaml")
    assert [g.name for g in two.decode.groups] == ["dc-a", "dc-b"]
    bundle = two.decode.group("dc-b").bundles()[0]
    assert bundle[datacenter_resource("dc-b")] > 0 and bundle["GPU"] == 1
    worker = two.role_config("decode", instance_id="decode-dc-b-0", lb_address="h:1", datacenter="dc-b")
    assert worker.datacenter == "dc-b" and worker.kv_lease_s == 60 and worker.agent_name == "decode-dc-b-0"


def test_speculative_decode_runs_in_rank_groups(tmp_path):
    """Speculative decoding with expert parallelism is supported (`engine.distributed.spec`): a decode group of 2
    ranks with MTP drafts is a valid layout, and its engine config carries both."""
    path = tmp_path / "c.yaml"
    path.write_text("decode: {balancer: {policy: kv_load}, worker: {speculative: mtp}, groups: [{num_ranks: 2}]}")
    cfg = ClusterConfig.load(path)
    engine = cfg.role_config("decode", instance_id="d", lb_address="h:1", num_ranks=2).engine_config()
    assert engine.speculative == "mtp" and engine.expert_parallel_size == 2


@pytest.mark.parametrize("text, needle", [
    ("vision: {balancer: {policy: image_affinity}, groups: [{num_ranks: 2}]}", "num_ranks must be 1"),
    ("decode: {balancer: {policy: kv_load}, worker: {port: 5}}", "set by the launcher"),
    ("decode: {balancer: {policy: kv_load}, worker: {max_num_seqs: 0}}", "decode settings"),
    ("decode: {balancer: {policy: kv_load}, worker: {no_such_field: 1}}", "no_such_field"),
    ("prefill: {balancer: {policy: nope}}", "policy 'nope' is not registered"),
    ("prefill: {balancer: {policy: prefix_aware}, groups: [{name: a}, {name: a}]}", "unique"),
    ("prefill: {balancer: {policy: prefix_aware}, groups: [{resources_per_rank: {datacenter_x: 1}}]}",
     "set `datacenter:`"),
    ("replicas: 3", "replicas"),
    ("- a list", "must be a mapping"),
    ("key: [unclosed", "cannot read"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path, text, needle):
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        ClusterConfig.load(path)
    assert needle in str(e.value) and str(path) in str(e.value)


def test_scale_targets_are_validated_before_anything_changes():
    two = ClusterConfig.load(CONFIGS / "two_datacenters.yaml")
    controller = ClusterController(two.model_dump_json())  # the plain class: validation needs no Ray
    with pytest.raises(ValueError, match="unknown stage 'audio'"):
        controller.scale({"audio": 1})
    with pytest.raises(ValueError, match="no vision tower"):  # /models/... is not readable here: no tower known
        controller.scale({"vision": 1})
    with pytest.raises(ValueError, match=r"say which: decode.GROUP=3"):
        controller.scale({"decode": 3})
    with pytest.raises(KeyError, match="no group 'dc-c'"):
        controller.scale({"decode.dc-c": 3})
    with pytest.raises(ValueError, match="count >= 0"):
        controller.scale({"prefill": -1})
    assert controller.num_instances() == {"prefill": 0, "decode": 0}


def test_cli_argument_errors(capsys):
    for argv, needle in ((["scale", "decode"], "STAGE=N"), (["scale", "decode=two"], "STAGE=N"),
                         (["up", "--detach"], "--detach needs --address"),
                         (["generate"], "--prompt-ids")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


def test_generate_ignores_a_stale_cluster_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEEPINFER_HOME", str(tmp_path))
    monkeypatch.delenv("DEEPINFER_CLUSTER", raising=False)
    assert cli._running_entrypoint() is None  # nothing recorded
    # recorded by a live `up` (this process) whose entrypoint does not answer
    write_state({"name": "deepinfer", "status": "up", "pid": os.getpid(), "entrypoint": "127.0.0.1:1"})
    assert read_state("deepinfer")["entrypoint"] == "127.0.0.1:1"
    assert cli._running_entrypoint() is None
    assert "does not answer; generating offline" in capsys.readouterr().err
    remove_state("other-cluster")
    assert read_state("deepinfer") is not None
    remove_state("deepinfer")
    assert read_state("deepinfer") is None and not list((tmp_path / "clusters").iterdir())


def test_status_table_lists_instances_and_balance():
    status = {"addresses": {"entrypoint": "127.0.0.1:5"}, "balance": {"prefill": 1.0, "decode": None},
              "instances": [
                  {"stage": "decode", "instance_id": "decode-0", "datacenter": "", "state": "serving",
                   "is_healthy": True, "num_running_requests": 3, "num_waiting_requests": 0,
                   "num_kv_blocks_used": 64, "num_kv_blocks_total": 256, "heartbeat_age_ms": 120, "pid": 42},
                  {"stage": "prefill", "instance_id": "prefill-0", "datacenter": "dc-a", "state": "restarting"}]}
    lines = cli._fmt_status(status).splitlines()
    assert lines[1].split()[:4] == ["prefill", "prefill-0", "dc-a", "restarting"]
    assert lines[2].split() == ["decode", "decode-0", "-", "serving", "yes", "3", "0", "64/256", "25%", "120", "42"]
    assert "decode: 1 serving, balance (max/mean load) unreachable" in lines
    assert json.dumps(status)  # what `status --json` prints
