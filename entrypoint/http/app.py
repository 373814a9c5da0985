"""The FastAPI app of the HTTP front: routes, API keys, body and in-flight limits, SSE, disconnects.

```python
app = create_app(HttpConfig(entrypoint="127.0.0.1:50051", model=ckpt))   # an ASGI app
serve(HttpConfig(...))                                                   # blocks: uvicorn
```

`/v1/chat/completions`, `/v1/responses`, `/v1/messages` go through recipe (`conversion.RecipeFront`);
`/v1/completions` (raw prompt) and `/v1/generate` (token ids in and out) go straight to the token API.
Every generation request holds one in-flight slot from its body being read until its last byte is
sent; a client that disconnects cancels its token call, which aborts the request on every stage.

Every answer carries `X-Request-Id` (the client's own when it sent a plain one, else the request's id:
the answer's `id`, which its token call and every stage's log lines carry) and gets one access-log line
(`entrypoint.http.access`). Chat / responses / messages answers say how they were sampled
(`X-DeepInfer-Thinking`, `X-DeepInfer-Sampling`, `X-DeepInfer-Sampling-Overridden`; `conversion.Prepared`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deepinfer.engine.config import read_config_json
from deepinfer.entrypoint.http import completions
from deepinfer.entrypoint.http.backend import TokenBackend, TokenCall
from deepinfer.entrypoint.http.config import HttpConfig
from deepinfer.entrypoint.http.conversion import (
    CHAT,
    MESSAGES,
    RESPONSE_CLS,
    RESPONSES,
    ImageUrlPolicy,
    Prepared,
    RecipeFront,
    RecipeStream,
    tokenizer_path,
)
from deepinfer.entrypoint.http.errors import ApiError, json_object
from deepinfer.entrypoint.http.keys import KeyLimiter, find_key, parse_keys
from deepinfer.entrypoint.http.metrics import HttpMetrics
from deepinfer.protos import entrypoint_pb2
from deepinfer.serving.logs import REQUEST_ID

logger = logging.getLogger("entrypoint.http")
access_logger = logging.getLogger("entrypoint.http.access")

REQUEST_ID_HEADER = "x-request-id"
"""Every response carries it: the client's own id when it sent a valid one, else the request's id
(the `id` of the answer, which every stage's log lines carry)."""
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
"""What a client's X-Request-Id may look like to be echoed (anything else is replaced, not echoed)."""

KNOWN_ROUTES = {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions", "/v1/generate",
                "/v1/models", "/health", "/metrics", "/version", "/tokenize"}
"""Paths that get their own `endpoint` metric label (others count as "other")."""
GENERATION_ROUTES = {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions", "/v1/generate"}
"""POST routes that generate: they count against their API key's concurrency and rate limits."""
SEED_HEADER = "X-DeepInfer-Seed"
"""The seed a seeded request sampled with (choice i of n used seed + i); also echoed as `usage.seed`."""


def _is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def _error_response(path: str, e: ApiError) -> JSONResponse:
    body = e.anthropic_body() if _is_anthropic(path) else e.openai_body()
    return JSONResponse(body, status_code=e.status, headers=e.headers())


class _ClientGone(Exception):
    """The client disconnected; nothing more is sent."""


# ---------------------------------------------------------------------------------------- state


class Front:
    """What the app shares between requests: config, recipe converter, token backend, metrics, slots."""

    def __init__(self, config: HttpConfig) -> None:
        if not config.entrypoint:
            raise ValueError("the HTTP front needs the token entrypoint's address (--entrypoint HOST:PORT)")
        from deepinfer.engine.hub import looks_like_repo_id, resolve_model

        model_dir = resolve_model(config.model, config.revision)  # a repo id: its cached snapshot, as the workers
        model_cfg = read_config_json(model_dir)
        self.config = config
        keys = config.api_key or os.environ.get("DEEPINFER_API_KEY") or _read_key_file()
        self.api_keys = parse_keys(keys)
        """Accepted API keys (any one) with their policies (`keys`); empty = no key needed."""
        self.limiter = KeyLimiter(config.key_max_concurrent_requests, config.key_requests_per_minute,
                                  config.default_traffic_class, config.retry_after_s)
        is_repo = config.model is not None and looks_like_repo_id(config.model) and not Path(config.model).is_dir()
        self.served_model_name = config.served_model_name or (config.model.split("/")[-1] if is_repo else model_dir.name)
        text_cfg = model_cfg.get("text_config") or model_cfg  # V4.1's published config nests the language model
        self.max_model_len = config.max_model_len or min(text_cfg["max_position_embeddings"], 8192)
        policy = ImageUrlPolicy(config.image_url_allowed_hosts.split(","))
        self.recipe = RecipeFront(model_dir, self.served_model_name, self.max_model_len, policy,
                                  default_thinking=config.default_thinking,
                                  thinking_sampling=config.thinking_sampling)
        self.token_texts = completions.TokenTexts(str(tokenizer_path(model_dir)))
        """Token id -> text, for /v1/completions logprobs."""
        self.metrics = HttpMetrics()
        self.backend: TokenBackend | None = None
        """Created on the server's event loop (lifespan)."""
        self.num_inflight = 0

    def acquire(self) -> None:
        """Take an in-flight slot; raises 429 with Retry-After when all are taken."""
        if self.num_inflight >= self.config.max_inflight_requests:
            self.metrics.rejected.inc()
            raise ApiError(429, f"the server is serving its maximum of {self.config.max_inflight_requests} "
                           "requests; retry later", code="rate_limit_exceeded", retry_after_s=self.config.retry_after_s)
        self.num_inflight += 1
        self.metrics.inflight.set(self.num_inflight)

    def release(self) -> None:
        self.num_inflight -= 1
        self.metrics.inflight.set(self.num_inflight)


class _Run:
    """One generation request in flight: its token call, the disconnect watch, its slot and timings."""

    def __init__(self, front: Front, endpoint: str, request: Request, call: TokenCall, t_accept: float) -> None:
        self.front = front
        self.endpoint = endpoint
        self.call = call
        self.t_accept = t_accept
        self.t_last: float | None = None
        self.is_client_gone = False
        self.is_closed = False
        self._watch = asyncio.ensure_future(self._watch_disconnect(request.receive))

    async def _watch_disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.is_client_gone = True
        self.call.cancel()

    async def read(self) -> entrypoint_pb2.GenerateResponse | None:
        """Blocks for the next delta (None at the end); raises `_ClientGone` or `ApiError`."""
        try:
            msg = await self.call.read()
        except (ApiError, asyncio.CancelledError):
            if self.is_client_gone:
                raise _ClientGone() from None
            raise
        if msg is None:
            return None
        now = time.monotonic()
        m = self.front.metrics
        if msg.token_ids:
            if self.t_last is None:
                m.ttft.labels(self.endpoint).observe(now - self.t_accept)
            else:
                m.itl.labels(self.endpoint).observe((now - self.t_last) / len(msg.token_ids))
            self.t_last = now
        if msg.finish_reason:  # the engine's own count, whatever the API reports
            m.prompt_tokens.labels(self.endpoint).inc(msg.usage.prompt_tokens)
            m.completion_tokens.labels(self.endpoint).inc(msg.usage.completion_tokens)
            m.cached_prompt_tokens.labels(self.endpoint).inc(msg.usage.cached_prompt_tokens)
            m.e2e.labels(self.endpoint).observe(now - self.t_accept)
        return msg

    def close(self) -> None:
        """End the request: cancel the call (aborting it everywhere unless it finished) and free the slot."""
        if self.is_closed:
            return
        self.is_closed = True
        self._watch.cancel()
        self.call.cancel()
        self.front.release()


async def _start(front: Front, endpoint: str, request: Request, t_accept: float,
                 token_request: entrypoint_pb2.GenerateRequest) -> tuple[_Run, entrypoint_pb2.GenerateResponse]:
    """Take a slot, submit the request and block until its first delta, so that refusals (bad input,
    no capacity) still get their HTTP status. Returns the run (the caller closes it) and that delta."""
    front.acquire()
    try:
        call = front.backend.generate(token_request)
    except BaseException:
        front.release()
        raise
    run = _Run(front, endpoint, request, call, t_accept)
    try:
        first = await run.read()
        if first is None:
            raise ApiError(500, f"internal error (request {token_request.request_id})", code="internal_error")
        return run, first
    except BaseException:
        run.close()
        raise


_DRAIN_TIMEOUT_S = 10.0
"""How long a refused request's body is read (and thrown away) at most before the answer."""


async def _discard(chunks: AsyncIterator[bytes], limit: int) -> bool:
    """Reads and throws away `chunks` to their end; False if they pass `limit` bytes, take longer than
    `_DRAIN_TIMEOUT_S` or the client leaves.

    Why: uvicorn (h11) closes the connection when a response is complete while the request body is
    still arriving, and the unread bytes in the socket make the kernel answer with a reset; a client
    that writes the whole body before reading its answer (urllib) then sees the reset, not the error.
    Once the body is read the connection stays healthy (and keep-alive). NOTE: uvicorn's `receive`
    answers http.disconnect once a response is complete, so the body cannot be read after the answer.
    """
    async def drain() -> bool:
        seen = 0
        async for chunk in chunks:
            seen += len(chunk)
            if seen > limit:
                return False
        return True

    try:
        return await asyncio.wait_for(drain(), _DRAIN_TIMEOUT_S)
    except (asyncio.TimeoutError, ClientDisconnect):
        return False


async def _receive_chunks(receive) -> AsyncIterator[bytes]:
    """The request body's chunks straight from the ASGI `receive` (ends at the last one or a disconnect)."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _read_body(request: Request, config: HttpConfig) -> bytes:
    """Blocks until the body is read; 413 past `config.max_body_bytes` (whatever Content-Length
    claimed), after reading the rest of a body up to `config.drain_body_bytes` (see `_discard`)."""
    max_bytes, drain_bytes = config.max_body_bytes, config.drain_body_bytes
    chunks, size = [], 0
    stream = request.stream()
    async for chunk in stream:
        size += len(chunk)
        if size > max_bytes:
            if size <= drain_bytes:
                await _discard(stream, drain_bytes - size)
            raise ApiError(413, f"the request body is larger than {max_bytes} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _EventStream(StreamingResponse):
    """An SSE response whose end (normal, client gone or failed) always closes its run.

    NOTE: does not read `receive` itself (the run's disconnect watch does), unlike StreamingResponse.
    """

    def __init__(self, chunks: AsyncIterator[bytes], run: _Run, headers: dict[str, str] | None = None) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self.run.is_client_gone = True
        finally:
            await self.body_iterator.aclose()
            self.run.close()


# ---------------------------------------------------------------------------------------- recipe APIs


def _sse(api: str, event) -> bytes:
    name = RESPONSE_CLS[api].sse_event_name(event)
    return ((f"event: {name}\n" if name else "") + f"data: {event.to_json()}\n\n").encode()


def _sse_error(api: str, e: ApiError) -> bytes:
    """A failure after the stream started, in the API's own streaming shape."""
    if api == MESSAGES:
        return f"event: error\ndata: {json.dumps(e.anthropic_body())}\n\n".encode()
    if api == RESPONSES:
        error = e.openai_body()["error"]
        return f"event: error\ndata: {json.dumps({'type': 'error', **error})}\n\n".encode()
    return f"data: {json.dumps(e.openai_body())}\n\n".encode()


async def _recipe_events(front: Front, prepared: Prepared, run: _Run,
                         first: entrypoint_pb2.GenerateResponse) -> AsyncIterator[Any]:
    """Recipe's protocol events for the token stream that starts with `first` (see `RecipeStream`);
    cancels the token call when recipe's parser ends early (a stop sequence matched)."""
    stream = RecipeStream(prepared, front.recipe.tokenizer)
    try:
        for event in stream.start(first):
            yield event
        msg = first
        while True:
            for event in stream.push(msg):
                yield event
            if stream.is_done:
                break
            msg = await run.read()
            if msg is None:
                raise ApiError(500, f"internal error (request {prepared.response_id})", code="internal_error")
        run.call.cancel()  # no-op when the call finished
        for event in stream.finish():
            yield event
    finally:
        stream.close()


async def _recipe_route(front: Front, api: str, request: Request) -> Response:
    t_accept = time.monotonic()
    prepared = front.recipe.prepare(api, await _read_body(request, front.config))
    _set_request_id(request, prepared.response_id)
    headers = prepared.sampling_headers()
    seed = prepared.request.inference_options.seed
    if seed is not None:
        headers[SEED_HEADER] = str(seed)
    token_request = entrypoint_pb2.GenerateRequest(
        request_id=prepared.response_id, prompt_token_ids=prepared.prompt_token_ids,
        sampling_params=prepared.sampling_params(), images=prepared.images,
        is_max_tokens_default=prepared.is_max_tokens_default, kv_traffic_class=_traffic_class(front, request),
        # a chat turn: its next turn extends this prompt and answer (the decode stage stores both; n > 1 is
        # set per choice below, unmarked: only one of the answers could continue)
        is_conversation=True)
    if prepared.n > 1:
        answer = await _recipe_choices(front, api, prepared, request, t_accept)
        return Response(_echo_seed(answer, seed), media_type="application/json", headers=headers)
    run, first = await _start(front, request.url.path, request, t_accept, token_request)
    events = _recipe_events(front, prepared, run, first)
    if prepared.is_stream:
        return _EventStream(_recipe_sse(api, events, run), run, headers)
    try:
        response = RESPONSE_CLS[api](prepared.response_id, prepared.model, prepared.created,
                                     first.usage.prompt_tokens, first.usage.cached_prompt_tokens)
        async for event in events:
            response.accumulate(event)
        return Response(_echo_seed(response.to_json(), seed), media_type="application/json", headers=headers)
    finally:
        await events.aclose()
        run.close()


async def _recipe_choices(front: Front, api: str, prepared: Prepared, request: Request, t_accept: float) -> str:
    """Blocks until the n choices of a non-streamed request finished (one token call each, concurrently);
    returns the answer with choice i at index i and usage summed over the choices (the prompt once)."""

    async def one(choice: int) -> dict:
        token_request = entrypoint_pb2.GenerateRequest(
            request_id=f"{prepared.response_id}-{choice}", prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=prepared.sampling_params(choice), images=prepared.images,
            is_max_tokens_default=prepared.is_max_tokens_default, kv_traffic_class=_traffic_class(front, request))
        run, first = await _start(front, request.url.path, request, t_accept, token_request)
        events = _recipe_events(front, prepared, run, first)
        try:
            response = RESPONSE_CLS[api](prepared.response_id, prepared.model, prepared.created,
                                         first.usage.prompt_tokens, first.usage.cached_prompt_tokens)
            async for event in events:
                response.accumulate(event)
            return json.loads(response.to_json())
        finally:
            await events.aclose()
            run.close()

    return json.dumps(await _gather_choices(prepared.n, one))


async def _gather_choices(n: int, one) -> dict:
    """Runs `one(i)` (an awaitable answer with one choice) for i < n concurrently, all cancelled if one
    fails; returns the first answer with choice i at index i and usage summed over the choices (the
    prompt counted once; completion_tokens_details summed where every answer has them)."""
    tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
    try:
        answers = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    merged = answers[0]
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = merged.get("usage") or {}
    completion = sum((a.get("usage") or {}).get("completion_tokens", 0) for a in answers)
    if usage:
        usage["completion_tokens"] = completion
        usage["total_tokens"] = usage.get("prompt_tokens", 0) + completion
        details = [(a.get("usage") or {}).get("completion_tokens_details") for a in answers]
        if all(isinstance(d, dict) for d in details):
            usage["completion_tokens_details"] = {
                k: sum(d.get(k) or 0 for d in details) for k in details[0] if isinstance(details[0][k], int)}
    return merged


async def _recipe_sse(api: str, events: AsyncIterator[Any], run: _Run) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield _sse(api, event)
        done = RESPONSE_CLS[api].sse_done_data()
        if done is not None:
            yield f"data: {done}\n\n".encode()
    except _ClientGone:
        return
    except ApiError as e:
        yield _sse_error(api, e)
    except Exception:
        logger.exception("%s: the stream failed", run.call.request_id)
        yield _sse_error(api, ApiError(500, f"internal error (request {run.call.request_id})", code="internal_error"))
    finally:
        await events.aclose()


# ---------------------------------------------------------------------------------------- the app


def _read_key_file() -> str:
    """The keys in the file named by DEEPINFER_API_KEY_FILE (how `deepinfer up` hands them over), or ""."""
    path = os.environ.get("DEEPINFER_API_KEY_FILE")
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the API key file {path} (DEEPINFER_API_KEY_FILE): {e.strerror}") from None


def _traffic_class(front: Front, request: Request) -> str:
    """The KV store traffic class of the request's API key (its `class=`, else the server default)."""
    return front.limiter.traffic_class(request.scope.get("state", {}).get("api_key"))


def _echo_seed(answer: str, seed: int | None) -> str:
    """A JSON answer with `usage.seed` set to the seed its sampling used (unchanged without a seed or usage)."""
    if seed is None:
        return answer
    body = json.loads(answer)
    if isinstance(body.get("usage"), dict):
        body["usage"]["seed"] = seed
    return json.dumps(body)


def _set_request_id(request: Request, request_id: str) -> None:
    """Name the request by the id its token call carries (log lines from here on, the X-Request-Id
    header unless the client sent its own)."""
    request.scope.setdefault("state", {})["request_id"] = request_id
    REQUEST_ID.set(request_id)


class _Guard:
    """Pure ASGI middleware: API key (all but /health), Content-Length cap, request metrics, the
    X-Request-Id header on every response, the access log."""

    def __init__(self, app, front: Front) -> None:
        self.app = app
        self.front = front

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = [500]
        headers = dict(scope["headers"])
        given_id = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        client_id = given_id if _CLIENT_REQUEST_ID.fullmatch(given_id) else None
        state = scope.setdefault("state", {})
        state["request_id"] = f"req-{uuid.uuid4().hex}"  # routes that start a token call rename it
        token = REQUEST_ID.set(state["request_id"])
        t0 = time.monotonic()

        async def send_and_record(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                echoed = client_id or state["request_id"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER.encode(), echoed.encode())]}
            await send(message)

        admitted: str | None = None
        try:
            error = self._refusal(path, headers, state)
            if error is None and scope["method"] == "POST" and path in GENERATION_ROUTES:
                try:
                    admitted = self.front.limiter.admit(state.get("api_key"))
                except ApiError as e:
                    error = e
            if error is not None:
                self.front.metrics.errors.labels(error.code or "none", str(error.status)).inc()
                if self._drainable(headers):
                    await _discard(_receive_chunks(receive), self.front.config.drain_body_bytes)
                await _error_response(path, error)(scope, receive, send_and_record)
                return
            await self.app(scope, receive, send_and_record)
        finally:
            if admitted is not None:
                self.front.limiter.release(admitted)
            endpoint = path if path in KNOWN_ROUTES else "other"
            self.front.metrics.requests.labels(endpoint, str(status[0])).inc()
            key = state.get("api_key")
            if scope["method"] == "POST" and path in GENERATION_ROUTES:
                self.front.metrics.key_requests.labels(key.name if key is not None else "none", str(status[0])).inc()
            if self.front.config.access_log:
                self._log_access(scope, status[0], time.monotonic() - t0, state["request_id"], client_id)
            REQUEST_ID.reset(token)

    @staticmethod
    def _log_access(scope, status: int, duration_s: float, request_id: str, client_id: str | None) -> None:
        client = scope.get("client") or ("-", 0)
        fields = {"method": scope["method"], "path": scope["path"], "status": status,
                  "duration_ms": round(duration_s * 1000, 1), "client": f"{client[0]}:{client[1]}",
                  "client_request_id": client_id}
        access_logger.info("%s %s %d %.1fms client=%s client_request_id=%s", scope["method"], scope["path"], status,
                           duration_s * 1000, fields["client"], client_id or "-",
                           extra={"request_id": request_id, "fields": fields})

    def _drainable(self, headers: dict[bytes, bytes]) -> bool:
        """Whether a refused request's body is read before the answer (see `_discard`): not when the
        client waits for `100 Continue` (it sends no body unless asked; reading would ask for it), nor
        when Content-Length already says it is past `drain_body_bytes`."""
        if headers.get(b"expect", b"").lower() == b"100-continue":
            return False
        length = headers.get(b"content-length")
        if length is not None:
            return length.isdigit() and 0 < int(length) <= self.front.config.drain_body_bytes
        return b"transfer-encoding" in headers

    def _refusal(self, path: str, headers: dict[bytes, bytes], state: dict) -> ApiError | None:
        keys = self.front.api_keys
        if keys and path != "/health":
            given = headers.get(b"x-api-key", b"").decode("latin-1")
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not given and auth[:7].lower() == "bearer ":
                given = auth[7:].strip()
            if not given:
                return ApiError(401, "missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                                code="invalid_api_key")
            key = find_key(keys, given)  # NOTE: compares every key (no early exit)
            if key is None:
                return ApiError(401, "invalid API key", code="invalid_api_key")
            state["api_key"] = key
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.front.config.max_body_bytes:
            return ApiError(413, f"the request body is larger than {self.front.config.max_body_bytes} bytes",
                            code="request_too_large")
        return None


def create_app(config: HttpConfig) -> FastAPI:
    """The ASGI app of the HTTP front (loads the tokenizer; connects to the entrypoint on startup)."""
    front = Front(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        front.backend = TokenBackend(config.entrypoint, config.retry_after_s, config.request_timeout_s)
        logger.info("HTTP front for %s (model %s, %s encoding, context %d) on the token entrypoint %s",
                    front.served_model_name, config.model or "built-in", front.recipe.encoding_name,
                    front.max_model_len, config.entrypoint)
        try:
            yield
        finally:
            await front.backend.close()

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = front
    app.add_middleware(_Guard, front=front)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        front.metrics.errors.labels(e.code or "none", str(e.status)).inc()
        return _error_response(request.url.path, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 405:
            allow = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow") or ""
            error = ApiError(405, f"method {request.method} is not allowed on {request.url.path}"
                             + (f"; use {allow}" if allow else ""), code="method_not_allowed",
                             extra_headers={"Allow": allow} if allow else None)
        elif e.status_code == 404:
            error = ApiError(404, f"no route {request.method} {request.url.path}", code="not_found")
        else:
            error = ApiError(e.status_code, str(e.detail), code="invalid_request_error")
        return _error_response(request.url.path, error)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, e: _ClientGone):
        return Response(status_code=499)  # nobody reads it; counted in the metrics as 499

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(request.url.path, ApiError(500, "internal error", code="internal_error"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _recipe_route(front, CHAT, request)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await _recipe_route(front, RESPONSES, request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await _recipe_route(front, MESSAGES, request)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        t_accept = time.monotonic()
        body = completions.parse(completions.CompletionBody, await _read_body(request, config))
        front.recipe.check_model(body.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        _set_request_id(request, rid)
        prompt_ids = body.prompt_token_ids(front.recipe.tokenizer)
        if body.n > 1:
            answer = await _completion_choices(front, body, rid, prompt_ids, request, t_accept)
            if body.seed is not None:
                answer["usage"]["seed"] = body.seed
            return JSONResponse(answer, headers={SEED_HEADER: str(body.seed)} if body.seed is not None else None)
        token_request = entrypoint_pb2.GenerateRequest(request_id=rid, prompt_token_ids=prompt_ids,
                                                       sampling_params=body.sampling_params(),
                                                       kv_traffic_class=_traffic_class(front, request))
        run, first = await _start(front, request.url.path, request, t_accept, token_request)
        builder = completions.CompletionBuilder(rid, body.model, body.include_usage,
                                                front.token_texts if body.logprobs is not None else None)
        builder.seed = body.seed
        headers = {SEED_HEADER: str(body.seed)} if body.seed is not None else None
        if body.stream:
            return _EventStream(_token_sse(builder, run, first), run, headers)
        return await _token_json(builder, run, first, headers)

    @app.post("/v1/generate")
    async def generate(request: Request):
        t_accept = time.monotonic()
        body = completions.parse(completions.GenerateBody, await _read_body(request, config))
        if body.model is not None:
            front.recipe.check_model(body.model)
        rid = body.request_id or f"gen-{uuid.uuid4().hex}"
        _set_request_id(request, rid)
        sampling_params = completions.generate_sampling_params(body)
        token_request = entrypoint_pb2.GenerateRequest(request_id=rid, prompt_token_ids=body.token_ids,
                                                       sampling_params=sampling_params,
                                                       kv_traffic_class=_traffic_class(front, request))
        run, first = await _start(front, request.url.path, request, t_accept, token_request)
        builder = completions.GenerateBuilder(rid, body.model or front.served_model_name)
        builder.seed = sampling_params.seed if sampling_params.HasField("seed") else None
        headers = {SEED_HEADER: str(builder.seed)} if builder.seed is not None else None
        if body.stream:
            return _EventStream(_token_sse(builder, run, first), run, headers)
        return await _token_json(builder, run, first, headers)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(front, name) for name in front.recipe.model_names]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        front.recipe.check_model(name)
        return _model_card(front, name)

    @app.get("/version")
    async def version():
        return {"version": _version(), "model": front.served_model_name, "encoding": front.recipe.encoding_name}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """`{"prompt": TEXT}` -> its token ids, or `{"messages": [...], "model"?}` -> the chat prompt's ids
        as the chat API renders it (recipe's encoding); `count` is their number."""
        body = json_object(await _read_body(request, config))
        if isinstance(body.get("prompt"), str):
            ids = front.recipe.tokenizer.encode(body["prompt"])
        elif isinstance(body.get("messages"), list):
            prepared = front.recipe.prepare(CHAT, json.dumps({"model": front.served_model_name, **body}).encode())
            ids = prepared.prompt_token_ids
        else:
            raise ApiError(400, "send {\"prompt\": TEXT} or {\"messages\": [...]}", param="prompt",
                           code="invalid_request_error")
        return {"tokens": list(ids), "count": len(ids), "max_model_len": front.max_model_len}

    @app.get("/health")
    async def health():
        is_healthy, message, stats = await front.backend.health()
        flags = {"batch_invariant": config.batch_invariant}
        if not is_healthy:
            return JSONResponse({"status": "unhealthy", "message": message, **flags}, status_code=503)
        if stats.get("degraded"):  # serving text; image requests fail until a vision instance serves
            return {"status": "degraded", "message": message, **flags}
        return {"status": "ok", **flags}

    @app.get("/metrics")
    async def metrics():
        is_healthy, _, stats = await front.backend.health()
        front.metrics.set_cluster(is_healthy, stats)
        front.metrics.update_hit_rate()
        lb_addresses = {stage: address for stage, address in (("vision", config.vision_lb_address),
                                                               ("prefill", config.prefill_lb_address),
                                                               ("decode", config.decode_lb_address)) if address}
        if lb_addresses:
            front.metrics.set_stages(await front.backend.stage_stats(lb_addresses))
        return Response(generate_latest(front.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepinfer")
    except PackageNotFoundError:
        return "unknown"


def _model_card(front: Front, name: str) -> dict:
    card = {"id": name, "object": "model", "created": 0, "owned_by": "deepinfer",
            "max_model_len": front.max_model_len}
    if name != front.served_model_name:
        card["root"] = front.served_model_name
    return card


async def _completion_choices(front: Front, body, rid: str, prompt_ids: list[int], request: Request,
                              t_accept: float) -> dict:
    """As `_recipe_choices` for `/v1/completions`."""

    async def one(choice: int) -> dict:
        token_request = entrypoint_pb2.GenerateRequest(request_id=f"{rid}-{choice}", prompt_token_ids=prompt_ids,
                                                       sampling_params=body.sampling_params(choice),
                                                       kv_traffic_class=_traffic_class(front, request))
        run, first = await _start(front, request.url.path, request, t_accept, token_request)
        builder = completions.CompletionBuilder(rid, body.model, False,
                                                front.token_texts if body.logprobs is not None else None)
        try:
            async for msg in _token_messages(run, first):
                builder.add(msg)
            return builder.response()
        finally:
            run.close()

    return await _gather_choices(body.n, one)


async def _token_messages(run: _Run, first: entrypoint_pb2.GenerateResponse):
    msg = first
    while msg is not None:
        yield msg
        if msg.finish_reason:
            return
        msg = await run.read()
    raise ApiError(500, f"internal error (request {run.call.request_id})", code="internal_error")


async def _token_json(builder, run: _Run, first: entrypoint_pb2.GenerateResponse,
                      headers: dict[str, str] | None = None) -> Response:
    try:
        async for msg in _token_messages(run, first):
            builder.add(msg)
        return JSONResponse(builder.response(), headers=headers)
    finally:
        run.close()


async def _token_sse(builder, run: _Run, first: entrypoint_pb2.GenerateResponse) -> AsyncIterator[bytes]:
    try:
        async for msg in _token_messages(run, first):
            for chunk in builder.chunks(msg):
                yield f"data: {json.dumps(chunk)}\n\n".encode()
        yield b"data: [DONE]\n\n"
    except _ClientGone:
        return
    except ApiError as e:
        yield f"data: {json.dumps(e.openai_body())}\n\n".encode()
    except Exception:
        logger.exception("%s: the stream failed", run.call.request_id)
        error = ApiError(500, f"internal error (request {run.call.request_id})", code="internal_error")
        yield f"data: {json.dumps(error.openai_body())}\n\n".encode()


def https_files(config: HttpConfig) -> tuple[str | None, str | None]:
    """The (certificate, key) files the front serves HTTPS with, or (None, None) for plain HTTP: its own
    `https_cert` / `https_key`, else the process's cluster TLS certificate (`serving.auth.tls_settings`),
    unless `https` is off. ValueError when only one of the pair is given."""
    if not config.https:
        return None, None
    if bool(config.https_cert) != bool(config.https_key):
        raise ValueError("--https-cert and --https-key go together (the certificate and its private key)")
    if config.https_cert:
        return config.https_cert, config.https_key
    from deepinfer.serving.auth import tls_settings

    tls = tls_settings()
    return (tls.cert_path, tls.key_path) if tls is not None and tls.is_server else (None, None)


def serve(config: HttpConfig, *, on_ready=None) -> None:
    """Blocks serving the HTTP front with uvicorn until SIGINT / SIGTERM.

    Binds first, then calls `on_ready(address)` (e.g. to print it: `https://...` when it serves HTTPS,
    `https_files`), so a port of 0 works.
    """
    import socket

    import uvicorn

    cert, key = https_files(config)
    app = create_app(config)
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # NOTE: accepted sockets inherit TCP_NODELAY; without it a response's header and body writes wait
    # on the client's delayed ACK (~40 ms per request on a keep-alive connection)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    if on_ready is not None:
        on_ready(f"{'https' if cert else 'http'}://{host}:{port}")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5,
                                           ssl_certfile=cert, ssl_keyfile=key))
    server.run(sockets=[sock])

