"""The Ray launcher with a vision checkpoint (random weights): `up` starts one vision instance by
default beside prefill and decode; image requests answer like the offline engine; a SIGKILLed vision
worker fails image requests cleanly while text keeps flowing, Ray restarts it and it rejoins; `scale
vision=2` then `vision=1` live; the CLI's `scale vision=N` path and status rows show the stage.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import time

# NOTE: deploy first: it picks Ray's token-auth mode before ray is imported (deploy/__init__.py)
from deepinfer.deploy.config import ClusterConfig  # isort: skip
from deepinfer.deploy.controller import NAMESPACE  # isort: skip
from deepinfer.deploy.launcher import connect_ray, start_cluster, stop_cluster  # isort: skip

import grpc
import pytest
import ray

from deepinfer.entrypoint.client import Client, GenerateError

pytest.importorskip("nixl")
pytest.importorskip("PIL")

CLUSTER_NAME = "deepinfer-vision-test"
PLACEHOLDER = 129279


def _png(color) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(im).ellipse((8, 8, 56, 56), fill=color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _wait_for(what, fn, timeout_s=90.0, interval_s=0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny-vision"), preset="tiny", seed=13, vision=True))
    config = ClusterConfig.model_validate({
        "name": CLUSTER_NAME, "model": ckpt,
        "vision": {"balancer": {"policy": "image_affinity", "heartbeat_timeout_s": 2.0},
                   "worker": {"embedding_rows": 4096}},
        "prefill": {"balancer": {"policy": "prefix_aware", "heartbeat_timeout_s": 2.0},
                    "worker": {"max_num_seqs": 8, "num_blocks": 256}},
        "decode": {"balancer": {"policy": "kv_load", "heartbeat_timeout_s": 2.0},
                   "worker": {"max_num_seqs": 8, "num_blocks": 256}},
        "entrypoint": {"max_attempts": 3}, "http": {"enabled": False},
        # its own store: the default one ($DEEPINFER_HOME/kvstore/NAME) outlives the test
        "kv_store_dir": str(tmp_path_factory.mktemp("kvstore")),
    })
    assert config.active_stages() == ("vision", "prefill", "decode")
    assert not ray.is_initialized()
    connect_ray(None, num_cpus=8)
    controller = client = None
    try:
        controller = start_cluster(config)
        addresses = ray.get(controller.up.remote(), timeout=600)
        client = Client(addresses["entrypoint"], timeout_s=120.0)
        yield ckpt, controller, addresses, client
    finally:
        if client is not None:
            client.close()
        if controller is not None:
            stop_cluster(controller)
        ray.shutdown()


def _rows(controller, stage):
    return {r["instance_id"]: r for r in ray.get(controller.status.remote(), timeout=60)["instances"]
            if r["stage"] == stage}


def _image_request(client, color=(255, 0, 0)):
    return client.generate([5, PLACEHOLDER, 6, 7], images=[_data_url(_png(color))], temperature=0.0, max_tokens=4,
                           ignore_eos=True)


def test_up_starts_a_vision_instance_and_images_match_offline(cluster):
    from deepinfer.engine import LLM, SamplingParams

    ckpt, controller, addresses, client = cluster
    assert "vision_lb" in addresses
    rows = _rows(controller, "vision")
    assert list(rows) == ["vision-0"] and rows["vision-0"]["state"] == "serving", rows
    assert ray.get(controller.num_instances.remote()) == {"vision": 1, "prefill": 1, "decode": 1}
    out = _image_request(client)
    expected = LLM(model=ckpt, num_blocks=256).generate(
        [{"prompt_token_ids": [5, PLACEHOLDER, 6, 7], "multi_modal_data": {"image": [_png((255, 0, 0))]}}],
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"] == expected.outputs[0].token_ids
    stats = _rows(controller, "vision")["vision-0"]["stats"]
    assert stats["vision_images_encoded_total"] >= 1


def test_sigkill_vision_worker_text_flows_and_it_rejoins(cluster):
    _, controller, _, client = cluster
    actor = ray.get_actor(f"{CLUSTER_NAME}-vision-0", namespace=NAMESPACE)
    before = ray.get(actor.info.remote(), timeout=30)
    os.kill(before["pid"], signal.SIGKILL)
    failures = 0
    deadline = time.monotonic() + 120
    while True:  # image requests fail cleanly (never hang) until the restarted worker registers again
        assert len(client.generate([5, 6, 7], max_tokens=2, ignore_eos=True)["token_ids"]) == 2
        try:
            out = _image_request(client, (0, 0, 255))
            break
        except GenerateError as e:
            assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), e
            failures += 1
        assert time.monotonic() < deadline, "the vision worker never came back"
        time.sleep(0.5)
    assert len(out["token_ids"]) == 4
    after = ray.get(actor.info.remote(), timeout=30)
    assert after["is_restarted"] and after["pid"] != before["pid"]


def test_scale_vision_up_and_down_live(cluster):
    _, controller, _, client = cluster
    assert ray.get(controller.scale.remote({"vision": 2}), timeout=600)["vision"] == 2
    _wait_for("two vision instances serving", lambda: len([r for r in _rows(controller, "vision").values()
                                                          if r["state"] == "serving"]) == 2)
    outs = [_image_request(client, (40 * i, 0, 0)) for i in range(4)]
    assert all(len(o["token_ids"]) == 4 for o in outs)
    assert ray.get(controller.scale.remote({"vision": 1}), timeout=600)["vision"] == 1
    assert len(_image_request(client)["token_ids"]) == 4
