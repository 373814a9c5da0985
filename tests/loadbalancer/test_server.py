"""The gRPC shell on loopback: two fake prefill instances register, heartbeat, get picked, one goes
silent and is dropped; error statuses for a wrong stage, no instance, no room."""

from __future__ import annotations

import time

import grpc
import pytest

from deepinfer.loadbalancer.server import start_server
from deepinfer.protos import common_pb2, loadbalancer_pb2, loadbalancer_pb2_grpc

TIMEOUT_S = 0.5
RPC_TIMEOUT_S = 5.0


@pytest.fixture
def lb():
    running = start_server("127.0.0.1:0", "prefill", "prefix_aware", heartbeat_timeout_s=TIMEOUT_S, max_workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield loadbalancer_pb2_grpc.LoadBalancerStub(channel)
    finally:
        channel.close()
        running.server.stop(None)


def _register(stub, instance_id, **fields):
    return stub.Register(
        loadbalancer_pb2.RegisterRequest(
            instance_id=instance_id, stage=common_pb2.STAGE_PREFILL, address=f"127.0.0.1:{9000 + len(instance_id)}",
            kv_agent_name=f"agent-{instance_id}", kv_agent_metadata=b"\x00meta", datacenter="dc-a", block_size=4,
            **fields,
        ),
        timeout=RPC_TIMEOUT_S,
    )


def _heartbeat(stub, instance_id, **load):
    """Heartbeat as an instance does: register again when the balancer no longer knows it."""
    report = loadbalancer_pb2.LoadReport(is_healthy=True, **load)
    reply = stub.Heartbeat(loadbalancer_pb2.HeartbeatRequest(instance_id=instance_id, load=report),
                           timeout=RPC_TIMEOUT_S)
    if not reply.is_known:
        _register(stub, instance_id, load=report)
    return reply


def _pick(stub, **fields):
    return stub.Pick(loadbalancer_pb2.PickRequest(request_id="r", **fields), timeout=RPC_TIMEOUT_S)


def _listed(stub):
    return [i.instance_id for i in stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                                      timeout=RPC_TIMEOUT_S).instances]


def test_register_heartbeat_pick_and_drop_silent(lb):
    reply = _register(lb, "p0")
    assert reply.heartbeat_timeout_ms == 500 and 0 < reply.heartbeat_interval_ms < 500
    _register(lb, "p1")
    assert _pick(lb, num_prompt_tokens=12).instance.instance_id in {"p0", "p1"}  # pickable before any heartbeat

    assert _heartbeat(lb, "p0", cached_block_hashes=[1, 2], num_kv_blocks_total=64).needs_full_cached_hashes is False
    assert _heartbeat(lb, "p1", num_queued_prefill_tokens=3).is_known
    picked = _pick(lb, stage=common_pb2.STAGE_PREFILL, prompt_block_hashes=[1, 2, 3], num_prompt_tokens=12)
    assert picked.instance.instance_id == "p0" and picked.num_matched_prefix_tokens == 8
    assert picked.instance.kv_agent_metadata == b"\x00meta" and picked.instance.datacenter == "dc-a"
    assert picked.instance.load.num_queued_prefill_tokens == 4  # 12 - 8 uncached tokens counted at once
    assert picked.instance.num_cached_block_hashes == 2
    assert _listed(lb) == ["p0", "p1"]

    # p0 goes silent; p1 keeps heartbeating until the balancer drops p0
    deadline = time.monotonic() + 10 * TIMEOUT_S
    while "p0" in _listed(lb):
        assert time.monotonic() < deadline, "silent instance was never dropped"
        _heartbeat(lb, "p1")
        time.sleep(0.05)
    _heartbeat(lb, "p1")
    assert _listed(lb) == ["p1"]
    assert _pick(lb, prompt_block_hashes=[1, 2, 3], num_prompt_tokens=12).instance.instance_id == "p1"
    assert not lb.Heartbeat(loadbalancer_pb2.HeartbeatRequest(instance_id="p0"), timeout=RPC_TIMEOUT_S).is_known

    assert lb.Deregister(loadbalancer_pb2.DeregisterRequest(instance_id="p1"), timeout=RPC_TIMEOUT_S).was_found
    with pytest.raises(grpc.RpcError) as e:
        _pick(lb, num_prompt_tokens=12)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy prefill instance" in e.value.details()


def test_wrong_stage_is_refused(lb):
    with pytest.raises(grpc.RpcError) as e:
        lb.Register(loadbalancer_pb2.RegisterRequest(instance_id="d0", stage=common_pb2.STAGE_DECODE),
                    timeout=RPC_TIMEOUT_S)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "STAGE_PREFILL" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        _register(lb, "")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        _pick(lb, stage=common_pb2.STAGE_DECODE)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_decode_without_room_is_resource_exhausted():
    running = start_server("127.0.0.1:0", "decode", "kv_load", heartbeat_timeout_s=TIMEOUT_S, max_workers=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = loadbalancer_pb2_grpc.LoadBalancerStub(channel)
            stub.Register(loadbalancer_pb2.RegisterRequest(
                instance_id="d0", stage=common_pb2.STAGE_DECODE, block_size=4,
                load=loadbalancer_pb2.LoadReport(is_healthy=True, num_kv_blocks_total=2)), timeout=RPC_TIMEOUT_S)
            with pytest.raises(grpc.RpcError) as e:
                _pick(stub, num_prompt_tokens=12)  # needs 4 blocks: more than the pool holds, waiting cannot help
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert _pick(stub, num_prompt_tokens=5).instance.load.num_kv_blocks_used == 2
            with pytest.raises(grpc.RpcError) as e:
                _pick(stub, num_prompt_tokens=5)  # both blocks held by the first pick until the next heartbeat
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        running.server.stop(None)
