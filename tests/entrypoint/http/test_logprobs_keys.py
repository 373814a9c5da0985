"""Issue 31, second part, in-process (the FastAPI app and a fake token backend, no cluster): logprobs in
each API's shape (chat, completions, responses, /v1/generate; streamed too), per-API-key limits (429 with
Retry-After in the OpenAI / Anthropic shapes), the key's traffic class on the token request, the seed
echoed in usage and a header, and the /metrics figures that carry no key value.

The decode stream's logprob bookkeeping (`protos.convert.token_chunk`: the imported first token) is tested
here too; the cluster's logprobs against the offline engine's are in test_logprobs_cluster.py.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig
from deepinfer.entrypoint.http.errors import ApiError
from deepinfer.entrypoint.http.keys import KeyLimiter, key_name, parse_keys
from deepinfer.protos import common_pb2
from tests.entrypoint.http.fakes import EOS, FakeBackend

KEYS = "sk-alpha;name=team-a;class=agent;rpm=3,sk-bravo;max_concurrent=1"
LP = {5: (-0.25, [(5, -0.25), (9, -2.0)]), 6: (-0.5, [(6, -0.5), (9, -1.5)]), EOS: (-0.125, [(EOS, -0.125), (9, -3.0)])}


def _lp(token_id: int, k: int) -> common_pb2.TokenLogprobs:
    logprob, top = LP[token_id]
    return common_pb2.TokenLogprobs(token_id=token_id, logprob=logprob, rank=1, top_token_ids=[t for t, _ in top[:k]],
                                    top_logprobs=[v for _, v in top[:k]])


class _FakeBackend(FakeBackend):
    """Answers tokens 5, 6 then EOS (with logprobs when asked) and records the requests."""

    def logprobs(self, request, token_ids):
        sp = request.sampling_params
        return [_lp(t, sp.logprobs) for t in token_ids] if sp.HasField("logprobs") else []


@pytest.fixture(scope="module")
def client():
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(builtin_model_path()), served_model_name="m",
                                api_key=KEYS, default_thinking=False))
    with TestClient(app, headers={"Authorization": "Bearer sk-bravo"}) as c:
        c.backend = c.app.state.front.backend = _FakeBackend()
        yield c


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_logprobs_in_openai_shape(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    assert client.backend.requests[-1].sampling_params.logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5]  # EOS is not shown, as in the text
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [[-0.25, -2.0], [-0.5, -1.5]]
    assert all(isinstance(c["token"], str) and isinstance(c["bytes"], list) for c in content)
    r = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
    assert client.backend.requests[-1].sampling_params.logprobs == 0
    assert all(c["top_logprobs"] == [] for c in r.json()["choices"][0]["logprobs"]["content"])
    streamed = client.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 1, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    got = [c["logprob"] for ch in chunks for choice in ch["choices"] if choice.get("logprobs")
           for c in choice["logprobs"]["content"]]
    assert got == [-0.25, -0.5]
    client.post("/v1/chat/completions", json=CHAT)
    assert not client.backend.requests[-1].sampling_params.HasField("logprobs")  # not asked: not computed


def test_responses_logprobs(client):
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "top_logprobs": 2})
    assert r.status_code == 200, r.text
    part = r.json()["output"][-1]["content"][0]
    assert [lp["logprob"] for lp in part["logprobs"]] == [-0.25, -0.5]


def test_completions_logprobs_legacy_shape(client):
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 2, "max_tokens": 4})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.5] and len(lp["tokens"]) == 2 and len(lp["top_logprobs"]) == 2
    assert list(lp["top_logprobs"][0].values()) == [-0.25, -2.0]
    assert lp["text_offset"] == [0, len(lp["tokens"][0])]
    streamed = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 0, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]] \
        == [-0.25, -0.5]
    bad = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"


def test_generate_logprobs(client):
    r = client.post("/v1/generate", json={"token_ids": [3, 4], "sampling_params": {"logprobs": 1, "seed": 7}})
    choice = r.json()["choices"][0]
    assert [lp["logprob"] for lp in choice["logprobs"]] == [-0.25, -0.5, -0.125]
    assert choice["logprobs"][0]["top_logprobs"] == [{"token_id": 5, "logprob": -0.25}]
    assert r.json()["usage"]["seed"] == 7 and r.headers["x-deepinfer-seed"] == "7"


def test_seed_is_echoed(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "seed": 42})
    assert r.json()["usage"]["seed"] == 42 and r.headers["x-deepinfer-seed"] == "42"
    r = client.post("/v1/chat/completions", json={**CHAT, "seed": 42, "n": 2})
    assert r.json()["usage"]["seed"] == 42
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "seed": 5})
    assert r.json()["usage"]["seed"] == 5
    assert "seed" not in client.post("/v1/chat/completions", json=CHAT).json()["usage"]


def test_rate_limit_per_key_is_429_with_retry_after(client):
    headers = {"Authorization": "Bearer sk-alpha"}
    for _ in range(3):
        assert client.post("/v1/chat/completions", json=CHAT, headers=headers).status_code == 200
        assert client.backend.requests[-1].kv_traffic_class == "agent"
    r = client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error" and "team-a" in r.json()["error"]["message"]
    r = client.post("/v1/messages", json={**CHAT, "max_tokens": 4}, headers={"x-api-key": "sk-alpha"})
    assert r.status_code == 429 and r.json()["type"] == "error" and r.json()["error"]["type"] == "rate_limit_error"
    assert client.get("/v1/models", headers=headers).status_code == 200  # only generation counts
    # another key is not limited by it; its class is the server default (none)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert client.backend.requests[-1].kv_traffic_class == ""


def test_metrics_name_keys_without_their_value(client):
    text = client.get("/metrics").text
    assert 'deepinfer_http_key_requests_total{key="team-a",status="429"}' in text
    assert f'key="{key_name("sk-bravo")}"' in text
    assert "sk-alpha" not in text and "sk-bravo" not in text
    assert 'deepinfer_http_errors_total{code="rate_limit_exceeded",status="429"}' in text
    assert "deepinfer_http_prefix_cache_hit_rate" in text


def test_concurrency_limit_and_key_parsing():
    keys = parse_keys("k1;max_concurrent=1;class=chat, k2")
    limiter = KeyLimiter(default_max_concurrent=2)
    name = limiter.admit(keys[0])
    with pytest.raises(ApiError) as e:
        limiter.admit(keys[0])
    assert e.value.status == 429 and e.value.retry_after_s >= 1
    limiter.release(name)
    limiter.admit(keys[0])
    assert limiter.traffic_class(keys[0]) == "chat" and limiter.traffic_class(keys[1]) == ""
    limiter.admit(keys[1]), limiter.admit(keys[1])
    with pytest.raises(ApiError):
        limiter.admit(keys[1])  # the server default applies to a key without its own limit
    for bad in ("k;class=batch", "k;rpm=x", "k;max_concurrent=-1", "k;colour=red", ";name=x"):
        with pytest.raises(ValueError) as e:
            parse_keys(bad)
        assert "k;" not in str(e.value)  # the key is never in the message


def test_token_chunk_leaves_the_imported_first_token_to_start():
    """Decode's engine has no logprobs for the first token (prefill sampled it): the chunk lacks that leading
    entry, and the Start stream puts the prefill's in front (decode_worker/server.py)."""
    from deepinfer.engine.engine import CompletionOutput, RequestOutput
    from deepinfer.engine.sampling.sampler import TokenLogprobs
    from deepinfer.protos.convert import token_chunk, token_logprobs_from_proto, token_logprobs_to_proto

    lps = [TokenLogprobs(t, -0.5 * t, 1, [t], [-0.5 * t]) for t in (6, 7)]
    co = CompletionOutput(0, "abc", [5, 6, 7], lps)
    first = token_chunk("r", RequestOutput("r", None, [1], [co]), 0, 0, 1)
    assert list(first.token_ids) == [5, 6, 7] and [lp.token_id for lp in first.logprobs] == [6, 7]
    later = token_chunk("r", RequestOutput("r", None, [1], [co]), 2, 2, 1)
    assert list(later.token_ids) == [7] and [lp.token_id for lp in later.logprobs] == [7]
    assert token_logprobs_from_proto(token_logprobs_to_proto(lps[0])) == lps[0]
