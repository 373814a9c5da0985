"""Content-level checks of the HTTP API with the trained built-in demo model (tools/demo_model):
"What is 37 + 48?" -> 85, thinking -> reasoning_content apart from content, the weather tool ->
a `get_weather` call with `{"city": "Paris"}` whatever the chunking, in the OpenAI and Anthropic APIs.

Skipped while the default model is the random-weight one: the trained checkpoint is recognised by
the `deepinfer` section its exporter writes into config.json (`tools/demo_model/train.py`).
"""

from __future__ import annotations

import json

import pytest

from tests.entrypoint.http.conftest import API_KEY


def _is_trained_demo_model() -> bool:
    from deepinfer.engine.testing.default_model import ensure_default_model

    config = json.loads((ensure_default_model() / "config.json").read_text())
    return "deepinfer" in config


pytestmark = [
    pytest.mark.skipif(not _is_trained_demo_model(), reason=(
        "the default model is not the trained built-in demo model (no `deepinfer` section in its config.json): "
        "content checks need it; the protocol checks of test_http_api.py run on any weights")),
]

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city name, e.g. Paris"}},
                   "required": ["city"]}}}
ADD = [{"role": "user", "content": "What is 37 + 48?"}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def model_name(default_model_dir) -> str:
    return default_model_dir.name


@pytest.fixture(scope="module")
def oai(cluster):
    import openai

    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def claude(cluster):
    import anthropic

    with anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


def test_addition_non_streaming_and_streaming(oai, model_name):
    out = oai.chat.completions.create(model=model_name, messages=ADD, max_tokens=16, temperature=0,
                                      extra_body=NO_THINKING)
    assert "85" in out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    chunks = list(oai.chat.completions.create(model=model_name, messages=ADD, max_tokens=16, temperature=0,
                                              stream=True, extra_body=NO_THINKING))
    assert "85" in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_thinking_returns_reasoning_apart_from_content(oai, model_name):
    out = oai.chat.completions.create(model=model_name, messages=ADD, max_tokens=200, seed=0,
                                      extra_body={"thinking": {"type": "enabled"}})
    message = out.choices[0].message
    assert message.reasoning_content and "85" in message.content
    assert "</think>" not in message.content and "</think>" not in message.reasoning_content
    assert out.usage.completion_tokens_details.reasoning_tokens > 0


def _streamed_tool_calls(chunks) -> list[dict]:
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    return [calls[i] for i in sorted(calls)]


def test_weather_tool_call_streaming_and_not(oai, model_name):
    kwargs = dict(model=model_name, messages=WEATHER, tools=[WEATHER_TOOL], max_tokens=64, temperature=0,
                  extra_body=NO_THINKING)
    out = oai.chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = _streamed_tool_calls(oai.chat.completions.create(**kwargs, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", {"city": "Paris"})]


def test_responses_text_ends_completed(oai, model_name):
    # Responses turns thinking off with reasoning effort "none" (recipe; `thinking` is not a Responses
    # field), and greedy: the APIs' default temperature (1) samples a demo model's answers
    kwargs = dict(model=model_name, input="What is 37 + 48?", max_output_tokens=200, temperature=0,
                  reasoning={"effort": "none"})
    out = oai.responses.create(**kwargs)
    assert out.status == "completed" and "85" in out.output_text
    events = list(oai.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.completed" and "85" in events[-1].response.output_text


def test_anthropic_messages_text(claude, model_name):
    out = claude.messages.create(model=model_name, max_tokens=200, messages=ADD, extra_body={"temperature": 0},
                                 thinking={"type": "disabled"})
    assert out.stop_reason == "end_turn" and "85" in "".join(b.text for b in out.content if b.type == "text")
    with claude.messages.stream(model=model_name, max_tokens=200, messages=ADD, extra_body={"temperature": 0},
                                thinking={"type": "disabled"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[-1] == "message_stop" and "85" in "".join(b.text for b in final.content if b.type == "text")


def test_anthropic_messages_tool_use(claude, model_name):
    tool = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    with claude.messages.stream(model=model_name, max_tokens=200, messages=WEATHER, tools=[tool], extra_body={"temperature": 0},
                                thinking={"type": "disabled"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[-1] == "message_stop" and final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
