"""V4.1 chat rendering: a V4.1 checkpoint (config.json `model_type` deepseek_v41) renders chat prompts with
deepseek-recipe's `DeepseekV41Encoding` and its own tokenizer (which has `<｜System｜>`), in the HTTP front
(the FastAPI app in-process over a fake token backend, as tests/entrypoint/http/test_chat_template.py) and in
`LLM.chat` alike; V4's tokenizer cannot (recipe refuses it), V4 checkpoints keep V4's encoding, and a name in
config.json still wins."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest
from fastapi.testclient import TestClient

from deepinfer.engine.testing.make_checkpoint import TINY_V41_SPECIAL_TOKENS, TINY_V41_WORDS, make_checkpoint
from deepinfer.engine.tokenizer import chat_encoding_name, default_tokenizer_path, load_chat_encoding
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig
from tests.entrypoint.http.fakes import FakeBackend

SYSTEM = "<｜System｜>"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
TOKENS = TINY_V41_SPECIAL_TOKENS + TINY_V41_WORDS


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41-chat"), preset="tiny", format="published-v41")


def _recipe_conversation(messages, model: str = "m"):
    """recipe's own conversion of a Chat Completions body as V4.1-Flash (thinking on: recipe's default)."""
    options = recipe.ConversionOptions().with_model_versions_by_name({model: recipe.ModelVersion.DeepseekV41Flash})
    return recipe.ChatCompletionRequest(json.dumps({"model": model, "messages": messages})).convert(options).conversation


def _recipe_ids(ckpt, messages) -> list[int]:
    tokenizer = recipe.Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    return recipe.DeepseekV41Encoding().with_tokenizer(tokenizer).encode(_recipe_conversation(messages))


def test_the_encoding_follows_the_checkpoint(ckpt, tmp_path):
    assert chat_encoding_name(ckpt) == "v4.1"
    v4 = make_checkpoint(tmp_path / "v4", preset="tiny")
    assert chat_encoding_name(v4) == "v4"
    named = tmp_path / "named"
    named.mkdir()
    config = json.loads((ckpt / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "deepinfer": {"chat_encoding": "v4"}}))
    assert chat_encoding_name(named) == "v4"  # a name in config.json wins over the model type
    # why the checkpoint's own tokenizer: recipe's V4.1 encoding refuses V4's, which has no <｜System｜>
    v4_tokenizer = recipe.Tokenizer.from_file(str(default_tokenizer_path()))
    with pytest.raises(RuntimeError, match="System"):
        recipe.DeepseekV41Encoding().with_tokenizer(v4_tokenizer).encode(_recipe_conversation(MESSAGES))


def test_http_front_renders_the_system_turn_with_the_v41_encoding(ckpt):
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(ckpt), served_model_name="v41"))
    with TestClient(app) as client:
        backend = FakeBackend()
        app.state.front.backend = backend
        assert app.state.front.recipe.encoding_name == "v4.1"
        assert client.get("/version").json()["encoding"] == "v4.1"
        r = client.post("/v1/chat/completions", json={"model": "v41", "messages": MESSAGES})
        assert r.status_code == 200, r.text
        prompt = list(backend.requests[-1].prompt_token_ids)
        words = [TOKENS[i] for i in prompt]
        assert words[:2] == ["<｜begin▁of▁sentence｜>", SYSTEM]
        assert words[-7:] == ["be", "brief", "<｜User｜>", "hello", "there", "<｜Assistant｜>", "<think>"]
        assert prompt == _recipe_ids(ckpt, MESSAGES)  # recipe's own rendering, token for token
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)
        # /tokenize renders the same prompt; every id fits the tiny model's vocabulary
        t = client.post("/tokenize", json={"messages": MESSAGES}).json()
        assert t["tokens"] == prompt and max(prompt) < 64


def test_offline_chat_renders_and_serves_the_same_prompt(ckpt):
    from deepinfer.engine import LLM, SamplingParams

    conv = _recipe_conversation(MESSAGES)
    assert load_chat_encoding(ckpt).encode(conv) == _recipe_ids(ckpt, MESSAGES)
    out = LLM(str(ckpt)).chat(conv, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert out[0].prompt_token_ids == _recipe_ids(ckpt, MESSAGES)
    assert TOKENS.index(SYSTEM) in out[0].prompt_token_ids and len(out[0].outputs[0].token_ids) == 3
