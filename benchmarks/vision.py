"""The vision stage: encode throughput per instance, image vs text TTFT, and vision 1 -> 2 scaling.

    python -m deepinfer.benchmarks.vision [--model CKPT] [--images 24] [--requests 12] [--concurrency 8]
        [--threads 1] [--json OUT]

Every process is real (`deploy.processes.ServiceProcesses`, loopback, NIXL over UCX): three balancers,
vision instance(s), one prefill and one decode instance and the entrypoint; the model is `--model`
or a random-weight `tiny` checkpoint with the demo model's vision tower (`make_checkpoint(vision=True)`:
a 2-layer, 64-wide SigLIP ViT at 546 px -> 184 image tokens per small image). Images are distinct
random-colour 64x64 PNGs (so nothing hits the embedding cache unless said), sent as data: URLs.

1. `encode`: `Vision.Encode` on one instance directly (no other stage): batch 1 = one image per call,
   calls one after another; batch 8 = 8 concurrent one-image calls, which the instance's loop encodes
   together (`max_batch_images` 8). Images/s = images / wall time; also the mean encoder batch seen.
2. `ttft`: through the entrypoint, one request at a time, `max_tokens=1`: the same prompt with one
   image (its placeholder -> 184 image tokens) vs with the placeholder replaced by 184 text tokens
   (the same prompt length) vs the short text alone (the prompt without the image).
3. `scaling`: `--requests` image requests (distinct images, `max_tokens=1`) at `--concurrency`
   through the entrypoint with 1, then 2 vision instances: requests/s and mean latency.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client
from deepinfer.protos import common_pb2, vision_pb2, vision_pb2_grpc
from deepinfer.protos.metadata import STATS_METADATA_KEY
from deepinfer.serving.auth import secure_channel

PLACEHOLDER = 129279


def _png(seed: int) -> bytes:
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", (64, 64), tuple(rng.randrange(256) for _ in range(3)))
    ImageDraw.Draw(im).ellipse((8, 8, 56, 56), fill=tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(seed)).decode()


class Bench:
    """The processes of one run and helpers to reach them."""

    def __init__(self, model: str, logdir: Path, threads: int) -> None:
        self.model = model
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        self.procs = ServiceProcesses(logdir, env)
        self.info = self.procs.info
        self._seed = 1000

    def start(self) -> None:
        for stage, policy in (("vision", "image_affinity"), ("prefill", "prefix_aware"), ("decode", "kv_load")):
            self.procs.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy])
        self.procs.wait_ready()
        common = ["--model", self.model, "--loopback-ucx"]
        for stage in ("prefill", "decode"):
            extra = ["--embedding-rows", "16384"] if stage == "prefill" else []
            self.procs.spawn(stage, [f"{stage}_worker", "--lb-address", self.info[f"{stage}_lb"]["address"],
                                     "--instance-id", f"{stage}-0", "--max-num-seqs", "16", "--num-blocks", "1024",
                                     *common, *extra])
        self.add_vision("vision-0")
        self.procs.spawn("entrypoint", ["entrypoint", "--model", self.model,
                                        "--prefill-lb-address", self.info["prefill_lb"]["address"],
                                        "--decode-lb-address", self.info["decode_lb"]["address"],
                                        "--vision-lb-address", self.info["vision_lb"]["address"]])
        self.procs.wait_ready()
        self.client = Client(self.info["entrypoint"]["address"], timeout_s=600)

    def add_vision(self, name: str) -> None:
        self.procs.spawn(name, ["vision_worker", "--model", self.model, "--lb-address", self.info["vision_lb"]["address"],
                                "--instance-id", name, "--loopback-ucx", "--embedding-rows", "32768",
                                "--max-batch-images", "8"])
        self.procs.wait_ready()

    def next_seed(self) -> int:
        self._seed += 1
        return self._seed

    def vision_stats(self, name: str) -> dict:
        with secure_channel(self.info[name]["address"]) as channel:
            _, call = vision_pb2_grpc.VisionStub(channel).Health.with_call(common_pb2.HealthRequest(), timeout=30)
        return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])

    def stop(self) -> None:
        if hasattr(self, "client"):
            self.client.close()
        self.procs.stop()


def bench_encode(b: Bench, num_images: int) -> dict:
    out = {}
    with secure_channel(b.info["vision-0"]["address"]) as channel:
        stub = vision_pb2_grpc.VisionStub(channel)

        def encode(i: int) -> None:
            rid = f"enc-{b.next_seed()}-{i}"
            req = vision_pb2.EncodeRequest(request_id=rid)
            req.images.add(descriptor=_url(b.next_seed()).encode(), num_tokens=1)
            reply = stub.Encode(req, timeout=600)
            assert not reply.error.code, reply.error.message
            stub.Release(vision_pb2.ReleaseRequest(request_id=rid), timeout=60)

        encode(-1)  # warm-up
        for batch in (1, 8):
            s0 = b.vision_stats("vision-0")
            t0 = time.perf_counter()
            with ThreadPoolExecutor(batch) as pool:
                list(pool.map(encode, range(num_images)))
            wall = time.perf_counter() - t0
            s1 = b.vision_stats("vision-0")
            encoded = s1["vision_images_encoded_total"] - s0["vision_images_encoded_total"]
            batches = s1["vision_encode_batches_total"] - s0["vision_encode_batches_total"]
            enc_s = s1["vision_encode_seconds_sum"] - s0["vision_encode_seconds_sum"]
            out[f"batch{batch}"] = {"images": num_images, "wall_s": round(wall, 3),
                                    "images_per_s": round(num_images / wall, 2),
                                    "mean_encoder_batch": round(encoded / max(1, batches), 2),
                                    "encoder_images_per_s": round(encoded / enc_s, 2) if enc_s else None}
            print(f"encode batch {batch}: {out[f'batch{batch}']}", flush=True)
    return out


def _ttft(client: Client, ids: list[int], images=None) -> float:
    t0 = time.perf_counter()
    for _ in client.stream(ids, images=images, temperature=0.0, max_tokens=1, ignore_eos=True):
        return time.perf_counter() - t0
    raise RuntimeError("no token")


def bench_ttft(b: Bench, repeats: int) -> dict:
    rng = random.Random(0)
    results: dict[str, list[float]] = {"image": [], "text_same_length": [], "text_without_image": []}
    for r in range(repeats + 1):
        text = [rng.randrange(1000, 100000) for _ in range(24)]
        with_image = text[:12] + [PLACEHOLDER] + text[12:]
        same_len = text[:12] + [rng.randrange(1000, 100000) for _ in range(184)] + text[12:]
        t_img = _ttft(b.client, with_image, [_url(b.next_seed())])
        t_same = _ttft(b.client, same_len)
        t_text = _ttft(b.client, text)
        if r:  # the first round warms every path up
            results["image"].append(t_img)
            results["text_same_length"].append(t_same)
            results["text_without_image"].append(t_text)
    out = {k: round(statistics.median(v) * 1000, 1) for k, v in results.items()}
    print(f"TTFT median ms: {out}", flush=True)
    return {"median_ms": out, "repeats": repeats}


def bench_scaling(b: Bench, num_requests: int, concurrency: int) -> dict:
    def one(_: int) -> float:
        t0 = time.perf_counter()
        b.client.generate([5, PLACEHOLDER, 6, 7], images=[_url(b.next_seed())], temperature=0.0, max_tokens=1,
                          ignore_eos=True)
        return time.perf_counter() - t0

    def encoded() -> dict[str, int]:
        return {name: b.vision_stats(name)["vision_images_encoded_total"] for name in b.info
                if name.startswith("vision-")}

    out = {}
    for n in (1, 2):
        if n == 2:
            b.add_vision("vision-1")
            time.sleep(1.5)  # a heartbeat or two: the balancer knows both
        one(0)
        before = encoded()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            lat = list(pool.map(one, range(num_requests)))
        wall = time.perf_counter() - t0
        per = {name: count - before.get(name, 0) for name, count in encoded().items()}
        out[f"vision{n}"] = {"requests": num_requests, "concurrency": concurrency, "wall_s": round(wall, 2),
                             "requests_per_s": round(num_requests / wall, 2),
                             "mean_latency_s": round(statistics.mean(lat), 2), "images_encoded_by": per}
        print(f"scaling vision={n}: {out[f'vision{n}']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint with a vision tower (default: random tiny + vision)")
    parser.add_argument("--images", type=int, default=24, help="images per encode measurement")
    parser.add_argument("--ttft-repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16, help="image requests per scaling point")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    model = args.model
    if model is None:
        from deepinfer.engine.testing.make_checkpoint import make_checkpoint

        model = str(make_checkpoint(tmp / "ckpt", preset="tiny", seed=0, vision=True))
    b = Bench(model, tmp / "logs", args.threads)
    result = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads},
              "date": time.strftime("%Y-%m-%d"), "model": "tiny+vision (random)" if args.model is None else model}
    try:
        b.start()
        result["encode"] = bench_encode(b, args.images)
        result["ttft"] = bench_ttft(b, args.ttft_repeats)
        result["scaling"] = bench_scaling(b, args.requests, args.concurrency)
    finally:
        b.stop()
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
