"""The vision worker's shell in-process, with a real vision balancer: Encode answers descriptors of
embeddings held in NIXL memory, refuses bad images in-band, Release ends holds, and heartbeats carry
the cached images' keys so the balancer's image_affinity sends a repeated image back to its cache."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from deepinfer.loadbalancer import RequestInfo, Stage
from deepinfer.protos import common_pb2, vision_pb2, vision_pb2_grpc
from tests.vision_worker.test_core import data_url, png

pytest.importorskip("nixl")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.loadbalancer.server import start_server
    from deepinfer.vision_worker.config import VisionWorkerConfig
    from deepinfer.vision_worker.server import serve_vision

    ckpt = make_checkpoint(tmp_path_factory.mktemp("vis-srv"), preset="tiny", seed=5, vision=True)
    lb = start_server("127.0.0.1:0", Stage.VISION, "image_affinity")
    workers = [serve_vision(VisionWorkerConfig(model=str(ckpt), lb_address=f"127.0.0.1:{lb.port}",
                                               instance_id=f"vision-{i}", loopback_ucx=True, embedding_rows=2048,
                                               heartbeat_interval_s=0.1, max_images=3))
               for i in range(2)]
    channels = [grpc.insecure_channel(w.address) for w in workers]
    try:
        yield lb, workers, [vision_pb2_grpc.VisionStub(c) for c in channels]
    finally:
        for c in channels:
            c.close()
        for w in workers:
            w.stop(grace_s=0)
        lb.server.stop(0).wait()


def _encode(stub, rid, *images):
    req = vision_pb2.EncodeRequest(request_id=rid)
    for image in images:
        req.images.add(descriptor=image.encode() if isinstance(image, str) else image, offset=0, num_tokens=1)
    return stub.Encode(req, timeout=60)


def _stats(stub) -> dict:
    _, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=10)
    return json.loads(dict(call.trailing_metadata())["deepinfer-stats-json"])


def test_encode_release_and_bad_images(stack):
    _, workers, stubs = stack
    red = data_url(png((255, 0, 0)))
    reply = _encode(stubs[0], "a", red, png((0, 255, 0), shape="triangle"))
    assert not reply.error.code and len(reply.embeddings) == 2
    e = reply.embeddings[0]
    assert e.num_tokens == 184 and e.agent_name == "vision-0" and e.dtype == "float32"
    assert e.num_bytes == 184 * e.hidden_size * 4 and e.agent_metadata and len(e.content_hash) == 64
    assert reply.lease_deadline_unix_ms > time.time() * 1000
    assert _stats(stubs[0])["vision_held_requests"] == 1
    assert stubs[0].Release(vision_pb2.ReleaseRequest(request_id="a"), timeout=10).was_found
    assert _stats(stubs[0])["vision_held_requests"] == 0
    for bad, what in ((b"not an image", "not a supported image"), ("http://10.1.2.3/x.png", "not allowed"),
                      ("file:///etc/passwd", "not allowed")):
        refused = _encode(stubs[0], "bad", bad)
        assert refused.error.code == common_pb2.ERROR_CODE_INVALID_REQUEST and what in refused.error.message
    refused = _encode(stubs[0], "many", *[red] * 4)
    assert refused.error.code == common_pb2.ERROR_CODE_INVALID_REQUEST and "at most 3" in refused.error.message
    assert _stats(stubs[0])["vision_images_total"] == 2  # refused images never reached the encoder


def test_balancer_sends_a_repeated_image_to_the_instance_that_cached_it(stack):
    from deepinfer.entrypoint.server import image_pick_keys

    lb, _, stubs = stack
    blue = data_url(png((0, 0, 255)))
    assert not _encode(stubs[1], "b", blue).error.code
    stubs[1].Release(vision_pb2.ReleaseRequest(request_id="b"), timeout=10)
    ref = common_pb2.ImageRef(descriptor=blue.encode())
    keys = tuple(image_pick_keys([ref]))
    deadline = time.monotonic() + 10
    while keys[0] not in lb.balancer.membership.get("vision-1").cached_block_hashes:
        assert time.monotonic() < deadline, "the heartbeat never carried the cached image"
        time.sleep(0.05)
    for i in range(3):
        assert lb.balancer.pick(RequestInfo(request_id=str(i), block_hashes=keys, num_prompt_tokens=184)) \
            .instance_id == "vision-1"
    hits = _stats(stubs[1])["vision_cache_hits_total"]
    assert not _encode(stubs[1], "b2", blue).error.code
    assert _stats(stubs[1])["vision_cache_hits_total"] == hits + 1


def test_an_emptied_queue_is_reported_at_once(tmp_path):
    """With a 30 s heartbeat, the balancer still learns within seconds that an encode finished: the
    worker reports when its pending image tokens drop to zero (and the newly cached image with it)."""
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.entrypoint.server import image_pick_keys
    from deepinfer.loadbalancer.server import start_server
    from deepinfer.vision_worker.config import VisionWorkerConfig
    from deepinfer.vision_worker.server import serve_vision

    ckpt = make_checkpoint(tmp_path / "ckpt", preset="tiny", seed=5, vision=True)
    lb = start_server("127.0.0.1:0", Stage.VISION, "image_affinity", heartbeat_timeout_s=90)
    worker = serve_vision(VisionWorkerConfig(model=str(ckpt), lb_address=f"127.0.0.1:{lb.port}",
                                             instance_id="vision-slow", loopback_ucx=True, embedding_rows=512,
                                             heartbeat_interval_s=30, max_images=3))
    channel = grpc.insecure_channel(worker.address)
    try:
        image = data_url(png((0, 128, 255)))
        keys = tuple(image_pick_keys([common_pb2.ImageRef(descriptor=image.encode())]))
        lb.balancer.pick(RequestInfo(request_id="r", block_hashes=keys, num_prompt_tokens=184))  # counted as pending
        assert lb.balancer.membership.get("vision-slow").load.num_queued_prefill_tokens == 184
        assert not _encode(vision_pb2_grpc.VisionStub(channel), "r", image).error.code
        deadline = time.monotonic() + 5
        while True:
            inst = lb.balancer.membership.get("vision-slow")
            if keys[0] in inst.cached_block_hashes and inst.load.num_queued_prefill_tokens == 0:
                break
            assert time.monotonic() < deadline, f"no report after the encode: {inst.load}"
            time.sleep(0.05)
    finally:
        channel.close()
        worker.stop(grace_s=0)
        lb.server.stop(0).wait()
