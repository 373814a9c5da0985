"""Errors in each API's own shape: OpenAI `{"error": {message, type, param, code}}` and Anthropic
`{"type": "error", "error": {type, message}}`, and the map from the token API's gRPC status."""

from __future__ import annotations

import json
import logging

import grpc

logger = logging.getLogger("entrypoint.http")

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 504: "timeout_error"}
"""HTTP status -> Anthropic error type (anything else: api_error)."""

OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error",
                504: "timeout_error"}
"""HTTP status -> OpenAI error type (anything else: server_error)."""


class ApiError(Exception):
    """A request ends with this HTTP status and message (rendered in the caller's API shape).

    `message` is shown to the client, so it never carries internals (addresses, tracebacks).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None, extra_headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.extra_headers = dict(extra_headers or {})
        """More response headers (e.g. `Allow` of a 405)."""

    def headers(self) -> dict[str, str]:
        retry = {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}
        return {**self.extra_headers, **retry}

    def openai_body(self) -> dict:
        return {"error": {"message": self.message, "type": OPENAI_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}

    def body(self, is_anthropic: bool) -> bytes:
        return json.dumps(self.anthropic_body() if is_anthropic else self.openai_body()).encode()


def invalid(message: str, param: str | None = None, code: str = "invalid_request_error") -> ApiError:
    """A 400 for a bad request."""
    return ApiError(400, message, param=param, code=code)


def json_object(body: bytes) -> dict:
    """The request body as a JSON object; 400 for an empty body, bad JSON or another JSON value."""
    if not body.strip():
        raise invalid("the request body is empty; send a JSON object")
    try:
        parsed = json.loads(body)
    except ValueError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise invalid("the request body must be a JSON object")
    return parsed


def from_grpc(code: grpc.StatusCode, details: str, field: str | None, request_id: str, retry_after_s: int) -> ApiError:
    """The HTTP answer to a failed token-API call; only INVALID_ARGUMENT passes its message through."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, details, param=field or None, code="invalid_request_error")
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, details, code="not_found")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ApiError(429, "the service is at capacity; retry later", code="rate_limit_exceeded",
                        retry_after_s=retry_after_s)
    if code == grpc.StatusCode.UNAVAILABLE:
        logger.warning("%s: token API unavailable: %s", request_id, details)
        return ApiError(503, "the service is temporarily unavailable; retry later", code="service_unavailable",
                        retry_after_s=retry_after_s)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ApiError(504, "the request ran out of time", code="timeout")
    logger.error("%s: token API failed: %s %s", request_id, code.name, details)
    return ApiError(500, f"internal error (request {request_id})", code="internal_error")
