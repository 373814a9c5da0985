"""`RecipeStream` in-process, with the real recipe and the real V4 tokenizer: token API deltas of a
DSML tool call give the same tool call whatever the chunking; the engine's EOS is counted and not
shown; a stop sequence ends the stream early. No cluster needed."""

from __future__ import annotations

import json

import deepseek_recipe as recipe
import pytest

from deepinfer.entrypoint.http.conversion import CHAT, MESSAGES, RESPONSE_CLS, ImageUrlPolicy, RecipeFront, RecipeStream
from deepinfer.protos import common_pb2, entrypoint_pb2

EOS = 1
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
DSML = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


@pytest.fixture(scope="module")
def front(default_model_dir):
    return RecipeFront(default_model_dir, "m", 4096, ImageUrlPolicy([]))


def _deltas(token_ids: list[int], chunk: int, finish_reason: int, stop_token_id: int | None = None):
    """The token API's deltas of `token_ids`, `chunk` tokens each; the first carries the prompt usage."""
    usage = common_pb2.Usage(prompt_tokens=20, cached_prompt_tokens=8)
    out = []
    for start in range(0, len(token_ids), chunk):
        out.append(entrypoint_pb2.GenerateResponse(token_ids=token_ids[start:start + chunk]))
    out[0].usage.CopyFrom(usage)
    out[-1].finish_reason = finish_reason
    out[-1].usage.CopyFrom(common_pb2.Usage(prompt_tokens=20, completion_tokens=len(token_ids), cached_prompt_tokens=8))
    if stop_token_id is not None:
        out[-1].stop_token_id = stop_token_id
    return out


def _run(front, api: str, body: dict, deltas) -> tuple[dict, int]:
    prepared = front.prepare(api, json.dumps(body).encode())
    stream = RecipeStream(prepared, front.tokenizer)
    response = RESPONSE_CLS[api](prepared.response_id, "m", 0, 20, 8)
    events = stream.start(deltas[0])
    num_pushed = 0
    for msg in deltas:
        events += stream.push(msg)
        num_pushed += 1
        if stream.is_done:
            break
    events += stream.finish()
    for event in events:
        response.accumulate(event)
    return json.loads(response.to_json()), num_pushed


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_tool_call_parsed_the_same_whatever_the_chunking(front, chunk):
    ids = front.tokenizer.encode(DSML) + [EOS]
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [TOOL],
            "thinking": {"type": "disabled"}}
    out, _ = _run(front, CHAT, body, _deltas(ids, chunk, common_pb2.FINISH_REASON_STOP, EOS))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # every token the engine produced is counted, the EOS included, and nothing of it is shown
    assert out["usage"]["completion_tokens"] == len(ids)
    assert out["usage"]["prompt_cache_hit_tokens"] == 8 and out["usage"]["prompt_tokens"] == 20

    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}],
            "thinking": {"type": "disabled"}}
    out, _ = _run(front, MESSAGES, body, _deltas(ids, chunk, common_pb2.FINISH_REASON_STOP, EOS))
    (use,) = [b for b in out["content"] if b["type"] == "tool_use"]
    assert out["stop_reason"] == "tool_use" and use["name"] == "get_weather" and use["input"] == {"city": "Paris"}


@pytest.mark.parametrize("reported", [True, False], ids=["stop_token_id", "eos_without_stop_reason"])
def test_eos_is_counted_not_shown_and_reasoning_is_split(front, reported):
    # the engine reports no stop_reason when EOS (rather than one of stop_token_ids) ended the answer
    ids = front.tokenizer.encode("Adding: 85.</think>The answer is 85.") + [EOS]
    body = {"model": "m", "messages": [{"role": "user", "content": "What is 37 + 48?"}]}  # thinking by default
    out, _ = _run(front, CHAT, body, _deltas(ids, 3, common_pb2.FINISH_REASON_STOP, EOS if reported else None))
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] == "Adding: 85." and message["content"] == "The answer is 85."
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == len(ids)


def test_stop_sequence_ends_the_stream_early(front):
    ids = front.tokenizer.encode("one two three four five six")
    body = {"model": "m", "messages": [{"role": "user", "content": "Count"}], "stop": [" three"],
            "thinking": {"type": "disabled"}}
    deltas = _deltas(ids, 1, common_pb2.FINISH_REASON_LENGTH)
    out, num_pushed = _run(front, CHAT, body, deltas)
    assert out["choices"][0]["message"]["content"] == "one two"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert num_pushed < len(deltas)  # the rest of the stream is not read (the call gets cancelled)


def test_length_finish(front):
    ids = front.tokenizer.encode("one two three")
    body = {"model": "m", "messages": [{"role": "user", "content": "Count"}], "thinking": {"type": "disabled"}}
    out, _ = _run(front, CHAT, body, _deltas(ids, 2, common_pb2.FINISH_REASON_LENGTH))
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == len(ids)
    assert recipe.ChatCompletionResponse.sse_done_data() == "[DONE]"


def test_prepare_thinking_effort_json_and_max_tokens(front):
    def prepare(**extra):
        body = {"model": "m", "messages": [{"role": "user", "content": "Give me json for 37 + 48"}], **extra}
        return front.prepare(CHAT, json.dumps(body).encode())

    thinking, plain = prepare(), prepare(thinking={"type": "disabled"})
    end_think = front.tokenizer.encode("</think>")
    assert plain.prompt_token_ids[-len(end_think):] == end_think  # non-thinking prompts close the think block
    assert thinking.prompt_token_ids[-1:] == front.tokenizer.encode("<think>")
    # unset max_tokens: recipe's default, lowered to the context left (4096 here)
    assert thinking.max_tokens == 4096 - len(thinking.prompt_token_ids)
    assert prepare(max_tokens=7).max_tokens == 7
    assert len(prepare(reasoning_effort="max").prompt_token_ids) > len(prepare(reasoning_effort="high").prompt_token_ids)
    json_mode = prepare(response_format={"type": "json_object"}, thinking={"type": "disabled"})
    assert json_mode.request.parsing_options.parse_json_output
    params = prepare(temperature=0.3, top_p=0.5, seed=11, thinking={"type": "disabled"}).sampling_params()
    # a vision checkpoint converts as V4.1-Flash, whose top_p recipe fixes at 1.0
    top_p = 1.0 if front.has_vision else 0.5
    assert (params.temperature, params.top_p, params.seed) == (pytest.approx(0.3), pytest.approx(top_p), 11)
    assert not params.stop  # stop sequences stay with recipe's parser
    assert thinking.sampling_params().temperature == 1.0  # recipe: thinking mode samples at 1.0
    assert front.prepare(CHAT, json.dumps({"model": "DeepSeek-V4-Pro", "messages": [
        {"role": "user", "content": "x"}]}).encode()).model == "DeepSeek-V4-Pro"  # recipe's names are aliases


def test_chat_encoding_is_read_from_the_checkpoint_config(tmp_path):
    from deepinfer.entrypoint.http.conversion import chat_encoding

    config = tmp_path / "config.json"
    for content, expected in (({}, "v4"), ({"chat_encoding": "v4.1"}, "v4.1"),
                              ({"deepinfer": {"chat_encoding": "v4.1"}}, "v4.1")):
        config.write_text(json.dumps(content))
        assert chat_encoding(tmp_path) == expected
    config.write_text(json.dumps({"chat_encoding": "v5"}))
    with pytest.raises(ValueError, match="v5"):
        chat_encoding(tmp_path)
