"""The vision stage across real processes on loopback: three balancers, one vision, one prefill and one
decode instance (embeddings and KV over NIXL) and the entrypoint, each started as `python -m ...`, with
a random-weight vision checkpoint.

Image prompts give the offline engine's output token for token, the embeddings moved by NIXL READ
(counters on both sides), a repeated image is encoded once, bad images are refused with
INVALID_ARGUMENT before prefill while text keeps flowing, and killing the vision worker fails image
requests cleanly (text unaffected) until a new one joins.
"""

from __future__ import annotations

import base64
import io
import json
import os
import time

import grpc
import pytest

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client, GenerateError
from deepinfer.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, vision_pb2_grpc
from tests.e2e._cluster import POLICIES, service_processes, spawn_cluster

pytest.importorskip("nixl")
pytest.importorskip("PIL")

STARTUP_TIMEOUT_S = 90.0
RPC_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"
PLACEHOLDER = 129279


def png(color, shape="circle", size=(64, 64)) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(im)
    if shape == "circle":
        draw.ellipse((8, 8, size[0] - 8, size[1] - 8), fill=color)
    else:
        draw.polygon([(size[0] // 2, 4), (4, size[1] - 4), (size[0] - 4, size[1] - 4)], fill=color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class VisionCluster:
    def __init__(self, checkpoint: str, processes: ServiceProcesses) -> None:
        self.checkpoint = checkpoint
        self.processes = processes
        self.info = processes.info
        self.client = Client(self.info["entrypoint"]["address"], timeout_s=120.0)
        self._channels: dict[str, grpc.Channel] = {}

    def stats(self, name: str) -> dict:
        address = self.info[name]["address"]
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        stub = {"vision": vision_pb2_grpc.VisionStub, "prefill": prefill_pb2_grpc.PrefillStub,
                "decode": decode_pb2_grpc.DecodeStub}[name.split("-")[0]](
            self._channels[address])
        reply, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
        assert reply.is_healthy, reply.message
        return json.loads(dict(call.trailing_metadata())[STATS_KEY])

    def start_vision(self, name: str) -> None:
        self.processes.spawn(name, ["vision_worker", "--model", self.checkpoint, "--lb-address",
                                    self.info["vision_lb"]["address"], "--instance-id", name, "--loopback-ucx",
                                    "--embedding-rows", "4096", "--max-image-pixels", "10000000",
                                    "--max-image-bytes", "2000000"])
        self.processes.wait_ready(STARTUP_TIMEOUT_S)

    def close(self) -> None:
        self.client.close()
        for channel in self._channels.values():
            channel.close()


def vision_cluster(tmp_path_factory, ckpt: str, heartbeat_timeout_s: str, num_blocks: str,
                   entrypoint_args: tuple[str, ...] = ()):
    """Yields a `VisionCluster` on `ckpt` (its balancers with `heartbeat_timeout_s`, workers of `num_blocks` blocks)
    with one vision instance, `vision-0`; stops it all after."""
    processes = service_processes(tmp_path_factory)
    cluster = None
    try:
        spawn_cluster(processes, ckpt, ["--max-num-seqs", "8", "--num-blocks", num_blocks], STARTUP_TIMEOUT_S,
                      stages=("vision", "prefill", "decode"), entrypoint_args=entrypoint_args,
                      lb_args={stage: ["--heartbeat-timeout-s", heartbeat_timeout_s] for stage in POLICIES})
        cluster = VisionCluster(ckpt, processes)
        cluster.start_vision("vision-0")
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        processes.stop(10.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny-vision"), preset="tiny", seed=11, vision=True))
    # a killed vision stage is waited for 1 s only (then image requests fail)
    yield from vision_cluster(tmp_path_factory, ckpt, "2", "256", ("--outage-wait-s", "1"))


RED, BLUE = png((255, 0, 0)), png((0, 0, 255), "triangle")


def image_cases(red: bytes, blue: bytes) -> list[tuple[list[int], list[bytes]]]:
    """Prompt ids and their images: one image, two (both orders: the embeddings must matter), none."""
    return [
        ([5, 6, PLACEHOLDER, 7, 8], [red]),
        ([9, PLACEHOLDER, 10, 11, PLACEHOLDER, 12], [blue, red]),
        ([9, PLACEHOLDER, 10, 11, PLACEHOLDER, 12], [red, blue]),
        ([13, 14, 15], []),
    ]


def generate_as_offline(cluster: VisionCluster, cases, max_tokens: int, num_blocks: int) -> tuple[list, list]:
    """Each case greedily through the cluster and through the offline engine (`num_blocks` blocks); asserts the same
    tokens; returns the cluster's outputs and the engine's."""
    from deepinfer.engine import LLM, SamplingParams

    outs = [cluster.client.generate(ids, images=[data_url(i) for i in imgs] or None, temperature=0.0,
                                    max_tokens=max_tokens, ignore_eos=True) for ids, imgs in cases]
    llm = LLM(model=cluster.checkpoint, num_blocks=num_blocks, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    offline = []
    for (ids, imgs), out in zip(cases, outs):
        prompt = {"prompt_token_ids": ids, **({"multi_modal_data": {"image": imgs}} if imgs else {})}
        offline.append(llm.generate([prompt], params, use_tqdm=False)[0])
        assert out["token_ids"] == offline[-1].outputs[0].token_ids, (ids, len(imgs))
    assert outs[1]["token_ids"] != outs[2]["token_ids"]  # same ids, images swapped: the embeddings matter
    return outs, offline


def test_image_outputs_equal_offline_engine_and_embeddings_moved_by_nixl(cluster):
    cases = image_cases(RED, BLUE)
    v0, p0, d0 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    outs, _ = generate_as_offline(cluster, cases, 8, 256)
    for (ids, imgs), out in zip(cases, outs):
        assert out["usage"]["prompt_tokens"] == len(ids) + 183 * len(imgs)  # each placeholder -> 184 image tokens
    # two distinct images, five image uses: encoded twice, the rest were cache hits
    v1, p1, d1 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    assert v1["vision_images_encoded_total"] - v0["vision_images_encoded_total"] == 2
    assert v1["vision_cache_hits_total"] - v0["vision_cache_hits_total"] == 3
    row_bytes = 4 * json.loads(open(os.path.join(cluster.checkpoint, "config.json")).read())["hidden_size"]
    assert p1["embeddings_read_bytes_total"] - p0["embeddings_read_bytes_total"] == 5 * 184 * row_bytes
    assert p1["embeddings_reads_done_total"] - p0["embeddings_reads_done_total"] == 5
    # the decode reservation READs them too (to compute image positions itself: replay, preemption)
    assert d1["embeddings_read_bytes_total"] - d0["embeddings_read_bytes_total"] == 5 * 184 * row_bytes
    assert v1["embeddings_served_bytes_total"] - v0["embeddings_served_bytes_total"] == 2 * (
        p1["embeddings_read_bytes_total"] - p0["embeddings_read_bytes_total"])
    # the holds were released once the prefill answered
    assert _wait_for("holds released", lambda: cluster.stats("vision-0")["vision_held_requests"] == 0)


def test_bad_images_are_refused_before_prefill_and_text_keeps_flowing(cluster):
    p0 = cluster.stats("prefill")
    big = png((0, 255, 0), size=(4000, 3000))  # 12 M pixels, over the instance's 10 M limit
    bad = {
        "corrupt": (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "not a supported image"),
        "non-image": (b"just some text, no image", "not a supported image"),
        "over the pixel limit": (big, "pixels; at most 10000000"),
        "over the byte limit": (big + b"\x00" * 3_000_000, "bytes; at most 2000000"),
        "url outside the allow-list": ("http://10.0.0.1/secret.png", "not allowed"),
        "unsupported scheme": ("ftp://images.example.com/a.png", "not allowed"),
    }
    for name, (image, message) in bad.items():
        with pytest.raises(GenerateError) as e:
            cluster.client.generate([5, PLACEHOLDER, 6], images=[image], max_tokens=4)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, name
        assert message in str(e.value), (name, str(e.value))
    with pytest.raises(GenerateError) as e:  # more images than the per-request quota (8)
        cluster.client.generate([5] + [PLACEHOLDER] * 9, images=[RED] * 9, max_tokens=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 8" in str(e.value)
    # context checks count image tokens: 3 text tokens + 4000 fit 4096, but not with the image's 184
    with pytest.raises(GenerateError) as e:
        cluster.client.generate([5, PLACEHOLDER, 6], images=[RED], max_tokens=4000)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "with image tokens" in str(e.value)
    p1 = cluster.stats("prefill")
    assert p1["embeddings_reads_done_total"] == p0["embeddings_reads_done_total"]
    assert p1["kv_transfer_sends_done_total"] == p0["kv_transfer_sends_done_total"]  # nothing reached prefill
    assert cluster.client.generate([5, 6, 7], max_tokens=3, ignore_eos=True)["finish_reason"] is not None
    _wait_for("holds dropped", lambda: cluster.stats("vision-0")["vision_held_requests"] == 0)


def _wait_for(what: str, fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_killing_the_vision_worker_fails_image_requests_cleanly_and_a_new_one_rejoins(cluster):
    proc = cluster.processes.procs["vision-0"]
    proc.kill()
    proc.wait(10)
    # image requests wait for the lost instance (`--outage-wait-s`, 1 s here; a restart under its id would
    # serve them: test_chaos_vision.py), then fail cleanly (UNAVAILABLE); text requests keep flowing
    for _ in range(3):
        with pytest.raises(GenerateError) as e:
            cluster.client.generate([5, PLACEHOLDER, 6], images=[RED], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and "vision" in str(e.value)
        assert len(cluster.client.generate([5, 6, 7], max_tokens=2, ignore_eos=True)["token_ids"]) == 2
    # the entrypoint stays healthy (text serves) and says the vision stage is missing
    health = _wait_for("the balancer to drop vision-0",
                       lambda: (h := cluster.client.health())["message"] and h)
    assert health["is_healthy"] and "degraded: no healthy vision instance" in health["message"], health
    cluster.start_vision("vision-1")
    out = _wait_for("a vision instance serving again", lambda: _try_image(cluster))
    assert len(out["token_ids"]) == 2


def _try_image(cluster):
    try:
        return cluster.client.generate([5, PLACEHOLDER, 6], images=[BLUE], max_tokens=2, ignore_eos=True)
    except GenerateError:
        return None


def test_vision_instance_lost_before_prefill_read_is_encoded_again(cluster):
    """The vision instance holding a request's embeddings dies before the prefill READs them: the prefill
    reports them lost (retryable), the entrypoint encodes the images on another vision instance and the
    request completes with the offline output."""
    import signal
    import threading

    cluster.start_vision("vision-2")  # with vision-1 (from the kill test): two live instances
    names = ["vision-1", "vision-2"]
    _wait_for("both vision instances pickable", lambda: all(cluster.stats(n) for n in names))
    prefill = cluster.processes.procs["prefill"]
    image = png((10, 200, 30))
    result: dict = {}

    def run():
        try:
            result["out"] = cluster.client.generate([5, PLACEHOLDER, 6], images=[image], temperature=0.0,
                                                    max_tokens=3, ignore_eos=True)
        except Exception as e:  # reported below
            result["error"] = e

    reads0 = cluster.stats("decode")["embeddings_reads_done_total"]
    prefill.send_signal(signal.SIGSTOP)  # the prefill call waits; heartbeats pause (< the 2 s timeout)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        # encoded, held, and read by the decode reservation: the prefill's READ is the one that fails
        _wait_for("the decode read the embeddings", lambda: cluster.stats("decode")["embeddings_reads_done_total"]
                  > reads0, timeout_s=1.5)
        holder = next(n for n in names if cluster.stats(n)["vision_held_requests"])
        cluster.processes.procs[holder].kill()
        cluster.processes.procs[holder].wait(10)
    finally:
        prefill.send_signal(signal.SIGCONT)
    thread.join(60)
    assert "error" not in result, result.get("error")
    from deepinfer.engine import LLM, SamplingParams

    expected = LLM(model=cluster.checkpoint, num_blocks=256, max_num_seqs=8).generate(
        [{"prompt_token_ids": [5, PLACEHOLDER, 6], "multi_modal_data": {"image": [image]}}],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert result["out"]["token_ids"] == expected.outputs[0].token_ids
    survivor = next(n for n in names if n != holder)
    assert cluster.stats(survivor)["vision_images_encoded_total"] >= 1


def test_vision_instance_lost_before_the_decode_read_is_encoded_again(cluster):
    """As above, but the vision instance dies before the decode reservation READs the embeddings."""
    import signal
    import threading

    live = [n for n in cluster.processes.procs if n.startswith("vision-")
            and cluster.processes.procs[n].poll() is None]
    cluster.start_vision("vision-3")
    names = [*live, "vision-3"]
    decode = cluster.processes.procs["decode"]
    image = png((200, 200, 30))
    result: dict = {}

    def run():
        try:
            result["out"] = cluster.client.generate([7, PLACEHOLDER, 8], images=[image], temperature=0.0,
                                                    max_tokens=3, ignore_eos=True)
        except Exception as e:  # reported below
            result["error"] = e

    decode.send_signal(signal.SIGSTOP)  # Reserve waits; heartbeats pause (< the 2 s timeout)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        holder = _wait_for("the images encoded and held", lambda: next(
            (n for n in names if cluster.stats(n)["vision_held_requests"]), None), timeout_s=1.5)
        cluster.processes.procs[holder].kill()
        cluster.processes.procs[holder].wait(10)
    finally:
        decode.send_signal(signal.SIGCONT)
    thread.join(60)
    assert "error" not in result, result.get("error")
    from deepinfer.engine import LLM, SamplingParams

    expected = LLM(model=cluster.checkpoint, num_blocks=256, max_num_seqs=8).generate(
        [{"prompt_token_ids": [7, PLACEHOLDER, 8], "multi_modal_data": {"image": [image]}}],
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert result["out"]["token_ids"] == expected.outputs[0].token_ids
