"""Issue 31: request ids on the log lines of every gRPC handler (`serving.auth.RequestIds`, which every
deepinfer server runs) and the `--log-level` / `--log-format` flags (or their environment defaults) that
every process takes (`serving.logs.logging_args`)."""

from __future__ import annotations

import concurrent.futures
import io
import json
import logging

import grpc
import pytest

from deepinfer.protos import common_pb2, entrypoint_pb2, entrypoint_pb2_grpc
from deepinfer.serving.auth import secure_channel, server_interceptors
from deepinfer.serving.logs import FORMAT_ENV, LEVEL_ENV, configure_logging, logging_args

logger = logging.getLogger("test.handler")


class _Servicer(entrypoint_pb2_grpc.EntrypointServicer):
    def Abort(self, request, context):
        logger.info("aborting")
        return common_pb2.AbortResponse(was_found=True)

    def Generate(self, request, context):
        logger.info("first")
        yield entrypoint_pb2.GenerateResponse(request_id=request.request_id)
        logger.info("last")
        yield entrypoint_pb2.GenerateResponse(request_id=request.request_id,
                                              finish_reason=common_pb2.FINISH_REASON_STOP)


def test_handlers_log_the_request_id(monkeypatch):
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("DEEPINFER_CLUSTER_SECRET_FILE", raising=False)
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(2), interceptors=server_interceptors())
    entrypoint_pb2_grpc.add_EntrypointServicer_to_server(_Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        configure_logging("info", "json", stream=stream)
        with secure_channel(f"127.0.0.1:{port}") as channel:
            stub = entrypoint_pb2_grpc.EntrypointStub(channel)
            stub.Abort(common_pb2.AbortRequest(request_id="req-abc"), timeout=10)
            list(stub.Generate(entrypoint_pb2.GenerateRequest(request_id="chatcmpl-42"), timeout=10))
    finally:
        server.stop(0)
        root.handlers[:], root.level = saved
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    by_message = {line["message"]: line["request_id"] for line in lines if line["logger"] == "test.handler"}
    assert by_message == {"aborting": "req-abc", "first": "chatcmpl-42", "last": "chatcmpl-42"}


def test_logging_args(monkeypatch):
    monkeypatch.delenv(LEVEL_ENV, raising=False)
    monkeypatch.delenv(FORMAT_ENV, raising=False)
    assert logging_args(["--port", "0"]) == ("info", "text", ["--port", "0"])
    assert logging_args(["--log-level", "debug", "--port", "0", "--log-format", "json"]) == ("debug", "json",
                                                                                            ["--port", "0"])
    monkeypatch.setenv(LEVEL_ENV, "warning")
    monkeypatch.setenv(FORMAT_ENV, "json")
    assert logging_args([]) == ("warning", "json", [])
    assert logging_args(["--log-level", "error"])[0] == "error"
    with pytest.raises(SystemExit):
        logging_args(["--log-level", "loud"])
