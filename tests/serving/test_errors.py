"""The one refusal table of every worker shell (`serving.errors`): exception -> wire ErrorCode -> gRPC status."""

from __future__ import annotations

import grpc
import pytest

from deepinfer.engine.cache.block_pool import NoFreeBlocksError, NoFreeSlotsError
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.protos import common_pb2
from deepinfer.serving.errors import RETRYABLE_ERRORS, STATUS_OF_ERROR, Aborted, Refused, error_of, refusal, status_of


@pytest.mark.parametrize("exc, code, field", [
    (InvalidRequestError("top_p must be in (0, 1]", field="top_p"), common_pb2.ERROR_CODE_INVALID_REQUEST, "top_p"),
    (InvalidRequestError("bad prompt"), common_pb2.ERROR_CODE_INVALID_REQUEST, ""),
    (NoFreeBlocksError("no free blocks"), common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, ""),
    (NoFreeSlotsError("no free slots"), common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, ""),
    (Aborted("Abort RPC"), common_pb2.ERROR_CODE_ABORTED, ""),
    (TimeoutError(), common_pb2.ERROR_CODE_UNAVAILABLE, ""),
    (Refused(common_pb2.ERROR_CODE_NOT_FOUND, "no reservation", "request_id"), common_pb2.ERROR_CODE_NOT_FOUND,
     "request_id"),
    (RuntimeError("boom"), common_pb2.ERROR_CODE_INTERNAL, ""),
])
def test_refusal_table(exc, code, field):
    error = error_of(exc, request_id="r1")
    assert (error.code, error.field) == (code, field)
    assert error.message


def test_messages_name_the_request_and_the_loop():
    assert error_of(Aborted("drain timeout"), request_id="r7").message == "request 'r7' was aborted: drain timeout"
    assert error_of(TimeoutError(), loop_name="decode engine loop").message == \
        "the decode engine loop did not answer in time"
    assert error_of(RuntimeError("boom")).message == "RuntimeError: boom"
    assert error_of(InvalidRequestError("n must be 1", field="n")).message == "n must be 1"


def test_stage_rows_come_first():
    extra = ((ValueError, common_pb2.ERROR_CODE_INVALID_REQUEST, "images"),)
    error = error_of(InvalidRequestError("not an image", field="x"), extra=extra)
    assert (error.code, error.field) == (common_pb2.ERROR_CODE_INVALID_REQUEST, "images")
    lost = ((ConnectionError, common_pb2.ERROR_CODE_UNAVAILABLE, "image_embeddings"),)
    assert error_of(ConnectionError("gone"), extra=lost).field == "image_embeddings"
    assert error_of(ConnectionError("gone")).code == common_pb2.ERROR_CODE_INTERNAL  # without the row


def test_refused_passes_through():
    r = Refused(common_pb2.ERROR_CODE_UNAVAILABLE, "draining")
    assert refusal(r) is r
    assert r.to_proto() == common_pb2.Error(code=common_pb2.ERROR_CODE_UNAVAILABLE, message="draining")


def test_every_error_code_has_a_grpc_status():
    codes = [v.number for v in common_pb2.ErrorCode.DESCRIPTOR.values if v.number]
    assert sorted(STATUS_OF_ERROR) == sorted(codes)
    assert status_of(common_pb2.ERROR_CODE_INVALID_REQUEST) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(common_pb2.ERROR_CODE_ABORTED) is grpc.StatusCode.CANCELLED
    assert status_of(12345) is grpc.StatusCode.INTERNAL
    assert set(RETRYABLE_ERRORS) == {common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, common_pb2.ERROR_CODE_UNAVAILABLE}
