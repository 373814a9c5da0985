"""Structured outputs and sampling penalties through the HTTP front.

In-process (no cluster): recipe's output constraint becomes the token API's `StructuredOutput`
(JSON mode, json_schema, regex, DSML tool calls; a free reasoning part in thinking mode), the DSML
tool-call grammar accepts exactly what recipe renders, and penalties reach the sampling params or
are refused. Live (the local cluster with the built-in model, the official openai SDK): JSON mode,
a json_schema and a regex response format give content that parses / validates / matches, a
required tool call comes back as `tool_calls`, and bad values are 400s.
"""

from __future__ import annotations

import json
import re

import deepseek_recipe as recipe
import httpx
import openai
import pytest

from deepinfer.engine.sampling import StructuredOutputParams
from deepinfer.engine.structured_output import GrammarCompiler
from deepinfer.engine.tokenizer import load_tokenizer
from deepinfer.entrypoint.http.conversion import CHAT, RESPONSES, ImageUrlPolicy, RecipeFront
from deepinfer.entrypoint.http.errors import ApiError
from deepinfer.protos.convert import structured_output_from_proto
from tests.entrypoint.http.conftest import API_KEY

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"], "additionalProperties": False}
EOS = 1


@pytest.fixture(scope="module")
def front(default_model_dir):
    return RecipeFront(default_model_dir, "m", 4096, ImageUrlPolicy([]))


@pytest.fixture(scope="module")
def compiler():
    tokenizer = load_tokenizer()
    return tokenizer, GrammarCompiler(tokenizer, tokenizer.get_vocab_size(), [EOS])


def _chat(front: RecipeFront, **body):
    return front.prepare(CHAT, json.dumps({"model": "m", "messages": [{"role": "user", "content": "Reply in json"}],
                                           **body}).encode())


def test_json_mode_schema_and_regex_become_token_api_constraints(front):
    thinking = _chat(front, response_format={"type": "json_object"})
    so = thinking.sampling_params().structured_output
    assert so.json_schema == '{"type":"object"}' and so.reasoning_end == "</think>"  # thinking: answer after it
    plain = _chat(front, response_format={"type": "json_object"}, thinking={"type": "disabled"})
    so = plain.sampling_params().structured_output
    assert so.json_schema == '{"type":"object"}' and not so.HasField("reasoning_end")
    schema = _chat(front, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert json.loads(schema.sampling_params().structured_output.json_schema) == SCHEMA
    regex = _chat(front, response_format={"type": "regex", "regex": "[0-9]+"}, thinking={"type": "disabled"})
    assert regex.sampling_params().structured_output.regex == "[0-9]+"
    responses = front.prepare(RESPONSES, json.dumps({"model": "m", "input": "json please", "text": {"format": {
        "type": "json_schema", "name": "a", "schema": SCHEMA}}}).encode())
    assert json.loads(responses.sampling_params().structured_output.json_schema) == SCHEMA
    text = _chat(front)
    assert not text.sampling_params().HasField("structured_output")
    # every one converts into a valid engine constraint
    for prepared in (thinking, plain, schema, regex, responses):
        structured_output_from_proto(prepared.sampling_params().structured_output)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_tool_call_grammar_accepts_what_recipe_renders(front, compiler, tool_choice):
    tokenizer, grammar_compiler = compiler
    thinking = {"type": "enabled" if tool_choice == "auto" else "disabled"}
    prepared = _chat(front, tools=[WEATHER_TOOL], tool_choice=tool_choice, thinking=thinking)
    params = structured_output_from_proto(prepared.sampling_params().structured_output)
    assert params.structural_tag is not None
    # the assistant turn recipe renders for a call (history), as the model would write it after the prompt
    tool = recipe.ToolDefinition("get_weather", "Get the current weather in a city.",
                                 WEATHER_TOOL["function"]["parameters"])
    user = recipe.UserMessage("Reply in json")
    call = recipe.AssistantMessage("", reasoning_content="I call the tool." if thinking["type"] == "enabled" else None,
                                   tool_calls=[recipe.ToolCall("c1", "get_weather", '{"city": "Paris"}')])
    encoding = recipe.DeepseekV4Encoding()
    is_thinking = thinking["type"] == "enabled"
    before = encoding.render_conversation(recipe.Conversation([user], tools=[tool], thinking_mode=is_thinking)).prompt
    after = encoding.render_conversation(recipe.Conversation([user, call, recipe.UserMessage("ok")], tools=[tool],
                                                             thinking_mode=is_thinking)).prompt
    completion = after[len(before):after.index("<｜end▁of▁sentence｜>")]
    assert "<｜DSML｜invoke" in completion
    if tool_choice == "required":  # recipe renders that prompt with the block's opener in place
        opener = "\n\n<｜DSML｜tool_calls>\n"
        assert completion.startswith(opener)
        assert prepared.prompt_token_ids[-7:] == tokenizer.encode(opener, add_special_tokens=False).ids
        completion = completion.removeprefix(opener)
    state = grammar_compiler.new_state(params)
    ids = tokenizer.encode(completion, add_special_tokens=False).ids + [EOS]
    assert state.advance_to(ids) and state.is_terminated, completion
    # a call of an unknown tool, or bad parameters, is not accepted
    for bad in (completion.replace("get_weather", "get_time"), completion.replace('name="city"', 'name="town"')):
        state = grammar_compiler.new_state(params)
        assert not state.advance_to(tokenizer.encode(bad, add_special_tokens=False).ids + [EOS]), bad
    if tool_choice == "required":  # plain text is not a tool call
        state = grammar_compiler.new_state(params)
        assert not state.advance_to(tokenizer.encode("Sunny.", add_special_tokens=False).ids)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_allows_one_invoke(front, compiler, parallel):
    tokenizer, grammar_compiler = compiler
    prepared = _chat(front, tools=[WEATHER_TOOL], tool_choice="required", thinking={"type": "disabled"},
                     parallel_tool_calls=parallel)
    params = structured_output_from_proto(prepared.sampling_params().structured_output)
    invoke = ('<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">{}</｜DSML｜parameter>'
              '\n</｜DSML｜invoke>\n')
    opener = "\n\n<｜DSML｜tool_calls>\n"
    # recipe renders a required call's prompt with the block's opener in place: the answer starts at the invoke
    assert prepared.prompt_token_ids[-7:] == tokenizer.encode(opener, add_special_tokens=False).ids
    for cities in (["Paris"], ["Paris", "Rome"]):
        text = "".join(invoke.format(c) for c in cities) + "</｜DSML｜tool_calls>"
        state = grammar_compiler.new_state(params)
        accepted = state.advance_to(tokenizer.encode(text, add_special_tokens=False).ids + [EOS])
        assert accepted == (len(cities) == 1 or parallel), text
        # a second opener (what the model was held to before) is not an answer
        state = grammar_compiler.new_state(params)
        assert not state.advance_to(tokenizer.encode(opener + text, add_special_tokens=False).ids + [EOS])


def test_penalties_reach_the_sampling_params_and_bad_ones_are_refused(front):
    params = _chat(front, presence_penalty=1.5, frequency_penalty=-0.5).sampling_params()
    assert params.presence_penalty == 1.5 and params.frequency_penalty == -0.5
    assert _chat(front).sampling_params().presence_penalty == 0.0
    for name, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("presence_penalty", "high")):
        with pytest.raises(ApiError) as info:
            _chat(front, **{name: value})
        assert info.value.status == 400 and name in str(info.value)


def test_completions_response_format_and_refused_guided_fields():
    from deepinfer.entrypoint.http.completions import CompletionBody, parse

    def params(**body):
        return parse(CompletionBody, json.dumps({"model": "m", "prompt": "x", **body}).encode()).sampling_params()

    assert not params().HasField("structured_output")
    assert not params(response_format={"type": "text"}).HasField("structured_output")
    assert params(response_format={"type": "json_object"}).structured_output.json_schema == '{"type":"object"}'
    schema = params(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert json.loads(schema.structured_output.json_schema) == SCHEMA
    assert params(response_format={"type": "regex", "regex": "a+"}).structured_output.regex == "a+"
    for body in ({"response_format": {"type": "xml"}}, {"response_format": {"type": "regex"}},
                 {"guided_json": {"type": "object"}}, {"structured_outputs": {"regex": "a"}}):
        with pytest.raises(ApiError) as info:
            params(**body)
        assert info.value.status == 400


def test_constraint_compiles_as_the_engine_would(compiler):
    _, grammar_compiler = compiler
    grammar_compiler.compile(StructuredOutputParams(any_json=True, reasoning_end="</think>"))
    grammar_compiler.compile(StructuredOutputParams(json_schema=json.dumps(SCHEMA), reasoning_end="</think>"))


# ---------------------------------------------------------------------------------------- live cluster


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.http_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def _json_mode(oai, default_model_dir, thinking: str):
    messages = [{"role": "user", "content": "What is 37 + 48? Answer in JSON."}]
    # thinking mode gets room for the reasoning: JSON mode holds only the content after `</think>`
    # (the built-in model's reasoning alone can take 60 tokens, leaving no content to check)
    max_tokens = 60 if thinking == "disabled" else 200
    return oai.chat.completions.create(model=default_model_dir.name, messages=messages, max_tokens=max_tokens,
                                       temperature=0.0, response_format={"type": "json_object"},
                                       extra_body={"thinking": {"type": thinking}}).choices[0]


@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
def test_json_mode_content_is_held_to_json(oai, default_model_dir, compiler, thinking):
    """Whatever the weights, JSON mode's content is a JSON object, or (cut by max_tokens) a prefix of one."""
    tokenizer, grammar_compiler = compiler
    choice = _json_mode(oai, default_model_dir, thinking)
    content = choice.message.content
    assert content.startswith("{"), content
    if thinking == "enabled":
        assert choice.message.reasoning_content and "</think>" not in choice.message.reasoning_content
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert choice.finish_reason == "length"
        state = grammar_compiler.new_state(StructuredOutputParams(json_schema='{"type": "object"}'))
        assert state.advance_to(tokenizer.encode(content, add_special_tokens=False).ids), content


def test_json_mode_builtin_model_finishes_a_valid_object(oai, default_model_dir):
    for thinking in ("disabled", "enabled"):
        choice = _json_mode(oai, default_model_dir, thinking)
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_and_regex_response_formats(oai, default_model_dir):
    messages = [{"role": "user", "content": "What is 37 + 48?"}]
    out = oai.chat.completions.create(
        model=default_model_dir.name, messages=messages, max_tokens=200, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}},
        extra_body={"thinking": {"type": "disabled"}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = oai.chat.completions.create(
        model=default_model_dir.name, messages=messages, max_tokens=20, temperature=0.0,
        extra_body={"thinking": {"type": "disabled"}, "response_format": {"type": "regex", "regex": "[0-9]{2,3}"}})
    assert re.fullmatch("[0-9]{2,3}", out.choices[0].message.content)


def test_required_tool_call_comes_back_as_tool_calls(oai, default_model_dir):
    out = oai.chat.completions.create(
        model=default_model_dir.name, messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=60,
        temperature=0.0, tools=[WEATHER_TOOL], tool_choice="required", extra_body={"thinking": {"type": "disabled"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0].function
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_auto_tool_call_is_well_formed_streaming_and_not(oai, default_model_dir, thinking):
    """`tool_choice` auto: the answer may be text or DSML calls; the calls that come back are well formed.

    NOTE: thinking mode samples at temperature 1 (recipe's rule) and this model's reasoning often runs
    past max_tokens or ends in text; seed 6 is one whose answer is a call (measured: 3 of seeds 0-7)."""
    kwargs = dict(model=default_model_dir.name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[WEATHER_TOOL], max_tokens=80, temperature=0.0, seed=6,
                  extra_body={"thinking": {"type": thinking}})
    choice = oai.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"] and isinstance(calls[0][1]["city"], str)
    if thinking == "disabled":  # greedy; thinking mode samples at temperature 1 (recipe), seeded here
        streamed: dict[int, list[str]] = {}
        for chunk in oai.chat.completions.create(**kwargs, stream=True):
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = streamed.setdefault(delta.index, ["", ""])
                entry[0] += (delta.function.name or "") if delta.function else ""
                entry[1] += (delta.function.arguments or "") if delta.function else ""
        assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == calls


def test_frequency_penalty_changes_a_repetitive_answer(oai, default_model_dir):
    """The built-in model copies "red red red red blue"; penalising repeats (generated tokens only) breaks the copy."""
    def answer(**penalty) -> str:
        return oai.chat.completions.create(
            model=default_model_dir.name, max_tokens=20, temperature=0.0, extra_body={"thinking": {"type": "disabled"}},
            messages=[{"role": "user", "content": "Repeat these words: red red red red blue"}],
            **penalty).choices[0].message.content

    # frequency 2.0 alone no longer breaks this model's copy (measured 2026-12-03: the same answer)
    plain, penalised = answer(), answer(frequency_penalty=2.0, presence_penalty=2.0)
    assert plain == "red red red red blue"
    assert penalised != plain and penalised.count("red") < plain.count("red")


def test_bad_constraints_and_penalties_are_400(http, default_model_dir):
    chat = {"model": default_model_dir.name, "messages": [{"role": "user", "content": "json"}], "max_tokens": 4,
            "thinking": {"type": "disabled"}}
    bad_schema = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "no-such-type"}}}}
    reply = http.post("/v1/chat/completions", json=bad_schema)  # recipe checks the schema itself
    assert reply.status_code == 400 and "schema" in reply.json()["error"]["message"], reply.text
    reply = http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "regex", "regex": "(a"}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_output", reply.text
    for name, value in (("presence_penalty", 2.01), ("frequency_penalty", -2.5)):
        reply = http.post("/v1/chat/completions", json={**chat, name: value})
        assert reply.status_code == 400 and name in reply.text, reply.text
        reply = http.post("/v1/completions", json={"model": default_model_dir.name, "prompt": "x", name: value})
        assert reply.status_code == 400 and name in reply.text, reply.text
    reply = http.post("/v1/completions", json={"model": default_model_dir.name, "prompt": "x",
                                               "repetition_penalty": 0})
    assert reply.status_code == 400 and "repetition_penalty" in reply.text
    reply = http.post("/v1/generate", json={"token_ids": [5, 6], "sampling_params": {
        "max_tokens": 2, "repetition_penalty": -1}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "repetition_penalty"
    # penalties and a constraint are served on the raw routes too
    ok = http.post("/v1/completions", json={"model": default_model_dir.name, "prompt": "red green", "max_tokens": 3,
                                            "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                            "repetition_penalty": 1.2})
    assert ok.status_code == 200, ok.text
    out = http.post("/v1/completions", json={"model": default_model_dir.name, "prompt": "Reverse these words: red blue",
                                             "max_tokens": 8, "temperature": 0,
                                             "response_format": {"type": "regex", "regex": "(red|blue)( (red|blue))?"}})
    assert re.fullmatch("(red|blue)( (red|blue))?", out.json()["choices"][0]["text"]), out.text
    reply = http.post("/v1/completions", json={"model": default_model_dir.name, "prompt": "x", "guided_regex": "a"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "guided_regex"
    out = http.post("/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": {
        "max_tokens": 8, "temperature": 0, "structured_output": {"regex": "(yes|no)"}}}).json()
    assert out["choices"][0]["text"] in ("yes", "no") and out["choices"][0]["finish_reason"] == "stop"
