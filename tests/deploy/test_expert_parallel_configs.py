"""The V4-Flash expert-parallel layouts in deploy/configs/ (issue 25) load and validate, and a multi-rank
instance's placement group is one bundle of its ranks' resources per node slice (its actor reserves every rank's GPU
of its node; a `deploy.rank_slice` actor each other node's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer.deploy.config import ClusterConfig, InstanceGroup, datacenter_resource

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"
V4_FLASH_ROUTED_EXPERTS = 256
"""n_routed_experts of DeepSeek-V4-Flash (its public config): the expert slots must divide over the ranks."""


@pytest.mark.parametrize("name, stage, num_ranks, num_redundant", [
    ("v4_flash_2x8gpu", "prefill", 8, 16), ("v4_flash_2x8gpu", "decode", 8, 16),
    ("v4_flash_wide_decode", "prefill", 8, 16), ("v4_flash_wide_decode", "decode", 48, 32),
])
def test_v4_flash_layouts_load_as_expert_parallel_groups(name, stage, num_ranks, num_redundant):
    config = ClusterConfig.load(CONFIGS / f"{name}.yaml")
    (group,) = config.stage(stage).groups
    assert group.num_ranks == num_ranks
    # one bundle (8 GPUs) per node slice: one node, one actor; the 48-rank decode over 6 nodes (rank_slice actors)
    assert group.bundles() == [{"GPU": 8.0, "CPU": 64.0}] * (num_ranks // 8)
    worker = config.role_config(stage, instance_id=f"{stage}-0", lb_address="h:1", num_ranks=group.num_ranks)
    engine = worker.engine_config()
    assert (engine.expert_parallel_size, engine.num_redundant_experts) == (num_ranks, num_redundant)
    assert engine.eplb_interval_steps > 0 and engine.moe_backend == "fp4" and engine.device == "cuda"
    assert (V4_FLASH_ROUTED_EXPERTS + num_redundant) % num_ranks == 0
    assert engine.max_num_seqs // num_ranks >= (128 if stage == "decode" else 8)  # decode: batch 128 per rank


def test_two_by_eight_gpus_is_one_prefill_and_one_decode_node():
    config = ClusterConfig.load(CONFIGS / "v4_flash_2x8gpu.yaml")
    assert config.num_instances() == {"prefill": 1, "decode": 1}
    gpus = sum(g.bundles()[0]["GPU"] * g.num_instances for s in ("prefill", "decode") for g in config.stage(s).groups)
    assert gpus == 16


def test_a_multi_rank_bundle_carries_every_rank_and_its_datacenter_share():
    group = InstanceGroup(num_ranks=4, datacenter="dc-a", resources_per_rank={"GPU": 1, "CPU": 2, "memory": 0})
    (bundle,) = group.bundles()
    assert bundle["GPU"] == 4 and bundle["CPU"] == 8 and "memory" not in bundle
    assert bundle[datacenter_resource("dc-a")] == pytest.approx(4 * InstanceGroup(datacenter="dc-a").bundles()[0][
        datacenter_resource("dc-a")])
    assert InstanceGroup().bundles() == [{"CPU": 1.0}]


def test_eplb_interval_reaches_the_engine_from_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode: {balancer: {policy: kv_load}, worker: {num_redundant_experts: 4, eplb_interval_steps: 7},"
                    " groups: [{num_ranks: 4}]}\n")
    config = ClusterConfig.load(path)
    engine = config.role_config("decode", instance_id="d", lb_address="h:1", num_ranks=4).engine_config()
    assert (engine.expert_parallel_size, engine.num_redundant_experts, engine.eplb_interval_steps) == (4, 4, 7)
