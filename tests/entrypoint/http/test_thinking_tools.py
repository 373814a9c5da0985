"""Tool calls in thinking mode (issue 31), in-process: the grammar the front sends keeps DSML out of
the reasoning (a call can only be written after `</think>`, where the tool-call grammar holds it), and a
forced tool_choice (`required`, a named tool, Anthropic's `any` / `tool`) is served in thinking mode
too, where recipe refuses or relaxes it, through every API's own shape."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.structured_output import GrammarCompiler
from deepinfer.engine.tokenizer import load_tokenizer
from deepinfer.entrypoint.http.conversion import CHAT, MESSAGES, RESPONSES, ImageUrlPolicy, RecipeFront
from deepinfer.entrypoint.http.errors import ApiError
from deepinfer.protos.convert import structured_output_from_proto

pytest.importorskip("xgrammar")

EOS = 1
WEATHER = {"name": "get_weather", "description": "Get the weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "description": "Get the time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_TOOLS = [{"type": "function", "function": t} for t in (WEATHER, TIME)]
RESPONSES_TOOLS = [{"type": "function", **t} for t in (WEATHER, TIME)]
MESSAGES_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                  for t in (WEATHER, TIME)]
INVOKE = ('<｜DSML｜invoke name="{name}">\n<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
          '</｜DSML｜invoke>\n')
BLOCK = "\n\n<｜DSML｜tool_calls>\n{}</｜DSML｜tool_calls>"


@pytest.fixture(scope="module")
def front():
    return RecipeFront(builtin_model_path(), "m", 4096, ImageUrlPolicy([]))


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [EOS])


def _prepare(front, api: str, tool_choice=None, **extra):
    if api == CHAT:
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": CHAT_TOOLS}
    elif api == RESPONSES:
        body = {"input": "Weather in Paris?", "tools": RESPONSES_TOOLS}
    else:
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": MESSAGES_TOOLS,
                "max_tokens": 64}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return front.prepare(api, json.dumps({"model": "m", **body, **extra}).encode())


def _accepts(compiler, prepared, text: str) -> bool:
    tokenizer, grammar_compiler = compiler
    params = structured_output_from_proto(prepared.sampling_params().structured_output)
    state = grammar_compiler.new_state(params)
    return state.advance_to(tokenizer.encode(text, add_special_tokens=False).ids + [EOS]) and state.is_terminated


def test_dsml_inside_the_reasoning_is_refused_after_it_accepted(front, compiler):
    prepared = _prepare(front, CHAT, "auto")
    assert prepared.is_thinking
    call = BLOCK.format(INVOKE.format(name="get_weather"))
    assert _accepts(compiler, prepared, "I look it up.</think>" + call)
    assert _accepts(compiler, prepared, "No tool needed.</think>It is sunny.")
    # the model opening a call in its reasoning (what recipe's parser took, unconstrained, before)
    assert not _accepts(compiler, prepared, "I call" + call + "</think>Done.")
    assert not _accepts(compiler, prepared, "Hmm <｜DSML｜invoke name=\"get_weather\">")
    # an invoke without the block opener (which recipe's parser would take, unconstrained) is not text either
    assert not _accepts(compiler, prepared, "Ok.</think>" + INVOKE.format(name="get_weather"))
    assert not _accepts(compiler, prepared, 'Ok.</think><｜DSML｜invoke name="get_weather with city Paris">')
    # after the reasoning, an undeclared tool or a missing argument is not a call
    assert not _accepts(compiler, prepared, "Ok.</think>" + BLOCK.format(INVOKE.format(name="get_news")))
    assert not _accepts(compiler, prepared, "Ok.</think>" + BLOCK.format(
        '<｜DSML｜invoke name="get_weather">\n</｜DSML｜invoke>\n'))


@pytest.mark.parametrize("api, tool_choice, named", [
    (CHAT, "required", None),
    (CHAT, {"type": "function", "function": {"name": "get_time"}}, "get_time"),
    (RESPONSES, "required", None),
    (RESPONSES, {"type": "function", "name": "get_time"}, "get_time"),
    (MESSAGES, {"type": "any"}, None),
    (MESSAGES, {"type": "tool", "name": "get_time"}, "get_time"),
])
def test_forced_tool_choice_works_in_thinking_mode(front, compiler, api, tool_choice, named):
    prepared = _prepare(front, api, tool_choice)  # recipe alone: a 400 (or `any` relaxed to `auto`)
    assert prepared.is_thinking
    weather, time_ = (BLOCK.format(INVOKE.format(name=n)) for n in ("get_weather", "get_time"))
    assert not _accepts(compiler, prepared, "Easy.</think>It is sunny.")  # text is not an answer
    assert _accepts(compiler, prepared, "I call it.</think>" + time_)
    assert _accepts(compiler, prepared, "I call it.</think>" + weather) == (named is None)
    assert not _accepts(compiler, prepared, "I call" + time_ + "</think>" + time_)


def test_forced_tool_choice_parses_into_a_call(front):
    """Recipe's parser (the auto-mode parser the front uses in thinking mode) turns the held answer into
    the API's tool call."""
    prepared = _prepare(front, CHAT, "required")
    tokenizer = recipe.Tokenizer.from_file(str(builtin_model_path() / "tokenizer.json")) \
        if (builtin_model_path() / "tokenizer.json").exists() else front.tokenizer
    processor = prepared.processor(tokenizer)
    processor.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=1,
                                                                                 prompt_cache_hit_tokens=0)))
    text = "I call it.</think>" + BLOCK.format(INVOKE.format(name="get_weather"))
    events = processor.push(recipe.InferenceChunk.tokens(tokenizer.encode(text)))
    events += processor.push(recipe.InferenceChunk.finish(recipe.InferenceFinishReason.Stop))
    response = recipe.ChatCompletionResponse(prepared.response_id, "m", 0, 1, 0)
    for event in events:
        response.accumulate(event)
    choice = json.loads(response.to_json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}


def test_a_named_tool_that_is_not_declared_is_refused(front):
    with pytest.raises(ApiError) as info:
        _prepare(front, CHAT, {"type": "function", "function": {"name": "get_news"}})
    assert info.value.status == 400 and "get_news" in info.value.message


def test_non_thinking_forced_tool_choice_is_unchanged(front, compiler):
    """Outside thinking mode recipe serves required itself (the block opener already in the prompt)."""
    prepared = _prepare(front, CHAT, "required", thinking={"type": "disabled"})
    assert not prepared.is_thinking
    assert _accepts(compiler, prepared, INVOKE.format(name="get_weather") + "</｜DSML｜tool_calls>")
    auto = _prepare(front, CHAT, "auto", thinking={"type": "disabled"})
    assert _accepts(compiler, auto, "Sunny." + BLOCK.format(INVOKE.format(name="get_weather")))
    assert _accepts(compiler, auto, "It is sunny.")
    assert not _accepts(compiler, auto, "Sunny." + INVOKE.format(name="get_weather"))  # no stray invoke


# ---------------------------------------------------------------------------------------- live cluster


def _valid_call(name: str, arguments: dict) -> bool:
    import jsonschema

    schema = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}.get(name)
    if schema is None:
        return False
    try:
        jsonschema.validate(arguments, schema)
    except jsonschema.ValidationError:
        return False
    return True


NUM_SEEDS = 20


def test_thinking_tool_calls_over_seeds_through_both_sdks(cluster, default_model_dir):
    """Issue 31's battery: thinking mode (sampled at temperature 1), 20 seeds through each SDK; every tool
    call that comes back names a declared tool with arguments valid for its schema (before: 5 of 20 chat
    calls had non-JSON arguments, 11 of 20 Anthropic tool_use blocks were invalid), and a required one
    comes back as a call."""
    from concurrent.futures import ThreadPoolExecutor

    import anthropic
    import openai

    from tests.entrypoint.http.conftest import API_KEY, MAX_INFLIGHT

    model = default_model_dir.name
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    oai = openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=2, timeout=120)
    claude = anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=2, timeout=120)

    # NOTE: an answer cut by max_tokens inside a call is partial by nature; only finished calls are judged
    def chat(seed: int):
        choice = oai.chat.completions.create(model=model, messages=question, tools=CHAT_TOOLS, max_tokens=100,
                                             seed=seed, tool_choice="required" if seed % 4 == 0 else "auto",
                                             extra_body={"thinking": {"type": "enabled"}}).choices[0]
        if seed % 4 == 0 and choice.finish_reason != "length":
            assert choice.finish_reason == "tool_calls", choice.message
        if choice.finish_reason == "length":
            return []
        return [(c.function.name, c.function.arguments, f"chat seed {seed}: {choice.message}")
                for c in choice.message.tool_calls or []]

    def messages(seed: int):
        out = claude.messages.create(model=model, messages=question, tools=MESSAGES_TOOLS, max_tokens=100,
                                     thinking={"type": "enabled", "budget_tokens": 64},
                                     tool_choice={"type": "any"} if seed % 4 == 0 else {"type": "auto"},
                                     extra_body={"seed": seed})
        if out.stop_reason == "max_tokens":
            return []
        return [(b.name, json.dumps(b.input), f"messages seed {seed}: {out.content}") for b in out.content
                if b.type == "tool_use"]

    with ThreadPoolExecutor(MAX_INFLIGHT) as pool:
        chat_calls = [c for calls in pool.map(chat, range(NUM_SEEDS)) for c in calls]
        tool_uses = [c for calls in pool.map(messages, range(NUM_SEEDS)) for c in calls]
    bad = []
    for name, arguments, where in chat_calls + tool_uses:
        try:
            ok = _valid_call(name, json.loads(arguments))
        except ValueError:
            ok = False
        if not ok:
            bad.append((name, arguments, where))
    assert not bad, f"{len(bad)} of {len(chat_calls) + len(tool_uses)} calls invalid: {bad}"
    assert chat_calls and tool_uses  # the model calls tools in thinking mode (held to it for required / any)
