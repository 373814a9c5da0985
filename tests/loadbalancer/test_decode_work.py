"""Decode picks by predicted work and free state slots (issue 25, "balance of the request balancers"): `decode_work`
ranks (instance, rank) places by the output tokens their requests may still generate, counts a pick's predicted
tokens and slot until the next report corrects them, and no decode policy picks a place without a free slot while
another has room; a request no pool could ever hold is `RequestTooLarge` (the entrypoint fails it at once instead of
waiting)."""

from __future__ import annotations

import grpc
import pytest

from deepinfer.loadbalancer import Balancer, InsufficientCapacity, RequestInfo, RequestTooLarge, Stage, make_policy
from deepinfer.loadbalancer.membership import InstanceLoad, RankLoad
from deepinfer.loadbalancer.server import load_from_proto, load_to_proto, start_server
from deepinfer.protos import common_pb2, loadbalancer_pb2, loadbalancer_pb2_grpc
from tests.loadbalancer.factories import add, make_membership


def _rank(rank: int, *, used: int = 0, left: int = 0, slots: int | None = 4, running: int = 0, total: int = 32):
    return RankLoad(rank, num_running_requests=running, num_kv_blocks_used=used, num_kv_blocks_total=total,
                    num_free_slots=slots, num_output_tokens_left=left)


def _ep(*ranks: RankLoad) -> dict:
    """An EP instance's load: per-rank figures and the instance sums (as the decode worker reports them)."""
    slots = [r.num_free_slots for r in ranks]
    return {"num_kv_blocks_total": 32, "ranks": ranks, "num_free_slots": None if None in slots else sum(slots),
            "num_output_tokens_left": sum(r.num_output_tokens_left for r in ranks)}


def _balancer(policy: str, **instances) -> Balancer:
    members, _ = make_membership()
    for instance_id, load in instances.items():
        add(members, instance_id, Stage.DECODE, **load)
    return Balancer(Stage.DECODE, policy, members)


def test_decode_work_picks_the_least_work_left_not_the_fewest_blocks():
    # rank a/0 holds few blocks but long answers ahead; b/1 many blocks (long prompts) with little left to generate
    balancer = _balancer("decode_work", a=_ep(_rank(0, used=2, left=300), _rank(1, used=3, left=200)),
                         b=_ep(_rank(0, used=9, left=150), _rank(1, used=12, left=40)))
    assert _placement(balancer, num_output_tokens=100) == ("b", 1)
    # kv_load on the same loads follows the blocks
    kv = _balancer("kv_load", a=_ep(_rank(0, used=2, left=300), _rank(1, used=3, left=200)),
                   b=_ep(_rank(0, used=9, left=150), _rank(1, used=12, left=40)))
    assert _placement(kv, num_output_tokens=100) == ("a", 0)


def _placement(balancer: Balancer, **request) -> tuple[str, int | None]:
    inst, rank = balancer.pick_placement(RequestInfo(**request))
    return inst.instance_id, rank


def test_a_pick_counts_its_predicted_tokens_and_slot_until_the_next_report():
    balancer = _balancer("decode_work", a=_ep(_rank(0, left=10, slots=2), _rank(1, left=50, slots=2)))
    assert _placement(balancer, num_output_tokens=100) == ("a", 0)
    load = balancer.membership.get("a").load
    assert (load.ranks[0].num_output_tokens_left, load.ranks[0].num_free_slots) == (110, 1)
    assert (load.num_output_tokens_left, load.num_free_slots) == (160, 3)
    assert _placement(balancer, num_output_tokens=30) == ("a", 1)  # 50 < 110 now
    assert _placement(balancer, num_output_tokens=30) == ("a", 1)  # 80 < 110
    # rank 1's two slots are taken: the next request goes to rank 0 whatever its work
    assert balancer.membership.get("a").load.ranks[1].num_free_slots == 0
    assert _placement(balancer, num_output_tokens=1) == ("a", 0)
    with pytest.raises(InsufficientCapacity) as e:  # every slot taken: full now, not too large
        balancer.pick_placement(RequestInfo(num_output_tokens=1))
    assert not isinstance(e.value, RequestTooLarge)
    # the decode's next report replaces the predictions with what it really holds
    balancer.membership.heartbeat("a", InstanceLoad(**_ep(_rank(0, left=5, slots=1), _rank(1, left=70, slots=2))))
    assert _placement(balancer, num_output_tokens=1) == ("a", 0)


def test_unknown_output_length_counts_the_policy_default():
    members, _ = make_membership()
    add(members, "a", Stage.DECODE, **_ep(_rank(0), _rank(1)))
    balancer = Balancer(Stage.DECODE, make_policy("decode_work", default_output_tokens=64), members)
    balancer.pick_placement(RequestInfo())
    assert [r.num_output_tokens_left for r in members.get("a").load.ranks] == [64, 0]
    assert _placement(balancer) == ("a", 1)  # the two picks spread over the ranks


@pytest.mark.parametrize("policy", ["kv_load", "decode_work"])
def test_a_place_without_a_free_slot_is_never_picked_while_another_has_room(policy):
    # a/0 is the emptiest by every other measure but has no free state slot
    balancer = _balancer(policy, a=_ep(_rank(0, slots=0), _rank(1, used=20, left=500, running=3, slots=1)),
                         b=_ep(_rank(0, used=25, left=900, running=5, slots=1), _rank(1, used=30, left=999, slots=0)))
    picks = {_placement(balancer, num_output_tokens=10) for _ in range(2)}
    assert picks == {("a", 1), ("b", 0)}
    with pytest.raises(InsufficientCapacity, match="has room"):
        balancer.pick_placement(RequestInfo(num_output_tokens=10))


def test_one_rank_instances_and_unreported_slots():
    # one-rank instances: the instance's own figures; slots not reported (an older decode) count as room
    balancer = _balancer("decode_work", a={"num_kv_blocks_total": 8, "num_output_tokens_left": 90, "num_free_slots": 0},
                         b={"num_kv_blocks_total": 8, "num_output_tokens_left": 500},
                         c={"num_kv_blocks_total": 8, "num_output_tokens_left": 700, "num_free_slots": 2})
    assert _placement(balancer, num_output_tokens=10) == ("b", None)
    assert balancer.membership.get("b").load.num_free_slots is None  # stays unknown after the pick
    assert _placement(balancer, num_output_tokens=300) == ("b", None)  # 510 < 700
    assert _placement(balancer, num_output_tokens=10) == ("c", None)  # 810 > 700


def test_a_request_no_pool_could_hold_is_too_large():
    balancer = _balancer("decode_work", a=_ep(_rank(0, total=8, slots=0), _rank(1, total=8, slots=0)))
    with pytest.raises(RequestTooLarge, match="more KV blocks than any"):
        balancer.pick_placement(RequestInfo(num_kv_blocks_needed=9))
    with pytest.raises(InsufficientCapacity) as e:  # fits an empty rank: full now (no slot), retry later
        balancer.pick_placement(RequestInfo(num_kv_blocks_needed=8))
    assert not isinstance(e.value, RequestTooLarge)


def test_new_load_fields_survive_the_wire():
    load = InstanceLoad(**_ep(_rank(0, left=7, slots=0), _rank(1, left=9, slots=None)))
    back = load_from_proto(load_to_proto(load))
    assert back.ranks == load.ranks  # 0 free slots stays 0, unreported stays None
    assert (back.num_output_tokens_left, back.num_free_slots) == (16, None)
    assert load_from_proto(load_to_proto(InstanceLoad(num_free_slots=0))).num_free_slots == 0


def test_pick_passes_the_requests_output_tokens():
    running = start_server("127.0.0.1:0", "decode", "decode_work", heartbeat_timeout_s=5.0, max_workers=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            lb = loadbalancer_pb2_grpc.LoadBalancerStub(channel)
            ranks = [loadbalancer_pb2.RankLoad(rank=r, num_kv_blocks_total=8, num_free_slots=1) for r in range(2)]
            lb.Register(loadbalancer_pb2.RegisterRequest(
                instance_id="d0", stage=common_pb2.STAGE_DECODE, address="127.0.0.1:9", block_size=4,
                load=loadbalancer_pb2.LoadReport(is_healthy=True, num_kv_blocks_total=8, num_free_slots=2,
                                                 ranks=ranks)), timeout=10)
            picked = lb.Pick(loadbalancer_pb2.PickRequest(request_id="r", num_prompt_tokens=5, num_output_tokens=40),
                             timeout=10)
            assert picked.rank == 0 and picked.instance.load.ranks[0].num_output_tokens_left == 40
            assert picked.instance.load.ranks[0].num_free_slots == 0 and picked.instance.load.num_free_slots == 1
            assert lb.Pick(loadbalancer_pb2.PickRequest(request_id="s", num_prompt_tokens=5), timeout=10).rank == 1
            with pytest.raises(grpc.RpcError) as e:  # both slots taken until the next heartbeat: full now
                lb.Pick(loadbalancer_pb2.PickRequest(request_id="t", num_prompt_tokens=5), timeout=10)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            with pytest.raises(grpc.RpcError) as e:  # 9 blocks: more than a rank's pool, never fits
                lb.Pick(loadbalancer_pb2.PickRequest(request_id="u", num_prompt_tokens=33), timeout=10)
            assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    finally:
        running.server.stop(None)


def test_pinned_follows_the_place_the_request_id_names():
    balancer = _balancer("pinned", a=_ep(_rank(0), _rank(1, slots=0)), b=_ep(_rank(0, left=9), _rank(1, left=500)))
    assert _placement(balancer, request_id="r1@b/1") == ("b", 1)  # the most work: named, so taken
    assert _placement(balancer, request_id="r2@a/1") == ("a", 0)  # no free slot there: as decode_work
    assert _placement(balancer, request_id="r3@b") == ("b", 0)  # an instance only: its least loaded rank
    assert _placement(balancer, request_id="r4") == ("a", 0)  # nothing named: as decode_work
