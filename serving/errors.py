"""Refusals and failures on the wire: the ONE mapping every worker shell and the entrypoint use.

A request that a stage refuses (bad input, no room, aborted, draining, a stuck engine loop) or that
fails there is answered with an in-band `Error` (protos/common.proto: `ErrorCode`, message, field);
the entrypoint turns an `Error` into a gRPC status at the edge. Both steps are tables here:

    exception --REFUSAL_CODES--> ErrorCode --STATUS_OF_ERROR--> grpc.StatusCode

| exception | ErrorCode | gRPC status |
|---|---|---|
| `Refused(code, ...)` | its own code | per code |
| `engine.errors.InvalidRequestError` | INVALID_REQUEST (its `field`) | INVALID_ARGUMENT |
| `NoFreeBlocksError`, `NoFreeSlotsError` | RESOURCE_EXHAUSTED (retryable elsewhere) | RESOURCE_EXHAUSTED |
| `Aborted` | ABORTED | CANCELLED |
| `TimeoutError` (the engine loop did not answer) | UNAVAILABLE (retryable) | UNAVAILABLE |
| draining / unhealthy instance (`WorkerShell.check_accepting`) | UNAVAILABLE (retryable) | UNAVAILABLE |
| anything else | INTERNAL | INTERNAL |

A stage adds its own exceptions (e.g. lost image embeddings -> UNAVAILABLE on `image_embeddings`)
as `extra` rows, checked before the shared ones.
"""

from __future__ import annotations

import collections
import threading

import grpc

from deepinfer.engine.cache.block_pool import NoFreeBlocksError, NoFreeSlotsError
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.protos import common_pb2


class Aborted(Exception):
    """The request was aborted (Abort RPC, client gone, drain timeout) before it finished here."""


class Refused(Exception):
    """A request refused or failed on this stage with a known wire code; becomes an in-band `Error`.

    `code` is a `common_pb2.ErrorCode` value; `field` names the offending request field ("" = none).
    """

    def __init__(self, code: int, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.field = field

    def to_proto(self) -> common_pb2.Error:
        """The in-band `Error` message of this refusal."""
        return common_pb2.Error(code=self.code, message=str(self), field=self.field)


RefusalRow = tuple[type[BaseException], int, str | None]
"""(exception class, ErrorCode, field): field None = the exception's own `field` attribute, if any."""

REFUSAL_CODES: tuple[RefusalRow, ...] = (
    (InvalidRequestError, common_pb2.ERROR_CODE_INVALID_REQUEST, None),
    (NoFreeBlocksError, common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, None),
    (NoFreeSlotsError, common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, None),
    (Aborted, common_pb2.ERROR_CODE_ABORTED, None),
    (TimeoutError, common_pb2.ERROR_CODE_UNAVAILABLE, None),
)
"""Exception -> wire `ErrorCode`, first match wins (after a stage's `extra` rows)."""

STATUS_OF_ERROR: dict[int, grpc.StatusCode] = {
    common_pb2.ERROR_CODE_INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    common_pb2.ERROR_CODE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    common_pb2.ERROR_CODE_UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    common_pb2.ERROR_CODE_DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    common_pb2.ERROR_CODE_ABORTED: grpc.StatusCode.CANCELLED,
    common_pb2.ERROR_CODE_INTERNAL: grpc.StatusCode.INTERNAL,
}
"""Wire `ErrorCode` -> gRPC status at the edge (the entrypoint's answer to its client)."""

STALE_RESERVATION_FIELD = "request_id"
"""`Error.field` of a decode Reserve refused UNAVAILABLE because the request id still holds an earlier
attempt's reservation there (its Abort is still on the way): the entrypoint aborts it and reserves again."""

QUARANTINE_FIELD = "kv_quarantine"
"""`Error.field` of a decode Reserve refused RESOURCE_EXHAUSTED while some of the instance's blocks or state slots are
held by aborted reservations in quarantine (a late WRITE of a lost prefill may still land in them): that capacity
comes back when their leases end, so the entrypoint waits for it (bounded) instead of failing an accepted request."""

RETRYABLE_ERRORS = (common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, common_pb2.ERROR_CODE_UNAVAILABLE)
"""Codes after which the same request may succeed on another instance of the stage."""


def status_of(code: int) -> grpc.StatusCode:
    """The gRPC status of a wire `ErrorCode` (INTERNAL for unknown codes)."""
    return STATUS_OF_ERROR.get(code, grpc.StatusCode.INTERNAL)


def refusal(e: BaseException, *, request_id: str = "", loop_name: str = "engine loop",
            extra: tuple[RefusalRow, ...] = ()) -> Refused:
    """`e` as a `Refused`: its code from `extra` then `REFUSAL_CODES` (first match), else INTERNAL.

    `request_id` names the request in an abort's message; `loop_name` names the loop that did not
    answer in a `TimeoutError`'s message.
    """
    if isinstance(e, Refused):
        return e
    for cls, code, field in (*extra, *REFUSAL_CODES):
        if isinstance(e, cls):
            if field is None:
                field = getattr(e, "field", None) or ""
            if isinstance(e, Aborted):
                message = f"request {request_id!r} was aborted: {e}" if request_id else f"aborted: {e}"
            elif isinstance(e, TimeoutError) and cls is TimeoutError:
                message = f"the {loop_name} did not answer in time"
            else:
                message = str(e)
            return Refused(code, message, field)
    return Refused(common_pb2.ERROR_CODE_INTERNAL, f"{type(e).__name__}: {e}")


def error_of(e: BaseException, **kwargs) -> common_pb2.Error:
    """The in-band `Error` of `e` (as `refusal(e, **kwargs)`), counted by cause (`count_error`)."""
    error = refusal(e, **kwargs).to_proto()
    count_error(error.code, error.field)
    return error


ERRORS_BY_CAUSE: collections.Counter[str] = collections.Counter()
"""In-band errors this process answered, by cause (`cause_of`): a worker's `Health` stats carry them
(`errors_by_cause`) and the HTTP front exports them as `deepinfer_stage_errors_total{stage,instance,cause}`."""
_errors_lock = threading.Lock()


def cause_of(code: int, field: str = "") -> str:
    """The cause label of an in-band error: its `ErrorCode` in lower case, with the field that says more
    (`unavailable/destination`: the KV write to decode failed; `unavailable/image_embeddings`)."""
    try:
        name = common_pb2.ErrorCode.Name(code).removeprefix("ERROR_CODE_").lower()
    except ValueError:
        name = f"code_{code}"
    return f"{name}/{field}" if field else name


def count_error(code: int, field: str = "") -> None:
    """Count one in-band error answered by this process (every `error_of`, and errors a stage builds itself)."""
    with _errors_lock:
        ERRORS_BY_CAUSE[cause_of(code, field)] += 1


def errors_by_cause() -> dict[str, int]:
    """A copy of `ERRORS_BY_CAUSE`."""
    with _errors_lock:
        return dict(ERRORS_BY_CAUSE)
