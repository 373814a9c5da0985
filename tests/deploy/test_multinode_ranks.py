"""A rank group spanning nodes (issue 25, wide EP decode): a 4-rank instance placed as 2 + 2 over two emulated Ray
nodes (`ray.cluster_utils.Cluster`: two raylets on this machine, each with room for one node slice), rank 0's
slice in an actor on the first (the engine, which starts rank 1), ranks 2-3 started by a `RankSliceActor` on the
second, all joined in one gloo group at rank 0's address. Greedy tokens equal the one-process engine's; killing
the second slice's actor (its ranks die with it) fails the instance as a whole."""

from __future__ import annotations

# NOTE: deploy first: it picks Ray's token-auth mode before ray is imported (deploy/__init__.py)
from deepinfer.deploy.config import ClusterConfig, InstanceGroup  # isort: skip
from deepinfer.deploy.rank_slice import pick_group_address, start_node_slices  # isort: skip

from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deepinfer.engine import SamplingParams
from deepinfer.engine.distributed.group import node_slices
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import PRESETS

SLOT = "rank_slot"
"""A custom resource, 2 per emulated node: a node fits one 2-rank slice, so PACK must use both nodes."""


def test_bundles_per_node_slice_and_one_node_unchanged():
    one = InstanceGroup(num_ranks=4, resources_per_rank={"GPU": 1, "CPU": 8})
    assert one.bundles() == [{"GPU": 4, "CPU": 32}] and one.placement_strategy_of() == "STRICT_PACK"
    assert InstanceGroup(num_ranks=4, ranks_per_node=8).bundles() == [{"CPU": 4}]
    wide = InstanceGroup(num_ranks=20, ranks_per_node=8, resources_per_rank={"GPU": 1, "CPU": 8}, datacenter="a")
    assert [list(s) for s in wide.node_slices()] == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    assert [b["GPU"] for b in wide.bundles()] == [8, 8, 4] and wide.placement_strategy_of() == "PACK"
    assert InstanceGroup(num_ranks=4, ranks_per_node=2, placement_strategy="STRICT_SPREAD").placement_strategy_of() \
        == "STRICT_SPREAD"
    assert node_slices(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    wide_yaml = ClusterConfig.load(Path(__file__).parents[2] / "deploy/configs/v4_flash_wide_decode.yaml")
    decode = wide_yaml.decode.groups[0]
    assert len(decode.bundles()) == 6 and decode.bundles()[0] == {"GPU": 8, "CPU": 64}
    engine = wide_yaml.role_config("decode", num_ranks=48, rank_group_address="10.0.0.5:29500",
                                   local_ranks=8).engine_config()
    assert (engine.expert_parallel_size, engine.local_ranks, engine.rank_group_address) == (48, 8, "10.0.0.5:29500")
    assert ClusterConfig().role_config("decode", num_ranks=2).engine_config().local_ranks is None
    with pytest.raises(ValueError, match="host:port"):
        EngineConfig(expert_parallel_size=2, rank_group_address="10.0.0.5")
    with pytest.raises(ValueError, match="at most"):
        EngineConfig(expert_parallel_size=2, local_ranks=3)


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (num,), generator=g)]


def _generate(engine: Engine, prompts, max_tokens, prefix: str = "") -> dict[str, list[int]]:
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(f"{prefix}{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id.removeprefix(prefix)] = list(o.outputs[0].token_ids)
    return out


class _RankZero:
    """The instance's actor in this test: the engine (rank 0), which starts rank 1 on its node."""

    def __init__(self, kw: dict) -> None:
        torch.set_num_threads(1)
        self.engine = Engine(**kw)

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def generate(self, prompts, max_tokens, prefix: str = ""):
        return _generate(self.engine, prompts, max_tokens, prefix)

    def expert_loads(self):
        return self.engine.executor.expert_loads()

    def shutdown(self) -> None:
        self.engine.shutdown()


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {SLOT: 2}})
    cluster.add_node(num_cpus=3, resources={SLOT: 2})
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_four_ranks_over_two_nodes_match_one_process_and_a_lost_slice_fails_the_instance(two_nodes, tmp_path):
    model = str(make_checkpoint(tmp_path / "tiny8", preset={**PRESETS["tiny"].hf_config(), "n_routed_experts": 8},
                                seed=4))
    kw = dict(model=model, max_num_seqs=4, max_model_len=64, batch_invariant=True)
    prompts, max_tokens = _prompts(4, 500, seed=1), [3, 5, 2, 4]
    one = Engine(**kw)
    ref = _generate(one, prompts, max_tokens)
    one.shutdown()

    group = InstanceGroup(num_ranks=4, ranks_per_node=2, resources_per_rank={"CPU": 0.5, SLOT: 1})
    bundles = group.bundles()
    pg = placement_group(bundles, strategy=group.placement_strategy_of())
    ray.get(pg.ready(), timeout=60)
    try:
        address = pick_group_address(pg)
        slices = start_node_slices(pg, bundles, group.node_slices(), address, "gloo")
        started = [s.start.remote() for s in slices]  # they wait for rank 0's published spec
        bundle = dict(bundles[0])
        rank0 = ray.remote(_RankZero).options(
            num_cpus=bundle.pop("CPU"), resources=bundle, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
        ).remote({**kw, "expert_parallel_size": 4, "local_ranks": 2, "rank_group_address": address})
        assert ray.get(rank0.node_id.remote(), timeout=120) != ray.get(slices[0].node_id.remote())  # 2 + 2
        assert len(ray.get(started, timeout=60)) == 1 and len(ray.get(started[0])) == 2
        assert ray.get(rank0.generate.remote(prompts, max_tokens), timeout=60) == ref

        ray.kill(slices[0], no_restart=True)  # ranks 2-3 exit with their actor
        with pytest.raises(ray.exceptions.RayTaskError, match="died|failed|Connection"):
            ray.get(rank0.generate.remote(prompts, max_tokens, "b"), timeout=60)
        with pytest.raises(ray.exceptions.RayTaskError, match="failed earlier"):  # the instance stays failed
            ray.get(rank0.expert_loads.remote(), timeout=30)
        ray.get(rank0.shutdown.remote(), timeout=60)  # closing a failed group does not hang on the lost ranks
        ray.kill(rank0, no_restart=True)
    finally:
        remove_placement_group(pg)
