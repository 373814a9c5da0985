"""DeepSeek-V4.1 image prompts through the cluster (vision -> prefill -> decode) on loopback: three balancers,
one vision, one prefill and one decode instance (embeddings and KV over NIXL) and the entrypoint, each started as
`python -m ...`, on the published-layout tiny V4.1 checkpoint with a vision tower
(`make_checkpoint --format published-v41 --vision`).

The vision stage serves V4.1's own tower (`engine.models.vision_v41`: recipe's preprocessed image -> its resize plan
and patches -> ViT -> aligner -> the span with its start / newline / end rows); the prefill and decode instances
read the spans and run V4.1's paged step with them (image rows as input, `bias_vl` routing, no Engram n-grams).
Outputs equal the offline engine's token for token. Fixtures and helpers are test_vision.py's (V4's cluster test).
"""

from __future__ import annotations

import json
import os

import pytest

from deepinfer.deploy.processes import ServiceProcesses
from tests.e2e.test_vision import PLACEHOLDER, STARTUP_TIMEOUT_S, VisionCluster, _wait_for, data_url, png

pytest.importorskip("nixl")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny-v41-vision"), format="published-v41", seed=13,
                               vision=True))
    processes = ServiceProcesses(tmp_path_factory.mktemp("logs"),
                                 {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    cluster = None
    try:
        for stage, policy in (("vision", "image_affinity"), ("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy,
                                            "--heartbeat-timeout-s", "30"])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        worker_args = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", "8", "--num-blocks", "64"]
        for stage in ("prefill", "decode"):
            processes.spawn(stage, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                    "--instance-id", f"{stage}-0", *worker_args])
        processes.spawn("entrypoint", [
            "entrypoint", "--model", ckpt, "--prefill-lb-address", info["prefill_lb"]["address"],
            "--decode-lb-address", info["decode_lb"]["address"], "--vision-lb-address", info["vision_lb"]["address"]])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        cluster = VisionCluster(ckpt, processes)
        cluster.start_vision("vision-0")
        yield cluster
    finally:
        if cluster is not None:
            cluster.close()
        processes.stop(10.0)


RED, BLUE = png((255, 0, 0)), png((0, 0, 255), "triangle", size=(90, 120))


def test_v41_image_outputs_equal_offline_engine(cluster):
    from deepinfer.engine import LLM, SamplingParams

    cases = [
        ([5, 6, PLACEHOLDER, 7, 8], [RED]),
        ([9, PLACEHOLDER, 10, 11, PLACEHOLDER, 12], [BLUE, RED]),
        ([9, PLACEHOLDER, 10, 11, PLACEHOLDER, 12], [RED, BLUE]),
        ([13, 14, 15], []),
    ]
    v0, p0, d0 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    outs = [cluster.client.generate(ids, images=[data_url(i) for i in imgs] or None, temperature=0.0,
                                    max_tokens=6, ignore_eos=True) for ids, imgs in cases]
    llm = LLM(model=cluster.checkpoint, num_blocks=64, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for (ids, imgs), out in zip(cases, outs):
        prompt = {"prompt_token_ids": ids, **({"multi_modal_data": {"image": imgs}} if imgs else {})}
        expected = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out["token_ids"] == expected.outputs[0].token_ids, (ids, len(imgs))
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert outs[1]["token_ids"] != outs[2]["token_ids"]  # same ids, images swapped: the embeddings matter
    v1, p1, d1 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    assert v1["vision_images_encoded_total"] - v0["vision_images_encoded_total"] == 2  # two distinct images
    hidden = json.loads(open(os.path.join(cluster.checkpoint, "config.json")).read())["text_config"]["hidden_size"]
    spans = outs[0]["usage"]["prompt_tokens"] - 4 + outs[1]["usage"]["prompt_tokens"] - 4 + \
        outs[2]["usage"]["prompt_tokens"] - 4  # image positions of the three image requests
    assert p1["embeddings_read_bytes_total"] - p0["embeddings_read_bytes_total"] == spans * 4 * hidden
    assert d1["embeddings_read_bytes_total"] - d0["embeddings_read_bytes_total"] == spans * 4 * hidden
    _wait_for("holds released", lambda: cluster.stats("vision-0")["vision_held_requests"] == 0)
