"""`entrypoint.migration` in-process, no workers: the stage-outage bookkeeping that lets queued work
wait for a restarted instance, the "is that process gone" probe, and the prompt release of the
decode reservation a dead prefill was to write into."""

from __future__ import annotations

import socket
import threading

import grpc

from deepinfer.entrypoint.migration import (
    OUTAGE_POLL_S,
    WRITER_GONE_REASON,
    StageOutages,
    _release_attempt,
    is_process_gone,
)
from deepinfer.protos import decode_pb2_grpc


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stage_is_out_for_the_wait_window_after_losing_an_instance():
    clock = _Clock()
    outages = StageOutages(wait_s=30.0, clock=clock)
    assert outages.wait_until("prefill") is None  # nobody saw it fail: no waiting
    outages.mark_lost("prefill", "prefill-0", "127.0.0.1:1")
    assert outages.wait_until("prefill") == 130.0
    assert outages.wait_until("decode") is None
    clock.now = 130.0
    assert outages.wait_until("prefill") is None


def test_a_lost_instance_is_usable_again_once_it_answers():
    clock = _Clock()
    outages = StageOutages(wait_s=30.0, clock=clock)
    probes: list[str] = []
    assert outages.is_usable("decode-1", "a:1", lambda: probes.append("x") or False)  # never lost: no probe
    assert probes == []
    outages.mark_lost("prefill", "prefill-0", "a:1")
    assert not outages.is_usable("prefill-0", "a:1", lambda: probes.append("a:1") or False)
    assert not outages.is_usable("prefill-0", "a:1", lambda: probes.append("a:1") or True)  # cached answer
    assert probes == ["a:1"]
    clock.now += OUTAGE_POLL_S
    # restarted under its id on another port: that address answers
    assert outages.is_usable("prefill-0", "a:2", lambda: probes.append("a:2") or True)
    assert not outages.is_known_lost("prefill-0")


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Stub:
    def __init__(self, health_error: Exception | None = None) -> None:
        self.health_error = health_error
        self.aborts: list[str] = []

    def Health(self, request, timeout=None):
        if self.health_error is not None:
            raise self.health_error

    def Abort(self, request, timeout=None):
        self.aborts.append(request.reason)


def test_only_a_refused_connection_proves_a_process_gone():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert is_process_gone(decode_pb2_grpc.DecodeStub(channel), timeout_s=2.0)
    assert not is_process_gone(_Stub())  # answers
    # a hung process or a cut link: no proof, its late WRITE may still land
    assert not is_process_gone(_Stub(_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")))
    assert not is_process_gone(_Stub(_RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")))


class _Req:
    def __init__(self, prefill, decode) -> None:
        self.request_id = "r"
        self.lock = threading.Lock()
        self.prefill, self.decode = prefill, decode
        self.calls: list = []
        self.lost_instance_ids: list[str] = []

    def _abort_stages(self, stages, reason: str, rpc_timeout_s: float) -> None:
        for _, stub in stages:
            stub.Abort(type("A", (), {"reason": reason})(), timeout=rpc_timeout_s)


class _Lost(Exception):
    status = grpc.StatusCode.UNAVAILABLE


def test_a_dead_prefills_decode_reservation_is_released_at_once():
    dead = _Stub(_RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: "
                                                        "ipv4:127.0.0.1:9: Connection refused"))
    decode = _Stub()
    req = _Req(("prefill-0", dead), ("decode-0", decode))
    assert _release_attempt(req, _Lost("prefill died"), 1.0) == "prefill-0"
    assert len(decode.aborts) == 1 and decode.aborts[0].startswith(WRITER_GONE_REASON)
    assert req.lost_instance_ids == ["prefill-0"]
    # a hung prefill (no answer) may still write: decode quarantines as usual
    hung = _Stub(_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    decode = _Stub()
    req = _Req(("prefill-1", hung), ("decode-0", decode))
    _release_attempt(req, _Lost("prefill hung"), 1.0)
    assert len(decode.aborts) == 1 and not decode.aborts[0].startswith(WRITER_GONE_REASON)
