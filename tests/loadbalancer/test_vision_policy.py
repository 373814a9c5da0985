"""The vision balancer: least pending image tokens, image-hash affinity, picks counted until the next heartbeat."""

from __future__ import annotations

from deepinfer.loadbalancer import Balancer, RequestInfo, Stage, make_policy
from tests.loadbalancer.factories import add, make_membership


def test_image_affinity_prefers_cached_images_then_least_pending_tokens():
    members, _ = make_membership()
    add(members, "v0", Stage.VISION, block_size=0, num_queued_prefill_tokens=100)
    add(members, "v1", Stage.VISION, block_size=0, num_queued_prefill_tokens=0)
    add(members, "v2", Stage.VISION, block_size=0, num_queued_prefill_tokens=50, cached_block_hashes={7, 8})
    candidates = members.pickable(Stage.VISION)
    policy = make_policy("image_affinity")
    assert policy.select(candidates, RequestInfo(num_prompt_tokens=184)).instance_id == "v1"  # no hashes: least queued
    # both images cached on v2: 2 x 184 tokens saved outweigh its 50 queued ones
    assert policy.select(candidates, RequestInfo(block_hashes=(7, 8), num_prompt_tokens=368)).instance_id == "v2"
    # one small cached image (10 tokens) saves less than v2's queue
    assert policy.select(candidates, RequestInfo(block_hashes=(7, 9), num_prompt_tokens=20)).instance_id == "v1"


def test_vision_picks_add_uncached_image_tokens_until_the_next_heartbeat():
    members, _ = make_membership()
    add(members, "v0", Stage.VISION, block_size=0)
    add(members, "v1", Stage.VISION, block_size=0)
    balancer = Balancer(Stage.VISION, "image_affinity", members)
    picks = [balancer.pick(RequestInfo(request_id=str(i), block_hashes=(i,), num_prompt_tokens=184)).instance_id
             for i in range(4)]
    assert sorted(picks) == ["v0", "v0", "v1", "v1"]  # spread by the pending tokens the picks added
    assert members.get("v0").load.num_queued_prefill_tokens == 368
