"""The balancer's process shell: the `deepinfer.v1.LoadBalancer` gRPC service around a `Balancer`.

Everything that decides lives in the core (`membership.py`, `policies.py`, `balancer.py`); this
module only converts messages and maps core errors to gRPC status codes:
`NoHealthyInstance` -> UNAVAILABLE, `InsufficientCapacity` -> RESOURCE_EXHAUSTED (full now: retry later),
`RequestTooLarge` -> OUT_OF_RANGE (no instance could ever take it), a bad or wrong-stage registration ->
INVALID_ARGUMENT.

```python
server = serve("0.0.0.0:50051", "prefill", "prefix_aware")
server.wait_for_termination()
```
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent import futures
from typing import NamedTuple

import grpc

from deepinfer.loadbalancer.balancer import Balancer, InsufficientCapacity, NoHealthyInstance, RequestTooLarge
from deepinfer.loadbalancer.membership import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    Instance,
    InstanceInfo,
    InstanceLoad,
    Membership,
    RankLoad,
    Stage,
)
from deepinfer.loadbalancer.policies import Policy, RequestInfo, make_policy, matched_prefix_tokens
from deepinfer.protos import common_pb2, loadbalancer_pb2, loadbalancer_pb2_grpc
from deepinfer.serving.auth import add_port, server_interceptors

logger = logging.getLogger("loadbalancer")

STAGE_FROM_PROTO = {
    common_pb2.STAGE_VISION: Stage.VISION,
    common_pb2.STAGE_PREFILL: Stage.PREFILL,
    common_pb2.STAGE_DECODE: Stage.DECODE,
}
STAGE_TO_PROTO = {stage: value for value, stage in STAGE_FROM_PROTO.items()}

HEARTBEATS_PER_TIMEOUT = 3
"""Instances are told to heartbeat this many times per timeout, so one lost heartbeat is harmless."""


def load_from_proto(msg: loadbalancer_pb2.LoadReport) -> InstanceLoad:
    """The core's `InstanceLoad` of a wire `LoadReport`."""
    return InstanceLoad(
        num_queued_prefill_tokens=msg.num_queued_prefill_tokens,
        num_running_requests=msg.num_running_requests,
        num_waiting_requests=msg.num_waiting_requests,
        num_kv_blocks_used=msg.num_kv_blocks_used,
        num_kv_blocks_total=msg.num_kv_blocks_total,
        cached_block_hashes=frozenset(msg.cached_block_hashes),
        is_cached_hashes_delta=msg.is_cached_hashes_delta,
        evicted_block_hashes=frozenset(msg.evicted_block_hashes),
        is_healthy=msg.is_healthy,
        is_draining=msg.is_draining,
        ranks=tuple(RankLoad(r.rank, r.num_running_requests, r.num_waiting_requests, r.num_kv_blocks_used,
                             r.num_kv_blocks_total,
                             num_free_slots=r.num_free_slots if r.HasField("num_free_slots") else None,
                             num_output_tokens_left=r.num_output_tokens_left) for r in msg.ranks),
        num_free_slots=msg.num_free_slots if msg.HasField("num_free_slots") else None,
        num_output_tokens_left=msg.num_output_tokens_left,
    )


def _free_slots(n: int | None) -> dict:
    """The optional `num_free_slots` field's keyword (none when not reported)."""
    return {} if n is None else {"num_free_slots": n}


def load_to_proto(load: InstanceLoad, *, with_hashes: bool = True) -> loadbalancer_pb2.LoadReport:
    """The wire `LoadReport` of an `InstanceLoad` (hashes sorted, so equal loads give equal bytes)."""
    msg = loadbalancer_pb2.LoadReport(
        num_queued_prefill_tokens=load.num_queued_prefill_tokens,
        num_running_requests=load.num_running_requests,
        num_waiting_requests=load.num_waiting_requests,
        num_kv_blocks_used=load.num_kv_blocks_used,
        num_kv_blocks_total=load.num_kv_blocks_total,
        is_cached_hashes_delta=load.is_cached_hashes_delta,
        is_healthy=load.is_healthy,
        is_draining=load.is_draining,
        ranks=[loadbalancer_pb2.RankLoad(rank=r.rank, num_running_requests=r.num_running_requests,
                                         num_waiting_requests=r.num_waiting_requests,
                                         num_kv_blocks_used=r.num_kv_blocks_used,
                                         num_kv_blocks_total=r.num_kv_blocks_total,
                                         num_output_tokens_left=r.num_output_tokens_left,
                                         **_free_slots(r.num_free_slots)) for r in load.ranks],
        num_output_tokens_left=load.num_output_tokens_left,
        **_free_slots(load.num_free_slots),
    )
    if with_hashes:
        msg.cached_block_hashes.extend(sorted(load.cached_block_hashes))
        msg.evicted_block_hashes.extend(sorted(load.evicted_block_hashes))
    return msg


class LoadBalancerServicer(loadbalancer_pb2_grpc.LoadBalancerServicer):
    """`deepinfer.v1.LoadBalancer` over one stage's `Balancer` (thread-safe: the core locks)."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        self.membership = balancer.membership

    def Register(self, request, context):
        stage = STAGE_FROM_PROTO.get(request.stage)
        if stage != self.balancer.stage:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this balancer serves stage {self.balancer.stage.value!r}; register with "
                f"stage={common_pb2.Stage.Name(STAGE_TO_PROTO[self.balancer.stage])}, "
                f"got {common_pb2.Stage.Name(request.stage)}",
            )
        try:
            info = InstanceInfo(
                instance_id=request.instance_id,
                stage=stage,
                address=request.address,
                kv_agent_name=request.kv_agent_name,
                kv_agent_metadata=request.kv_agent_metadata,
                datacenter=request.datacenter,
                block_size=request.block_size,
            )
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        load = load_from_proto(request.load) if request.HasField("load") else None
        self.membership.register(info, load)
        logger.info("registered %s %s at %s", stage.value, info.instance_id, info.address)
        timeout_ms = int(self.membership.heartbeat_timeout_s * 1000)
        return loadbalancer_pb2.RegisterResponse(
            heartbeat_interval_ms=timeout_ms // HEARTBEATS_PER_TIMEOUT, heartbeat_timeout_ms=timeout_ms
        )

    def Heartbeat(self, request, context):
        result = self.membership.heartbeat(request.instance_id, load_from_proto(request.load))
        return loadbalancer_pb2.HeartbeatResponse(
            is_known=result.is_known, needs_full_cached_hashes=result.needs_full_cached_hashes
        )

    def Pick(self, request, context):
        if request.stage != common_pb2.STAGE_UNSPECIFIED and STAGE_FROM_PROTO.get(request.stage) != self.balancer.stage:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this balancer serves stage {self.balancer.stage.value!r}, got {common_pb2.Stage.Name(request.stage)}",
            )
        info = RequestInfo(
            request_id=request.request_id,
            block_hashes=tuple(request.prompt_block_hashes),
            num_prompt_tokens=request.num_prompt_tokens,
            num_kv_blocks_needed=request.num_kv_blocks_needed,
            num_output_tokens=request.num_output_tokens,
            preferred_datacenter=request.preferred_datacenter,
            exclude_instance_ids=frozenset(request.exclude_instance_ids),
        )
        try:
            with self.membership.lock:
                chosen, rank = self.balancer.pick_placement(info)
                return loadbalancer_pb2.PickResponse(
                    instance=self._instance_to_proto(chosen),
                    num_matched_prefix_tokens=matched_prefix_tokens(chosen, info),
                    **({"rank": rank} if rank is not None else {}),
                )
        except RequestTooLarge as e:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))
        except InsufficientCapacity as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NoHealthyInstance as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    def Deregister(self, request, context):
        was_found = self.membership.deregister(request.instance_id)
        if was_found:
            logger.info("deregistered %s", request.instance_id)
        return loadbalancer_pb2.DeregisterResponse(was_found=was_found)

    def ListInstances(self, request, context):
        with self.membership.lock:
            instances = [self._instance_to_proto(i) for i in self.membership.instances(self.balancer.stage)]
        return loadbalancer_pb2.ListInstancesResponse(instances=instances, balance=self.balancer.balance())

    def _instance_to_proto(self, inst: Instance) -> loadbalancer_pb2.Instance:
        info = inst.info
        return loadbalancer_pb2.Instance(
            instance_id=info.instance_id,
            stage=STAGE_TO_PROTO[info.stage],
            address=info.address,
            kv_agent_name=info.kv_agent_name,
            kv_agent_metadata=info.kv_agent_metadata,
            datacenter=info.datacenter,
            block_size=info.block_size,
            load=load_to_proto(inst.load, with_hashes=False),
            num_cached_block_hashes=len(inst.cached_block_hashes),
            heartbeat_age_ms=int(self.membership.heartbeat_age_s(inst) * 1000),
        )


class RunningLoadBalancer(NamedTuple):
    """A started balancer server and what tests and launchers need from it."""

    server: grpc.Server
    """The started gRPC server; `server.stop(grace)` ends it."""
    port: int
    """The bound port (the real one when the address asked for port 0)."""
    balancer: Balancer
    """The core it serves."""


def start_server(
    address: str,
    stage: Stage | str,
    policy: Policy | str,
    *,
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
    max_workers: int = 8,
    clock: Callable[[], float] = time.monotonic,
    **policy_kwargs,
) -> RunningLoadBalancer:
    """Start a `LoadBalancer` server for `stage` on `address` ("host:port"; port 0 picks a free one).

    `policy` is a registered policy name (built with `policy_kwargs`) or a `Policy` instance.
    Raises RuntimeError if the address cannot be bound.
    """
    policy = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
    balancer = Balancer(stage, policy, Membership(heartbeat_timeout_s, clock=clock))
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"loadbalancer-{balancer.stage.value}"),
        interceptors=server_interceptors(),  # the cluster secret (serving.auth): Register / Drain / Pick need it
    )
    loadbalancer_pb2_grpc.add_LoadBalancerServicer_to_server(LoadBalancerServicer(balancer), server)
    try:
        port = add_port(server, address)  # TLS when set (serving.auth)
    except RuntimeError as e:
        raise RuntimeError(f"cannot bind the {balancer.stage.value} balancer to {address!r}: {e}") from e
    if port == 0:
        raise RuntimeError(f"cannot bind the {balancer.stage.value} balancer to {address!r}")
    server.start()
    logger.info("%s balancer (%s) listening on %s (port %d)", balancer.stage.value, policy.name, address, port)
    return RunningLoadBalancer(server, port, balancer)


def serve(address: str, stage: Stage | str, policy: Policy | str, **kwargs) -> grpc.Server:
    """Start a `LoadBalancer` server (see `start_server` for the arguments) and return it, running."""
    return start_server(address, stage, policy, **kwargs).server
