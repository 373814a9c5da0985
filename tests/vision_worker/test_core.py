"""The vision core in-process: images resolved through recipe, encoded by a random-weight tower, kept in
NIXL-registered rows; repeated images are encoded once (counter), unreferenced entries are evicted
LRU-first, holds end on release or lease; bad images are refused with clear messages."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from deepinfer.engine.images import (
    ImageLimits,
    ImageResolver,
    ImageUrlPolicy,
    InvalidImageError,
    image_descriptor,
    image_source,
)
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV

pytest.importorskip("nixl")
PIL = pytest.importorskip("PIL")


def png(color=(255, 0, 0), size=(64, 64), shape="circle") -> bytes:
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


@pytest.fixture(scope="module")
def tower(tmp_path_factory):
    from deepinfer.engine.loader import load_vision_tower
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("vis"), preset="tiny", seed=3, vision=True)
    return load_vision_tower(str(ckpt))


@pytest.fixture
def core_factory(tower):
    from deepinfer.kv_transfer.embeddings import EmbeddingAgent
    from deepinfer.vision_worker.core import VisionCore, tower_encoder

    made = []

    def make(num_rows=2048, clock=None):
        agent = EmbeddingAgent(f"vis-core-{len(made)}", num_rows, tower.lm_hidden_size, ucx_env=LOOPBACK_UCX_ENV)
        core = VisionCore(tower_encoder(tower), agent, max_batch_images=8, **({"clock": clock} if clock else {}))
        made.append(agent)
        return core

    yield make
    for agent in made:
        agent.close()


def resolve(*pngs):
    resolver = ImageResolver(ImageUrlPolicy([]))
    return resolver.resolve([image_source(image_descriptor(__import__("deepseek_recipe").DataUrlImageSource(
        data_url(p)))) for p in pngs])


def test_encodes_batch_across_requests_once_per_image(core_factory, tower):
    from deepinfer.engine.models.vision import preprocess_pixels

    core = core_factory()
    red, blue = resolve(png((255, 0, 0)), png((0, 0, 255), shape="triangle"))
    assert red.num_tokens == 184 and red.content_hash != blue.content_hash
    core.submit("r1", [red, blue], lease_s=30)
    core.submit("r2", [red], lease_s=30)
    assert core.num_pending_images == 2 and core.num_pending_image_tokens == 368
    done = {d.request_id: d for d in core.step()}
    assert set(done) == {"r1", "r2"}
    stats = core.stats()
    assert stats["vision_images_encoded_total"] == 2 and stats["vision_cache_hits_total"] == 1
    assert stats["vision_encode_batches_total"] == 1
    expected = tower.encode([preprocess_pixels(red.info, tower.config)])[0]
    src = done["r2"].sources[0]
    start = (src.addr - core.agent.buffer.data_ptr()) // (src.num_bytes // src.num_rows)
    torch.testing.assert_close(core.agent.rows(start, src.num_rows), expected)
    assert done["r1"].is_cached == [False, False] and done["r2"].is_cached == [True]
    # a later request with the same image: a cache hit, nothing encoded
    core.submit("r3", [red], lease_s=30)
    assert [d.request_id for d in core.step()] == ["r3"]
    assert core.stats()["vision_images_encoded_total"] == 2 and core.stats()["vision_cache_hits_total"] == 2
    assert core.release("r1") and core.release("r2") and core.release("r3") and not core.release("r3")
    assert core.stats()["vision_held_requests"] == 0 and len(core.cached_hashes()) == 2


def test_lru_eviction_spares_held_entries_and_leases_end(core_factory):
    now = [0.0]
    core = core_factory(num_rows=400, clock=lambda: now[0])  # room for two 184-token images
    a, b, c = resolve(png((255, 0, 0)), png((0, 255, 0)), png((0, 0, 255)))
    core.submit("ra", [a], lease_s=5)
    core.submit("rb", [b], lease_s=5)
    assert len(core.step()) == 2
    core.release("rb")  # b is unreferenced now; a is still held
    core.submit("rc", [c], lease_s=5)
    assert [d.request_id for d in core.step()] == ["rc"]
    assert set(core.cached_hashes()) == {a.content_hash, c.content_hash}
    assert core.stats()["vision_cache_evictions_total"] == 1
    core.submit("rb2", [b], lease_s=5)  # both entries held: b waits
    assert core.step() == [] and core.num_pending_images == 1
    now[0] = 6.0  # the holds of ra and rc end
    core.step()
    assert [d.request_id for d in core.step()] == ["rb2"]


BAD = {
    "corrupt": (b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, "invalid_image"),
    "non-image": (b"%PDF-1.4 not an image at all", "invalid_image"),
}


def test_bad_images_are_refused_with_clear_messages():
    import deepseek_recipe as recipe

    resolver = ImageResolver(ImageUrlPolicy(["images.example.com"]),
                             ImageLimits(max_images=2, max_image_bytes=50_000, max_image_pixels=1_000_000))
    for name, (data, code) in BAD.items():
        with pytest.raises(InvalidImageError) as e:
            resolver.resolve([recipe.DataUrlImageSource(data_url(data))])
        assert e.value.code == code and "image 0" in str(e.value), name
    big = png(size=(600, 600))
    with pytest.raises(InvalidImageError, match="bytes; at most 50000"):
        resolver.resolve([recipe.BytesImageSource(big + b"\x00" * 60_000)])
    with pytest.raises(InvalidImageError, match="pixels; at most 1000000"):
        resolver.resolve([recipe.BytesImageSource(png(size=(1200, 1000)))])
    with pytest.raises(InvalidImageError, match="3 images; at most 2"):
        resolver.resolve([recipe.BytesImageSource(png())] * 3)
    with pytest.raises(InvalidImageError, match="not allowed") as e:
        resolver.resolve([recipe.UrlImageSource("http://10.0.0.1/a.png")])
    assert e.value.code == "image_url_not_allowed" and e.value.status == 400
    with pytest.raises(InvalidImageError, match="not allowed"):
        resolver.resolve([recipe.UrlImageSource("ftp://images.example.com/a.png")])


def test_requests_pinning_the_buffer_among_themselves_fail_instead_of_waiting_forever(core_factory):
    core = core_factory(num_rows=400)  # two 184-token images fit
    x, z, y, w = resolve(png((255, 0, 0)), png((0, 255, 0)), png((0, 0, 255)), png((9, 9, 9)))
    core.submit("warm", [x, z], lease_s=5)
    assert len(core.step()) == 1
    core.release("warm")  # x and z stay cached
    core.submit("r1", [x, y], lease_s=5)  # each pins one cached entry and needs room for another
    core.submit("r2", [z, w], lease_s=5)
    done = core.step()
    assert [(d.request_id, bool(d.error)) for d in done] == [("r1", True)] and "retry" in done[0].error
    assert [d.request_id for d in core.step()] == ["r2"]  # x was unpinned, evicted, w encoded
