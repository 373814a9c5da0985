"""The HTTP front with a checkpoint that ships its own chat template: the FastAPI app in-process (a fake token
backend, no cluster) renders chat prompts with that template, as `LLM.chat` does, and refuses with a 400 what
only recipe's DeepSeek-V4 encoding can render (tools, DSML tool calls, thinking). DeepSeek-V4 checkpoints keep
recipe's encoding."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.tokenizer import load_chat_encoding
from deepinfer.entrypoint.http.app import create_app
from deepinfer.entrypoint.http.config import HttpConfig
from deepinfer.entrypoint.http.conversion import TEMPLATE_ENCODING, ImageUrlPolicy, RecipeFront
from tests.entrypoint.http.fakes import FakeBackend

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "hello", "there", "be", "brief", "[UNK]"]


def _template_checkpoint(root):
    """A checkpoint directory (config only) with its own word-level tokenizer and jinja chat template."""
    ckpt = root / "tmpl"
    ckpt.mkdir()
    config = json.loads((builtin_model_path() / "config.json").read_text())
    config.pop("deepinfer", None)  # names no recipe encoding
    (ckpt / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"])
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return ckpt


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _template_checkpoint(tmp_path_factory.mktemp("chat-template"))


@pytest.fixture()
def client(ckpt):
    app = create_app(HttpConfig(entrypoint="127.0.0.1:1", model=str(ckpt), served_model_name="tmpl"))
    with TestClient(app) as c:
        backend = FakeBackend()
        app.state.front.backend = backend
        c.backend = backend
        yield c


def test_chat_uses_the_checkpoint_template(client, ckpt):
    assert client.app.state.front.recipe.encoding_name == TEMPLATE_ENCODING
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.post("/v1/chat/completions", json={"model": "tmpl", "messages": messages})
    assert r.status_code == 200, r.text
    prompt = list(client.backend.requests[-1].prompt_token_ids)
    assert [WORDS[i] for i in prompt] == ["<s>", "<|system|>", "be", "brief", "<|user|>", "hello", "there",
                                          "<|assistant|>"]
    assert prompt == load_chat_encoding(ckpt).encode(messages)  # the same prompt as LLM.chat
    body = r.json()
    message = body["choices"][0]["message"]
    assert message["content"].split() == ["hello", "there"] and not message.get("reasoning_content")
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["prompt_tokens"] == len(prompt)
    # Anthropic Messages too (thinking off by default for a template)
    r = client.post("/v1/messages", json={"model": "tmpl", "max_tokens": 5,
                                          "messages": [{"role": "user", "content": "hello"}]})
    assert r.status_code == 200, r.text
    assert [WORDS[i] for i in client.backend.requests[-1].prompt_token_ids] == ["<s>", "<|user|>", "hello",
                                                                                "<|assistant|>"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, code, says", [
    ({"tools": [TOOL]}, "tools_not_supported", "tools are not supported"),
    ({"messages": [{"role": "user", "content": "hello"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "a", "content": "sunny"}]},
     "tools_not_supported", "tool calls and tool results"),
    ({"thinking": {"type": "enabled"}}, "thinking_not_supported", "thinking mode is not supported"),
])
def test_recipe_only_features_are_refused(client, extra, code, says):
    body = {"model": "tmpl", "messages": [{"role": "user", "content": "hello"}], **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and says in error["message"]
    assert "checkpoint's chat template, not DeepSeek-V4's encoding" in error["message"]
    assert not client.backend.requests  # refused before the token API


def test_deepseek_v4_checkpoint_keeps_recipe_encoding(tmp_path):
    front = RecipeFront(builtin_model_path(), "m", 4096, ImageUrlPolicy([]))
    assert not front.is_template and front.encoding_name in ("v4", "v4.1")
    # a V4 checkpoint that names its encoding keeps it even when it also ships a template
    ckpt = _template_checkpoint(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "deepinfer": {"chat_encoding": "v4"}}))
    (ckpt / "tokenizer.json").unlink()  # the V4 tokenizer then
    named = RecipeFront(ckpt, "m", 4096, ImageUrlPolicy([]))
    assert not named.is_template and named.encoding_name == "v4"
