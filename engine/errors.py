"""Typed errors shared by every stage.

Stages translate these into their wire formats (HTTP status codes, gRPC status) at the boundary;
inside the engine code raises the most specific class so callers can tell a bad request (refuse it,
keep serving) from an internal failure.
"""

from __future__ import annotations


class DeepInferError(Exception):
    """Base class of every error deepinfer raises on purpose."""


class InvalidRequestError(DeepInferError, ValueError):
    """A request (or one of its parameters) is invalid; it is refused before it costs compute.

    `field` names the offending parameter (e.g. `"top_p"`, `"logit_bias"`) so front ends can point
    the client at it; the message always names it too and says which values are accepted.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        """Name of the offending request parameter, or None when the error is not about one field."""

    def __reduce__(self):  # keep `field` across pickling (Ray, multiprocessing)
        return (_rebuild_invalid_request_error, (type(self), str(self), self.field))


def _rebuild_invalid_request_error(cls: type[InvalidRequestError], message: str, field: str | None):
    return cls(message, field=field)
