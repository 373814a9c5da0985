"""The decode balancer picks an (instance, rank) of multi-rank instances (issue 25): `kv_load` compares ranks by
their own KV blocks and requests, counts a pick on the picked rank until the next heartbeat (no herding on one
rank), answers the rank in `PickResponse.rank` over gRPC, and leaves one-rank instances' picks rank-free."""

from __future__ import annotations

import grpc
import pytest

from deepinfer.loadbalancer import Stage
from deepinfer.loadbalancer.balancer import Balancer
from deepinfer.loadbalancer.membership import InstanceLoad, RankLoad
from deepinfer.loadbalancer.policies import RequestInfo
from deepinfer.loadbalancer.server import load_from_proto, load_to_proto, start_server
from deepinfer.protos import common_pb2, loadbalancer_pb2, loadbalancer_pb2_grpc
from tests.loadbalancer.factories import add, make_membership


def _ranks(*used_running, total=10):
    return tuple(RankLoad(r, running, 0, used, total) for r, (used, running) in enumerate(used_running))


def _balancer(**instances):
    members, _ = make_membership()
    for instance_id, load in instances.items():
        add(members, instance_id, Stage.DECODE, **load)
    return Balancer(Stage.DECODE, "kv_load", members)


def test_kv_load_picks_the_emptiest_rank_with_room_across_instances():
    balancer = _balancer(
        one={"num_kv_blocks_used": 4, "num_kv_blocks_total": 10},  # a one-rank instance
        ep={"num_kv_blocks_used": 2, "num_kv_blocks_total": 10, "ranks": _ranks((9, 1), (2, 3), (2, 1))})
    inst, rank = balancer.pick_placement(RequestInfo(num_kv_blocks_needed=3))
    assert (inst.instance_id, rank) == ("ep", 2)  # 2 blocks used on ranks 1 and 2; rank 2 runs fewer requests
    # the pick counts on rank 2 until the next heartbeat: the next request goes to rank 1
    assert inst.load.ranks[2].num_kv_blocks_used == 5 and inst.load.ranks[2].num_waiting_requests == 1
    assert balancer.pick_placement(RequestInfo(num_kv_blocks_needed=3))[1] == 1
    # rank 0 (1 block free) never fits; when no rank of `ep` has room left, the one-rank instance is picked
    inst, rank = balancer.pick_placement(RequestInfo(num_kv_blocks_needed=6))
    assert (inst.instance_id, rank) == ("one", None)


def test_policies_that_ignore_ranks_leave_the_choice_to_the_instance():
    members, _ = make_membership()
    add(members, "ep", Stage.DECODE, num_kv_blocks_total=10, ranks=_ranks((0, 0), (0, 0)))
    balancer = Balancer(Stage.DECODE, "round_robin", members)
    assert balancer.pick_placement(RequestInfo())[1] is None


def test_rank_loads_survive_the_wire():
    load = InstanceLoad(num_kv_blocks_used=3, num_kv_blocks_total=10, ranks=_ranks((3, 1), (7, 2)))
    assert load_from_proto(load_to_proto(load)).ranks == load.ranks


@pytest.fixture
def decode_lb():
    running = start_server("127.0.0.1:0", "decode", "kv_load", heartbeat_timeout_s=5.0, max_workers=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield loadbalancer_pb2_grpc.LoadBalancerStub(channel)
    finally:
        channel.close()
        running.server.stop(None)


def test_pick_response_names_the_rank(decode_lb):
    ranks = [loadbalancer_pb2.RankLoad(rank=0, num_kv_blocks_used=6, num_kv_blocks_total=8),
             loadbalancer_pb2.RankLoad(rank=1, num_kv_blocks_used=1, num_kv_blocks_total=8)]
    decode_lb.Register(loadbalancer_pb2.RegisterRequest(
        instance_id="d0", stage=common_pb2.STAGE_DECODE, address="127.0.0.1:9", block_size=4,
        load=loadbalancer_pb2.LoadReport(is_healthy=True, num_kv_blocks_used=1, num_kv_blocks_total=8, ranks=ranks)),
        timeout=10)
    picked = decode_lb.Pick(loadbalancer_pb2.PickRequest(request_id="r", num_prompt_tokens=9), timeout=10)
    assert picked.instance.instance_id == "d0" and picked.HasField("rank") and picked.rank == 1
    assert [r.num_kv_blocks_used for r in picked.instance.load.ranks] == [6, 4]  # 3 blocks counted on rank 1
