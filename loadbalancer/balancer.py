"""A stage's balancer core: filter the pickable instances, let the policy choose, count the pick.

`Balancer.pick` is pure and synchronous (no sockets); `loadbalancer/server.py` wraps it in gRPC.

A pick:
1. takes the stage's pickable instances (live, healthy, not draining) minus `exclude_instance_ids`;
   none left raises `NoHealthyInstance`;
2. keeps only those in `preferred_datacenter` when there is any;
3. asks the policy; None (nobody has room) raises `InsufficientCapacity`, or `RequestTooLarge` when no candidate
   could take the request even empty (more KV blocks than any pool holds: waiting would not help);
4. adds the request to the chosen instance's load until its next heartbeat (uncached prompt tokens
   for prefill, KV blocks, a state slot and the predicted output tokens for decode, uncached image tokens for vision,
   one waiting request everywhere), so picks between two heartbeats spread out.
"""

from __future__ import annotations

from collections import deque

from deepinfer.loadbalancer.membership import Instance, Membership, Stage
from deepinfer.loadbalancer.policies import (
    Policy,
    RequestInfo,
    could_ever_fit,
    make_policy,
    matched_prefix_tokens,
    num_kv_blocks_needed,
)

NUM_BALANCE_SAMPLES = 1024
"""Balance samples kept (one per pick) for `mean_balance`."""


class NoHealthyInstance(RuntimeError):
    """No instance of the stage can be picked (none registered, all unhealthy, draining or excluded)."""

    def __init__(self, stage: Stage, detail: str = "") -> None:
        self.stage = stage
        message = f"no healthy {stage.value} instance"
        super().__init__(f"{message}: {detail}" if detail else message)


class InsufficientCapacity(NoHealthyInstance):
    """Healthy instances exist but none has room for the request (e.g. too few free KV blocks, no free state slot)."""


class RequestTooLarge(InsufficientCapacity):
    """No candidate could take the request even when empty (it needs more KV blocks than any pool holds)."""


class Balancer:
    """Picks instances of one stage with one policy over a `Membership`."""

    def __init__(self, stage: Stage | str, policy: Policy | str, membership: Membership | None = None) -> None:
        self.stage = Stage(stage)
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.membership = membership if membership is not None else Membership()
        self._balance_samples: deque[float] = deque(maxlen=NUM_BALANCE_SAMPLES)

    def pick(self, request: RequestInfo | None = None) -> Instance:
        """The instance to send `request` to; raises `NoHealthyInstance` / `InsufficientCapacity`."""
        return self.pick_placement(request)[0]

    def pick_placement(self, request: RequestInfo | None = None) -> tuple[Instance, int | None]:
        """The instance to send `request` to and, from a rank-aware policy (`Policy.select_rank`), the rank of a
        multi-rank instance it should go to (None: the instance picks); raises as `pick`."""
        request = request or RequestInfo()
        with self.membership.lock:
            candidates = self.membership.pickable(self.stage)
            if request.exclude_instance_ids:
                candidates = [c for c in candidates if c.instance_id not in request.exclude_instance_ids]
            if not candidates:
                raise NoHealthyInstance(self.stage, self._why_none())
            if request.preferred_datacenter:
                local = [c for c in candidates if c.info.datacenter == request.preferred_datacenter]
                candidates = local or candidates
            chosen = self.policy.select(candidates, request)
            if chosen is None:
                if not any(could_ever_fit(c, request) for c in candidates):
                    raise RequestTooLarge(
                        self.stage, f"request {request.request_id!r} needs more KV blocks than any of "
                        f"{len(candidates)} candidate(s) holds in all")
                raise InsufficientCapacity(
                    self.stage, f"none of {len(candidates)} candidate(s) has room for request {request.request_id!r}"
                )
            rank = self.policy.select_rank(chosen, request)
            self._count_pick(chosen, request, rank)
            self._balance_samples.append(self.balance())
            return chosen, rank

    def balance(self) -> float:
        """max / mean of the policy's load over pickable instances: 1.0 is perfectly even (also when all
        are idle); 0.0 when there is none."""
        with self.membership.lock:
            loads = [self.policy.load(i) for i in self.membership.pickable(self.stage)]
        if not loads:
            return 0.0
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def mean_balance(self) -> float:
        """Mean of the `balance()` samples taken after each of the last picks (0.0 before any pick)."""
        samples = self._balance_samples
        return sum(samples) / len(samples) if samples else 0.0

    def _count_pick(self, chosen: Instance, request: RequestInfo, rank: int | None = None) -> None:
        num_prefill_tokens = num_kv_blocks = num_output_tokens = 0
        if self.stage == Stage.PREFILL:
            num_prefill_tokens = max(0, request.num_prompt_tokens - matched_prefix_tokens(chosen, request))
        elif self.stage == Stage.DECODE:
            num_kv_blocks = num_kv_blocks_needed(chosen, request)
            num_output_tokens = self.policy.predicted_output_tokens(request)
        elif self.stage == Stage.VISION:  # image tokens to encode, less those of images it has cached
            num_images = max(1, len(request.block_hashes))
            cached = sum(h in chosen.cached_block_hashes for h in request.block_hashes)
            num_prefill_tokens = request.num_prompt_tokens * (num_images - cached) // num_images
        self.membership.add_pending(
            chosen.instance_id, num_prefill_tokens=num_prefill_tokens, num_requests=1, num_kv_blocks=num_kv_blocks,
            num_output_tokens=num_output_tokens, rank=rank,
        )

    def _why_none(self) -> str:
        members = self.membership.instances(self.stage)
        if not members:
            return "none registered"
        states = ", ".join(
            f"{i.instance_id}={'draining' if i.is_draining else 'unhealthy' if not i.is_healthy else 'excluded'}"
            for i in members
        )
        return f"{len(members)} registered ({states})"
