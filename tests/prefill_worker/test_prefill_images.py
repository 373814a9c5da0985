"""The prefill core with images, in-process: embeddings READ over NIXL from a vision core's rows into the
prefill's own rows, then P/D as for text; outputs equal the offline engine's. A READ that fails
reports the images lost (retryable), and a full embedding buffer refuses before anything starts."""

from __future__ import annotations

import dataclasses
import io
import time

import pytest

from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID, IMAGE_TOKEN_ID, ImageResolver, ImageUrlPolicy
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from deepinfer.kv_transfer.embeddings import EmbeddingAgent
from deepinfer.prefill_worker.core import ImageInput, KVDestination, NoRoomForEmbeddings, PrefillCore, PrefillWork

pytest.importorskip("nixl")
pytest.importorskip("PIL")


def _png(color) -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(im).rectangle((10, 10, 50, 50), fill=color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import deepseek_recipe as recipe

    from deepinfer.engine.loader import load_vision_tower
    from deepinfer.vision_worker.core import VisionCore, tower_encoder

    path = str(make_checkpoint(tmp_path_factory.mktemp("tiny-vis"), preset="tiny", seed=9, vision=True))
    p_eng = Engine(EngineConfig(model=path, max_num_seqs=8))
    d_eng = Engine(EngineConfig(model=path, max_num_seqs=8))
    hidden = p_eng.model_config.hidden_size
    p_agent = KVTransferAgent("pi-prefill", p_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    d_agent = KVTransferAgent("pi-decode", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    p_agent.add_peer("pi-decode", d_agent.metadata(), d_agent.pool_layout())
    holder = EmbeddingAgent("pi-vision", 1024, hidden, ucx_env=LOOPBACK_UCX_ENV)
    reader = EmbeddingAgent("pi-prefill-emb", 400, hidden, ucx_env=LOOPBACK_UCX_ENV)
    vision = VisionCore(tower_encoder(load_vision_tower(path)), holder)
    images = ImageResolver(ImageUrlPolicy([])).resolve([recipe.BytesImageSource(_png((200, 0, 0))),
                                                       recipe.BytesImageSource(_png((0, 0, 200)))])
    yield path, PrefillCore(p_eng, p_agent, reader), DecodeCore(d_eng, d_agent, "pi-decode"), vision, images
    for agent in (p_agent, d_agent, holder, reader):
        agent.close()


def _encode(vision, rid, images):
    vision.submit(rid, images, lease_s=60)
    while True:
        for done in vision.step():
            if done.request_id == rid:
                return done.sources


def _run(prefill, decode, vision, rid, prompt, params, inputs):
    res = decode.reserve(rid, prompt, params, lease_s=60.0)
    dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0, state_slot=res.state_slot)
    prefill.submit(PrefillWork(rid, prompt, params, dest, inputs))
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline
        vision.step()  # the holder polls (UCX wire-up, READ notifications)
        for done in prefill.step():
            if done.error:
                decode.abort(rid)
                return done
        for ev in decode.step():
            if isinstance(ev, DecodeFailed):
                raise AssertionError(ev.error)
            if ev.finished:
                return ev


def test_prefill_reads_embeddings_and_equals_offline(stack):
    path, prefill, decode, vision, (red, blue) = stack
    sources = _encode(vision, "p1", [blue, red])  # the request id of every stage
    prompt = [5, 6] + [IMAGE_TOKEN_ID] * blue.num_tokens + [7] + [IMAGE_TOKEN_ID] * red.num_tokens + [8]
    inputs = [ImageInput(2, blue.num_tokens, blue.content_hash, sources[0]),
              ImageInput(3 + blue.num_tokens, red.num_tokens, red.content_hash, sources[1])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    served0 = vision.agent.stats()["embeddings_served_bytes_total"]
    out = _run(prefill, decode, vision, "p1", prompt, params, inputs)
    ref = LLM(path).generate([{"prompt_token_ids": [5, 6, IMAGE_PLACEHOLDER_ID, 7, IMAGE_PLACEHOLDER_ID, 8],
                               "multi_modal_data": {"image": [blue.info, red.info]}}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    read = prefill.emb_agent.stats()
    assert read["embeddings_read_bytes_total"] == sum(s.num_bytes for s in sources)
    assert read["embeddings_rows_free"] == read["embeddings_rows_total"]  # rows freed once copied out
    _wait(lambda: vision.step() is not None and vision.agent.stats()["embeddings_served_bytes_total"]
          == served0 + sum(s.num_bytes for s in sources))
    vision.release("p1")


def _wait(fn, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_failed_read_reports_lost_images_and_full_buffer_refuses(stack):
    _, prefill, decode, vision, (red, _) = stack
    (src,) = _encode(vision, "v2", [red])
    vision.release("v2")
    bogus = dataclasses.replace(src, addr=src.addr + (1 << 40))  # not registered at the holder
    prompt = [5] + [IMAGE_TOKEN_ID] * red.num_tokens + [6]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    done = _run(prefill, decode, vision, "p2", prompt, params, [ImageInput(1, red.num_tokens, red.content_hash, bogus)])
    assert done.is_images_lost and "failed" in done.error
    assert prefill.emb_agent.allocator.num_free_rows == 400 and prefill.num_reading == 0
    three = [ImageInput(1 + i * red.num_tokens, red.num_tokens, red.content_hash, src) for i in range(3)]
    res = decode.reserve("p3", [5] + [IMAGE_TOKEN_ID] * 3 * red.num_tokens + [6], params, lease_s=5.0)
    dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 3.0, state_slot=res.state_slot)
    with pytest.raises(NoRoomForEmbeddings, match="more --embedding-rows"):  # 3 x 184 rows > 400
        prefill.submit(PrefillWork("p3", [5] + [IMAGE_TOKEN_ID] * 3 * red.num_tokens + [6], params, dest, three))
    decode.abort("p3")
    # the READs already posted finish (the holder polls, as its loop does), then their rows are freed
    _wait(lambda: not vision.step() and not prefill.step() and prefill.num_reading == 0)
    assert prefill.emb_agent.allocator.num_free_rows == 400



def test_replay_decode_with_image_spans_equals_offline(stack):
    """A decode instance that rebuilds the bounded state by replay recomputes image positions from the
    spans it was given at Reserve (the image sits in the replayed tail of the prompt)."""
    from deepinfer.engine.multimodal import ImageSpan

    path, prefill, _, vision, (red, _) = stack
    d_eng = Engine(EngineConfig(model=path, max_num_seqs=8))
    d_agent = KVTransferAgent("pi-decode-replay", d_eng.cache, ucx_env=LOOPBACK_UCX_ENV, send_state=False)
    prefill.agent.add_peer("pi-decode-replay", d_agent.metadata(), d_agent.pool_layout())
    try:
        decode = DecodeCore(d_eng, d_agent, "pi-decode-replay")
        (src,) = _encode(vision, "p4", [red])
        start = (src.addr - vision.agent.buffer.data_ptr()) // (src.num_bytes // src.num_rows)
        embeds = vision.agent.rows(start, src.num_rows).clone()
        prompt = [5, 6, 7] + [IMAGE_TOKEN_ID] * red.num_tokens + [8, 9]
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        res = decode.reserve("p4", prompt, params, lease_s=60.0,
                             images=[ImageSpan(3, red.num_tokens, red.content_hash, embeds=embeds)])
        assert res.state_slot is None  # replay mode
        dest = KVDestination(res.peer, res.block_ids, res.transfer_id, 30.0)
        prefill.submit(PrefillWork("p4", prompt, params, dest,
                                   [ImageInput(3, red.num_tokens, red.content_hash, src)]))
        out = None
        deadline = time.monotonic() + 60
        while out is None:
            assert time.monotonic() < deadline
            vision.step()
            for done in prefill.step():
                assert not done.error, done.error
            for ev in decode.step():
                assert not isinstance(ev, DecodeFailed), ev
                if ev.finished:
                    out = ev
        ref = LLM(path).generate([{"prompt_token_ids": [5, 6, 7, IMAGE_PLACEHOLDER_ID, 8, 9],
                                   "multi_modal_data": {"image": [red.info]}}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        vision.release("p4")
    finally:
        prefill.agent.remove_peer("pi-decode-replay")
        d_agent.close()
