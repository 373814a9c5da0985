"""Image prompts in the engine and the offline LLM (engine/multimodal.py): placeholder expansion,
embeddings under chunked prefill, prefix caching keyed by image content, precomputed embeddings
(the prefill worker's path) and typed errors, on a random-weight tiny checkpoint with a vision tower."""

from __future__ import annotations

import io

import pytest
import torch

from deepinfer.engine import LLM, InvalidRequestError, SamplingParams
from deepinfer.engine.models.vision import preprocess_pixels
from deepinfer.engine.multimodal import IMAGE_PLACEHOLDER_ID, ImageSpan, expand_image_placeholders, image_content_hash
from deepinfer.engine.testing.make_checkpoint import make_checkpoint

recipe = pytest.importorskip("deepseek_recipe")
Image = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny-vision"), preset="tiny", seed=5, vision=True))


@pytest.fixture(scope="module")
def llm(vision_ckpt):
    return LLM(vision_ckpt, max_num_seqs=4, max_num_batched_tokens=1024)


def _png(seed: int, size=(60, 40)) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, "PNG")
    return buf.getvalue()


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(1000, 100000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prompt(images: list, head: int = 20, mid: int = 9, tail: int = 5) -> dict:
    ids = _text(head, 1) + [IMAGE_PLACEHOLDER_ID] + _text(mid, 2)
    if len(images) > 1:
        ids += [IMAGE_PLACEHOLDER_ID] + _text(tail, 3)
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_expand_image_placeholders():
    a = recipe.ImageInfo(b"a", 546, 546)
    b = recipe.ImageInfo(b"b", 672, 448)
    ids, spans = expand_image_placeholders([5, IMAGE_PLACEHOLDER_ID, 6, 7, IMAGE_PLACEHOLDER_ID], [a, b])
    assert [(s.offset, s.num_tokens) for s in spans] == [(1, 184), (187, 189)]
    assert ids == [5] + [129264] * 184 + [6, 7] + [129264] * 189
    assert spans[0].content_hash == image_content_hash(b"a") and spans[1].image is b and spans[0].embeds is None
    with pytest.raises(InvalidRequestError, match="2 image placeholder"):
        expand_image_placeholders([IMAGE_PLACEHOLDER_ID, IMAGE_PLACEHOLDER_ID], [a])


def test_chunked_prefill_gives_identical_greedy_output(vision_ckpt, llm):
    prompts = [_prompt([_png(1), _png(2)]), _prompt([_png(3)], head=3)]
    whole = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    chunked = LLM(vision_ckpt, max_num_seqs=4, max_num_batched_tokens=37, enable_prefix_caching=False)
    assert _tokens(chunked.generate(prompts, GREEDY, use_tqdm=False)) == whole
    # the same prompt alone, with its images as PIL images and as recipe ImageInfos, is the same again
    pil = [Image.open(io.BytesIO(_png(1))), Image.open(io.BytesIO(_png(2)))]
    assert _tokens(chunked.generate(_prompt(pil), GREEDY, use_tqdm=False)) == whole[:1]
    pre = recipe.OpenCvImagePreprocessor()
    infos = [pre.preprocess(_png(s), recipe.PreprocessOptions("high", 2048, 512)) for s in (1, 2)]
    assert _tokens(llm.generate(_prompt(infos), GREEDY, use_tqdm=False)) == whole[:1]


def test_images_change_the_prompt_logprobs(llm):
    """The image rows really replace the inputs (and the scratch prompt-logprob pass uses them too)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    a, b = llm.generate([_prompt([_png(1)]), _prompt([_png(2)])], params, use_tqdm=False)
    n_head = 20
    assert a.prompt_logprobs[1:n_head + 1] == b.prompt_logprobs[1:n_head + 1]  # before the image: unchanged
    assert a.prompt_logprobs[-1] != b.prompt_logprobs[-1]


def test_prefix_cache_keys_blocks_by_image_content(vision_ckpt):
    llm = LLM(vision_ckpt, max_num_seqs=4, max_num_batched_tokens=1024)
    block = llm.engine.kv_manager.block_size
    head = block + 6  # the image starts inside the second block
    first = llm.generate(_prompt([_png(1)], head=head, mid=30), GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    same = llm.generate(_prompt([_png(1)], head=head, mid=30), GREEDY, use_tqdm=False)[0]
    image_end = head + 184
    assert same.num_cached_tokens >= image_end  # every block over the image is reused
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate(_prompt([_png(2)], head=head, mid=30), GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == block  # only the block before the image
    fresh = LLM(vision_ckpt, max_num_seqs=4, max_num_batched_tokens=1024, enable_prefix_caching=False)
    want = fresh.generate(_prompt([_png(2)], head=head, mid=30), GREEDY, use_tqdm=False)[0]
    assert other.outputs[0].token_ids == want.outputs[0].token_ids


def test_precomputed_embeddings_equal_engine_encoding(llm):
    """The prefill worker's path: spans carrying embeddings computed elsewhere, no image bytes."""
    want = _tokens(llm.generate(_prompt([_png(4), _png(5)]), GREEDY, use_tqdm=False))
    prompt, spans = llm._with_images(_prompt([_png(4), _png(5)]))
    encoded = llm.engine.vision.encode([preprocess_pixels(s.image) for s in spans])
    given = [ImageSpan(s.offset, s.num_tokens, s.content_hash, embeds=e.clone()) for s, e in zip(spans, encoded)]
    engine = llm.engine
    rid = engine.add_request(None, prompt, GREEDY, images=given)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs[rid].outputs[0].token_ids == want[0]


def test_typed_errors(vision_ckpt, llm, tmp_path_factory):
    engine = llm.engine
    two_placeholders = _prompt([_png(1), _png(2)])
    two_placeholders["multi_modal_data"] = {"image": [_png(1)]}
    with pytest.raises(InvalidRequestError, match="2 image placeholder") as e:
        llm.generate(two_placeholders, GREEDY, use_tqdm=False)
    assert e.value.field == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="cannot be used") as e:
        llm.generate([_prompt([_png(1)]), _prompt([b"not an image"])], GREEDY, use_tqdm=False)
    assert e.value.field == "multi_modal_data"
    assert engine.num_unfinished_requests == 0  # nothing of the batch was queued
    prompt, spans = llm._with_images(_prompt([_png(1)]))
    bad = ImageSpan(spans[0].offset, spans[0].num_tokens, "h", embeds=torch.zeros(3, 64))
    with pytest.raises(InvalidRequestError, match="embeds has shape"):
        engine.add_request(None, prompt, GREEDY, images=[bad])
    shifted = ImageSpan(spans[0].offset - 1, spans[0].num_tokens, "h", image=spans[0].image)
    with pytest.raises(InvalidRequestError, match="do not all hold the image token"):
        engine.add_request(None, prompt, GREEDY, images=[shifted])
    broken = ImageSpan(spans[0].offset, spans[0].num_tokens, "h", image=recipe.ImageInfo(b"xx", spans[0].image.width, spans[0].image.height))
    with pytest.raises(InvalidRequestError, match="cannot be decoded"):
        engine.add_request(None, prompt, GREEDY, images=[broken])
    assert engine.num_unfinished_requests == 0

    text_only = LLM(str(make_checkpoint(tmp_path_factory.mktemp("tiny-text"), preset="tiny", seed=1)))
    with pytest.raises(InvalidRequestError, match="no vision tower") as e:
        text_only.generate({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [_png(1)]}}, GREEDY)
    assert e.value.field == "multi_modal_data"
    with pytest.raises(InvalidRequestError, match="no vision tower") as e:
        text_only.engine.add_request(None, [5, 6], GREEDY, images=[ImageSpan(0, 1, "h", embeds=torch.zeros(1, 64))])
    assert e.value.field == "images"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_and_async_scheduling_keep_image_outputs(vision_ckpt, llm, async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [_prompt([_png(6)]), _prompt([_png(7)]), _prompt([_png(6)], head=4)]
    want = _tokens(llm.generate(prompts, params, use_tqdm=False))
    tight = LLM(vision_ckpt, max_num_seqs=4, num_blocks=30, block_size=16, max_model_len=300,
                async_scheduling=async_scheduling)
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == want
    assert tight.engine.scheduler.num_preemptions > 0
