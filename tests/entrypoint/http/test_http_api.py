"""The HTTP front against a live local cluster (balancers, prefill, decode, entrypoint, HTTP front as
processes), through the official `openai` and `anthropic` SDKs and raw HTTP.

Protocol- and format-level checks run on the default model whatever its weights (random weights
give arbitrary text, so `max_tokens` stays small); content checks live in test_builtin_model.py.
"""

from __future__ import annotations

import json
import re
import threading
import time

import anthropic
import deepseek_recipe as recipe
import httpx
import openai
import pytest

from tests.entrypoint.http.conftest import ALLOWED_IMAGE_HOST, API_KEY, MAX_BODY_BYTES, MAX_INFLIGHT

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model_name(default_model_dir) -> str:
    return default_model_dir.name


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def claude(cluster):
    with anthropic.Anthropic(base_url=cluster.http_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.http_url, headers=HEADERS, timeout=60) as client:
        yield client


def _metrics(http) -> dict[str, float]:
    """Unlabelled sums of the front's counters: {metric name (with labels) -> value}."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _engine_tokens(http, endpoint: str) -> tuple[float, float, float]:
    m = _metrics(http)
    label = f'{{endpoint="{endpoint}"}}'
    return (m.get(f"deepinfer_http_prompt_tokens_total{label}", 0.0),
            m.get(f"deepinfer_http_completion_tokens_total{label}", 0.0),
            m.get(f"deepinfer_http_cached_prompt_tokens_total{label}", 0.0))


def _wait_for(what: str, fn, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _recipe_prompt_len(model_dir, body: dict) -> int:
    """What recipe + the V4 tokenizer make of `body`, computed here independently of the server."""
    from deepinfer.engine.tokenizer import default_tokenizer_path

    tokenizer = recipe.Tokenizer.from_file(str(default_tokenizer_path()))
    options = recipe.ConversionOptions().with_model_alias(body["model"], recipe.ModelVersion.DeepseekV4Pro)
    converted = recipe.ChatCompletionRequest(body).convert(options)
    return len(recipe.DeepseekV4Encoding().with_tokenizer(tokenizer).encode(converted.conversation))


# ---------------------------------------------------------------------------------------- OpenAI


def test_chat_completion_usage_matches_engine(oai, http, model_name, default_model_dir):
    body = {"model": model_name, "messages": [{"role": "user", "content": "What is 37 + 48?"}], "max_tokens": 5}
    before = _engine_tokens(http, "/v1/chat/completions")
    out = oai.chat.completions.create(**body)
    after = _engine_tokens(http, "/v1/chat/completions")
    choice = out.choices[0]
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-") and out.model == model_name
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    # thinking mode is recipe's default: the output so far is reasoning
    assert isinstance(choice.message.reasoning_content, str)
    usage = out.usage
    assert usage.prompt_tokens == _recipe_prompt_len(default_model_dir, body)
    assert 1 <= usage.completion_tokens <= 5
    if choice.finish_reason == "length":
        assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # what the engine reported on the token API equals what the client was told
    assert after[0] - before[0] == usage.prompt_tokens
    assert after[1] - before[1] == usage.completion_tokens
    assert after[2] - before[2] == usage.prompt_tokens_details.cached_tokens


def test_chat_completion_streaming(oai, model_name):
    chunks = list(oai.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is 37 + 48?"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"thinking": {"type": "disabled"}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and finishes[0] in ("stop", "length", "tool_calls")
    usage = [c.usage for c in chunks if c.usage]
    assert usage and usage[-1].completion_tokens <= 4 and usage[-1].prompt_tokens > 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(text, str)


def test_tool_definitions_round_trip(oai, model_name, default_model_dir):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=2)
    body = {"model": model_name, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 2}
    with_tool = oai.chat.completions.create(**body)
    # the tool schema is rendered into the prompt (DSML instructions + the schema)
    assert with_tool.usage.prompt_tokens == _recipe_prompt_len(default_model_dir, body)
    assert with_tool.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    # a tool call in the history and the tool's result are accepted back
    history = messages + [
        {"role": "assistant", "content": "", "reasoning_content": "I call get_weather.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    again = oai.chat.completions.create(model=model_name, messages=history, tools=[WEATHER_TOOL], max_tokens=2,
                                        tool_choice="auto")
    assert again.usage.prompt_tokens > with_tool.usage.prompt_tokens
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_responses_text_and_stream(oai, model_name):
    out = oai.responses.create(model=model_name, input="What is 37 + 48?", max_output_tokens=4)
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status in ("completed", "incomplete")  # random weights rarely end before the limit
    assert out.usage.output_tokens <= 4 and out.usage.input_tokens > 0
    events = list(oai.responses.create(model=model_name, input="What is 37 + 48?", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] in ("response.completed", "response.incomplete")
    if types[-1] == "response.incomplete":
        assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_completions_and_generate(oai, http, model_name):
    out = oai.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.completion_tokens <= 3 and out.usage.prompt_tokens > 0
    chunks = list(oai.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=3, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text  # greedy: same text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens

    gen = http.post("/v1/generate", json={"token_ids": [5, 6, 7, 8], "sampling_params": {
        "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}})
    assert gen.status_code == 200, gen.text
    choice = gen.json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"
    assert gen.json()["usage"]["prompt_tokens"] == 4
    with http.stream("POST", "/v1/generate", json={"token_ids": [5, 6, 7, 8], "stream": True, "sampling_params": {
            "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}}) as resp:
        lines = [ln[6:] for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    streamed = [t for ln in lines[:-1] for t in json.loads(ln)["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]


def test_models_health_metrics(http, cluster, model_name):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == model_name
    assert {"DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash"} <= {m["id"] for m in models["data"]}
    # no key needed; the numerics flag the workers run with is reported
    assert httpx.get(cluster.http_url + "/health").json() == {"status": "ok", "batch_invariant": False}
    text = http.get("/metrics").text
    for name in ("deepinfer_http_requests_total", "deepinfer_http_time_to_first_token_seconds_bucket",
                 "deepinfer_http_inter_token_latency_seconds_bucket", "deepinfer_http_requests_in_flight",
                 "deepinfer_entrypoint_healthy_instances"):
        assert name in text
    assert re.search(r'deepinfer_http_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text)
    # the stage instances' own stats, gathered through the balancers
    metrics = _metrics(http)
    sent = metrics['deepinfer_stage_kv_transfer_sent_bytes_total{instance="prefill-0",stage="prefill"}']
    assert sent > 0 and sent == metrics['deepinfer_stage_kv_transfer_received_bytes_total{instance="decode-0",stage="decode"}']
    assert metrics['deepinfer_stage_num_kv_blocks_total{instance="decode-0",stage="decode"}'] == 256


# ---------------------------------------------------------------------------------------- Anthropic


def test_messages_and_stream(claude, model_name):
    out = claude.messages.create(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert out.type == "message" and out.role == "assistant"
    assert out.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    assert out.usage.output_tokens <= 4
    with claude.messages.stream(model=model_name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "disabled"}) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert final.usage.output_tokens <= 4


def test_messages_tool_definitions(claude, model_name):
    tool = {"name": "get_weather", "description": "Get the current weather in a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}
    out = claude.messages.create(model=model_name, max_tokens=2, tools=[tool],
                                 messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    plain = claude.messages.create(model=model_name, max_tokens=2,
                                   messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    total = out.usage.input_tokens + out.usage.cache_read_input_tokens
    assert total > plain.usage.input_tokens + plain.usage.cache_read_input_tokens + 50


# ---------------------------------------------------------------------------------------- cache


def test_same_prompt_twice_reports_cached_tokens(oai, model_name):
    # unique text, long enough to fill several KV blocks beyond the shared template prefix
    words = " ".join(f"item{i}-{time.time_ns() % 100000}" for i in range(60))
    messages = [{"role": "user", "content": f"Remember this list: {words}"}]
    first = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    second = oai.chat.completions.create(model=model_name, messages=messages, max_tokens=1)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 200
    cached1, cached2 = first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens
    assert cached2 > cached1 and cached2 >= second.usage.prompt_tokens // 2
    assert second.usage.model_extra["prompt_cache_hit_tokens"] == cached2


# ---------------------------------------------------------------------------------------- bad input


def _openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _anthropic_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
    return body["error"]


def test_bad_input_battery(http, cluster, oai, model_name):
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    ok = {"model": model_name, "messages": user, "max_tokens": 1}
    assert _openai_error(http.post(chat, content=b""), 400)["type"] == "invalid_request_error"
    assert "JSON" in _openai_error(http.post(chat, content=b'{"model": "x", "messages": [', headers={
        "content-type": "application/json"}), 400)["message"]
    assert "messages" in _openai_error(http.post(chat, json={"model": model_name}), 400)["message"]
    _openai_error(http.post(chat, json={**ok, "messages": []}), 400)
    assert "bogus" in _openai_error(http.post(chat, json={**ok, "messages": [{"role": "bogus", "content": "x"}]}),
                                    400)["message"]
    _openai_error(http.post(chat, json={**ok, "messages": [{"role": "user", "content": 5}]}), 400)
    _openai_error(http.post(chat, json={**ok, "messages": [{"role": "user", "content": [{"type": "nope"}]}]}), 400)
    assert "max_tokens" in _openai_error(http.post(chat, json={**ok, "max_tokens": 0}), 400)["message"]
    _openai_error(http.post(chat, json={**ok, "max_tokens": -3}), 400)  # recipe: "expected u32"
    beyond = _openai_error(http.post(chat, json={**ok, "max_tokens": 100000}), 400)
    assert "context" in beyond["message"]
    for temperature in (-0.5, 2.5):
        assert "temperature" in _openai_error(http.post(chat, json={**ok, "temperature": temperature}), 400)["message"]
    for top_p in (0, 1.5):
        assert "top_p" in _openai_error(http.post(chat, json={**ok, "top_p": top_p}), 400)["message"]
    unknown = _openai_error(http.post(chat, json={**ok, "model": "no-such-model"}), 404)
    assert unknown["code"] == "model_not_found" and unknown["param"] == "model"
    assert "Stop" in _openai_error(http.post(chat, json={**ok, "stop": [f"s{i}" for i in range(17)]}), 400)["message"]
    # n > 1 is served without streaming (test_front_contract.py); streamed or past 16 it is refused
    assert _openai_error(http.post(chat, json={**ok, "n": 2, "stream": True}), 400)["param"] == "n"
    assert _openai_error(http.post(chat, json={**ok, "n": 17}), 400)["param"] == "n"
    assert "top_logprobs" in _openai_error(http.post(chat, json={**ok, "logprobs": True, "top_logprobs": 21}), 400)["message"]
    _openai_error(http.post(chat, json={**ok, "tools": [{"type": "function"}]}), 400)
    _openai_error(http.post(chat, json={**ok, "tools": [{"type": "function", "function": {"parameters": {}}}]}), 400)
    image = {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {
        "url": "http://169.254.169.254/latest/meta-data.png"}}]}
    error = _openai_error(http.post(chat, json={**ok, "messages": [image]}), 400)
    assert error["code"] == "image_url_not_allowed" and ALLOWED_IMAGE_HOST in error["message"]
    responses_image = {"model": model_name, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "http://10.0.0.1/a.png"}]}]}
    assert _openai_error(http.post("/v1/responses", json=responses_image), 400)["code"] == "image_url_not_allowed"
    messages_image = {"model": model_name, "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://localhost/a.png"}}]}]}
    assert "not allowed" in _anthropic_error(http.post("/v1/messages", json=messages_image), 400)["message"]
    big = {**ok, "messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}
    assert _openai_error(http.post(chat, json=big), 413)["code"] == "request_too_large"
    chunked = (b"x" * 65536 for _ in range(MAX_BODY_BYTES // 65536 + 2))  # no Content-Length: counted as read
    assert _openai_error(http.post(chat, content=chunked), 413)["code"] == "request_too_large"
    # API keys: missing, wrong, and the Anthropic header
    assert _openai_error(httpx.post(cluster.http_url + chat, json=ok), 401)["code"] == "invalid_api_key"
    _openai_error(httpx.post(cluster.http_url + chat, json=ok, headers={"Authorization": "Bearer wrong"}), 401)
    _openai_error(httpx.get(cluster.http_url + "/v1/models"), 401)
    messages = "/v1/messages"
    assert _anthropic_error(httpx.post(cluster.http_url + messages, json={}, headers={"x-api-key": "wrong"}),
                            401)["type"] == "authentication_error"
    # Anthropic-shaped errors on /v1/messages
    msg_ok = {"model": model_name, "max_tokens": 1, "messages": user}
    _anthropic_error(http.post(messages, content=b"{"), 400)
    _anthropic_error(http.post(messages, json={**msg_ok, "messages": []}), 400)
    assert _anthropic_error(http.post(messages, json={**msg_ok, "model": "nope"}), 404)["type"] == "not_found_error"
    assert _anthropic_error(http.post(messages, json={**msg_ok, "messages": [{"role": "user", "content": "x" * (
        MAX_BODY_BYTES + 10)}]}), 413)["type"] == "request_too_large"
    # the other routes
    _openai_error(http.post("/v1/responses", json={"model": model_name, "input": []}), 400)
    _openai_error(http.post("/v1/completions", json={"model": model_name, "prompt": "x", "temperature": 3}), 400)
    _openai_error(http.post("/v1/completions", json={"model": model_name, "prompt": "x", "n": 17}), 400)
    # the token API's own validation (gRPC INVALID_ARGUMENT) comes back as a 400 naming the field
    oov = _openai_error(http.post("/v1/generate", json={"token_ids": [5, 10**6], "sampling_params": {
        "max_tokens": 1}}), 400)
    assert oov["param"] == "prompt_token_ids" and "vocabulary" in oov["message"]
    _openai_error(http.post("/v1/generate", json={"token_ids": [5], "sampling_params": {"bogus": 1}}), 400)
    assert _openai_error(http.get("/v1/nope"), 404)["message"]

    # still healthy, and serving
    assert httpx.get(cluster.http_url + "/health").status_code == 200
    out = oai.chat.completions.create(model=model_name, messages=user, max_tokens=2)
    assert out.usage.completion_tokens <= 2
    _wait_for("blocks freed", cluster.blocks_freed)


# ---------------------------------------------------------------------------------------- limits, disconnects


# NOTE: requests that must outlive the client use /v1/generate with ignore_eos, so they run long
# whatever the weights (a trained model ends a chat answer after a few tokens).
LONG_GENERATE = {"token_ids": [1000, 2000, 3000], "sampling_params": {"max_tokens": 3000, "ignore_eos": True}}


def test_client_disconnect_frees_blocks_everywhere(cluster, http, model_name):
    body = {**LONG_GENERATE, "model": model_name, "stream": True}
    with httpx.Client(base_url=cluster.http_url, headers=HEADERS, timeout=60) as client:
        with client.stream("POST", "/v1/generate", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # NOTE: leaving a for loop over it would close the response
            events = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
            assert len(events) == 3 and all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in events)
            assert cluster.worker_stats("decode")["num_kv_blocks_used"] > 0
    # the connection is closed: the request is aborted on every stage
    _wait_for("blocks freed after the stream was dropped", cluster.blocks_freed)

    # a non-streaming request whose client times out
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster.http_url + "/v1/generate", json={**body, "stream": False}, headers=HEADERS,
                   timeout=httpx.Timeout(60, read=1.5))
    _wait_for("blocks freed after the client timed out", cluster.blocks_freed)
    _wait_for("no request in flight at the front", lambda: _metrics(http)["deepinfer_http_requests_in_flight"] == 0)


def test_inflight_cap_answers_429_with_retry_after(cluster, http, model_name):
    body = {"model": model_name, "messages": [{"role": "user", "content": "Count forever."}], "max_tokens": 3000,
            "stream": True}
    clients = [httpx.Client(base_url=cluster.http_url, headers=HEADERS, timeout=60) for _ in range(MAX_INFLIGHT)]
    streams = []
    try:
        for client in clients:  # hold every slot with a running stream
            stream = client.stream("POST", "/v1/generate", json={**LONG_GENERATE, "stream": True})
            resp = stream.__enter__()
            assert resp.status_code == 200
            streams.append(stream)
        full = http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1})
        assert _openai_error(full, 429)["type"] == "rate_limit_error"
        assert int(full.headers["retry-after"]) >= 0
        assert _anthropic_error(http.post("/v1/messages", json={**body, "max_tokens": 1}), 429)["type"] == \
            "rate_limit_error"
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        for client in clients:
            client.close()
    _wait_for("blocks freed", cluster.blocks_freed)
    _wait_for("slots free", lambda: _metrics(http)["deepinfer_http_requests_in_flight"] == 0)
    assert http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1}).status_code == 200


def test_image_fetcher_destination_filter():
    """The allow-list as recipe's fetcher hook: a URL of another host is never connected to."""
    from deepinfer.entrypoint.http.conversion import ImageUrlPolicy, image_urls

    assert sorted(image_urls({"messages": [{"content": [
        {"type": "image_url", "image_url": {"url": "http://a/1.png"}},
        {"type": "input_image", "image_url": "http://b/2.png"},
        {"type": "image", "source": {"type": "url", "url": "http://c/3.png"}},
        {"type": "text", "text": "http://not-an-image/"}]}]})) == ["http://a/1.png", "http://b/2.png", "http://c/3.png"]
    policy = ImageUrlPolicy([ALLOWED_IMAGE_HOST])
    with pytest.raises(recipe.ImageError) as e:
        policy.fetcher(1 << 20).fetch("http://127.0.0.1:9/secret.png")
    assert e.value.kind == "DestinationRejected"
    policy.check(f"https://{ALLOWED_IMAGE_HOST}/cat.png")
    policy.check("data:image/png;base64,AAAA")
    for url in ("http://127.0.0.1/a.png", "file:///etc/passwd", f"ftp://{ALLOWED_IMAGE_HOST}/a.png"):
        with pytest.raises(Exception) as refused:
            policy.check(url)
        assert refused.value.status == 400


def test_concurrent_streams_are_independent(oai, model_name):
    results: list = [None] * MAX_INFLIGHT

    def one(i: int) -> None:
        results[i] = oai.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": f"Say {i}"}], max_tokens=3, temperature=0,
            extra_body={"thinking": {"type": "disabled"}})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(MAX_INFLIGHT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None and r.usage.completion_tokens <= 3 for r in results)


def test_unreachable_entrypoint_answers_503_with_retry_after(tmp_path, default_model_dir):
    """A front whose token entrypoint is gone: 503 + Retry-After in each API's shape, /health 503."""
    import subprocess
    import sys

    from tests.entrypoint.http.cluster import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.entrypoint.http", "--entrypoint", "127.0.0.1:9", "--port", "0",
                             "--model", str(default_model_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=open(tmp_path / "http.err", "w"), text=True)
    try:
        url = json.loads(proc.stdout.readline())["address"]
        body = {"model": default_model_dir.name, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert _openai_error(resp, 503)["type"] == "service_unavailable_error"
        assert resp.headers["retry-after"] == "1" and "127.0.0.1:9" not in resp.text  # no internals
        assert _anthropic_error(httpx.post(url + "/v1/messages", json=body, timeout=30), 503)["type"] == \
            "overloaded_error"
        assert httpx.get(url + "/health", timeout=30).status_code == 503
    finally:
        proc.terminate()
        proc.wait(10)
