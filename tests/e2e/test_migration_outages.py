"""`entrypoint.migration` in-process, no workers: the stage-outage bookkeeping that lets queued work
wait for a restarted instance, the "is that process gone" probe, the prompt release of the decode
reservation a dead prefill was to write into, and the client's text across a migration (held-back
text recovered, a stop string spanning the migration point found)."""

from __future__ import annotations

import socket
import threading

import grpc

from deepinfer.entrypoint.migration import (
    OUTAGE_POLL_S,
    WRITER_GONE_REASON,
    DecodeLost,
    StageOutages,
    _release_attempt,
    is_address_gone,
    is_process_gone,
    run_migrating,
)
from deepinfer.protos import common_pb2, decode_pb2_grpc, entrypoint_pb2


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
    assert is_address_gone(f"127.0.0.1:{port}", timeout_s=2.0)
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

    def _abort_stages(self, stages, reason: str, rpc_timeout_s: float, writer_gone: bool = False) -> None:
        for _, stub in stages:
            stub.Abort(type("A", (), {"reason": reason, "writer_gone": writer_gone})(), timeout=rpc_timeout_s)


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


class _Detokenizer:
    """Token t is the letter 'a' + t."""

    def __init__(self, prompt, skip_special_tokens) -> None:
        pass

    def append(self, token_ids) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids)


class _MigReq(_Req):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.abort_reason = None
        self.is_done = False
        self.usage = common_pb2.Usage()
        self.num_resumed_tokens = 0


def _pairs(attempts, seen):
    """Attempt k yields `attempts[k]` = [(token, text)...] then loses its decode (the last attempt finishes)."""

    def generate(req, request, deadline):
        k = len(seen)
        seen.append(request)
        req.usage.prompt_tokens = len(request.prompt_token_ids) - req.num_resumed_tokens
        req.decode = (f"decode-{k}", _Stub())
        for i, (token, text) in enumerate(attempts[k]):
            resp = entrypoint_pb2.GenerateResponse(request_id="r", token_ids=[token], text=text)
            if i == 0:
                resp.usage.CopyFrom(req.usage)
            if k + 1 == len(attempts) and i + 1 == len(attempts[k]):
                resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
                resp.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                     completion_tokens=i + 1))
            yield resp
        if k + 1 < len(attempts):
            raise DecodeLost(f"decode-{k}", _Lost("gone"))

    return generate


def _run(attempts, **sampling):
    seen: list = []
    request = entrypoint_pb2.GenerateRequest(request_id="r", prompt_token_ids=[20, 21],
                                             sampling_params=common_pb2.SamplingParams(**sampling))
    out = list(run_migrating(_pairs(attempts, seen), _MigReq(), request, None, limit=3, rpc_timeout_s=1.0,
                             new_detokenizer=_Detokenizer))
    return out, seen, request


def test_a_stop_string_spanning_the_migration_point_ends_the_stream():
    # decode 0 streamed a, b and held "c" back (it may start "cde"), then died; decode 1 goes on d, e, f
    out, seen, request = _run([[(0, "a"), (1, "b"), (2, "")], [(3, "d"), (4, "e"), (5, "f"), (6, "g")]],
                              stop=["cde"], max_tokens=10)
    assert list(seen[1].sampling_params.stop) == []  # the entrypoint checks them for the continuation
    assert list(request.sampling_params.stop) == ["cde"]  # the client's request is untouched
    assert [t for r in out for t in r.token_ids] == [0, 1, 2, 3, 4]  # up to the token completing the stop
    assert "".join(r.text for r in out) == "ab"
    last = out[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP and last.stop_str == "cde"
    assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == 2
    # kept with include_stop_str_in_output; min_tokens delays the check as the engine does
    out, _, _ = _run([[(0, "a"), (1, "b"), (2, "")], [(3, "d"), (4, "e"), (5, "f")]], stop=["cde"],
                     include_stop_str_in_output=True)
    assert "".join(r.text for r in out) == "abcde"
    out, _, _ = _run([[(0, "a"), (1, "b"), (2, "")], [(3, "d"), (4, "e"), (5, "f")]], stop=["cde"], min_tokens=5)
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and "".join(r.text for r in out) == "abcdef"


def test_text_a_lost_decode_held_back_is_not_lost():
    # decode 0 held "c" (e.g. mid UTF-8 character) when it died: the client still gets it, in order; the
    # continuation's own text (decoded in another window: "?" here) is replaced by the tokens' text
    out, _, _ = _run([[(0, "a"), (1, "b"), (2, "")], [(3, "?d"), (4, "e")]])
    assert "".join(r.text for r in out) == "abcde"
    assert [t for r in out for t in r.token_ids] == [0, 1, 2, 3, 4]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
