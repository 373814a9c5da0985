"""Images through the HTTP API with the official openai SDK.

On a random-weight vision checkpoint (its own live cluster: three balancers, vision, prefill, decode,
entrypoint, HTTP front): an image prompt is answered, its usage counts the image's 184 image tokens,
a repeated image is encoded once, and bad images (corrupt bytes, a non-image, over the byte or pixel
limits, more images than the quota, a URL outside the allow-list, an unsupported scheme) get 400 with
a clear message, reach no prefill, and leave the server healthy.

Content checks (red circle -> red / circle, blue triangle -> blue / triangle, two images, an image in
an earlier turn) run against the built-in demo model, asked in its trained phrasings.
"""

from __future__ import annotations

import base64
import io
import json

import pytest

from tests.entrypoint.http.conftest import ALLOWED_IMAGE_HOST

openai = pytest.importorskip("openai")
pytest.importorskip("PIL")

API_KEY = "vision-key"


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


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                        {"type": "text", "text": text}]}


RED_CIRCLE, BLUE_TRIANGLE = png((220, 20, 20)), png((20, 20, 220), "triangle")


@pytest.fixture(scope="module")
def vision_cluster(tmp_path_factory):
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from tests.entrypoint.http.cluster import LocalCluster

    ckpt = make_checkpoint(tmp_path_factory.mktemp("http-vision"), preset="tiny", seed=21, vision=True)
    vision_args = ("--image-url-allowed-hosts", ALLOWED_IMAGE_HOST, "--max-images", "4", "--max-image-bytes",
                   "200000", "--max-image-pixels", "4000000", "--embedding-rows", "4096")
    with LocalCluster(ckpt, tmp_path_factory.mktemp("http-vision-logs"), api_key=API_KEY, vision_args=vision_args,
                      http_args=("--image-url-allowed-hosts", ALLOWED_IMAGE_HOST, "--max-model-len", "448"),
                      entrypoint_args=("--max-model-len", "448")) as running:
        yield running


@pytest.fixture(scope="module")
def client(vision_cluster):
    with openai.OpenAI(base_url=vision_cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(vision_cluster) -> str:
    from pathlib import Path

    return Path(vision_cluster.checkpoint).name


def _prompt_len(checkpoint, body: dict) -> int:
    from deepinfer.entrypoint.http.conversion import CHAT, ImageUrlPolicy, RecipeFront

    front = RecipeFront(checkpoint, body["model"], 1 << 20, ImageUrlPolicy([]))
    return len(front.prepare(CHAT, json.dumps(body).encode()).prompt_token_ids)


def test_image_prompt_counts_image_tokens_and_repeats_hit_the_cache(client, vision_cluster, model_name):
    messages = [image_message("What colour is the shape?", data_url(RED_CIRCLE))]
    v0 = vision_cluster.worker_stats("vision")
    first = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0)
    second = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0)
    body = {"model": model_name, "messages": messages, "max_tokens": 6}
    assert first.usage.prompt_tokens == _prompt_len(vision_cluster.checkpoint, body) + 183  # 1 placeholder -> 184
    assert first.choices[0].message.content == second.choices[0].message.content  # greedy, same image
    v1 = vision_cluster.worker_stats("vision")
    assert v1["vision_images_encoded_total"] - v0["vision_images_encoded_total"] == 1
    assert v1["vision_cache_hits_total"] - v0["vision_cache_hits_total"] == 1
    p = vision_cluster.worker_stats("prefill")
    assert p["embeddings_read_bytes_total"] > 0 and p["embeddings_reads_failed_total"] == 0
    import httpx

    metrics = httpx.get(vision_cluster.http_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                        timeout=30).text
    assert 'deepinfer_stage_vision_images_encoded_total{instance="vision-0",stage="vision"}' in metrics
    assert 'deepinfer_stage_embeddings_read_bytes_total{instance="prefill-0",stage="prefill"}' in metrics
    # an unspecified max_tokens is lowered to the context left after the image tokens, not refused
    # (the context is 448 tokens here, so the random model runs at most ~250 tokens to that limit)
    unbounded = client.with_options(timeout=300).chat.completions.create(model=model_name, messages=messages,
                                                                        temperature=0)
    assert unbounded.usage.prompt_tokens == first.usage.prompt_tokens
    assert unbounded.usage.prompt_tokens + unbounded.usage.completion_tokens <= 448


def test_bad_images_get_400_and_nothing_reaches_prefill(client, vision_cluster, model_name):
    p0 = vision_cluster.worker_stats("prefill")
    big = png((0, 200, 0), size=(2500, 2000))  # 5 M pixels > 4 M
    bad = {
        "corrupt": (data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64), "not a supported image"),
        "non-image": (data_url(b"hello, I am text", "text/plain"), "unsupported image"),
        "non-image bytes as png": (data_url(b"hello, I am text"), "not a supported image"),
        "over the byte limit": (data_url(RED_CIRCLE + b"\x00" * 250_000), "bytes; at most 200000"),
        "over the pixel limit": (data_url(big), "pixels; at most 4000000"),
        "outside the allow-list": ("http://10.0.0.1/secret.png", "not allowed"),
        "unsupported scheme": ("ftp://images.example.com/a.png", "not allowed"),
    }
    for name, (url, message) in bad.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model_name, messages=[image_message("what?", url)], max_tokens=2)
        assert e.value.status_code == 400 and message in str(e.value), (name, str(e.value))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=[image_message("what?", *[data_url(RED_CIRCLE)] * 5)])
    assert "at most 4" in str(e.value)
    p1 = vision_cluster.worker_stats("prefill")
    assert p1["embeddings_reads_done_total"] == p0["embeddings_reads_done_total"]
    assert p1["kv_transfer_sends_done_total"] == p0["kv_transfer_sends_done_total"]
    ok = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------- content (built-in model)


def _builtin_has_vision() -> bool:
    from deepinfer.engine.testing.default_model import ensure_default_model

    return "vision_config" in json.loads((ensure_default_model() / "config.json").read_text())


@pytest.fixture(scope="module")
def builtin(request):
    """The HTTP cluster of the built-in model (the shared one of conftest)."""
    assert _builtin_has_vision(), "the built-in demo model has no vision tower"
    return request.getfixturevalue("cluster")


def _ask(cluster, messages) -> str:
    from tests.entrypoint.http.conftest import API_KEY as SHARED_KEY

    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=SHARED_KEY, max_retries=0, timeout=120) as c:
        name = c.models.list().data[0].id
        out = c.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0,
                                        extra_body={"thinking": {"type": "disabled"}})
    return (out.choices[0].message.content or "").lower()


# The questions are the demo model's trained phrasings (it knows nothing else), in non-thinking mode
# (a vision checkpoint converts as V4.1-Flash, whose default is thinking).


def test_red_circle_is_red(builtin):
    assert _ask(builtin, [image_message("What colour is the shape?", data_url(RED_CIRCLE))]) == "red"


def test_blue_triangle_is_blue(builtin):
    assert _ask(builtin, [image_message("What colour is the shape?", data_url(BLUE_TRIANGLE))]) == "blue"


def test_blue_triangle_is_a_triangle(builtin):
    assert _ask(builtin, [image_message("What shape is it?", data_url(BLUE_TRIANGLE))]) == "triangle"
    assert _ask(builtin, [image_message("What shape is it?", data_url(RED_CIRCLE))]) == "circle"


def test_two_images_in_one_message(builtin):
    answer = _ask(builtin, [image_message("What colours are the shapes?", data_url(RED_CIRCLE),
                                          data_url(BLUE_TRIANGLE))])
    assert answer == "red and blue"


def test_image_in_an_earlier_turn(builtin):
    messages = [image_message("What shape is it?", data_url(BLUE_TRIANGLE)),
                {"role": "assistant", "content": "triangle"},
                {"role": "user", "content": "What colour is the shape?"}]
    assert _ask(builtin, messages) == "blue"


def test_builtin_outputs_equal_offline_llm(builtin):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.entrypoint.http.conversion import CHAT, ImageUrlPolicy, RecipeFront

    messages = [image_message("What colours are the shapes?", data_url(BLUE_TRIANGLE), data_url(RED_CIRCLE))]
    answer = _ask(builtin, messages)
    front = RecipeFront(builtin.checkpoint, "m", 1 << 20, ImageUrlPolicy([]))
    body = {"model": "m", "messages": messages, "thinking": {"type": "disabled"}}
    ids = front.prepare(CHAT, json.dumps(body).encode()).prompt_token_ids
    out = LLM(model=builtin.checkpoint).generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": [BLUE_TRIANGLE, RED_CIRCLE]}}],
        SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    # the HTTP content is recipe's parse of the same greedy tokens (any reasoning split off, EOS dropped)
    assert answer == "blue and red" and answer in out.text.lower()


def test_images_through_the_responses_and_messages_apis(vision_cluster, model_name):
    anthropic = pytest.importorskip("anthropic")
    with openai.OpenAI(base_url=vision_cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        out = c.responses.create(model=model_name, max_output_tokens=4, temperature=0, input=[{
            "role": "user", "content": [{"type": "input_image", "image_url": data_url(BLUE_TRIANGLE)},
                                        {"type": "input_text", "text": "What shape?"}]}])
        assert out.usage.input_tokens > 184
    with anthropic.Anthropic(base_url=vision_cluster.http_url, api_key=API_KEY, max_retries=0, timeout=120) as c:
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(RED_CIRCLE).decode()}}
        msg = c.messages.create(model=model_name, max_tokens=4, messages=[
            {"role": "user", "content": [image, {"type": "text", "text": "What colour?"}]}])
        assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 184  # the image may be cached
        bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x01" * 40).decode()}}
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model=model_name, max_tokens=4, messages=[{"role": "user", "content": [bad]}])
        assert e.value.status_code == 400 and e.value.body["type"] == "error" and "image" in str(e.value)
