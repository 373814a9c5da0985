"""A small Python client of the token-level `Entrypoint` service (no torch, no engine import).

```python
with Client("127.0.0.1:50051") as client:
    out = client.generate([5, 6, 7], max_tokens=16, temperature=0.0)
    out["token_ids"], out["finish_reason"], out["usage"]
    for delta in client.stream([5, 6, 7], max_tokens=16, temperature=0.8, seed=1):
        print(delta["token_ids"])
```

Sampling keyword arguments are the fields of `deepinfer.v1.SamplingParams` (= the engine's
`SamplingParams`); they are sent as given, unvalidated, so the server's validation answers. Unset
fields take the engine defaults, except `max_tokens`: unset means no cap (the context length).
Failures raise `GenerateError` carrying the gRPC status code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from deepinfer.protos import common_pb2, entrypoint_pb2, entrypoint_pb2_grpc
from deepinfer.protos.metadata import ERROR_FIELD_METADATA_KEY
from deepinfer.serving.auth import secure_channel

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
"""Wire finish reasons -> the engine's strings (UNSPECIFIED -> None)."""


class GenerateError(RuntimeError):
    """A request failed or was refused; `code` is the gRPC status (e.g. INVALID_ARGUMENT, UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.field = field
        """The offending request parameter for INVALID_ARGUMENT, when the server named one."""

    @classmethod
    def of(cls, e: grpc.RpcError) -> GenerateError:
        trailing = dict(e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else {}
        return cls(e.code(), e.details() or "", trailing.get(ERROR_FIELD_METADATA_KEY))


def sampling_params_proto(**fields: Any) -> common_pb2.SamplingParams:
    """The wire `SamplingParams` of keyword fields (None = unset); raises TypeError for unknown names."""
    msg = common_pb2.SamplingParams()
    known = msg.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        if name not in known:
            raise TypeError(f"unknown sampling parameter {name!r}; use one of {sorted(known)}")
        if value is None:
            continue
        if name == "logit_bias":
            msg.logit_bias.update({int(k): float(v) for k, v in value.items()})
        elif name == "structured_output":
            if not isinstance(value, dict):
                raise TypeError(f"structured_output must be a dict of StructuredOutput fields, got {value!r}")
            msg.structured_output.SetInParent()  # an empty dict still marks the field set (the server refuses it)
            fields_by_name = msg.structured_output.DESCRIPTOR.fields_by_name
            for key, item in value.items():
                if key not in fields_by_name:
                    raise TypeError(f"unknown structured_output field {key!r}; use one of {sorted(fields_by_name)}")
                if item is not None:
                    setattr(msg.structured_output, key, item)  # TypeError for a value of the wrong type
        elif name == "stop" and isinstance(value, str):
            msg.stop.append(value)
        elif known[name].is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


def _delta(msg: entrypoint_pb2.GenerateResponse) -> dict:
    delta = {
        "request_id": msg.request_id,
        "token_ids": list(msg.token_ids),
        "text": msg.text,
        "finish_reason": FINISH_REASONS.get(msg.finish_reason),
        "stop_reason": getattr(msg, msg.WhichOneof("stop_reason")) if msg.WhichOneof("stop_reason") else None,
        "usage": None,
        "error": None,
    }
    if msg.HasField("usage"):
        delta["usage"] = {"prompt_tokens": msg.usage.prompt_tokens, "completion_tokens": msg.usage.completion_tokens,
                          "cached_prompt_tokens": msg.usage.cached_prompt_tokens}
    if msg.HasField("error"):
        delta["error"] = {"code": common_pb2.ErrorCode.Name(msg.error.code), "message": msg.error.message}
    return delta


class Client:
    """Blocking client of one entrypoint (thread-safe: one gRPC channel, calls may run concurrently)."""

    def __init__(self, address: str, *, timeout_s: float | None = None, secret: str | None = None) -> None:
        """`secret`: the cluster secret the entrypoint checks (None = this process's, `serving.auth`)."""
        self.address = address
        self.timeout_s = timeout_s
        """Client-side deadline of each call (None = none); `deadline_ms` is the server-side budget."""
        self._channel = secure_channel(address, secret)
        self._stub = entrypoint_pb2_grpc.EntrypointStub(self._channel)

    def stream(self, prompt_token_ids: list[int], *, request_id: str = "", deadline_ms: int = 0,
               images: list[bytes | str] | None = None, image_placeholder_id: int | None = None,
               **sampling: Any) -> Iterator[dict]:
        """Blocks per delta: yields `{request_id, token_ids, text, finish_reason, stop_reason, usage, error}`
        dicts (token_ids/text are deltas; finish_reason and usage are set on the last one).

        `images`: one per image placeholder of the prompt, in order: encoded image bytes or a URL (data: or an
        allowed http(s) host); the vision stage encodes them. The placeholder is `<｜image｜>` (129279), or
        `image_placeholder_id` when the prompt was rendered with another spelling (V4.1's tokenizer:
        `<｜deepseek_image｜>`, `engine.tokenizer.RecipeChatEncoding.image_placeholder_id`), which is sent as 129279.
        A count of placeholders other than `len(images)` raises ValueError before anything is sent.

        Closing the iterator early (break, `close()`) cancels the call, which aborts the request on
        every stage. Raises `GenerateError` on a failed or refused request.
        """
        if images:
            from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID

            placeholder = IMAGE_PLACEHOLDER_ID if image_placeholder_id is None else image_placeholder_id
            offsets = [i for i, t in enumerate(prompt_token_ids) if t == placeholder]
            if len(offsets) != len(images):
                raise ValueError(f"the prompt holds {len(offsets)} image placeholders ({placeholder}) for "
                                 f"{len(images)} images; give one image per placeholder")
            prompt_token_ids = [IMAGE_PLACEHOLDER_ID if t == placeholder else t for t in prompt_token_ids]
        request = entrypoint_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=sampling_params_proto(**sampling),
            deadline_ms=deadline_ms)
        if images:
            for offset, image in zip(offsets, images):
                descriptor = image.encode() if isinstance(image, str) else bytes(image)
                request.images.add(descriptor=descriptor, offset=offset, num_tokens=1)
        call = self._stub.Generate(request, timeout=self.timeout_s)
        try:
            for msg in call:
                yield _delta(msg)
        except grpc.RpcError as e:
            raise GenerateError.of(e) from None
        finally:
            call.cancel()  # no-op once the call finished

    def generate(self, prompt_token_ids: list[int], **kwargs: Any) -> dict:
        """Blocks until the request finished; returns `{request_id, token_ids, text, finish_reason,
        stop_reason, usage}`. Same arguments as `stream`; raises `GenerateError`."""
        out = {"request_id": kwargs.get("request_id", ""), "token_ids": [], "text": "", "finish_reason": None,
               "stop_reason": None, "usage": None}
        for delta in self.stream(prompt_token_ids, **kwargs):
            out["request_id"] = delta["request_id"]
            out["token_ids"] += delta["token_ids"]
            out["text"] += delta["text"]
            if delta["finish_reason"]:
                out.update(finish_reason=delta["finish_reason"], stop_reason=delta["stop_reason"],
                           usage=delta["usage"])
        return out

    def abort(self, request_id: str, reason: str = "") -> bool:
        """Blocks until the entrypoint aborted `request_id` everywhere; False if it was not in flight."""
        reply = self._stub.Abort(common_pb2.AbortRequest(request_id=request_id, reason=reason),
                                 timeout=self.timeout_s or 10.0)
        return reply.was_found

    def health(self) -> dict:
        """Blocks for the entrypoint's Health: `{is_healthy, message, instance_id}`."""
        reply = self._stub.Health(common_pb2.HealthRequest(), timeout=self.timeout_s or 10.0)
        return {"is_healthy": reply.is_healthy, "message": reply.message, "instance_id": reply.instance_id}

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
