"""Which requests the decode stage writes to the store (`decode_worker.core`): the HTTP front marks its chat APIs'
single-answer turns as conversations (`GenerateRequest.is_conversation`); completions, raw token requests and the
n > 1 choices of a chat request are not. In-process: the FastAPI app over a fake token backend."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig
from tests.entrypoint.http.fakes import FakeBackend

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def client():
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(builtin_model_path()), served_model_name="m",
                                default_thinking=False))
    with TestClient(app) as c:
        c.backend = c.app.state.front.backend = FakeBackend()
        yield c


def test_chat_turns_are_conversations_completions_are_not(client):
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/messages", {**CHAT, "max_tokens": 4}),
                       ("/v1/responses", {"model": "m", "input": "hi"})):
        assert client.post(path, json=body).status_code == 200, path
        assert client.backend.requests[-1].is_conversation, path
    for path, body in (("/v1/completions", {"model": "m", "prompt": "hi"}), ("/v1/generate", {"token_ids": [3, 4]})):
        assert client.post(path, json=body).status_code == 200, path
        assert not client.backend.requests[-1].is_conversation, path
    assert client.post("/v1/chat/completions", json={**CHAT, "n": 2}).status_code == 200
    assert not any(r.is_conversation for r in client.backend.requests[-2:])  # two choices: neither continues
