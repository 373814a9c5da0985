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

from tests.e2e.test_vision import _wait_for, generate_as_offline, image_cases, png, vision_cluster

pytest.importorskip("nixl")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny-v41-vision"), format="published-v41", seed=13,
                               vision=True))
    yield from vision_cluster(tmp_path_factory, ckpt, "30", "64")


RED, BLUE = png((255, 0, 0)), png((0, 0, 255), "triangle", size=(90, 120))


def test_v41_image_outputs_equal_offline_engine(cluster):
    v0, p0, d0 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    outs, offline = generate_as_offline(cluster, image_cases(RED, BLUE), 6, 64)
    for out, expected in zip(outs, offline):
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    v1, p1, d1 = cluster.stats("vision-0"), cluster.stats("prefill"), cluster.stats("decode")
    assert v1["vision_images_encoded_total"] - v0["vision_images_encoded_total"] == 2  # two distinct images
    hidden = json.loads(open(os.path.join(cluster.checkpoint, "config.json")).read())["text_config"]["hidden_size"]
    spans = outs[0]["usage"]["prompt_tokens"] - 4 + outs[1]["usage"]["prompt_tokens"] - 4 + \
        outs[2]["usage"]["prompt_tokens"] - 4  # image positions of the three image requests
    assert p1["embeddings_read_bytes_total"] - p0["embeddings_read_bytes_total"] == spans * 4 * hidden
    assert d1["embeddings_read_bytes_total"] - d0["embeddings_read_bytes_total"] == spans * 4 * hidden
    _wait_for("holds released", lambda: cluster.stats("vision-0")["vision_held_requests"] == 0)
