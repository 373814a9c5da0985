"""DeepSeek-V4.1 image chat through the HTTP front: an OpenAI Chat Completions request with an `image_url` (data
URL) and an Anthropic Messages request with an image block, sent over HTTP to the front (`python -m
deepinfer.entrypoint.http`) of test_vision_v41.py's cluster (vision -> prefill -> decode over NIXL on the tiny
V4.1 vision checkpoint, `make_checkpoint --format published-v41 --vision`).

The front renders them with recipe's `DeepseekV41Encoding` and the checkpoint's tokenizer, which, as V4.1's own,
spells the image token `<｜deepseek_image｜>` (129264) and has no `<｜image｜>` (`engine.tokenizer.RecipeChatEncoding`
aliases recipe's spelling); the entrypoint expands each placeholder to the span the vision stage measured. The
answers equal `LLM.chat`'s greedy tokens and text (the engine given the same rendered prompt and image), and bad
image input gets a 4xx in each API's error shape. The cluster fixture and helpers are the V4.1 / V4 vision tests'.
"""

from __future__ import annotations

import base64
import json

import pytest

from tests.e2e.test_vision import STARTUP_TIMEOUT_S, _wait_for, data_url, png
from tests.e2e.test_vision_v41 import BLUE, RED, cluster  # noqa: F401 (cluster: this module's own instance)

pytest.importorskip("nixl")
pytest.importorskip("PIL")
httpx = pytest.importorskip("httpx")

MODEL = "v41"
SYSTEM = "be brief"
MAX_TOKENS = 5
WORD_BIAS = {i: 100.0 for i in range(10, 64)}
"""+100 on the tiny tokenizer's plain words (ids 10..63), so the random model's greedy tokens are words both sides
can show as text (the vision checkpoint's 129280-token vocabulary is mostly ids the tiny tokenizer cannot decode,
which recipe's stream parser leaves out); the same bias offline keeps the comparison exact."""


@pytest.fixture(scope="module")
def http_url(cluster):  # noqa: F811
    """The HTTP front over the cluster's entrypoint (greedy as asked in thinking mode: `--thinking-sampling
    request`)."""
    info = cluster.info
    cluster.processes.spawn("http", [
        "deepinfer.entrypoint.http", "--entrypoint", info["entrypoint"]["address"], "--host", "127.0.0.1",
        "--port", "0", "--model", cluster.checkpoint, "--served-model-name", MODEL, "--thinking-sampling", "request",
        "--vision-lb-address", info["vision_lb"]["address"]])
    cluster.processes.wait_ready(STARTUP_TIMEOUT_S)
    return info["http"]["address"]


@pytest.fixture(scope="module")
def llm(cluster):  # noqa: F811
    from deepinfer.engine import LLM

    return LLM(model=cluster.checkpoint, num_blocks=64, max_num_seqs=8)


def _chat_body(*images: bytes, text: str = "hello") -> dict:
    content = [{"type": "text", "text": text}, *({"type": "image_url", "image_url": {"url": data_url(i)}}
                                                 for i in images)]
    return {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logit_bias": WORD_BIAS}


def _messages_body(image: bytes) -> dict:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}}
    return {"model": MODEL, "system": SYSTEM, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logit_bias": WORD_BIAS, "messages": [{"role": "user", "content": [block, {"type": "text", "text": "what is it"}]}]}


def _offline(llm, api: str, body: dict):
    """`LLM.chat` of recipe's own conversion of `body` (V4.1-Flash), greedy, and the front's rendered prompt."""
    import deepseek_recipe as recipe

    from deepinfer.engine import SamplingParams
    from deepinfer.entrypoint.http.conversion import _REQUEST_CLS, ImageUrlPolicy, RecipeFront

    options = recipe.ConversionOptions().with_model_versions_by_name({MODEL: recipe.ModelVersion.DeepseekV41Flash})
    conversation = _REQUEST_CLS[api](json.dumps(body)).convert(options).conversation
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=WORD_BIAS)
    out = llm.chat(conversation, params, use_tqdm=False)[0]
    front = RecipeFront(llm.engine.model_path, MODEL, 1 << 20, ImageUrlPolicy([]))
    return out, front.prepare(api, json.dumps(body).encode())


def _answer_text(token_ids: list[int], llm) -> str:
    """What the front shows for greedy `token_ids`: the tokenizer's text of each, thinking markers left out."""
    tok = llm.tokenizer
    return "".join(tok.decode([t], skip_special_tokens=False) for t in token_ids
                   if tok.id_to_token(t) not in ("<think>", "</think>"))


def test_openai_and_anthropic_image_chat_equal_llm_chat(cluster, http_url, llm):  # noqa: F811
    from deepinfer.engine.tokenizer import V41_IMAGE_TOKEN

    v0, p0 = cluster.stats("vision-0"), cluster.stats("prefill")
    cases = [("chat", "/v1/chat/completions", _chat_body(RED)),
             ("chat", "/v1/chat/completions", _chat_body(BLUE, RED, text="what are they")),
             ("messages", "/v1/messages", _messages_body(BLUE))]
    with httpx.Client(base_url=http_url, timeout=120) as http:
        answers = [http.post(path, json=body) for _, path, body in cases]
    spans = 0
    for (api, _, body), r in zip(cases, answers):
        assert r.status_code == 200, r.text
        out, prepared = _offline(llm, api, body)
        ids = prepared.prompt_token_ids
        image_id = llm.tokenizer.token_to_id(V41_IMAGE_TOKEN)
        # the V4.1 rendering: <｜System｜> turn, one <｜deepseek_image｜> per image, then the span the engine ran
        assert ids[:2] == [0, llm.tokenizer.token_to_id("<｜System｜>")]
        num_images = len(prepared.images)
        assert num_images == ids.count(image_id) and num_images >= 1
        # the engine ran the front's prompt with each placeholder widened to its image's span (129264 throughout)
        assert [t for t in out.prompt_token_ids if t != image_id] == [t for t in ids if t != image_id]
        assert out.prompt_token_ids[prepared.images[0].offset] == image_id
        got = r.json()
        expected_text = _answer_text(out.outputs[0].token_ids, llm)
        if api == "chat":
            usage, message = got["usage"], got["choices"][0]["message"]
            assert usage["prompt_tokens"] == len(out.prompt_token_ids)
            assert usage["completion_tokens"] == len(out.outputs[0].token_ids) == MAX_TOKENS
            text = (message.get("reasoning_content") or "") + (message.get("content") or "")
        else:
            usage = got["usage"]
            assert usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) == len(out.prompt_token_ids)
            assert usage["output_tokens"] == MAX_TOKENS
            text = "".join(b.get("thinking") or b.get("text") or "" for b in got["content"])
        assert text.replace(" ", "") == expected_text.replace(" ", ""), (api, out.outputs[0].token_ids)
        spans += len(out.prompt_token_ids) - len(ids) + num_images
    v1, p1 = cluster.stats("vision-0"), cluster.stats("prefill")
    assert v1["vision_images_encoded_total"] - v0["vision_images_encoded_total"] >= 1
    hidden = json.loads(open(f"{cluster.checkpoint}/config.json").read())["text_config"]["hidden_size"]
    assert p1["embeddings_read_bytes_total"] - p0["embeddings_read_bytes_total"] == spans * 4 * hidden
    _wait_for("holds released", lambda: cluster.stats("vision-0")["vision_held_requests"] == 0)


def test_bad_image_input_gets_4xx_in_the_api_shape(cluster, http_url):  # noqa: F811
    p0 = cluster.stats("prefill")
    corrupt = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
    with httpx.Client(base_url=http_url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=_chat_body(corrupt))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert "not a supported image" in error["message"] and error["type"] == "invalid_request_error"
        r = http.post("/v1/chat/completions", json=_chat_body(*[RED] * 9))  # the vision stage's quota: 8
        assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"], r.text
        r = http.post("/v1/messages", json=_messages_body(corrupt))
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "image" in body["error"]["message"]
        bad_url = _chat_body(RED)
        bad_url["messages"][1]["content"][1]["image_url"]["url"] = "data:image/png;base64,@@not base64@@"
        r = http.post("/v1/chat/completions", json=bad_url)
        assert r.status_code == 400 and "Invalid base64" in r.json()["error"]["message"], r.text  # recipe's
    p1 = cluster.stats("prefill")
    assert p1["embeddings_reads_done_total"] == p0["embeddings_reads_done_total"]  # nothing reached prefill


@pytest.mark.parametrize("fmt", ["published-v41", "transformers"])
def test_an_image_to_a_checkpoint_without_a_vision_tower_is_refused(tmp_path, fmt):
    """A text-only tiny V4.1 (its tokenizer has no image token) or V4 (recipe's V4-Pro conversion drops image
    parts: an Anthropic base64 image was ignored silently) refuses image content with 400 images_not_supported in
    either API's shape, before any token call (a fake backend)."""
    from fastapi.testclient import TestClient

    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.entrypoint.http.app import create_app
    from deepinfer.entrypoint.http.config import HttpConfig
    from tests.entrypoint.http.fakes import FakeBackend

    ckpt = make_checkpoint(tmp_path / "text-only", preset="tiny", format=fmt)
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(ckpt), served_model_name=MODEL))
    with TestClient(app) as client:
        backend = FakeBackend()
        app.state.front.backend = backend
        chat = _chat_body(png((255, 0, 0)))
        chat.pop("logit_bias")  # ids of the tiny V4.1 vision tokenizer
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["code"] == "images_not_supported", r.text
        messages = _messages_body(png((255, 0, 0)))
        messages.pop("logit_bias")
        r = client.post("/v1/messages", json=messages)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "no images" in r.json()["error"]["message"]
        assert not backend.requests
