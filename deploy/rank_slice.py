"""Rank groups that span nodes: one Ray actor per node slice starts that node's ranks.

An instance of `num_ranks` ranks with `ranks_per_node` < `num_ranks` (`config.InstanceGroup`) gets a placement
group of one bundle per node slice (`InstanceGroup.bundles`; PACK: as few nodes as possible, a bundle never split).
Bundle 0 is the instance's actor (rank 0, the engine's process, which starts the other ranks of its slice itself,
as on one node); each other bundle gets a `RankSliceActor`, which starts its slice's ranks as processes on its node
(`engine.distributed.worker.RankSlice`). They all join ONE torch.distributed group at rank 0's address:

1. `pick_group_address(pg)`: a task on bundle 0 returns rank 0's node IP and a port free there ("host:port");
2. the instance's actor gets it as the engine's `rank_group_address` (with `local_ranks` = its slice's size), each
   slice actor as its `address`; the slice actors are started first and wait;
3. rank 0's executor hosts the group's TCP store at that address and publishes its `RankSpec` there (its memory
   fit sizes every rank's cache), which each slice actor reads (`fetch_published`) before starting its ranks;
4. every rank joins the group (gloo on the CPU, NCCL on GPUs) and the instance runs as on one node.

Failures: a slice's ranks die with its actor (they exit when their parent does), and the group's collectives then
fail on every other rank: the instance fails as a whole, as when a rank of a one-node instance dies.

NOTE: the whole group restarts together (Ray restarts neither a slice nor rank 0 alone into a running group: a
rendezvous happens once); `max_restarts` of the slice actors is 0.
"""

from __future__ import annotations

import ray

from deepinfer.engine.distributed.group import GroupAddress


class RankSliceActor:
    """Starts and holds one node slice's rank processes (a Ray actor: `ray.remote(RankSliceActor)`)."""

    def __init__(self, address: GroupAddress, ranks: list[int]) -> None:
        self.address = address
        self.ranks = list(ranks)
        self.slice = None

    def start(self) -> list[int]:
        """Blocks until rank 0 has published the group's `RankSpec` and this slice's ranks have loaded (they then
        join the group); their process ids."""
        from deepinfer.engine.distributed.group import fetch_published
        from deepinfer.engine.distributed.worker import RankSlice

        spec = fetch_published(self.address)
        if spec.address.world_size != self.address.world_size:
            raise RuntimeError(f"rank 0 published a group of {spec.address.world_size} ranks, this slice expected "
                               f"{self.address.world_size}")
        self.slice = RankSlice(spec, self.ranks)
        self.slice.wait_loaded(spec.address.timeout_s)
        return self.slice.pids

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def alive(self) -> list[bool]:
        return [] if self.slice is None else self.slice.alive()

    def kill_ranks(self) -> None:
        if self.slice is not None:
            self.slice.kill()


def _address_here() -> str:
    from deepinfer.engine.distributed.group import free_port

    host = ray.util.get_node_ip_address()
    return f"{host}:{free_port(host)}"


def pick_group_address(pg, timeout_s: float = 60.0) -> str:
    """Rank 0's rendezvous address of an instance placed by `pg`: bundle 0's node IP and a port free there now."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(num_cpus=0)(_address_here).options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0))
    return ray.get(task.remote(), timeout=timeout_s)


def start_node_slices(pg, bundles: list[dict[str, float]], slices: list[range], address: str, backend: str,
                      runtime_env: dict | None = None) -> list:
    """Start one `RankSliceActor` on each bundle after the first (slice k on bundle k), reserving the bundle's
    resources; returns their handles (call `start.remote()` on each, then start rank 0 with `address`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from deepinfer.engine.distributed.group import parse_address

    host, port = parse_address(address)
    group = GroupAddress(host, port, slices[-1].stop, backend)
    actors = []
    for k in range(1, len(slices)):
        bundle = dict(bundles[k])
        actors.append(ray.remote(RankSliceActor).options(
            num_cpus=bundle.pop("CPU", 0), num_gpus=bundle.pop("GPU", 0), resources=bundle, max_restarts=0,
            runtime_env=runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=k),
        ).remote(group, list(slices[k])))
    return actors
