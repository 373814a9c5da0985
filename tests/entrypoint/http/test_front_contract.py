"""The HTTP front's contract with its clients, in-process (the FastAPI app, a fake token backend, no
cluster), issue 31: fields honoured or refused (never dropped), the validation nits (2**70 seed, 405,
Anthropic's required max_tokens and system placement), request ids (X-Request-Id echoed, on every
answer, in the access log), the server's thinking default and the headers that say how a request
was sampled, API keys (several), /version and /tokenize.

Each "honoured" test reads the token API request the front sent: it fails if the field is dropped
(the engine's own handling of those fields is tested with the engine).
"""

from __future__ import annotations

import json
import logging

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig
from deepinfer.protos import common_pb2
from tests.entrypoint.http.fakes import FakeBackend

KEYS = ("key-a", "key-b")
HEADERS = {"Authorization": f"Bearer {KEYS[0]}"}


def _client(**config) -> TestClient:
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(builtin_model_path()), served_model_name="m",
                                api_key=",".join(KEYS), **config))
    return TestClient(app, headers=HEADERS)


@pytest.fixture(scope="module")
def client():
    with _client() as c:
        c.backend = c.app.state.front.backend = FakeBackend()
        yield c


def _chat(client, **body):
    return client.post("/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def _sent(client) -> common_pb2.SamplingParams:
    return client.backend.requests[-1].sampling_params


# ---------------------------------------------------------------------------------------- fields


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"])
def test_logit_bias_min_tokens_top_k_are_honoured(client, route):
    base = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
            "/v1/responses": {"input": "hi"},
            "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            "/v1/completions": {"prompt": "hi", "max_tokens": 8}}[route]
    r = client.post(route, json={"model": "m", **base, "logit_bias": {"5": 100, "7": -100}, "min_tokens": 3,
                                 "top_k": 4})
    assert r.status_code == 200, r.text
    params = _sent(client)
    assert dict(params.logit_bias) == {5: 100.0, 7: -100.0}
    assert params.min_tokens == 3 and params.top_k == 4


def test_repetition_penalty_is_honoured(client):
    assert _chat(client, repetition_penalty=1.3).status_code == 200
    assert _sent(client).repetition_penalty == pytest.approx(1.3)


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2 ** 40}, "min_tokens"),
    ({"top_k": "many"}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"best_of": 2}, "best_of"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"seed": 2 ** 70}, "seed"),
    ({"seed": 2 ** 63}, "seed"),
    ({"n": 2, "stream": True}, "n"),
    ({"n": 17}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "logprobs"),
])
def test_fields_it_cannot_honour_are_400s_naming_them(client, body, param):
    n = len(client.backend.requests)
    r = _chat(client, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert param in (error["param"] or "") or param in error["message"]
    assert len(client.backend.requests) == n  # refused before the token API


def test_n_choices_are_separate_seeded_calls_merged(client):
    oai = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=KEYS[0], http_client=client, max_retries=0)
    n_before = len(client.backend.requests)
    out = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=3, seed=11,
                                      extra_body={"thinking": {"type": "disabled"}})
    sent = client.backend.requests[n_before:]
    assert sorted(r.sampling_params.seed for r in sent) == [11, 12, 13]
    assert len({r.request_id for r in sent}) == 3 and all(r.request_id.startswith(out.id) for r in sent)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.finish_reason == "stop" for c in out.choices)
    assert out.usage.completion_tokens == 9 and out.usage.total_tokens == out.usage.prompt_tokens + 9
    n_before = len(client.backend.requests)
    text = oai.completions.create(model="m", prompt="hi", n=2, seed=5, max_tokens=4)
    assert [c.index for c in text.choices] == [0, 1] and text.usage.completion_tokens == 6
    assert sorted(r.sampling_params.seed for r in client.backend.requests[n_before:]) == [5, 6]


def test_completions_seed_and_prompt_ids_out_of_range_are_400(client):
    for body in ({"prompt": "x", "seed": 2 ** 70}, {"prompt": "x", "seed": 2 ** 63}, {"prompt": [2 ** 40]}):
        r = client.post("/v1/completions", json={"model": "m", **body})
        assert r.status_code == 400, r.text
    r = client.post("/v1/generate", json={"token_ids": [5], "sampling_params": {"seed": 2 ** 70}})
    assert r.status_code == 400, r.text


def test_anthropic_requires_max_tokens_and_a_top_level_system(client):
    claude = anthropic.Anthropic(base_url=str(client.base_url), api_key=KEYS[1], http_client=client, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "system", "content": "be brief"},
                                                                   {"role": "user", "content": "hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "invalid_request_error"
    assert "system" in info.value.body["error"]["message"]
    r = client.post("/v1/messages", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert r.json()["type"] == "error"
    ok = claude.messages.create(model="m", max_tokens=8, system="be brief",
                                messages=[{"role": "user", "content": "hi"}])
    assert ok.type == "message"


def test_wrong_method_is_405_in_the_api_shape(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"
    r = client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------------------------------- request ids


def test_request_id_on_every_answer_and_echoed(client, caplog):
    r = _chat(client, thinking={"type": "disabled"})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid == r.json()["id"] == client.backend.requests[-1].request_id  # the id every stage logs
    with caplog.at_level(logging.INFO, logger="entrypoint.http.access"):
        r = client.post("/v1/chat/completions", headers={"X-Request-Id": "client-42"},
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    internal = client.backend.requests[-1].request_id
    lines = [rec for rec in caplog.records if rec.name == "entrypoint.http.access"]
    assert lines and lines[-1].request_id == internal and "client_request_id=client-42" in lines[-1].getMessage()
    assert " 200 " in lines[-1].getMessage() and "/v1/chat/completions" in lines[-1].getMessage()
    # refusals carry one too; an id that is not a plain token is not echoed
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": "bad id\t"}, json={"model": "m"})
    assert r.status_code == 400 and r.headers["x-request-id"].startswith("req-")
    assert client.get("/health").headers["x-request-id"]


def test_json_logs_carry_the_request_id():
    import io

    from deepinfer.serving.logs import configure_logging, request_context

    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        configure_logging("info", "json", stream=stream)
        with request_context("chatcmpl-7"):
            logging.getLogger("prefill").info("prefilled %d tokens", 12)
        logging.getLogger("prefill").debug("hidden at info")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert lines == [{**lines[0], "level": "info", "logger": "prefill", "message": "prefilled 12 tokens",
                      "request_id": "chatcmpl-7"}]


# ---------------------------------------------------------------------------------------- thinking


def test_thinking_mode_says_it_overrode_temperature(client):
    oai = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=KEYS[0], http_client=client, max_retries=0)
    raw = oai.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                        temperature=0)
    assert raw.headers["x-deepinfer-thinking"] == "enabled"
    assert "temperature=0" in raw.headers["x-deepinfer-sampling-overridden"]
    assert raw.headers["x-deepinfer-sampling"].startswith("temperature=1.0")
    assert _sent(client).temperature == 1.0
    raw = oai.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "hi"}], temperature=0,
        extra_body={"thinking": {"type": "disabled"}})
    assert raw.headers["x-deepinfer-thinking"] == "disabled" and "x-deepinfer-sampling-overridden" not in raw.headers
    assert _sent(client).temperature == 0.0


def test_server_thinking_default_and_request_sampling():
    with _client(default_thinking=False, thinking_sampling="request") as c:
        c.backend = c.app.state.front.backend = FakeBackend()
        r = _chat(c, temperature=0)
        assert r.headers["x-deepinfer-thinking"] == "disabled" and _sent(c).temperature == 0.0
        r = _chat(c, temperature=0.2, thinking={"type": "enabled"})
        assert r.headers["x-deepinfer-thinking"] == "enabled"
        assert _sent(c).temperature == pytest.approx(0.2) and "x-deepinfer-sampling-overridden" not in r.headers


# ---------------------------------------------------------------------------------------- keys, misc


def test_several_api_keys(client):
    for key in KEYS:
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    r = client.get("/v1/models", headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_version_and_tokenize(client):
    assert client.get("/version").json()["model"] == "m"
    tokens = client.post("/tokenize", json={"prompt": "hi there"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    r = _chat(client)
    assert chat["tokens"] == list(client.backend.requests[-1].prompt_token_ids) and r.status_code == 200
    assert client.post("/tokenize", json={}).status_code == 400
