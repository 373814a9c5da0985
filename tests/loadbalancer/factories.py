"""Small factories for balancer tests: a hand-driven clock and instances."""

from __future__ import annotations

from deepinfer.loadbalancer import InstanceInfo, InstanceLoad, Membership, Stage


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_membership(timeout_s: float = 3.0) -> tuple[Membership, FakeClock]:
    clock = FakeClock()
    return Membership(heartbeat_timeout_s=timeout_s, clock=clock), clock


def add(
    members: Membership, instance_id: str, stage: Stage = Stage.PREFILL, *, block_size: int = 4,
    datacenter: str = "", **load,
):
    """Register `instance_id` with an initial load given as InstanceLoad fields."""
    info = InstanceInfo(instance_id, stage, address=f"{instance_id}:1", datacenter=datacenter, block_size=block_size)
    return members.register(info, InstanceLoad(**load) if load else None)
