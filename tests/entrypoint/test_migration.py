"""`entrypoint.migration` in-process: the continuation request, what may migrate, and `run_migrating`
driving a fake one-pair request path that loses its decode instance mid-stream."""

from __future__ import annotations

import threading

import grpc
import pytest

from deepinfer.entrypoint.migration import (
    DecodeLost,
    MigrationStats,
    continuation,
    not_migratable_reason,
    run_migrating,
)
from deepinfer.protos import common_pb2, entrypoint_pb2


class _Failed(Exception):
    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Stub:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def Abort(self, request, timeout=None):
        self.aborted.append(request.request_id)


class _Req:
    """The fields of `entrypoint.server._Request` that `run_migrating` touches."""

    def __init__(self, request_id: str = "r") -> None:
        self.request_id = request_id
        self.lock = threading.Lock()
        self.prefill = self.decode = None
        self.calls: list = []
        self.abort_reason = None
        self.is_done = False
        self.usage = common_pb2.Usage()
        self.lost_instance_ids: list[str] = []
        self.num_resumed_tokens = 0

    def _abort_stages(self, stages, reason, rpc_timeout_s):
        for _, stub in stages:
            stub.Abort(common_pb2.AbortRequest(request_id=self.request_id, reason=reason))


def _request(prompt, **sampling):
    return entrypoint_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt,
                                          sampling_params=common_pb2.SamplingParams(**sampling))


def test_continuation_appends_the_streamed_tokens_and_lowers_the_budgets():
    req = _request([1, 2, 3], max_tokens=10, min_tokens=4, seed=7)
    cont = continuation(req, [9, 8])
    assert list(cont.prompt_token_ids) == [1, 2, 3, 9, 8]
    assert cont.sampling_params.max_tokens == 8 and cont.sampling_params.min_tokens == 2
    assert cont.sampling_params.seed == 7
    assert list(req.prompt_token_ids) == [1, 2, 3]  # the original is untouched
    assert continuation(req, list(range(10))) is None  # nothing left to generate
    assert not continuation(_request([1]), [5]).sampling_params.HasField("max_tokens")  # no cap stays no cap
    # the client's prompt length travels with it (V4.1's decoder-replay tail start), kept across continuations
    assert cont.num_original_prompt_tokens == 3 and not req.HasField("num_original_prompt_tokens")
    assert continuation(cont, [7]).num_original_prompt_tokens == 3
    assert not continuation(req, []).HasField("num_original_prompt_tokens")  # nothing streamed: the same request


def test_only_exact_continuations_migrate_after_tokens_streamed():
    assert not_migratable_reason(common_pb2.SamplingParams(repetition_penalty=1.2, temperature=0.5, seed=1)) is None
    assert "presence" in not_migratable_reason(common_pb2.SamplingParams(presence_penalty=0.5))
    assert "frequency" in not_migratable_reason(common_pb2.SamplingParams(frequency_penalty=0.5))
    structured = common_pb2.SamplingParams(structured_output=common_pb2.StructuredOutput(any_json=True))
    assert "grammar" in not_migratable_reason(structured)


def _fake_generate(tokens_per_attempt, lose_after, stubs):
    """A one-pair request path: attempt k streams `tokens_per_attempt[k]` (one token a response), then
    loses its decode instance after `lose_after[k]` responses (None = finishes)."""
    seen = []

    def generate(req, request, deadline):
        k = len(seen)
        seen.append(request)
        req.usage.prompt_tokens = len(request.prompt_token_ids) - req.num_resumed_tokens
        req.usage.cached_prompt_tokens = 3 + k
        req.decode = (f"decode-{k}", stubs[k])
        toks = tokens_per_attempt[k]
        for i, t in enumerate(toks):
            if lose_after[k] is not None and i == lose_after[k]:
                raise DecodeLost(f"decode-{k}", _Failed(grpc.StatusCode.UNAVAILABLE, "gone"))
            last = i + 1 == len(toks)
            resp = entrypoint_pb2.GenerateResponse(request_id=req.request_id, token_ids=[t])
            req.usage.completion_tokens += 1
            if i == 0 or last:
                resp.usage.CopyFrom(req.usage if not last else common_pb2.Usage(
                    prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                    cached_prompt_tokens=req.usage.cached_prompt_tokens))
            if last:
                resp.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield resp

    return generate, seen


def test_run_migrating_continues_the_stream_with_right_usage():
    stubs = [_Stub(), _Stub(), _Stub()]
    generate, seen = _fake_generate([[10, 11, 12, 13], [12, 13, 14], [14, 15]], [2, 2, None], stubs)
    req, stats = _Req(), MigrationStats()
    out = list(run_migrating(generate, req, _request([1, 2, 3, 4, 5], max_tokens=6), None, limit=3,
                             rpc_timeout_s=1.0, stats=stats))
    assert [t for r in out for t in r.token_ids] == [10, 11, 12, 13, 14, 15]
    assert list(seen[1].prompt_token_ids) == [1, 2, 3, 4, 5, 10, 11]
    assert list(seen[2].prompt_token_ids) == [1, 2, 3, 4, 5, 10, 11, 12, 13]
    assert seen[2].sampling_params.max_tokens == 2
    assert not seen[0].HasField("num_original_prompt_tokens")
    assert seen[1].num_original_prompt_tokens == seen[2].num_original_prompt_tokens == 5
    assert [r.HasField("usage") for r in out] == [True, False, False, False, False, True]
    assert out[-1].usage.prompt_tokens == 5 and out[-1].usage.completion_tokens == 6
    assert out[-1].usage.cached_prompt_tokens == 3  # the first prefill's hit
    assert stats.as_dict() == {"num_migrations_total": 2, "num_migrated_requests_total": 1,
                               "num_not_migrated_total": 0}
    assert stubs[0].aborted == ["r"] and stubs[1].aborted == ["r"]  # the lost ones, in daemon threads (done by now)


def test_run_migrating_stops_at_the_limit_and_for_inexact_requests():
    generate, _ = _fake_generate([[1, 2, 3]] * 3, [1, 1, 1], [_Stub()] * 3)
    with pytest.raises(_Failed):
        list(run_migrating(generate, _Req(), _request([7, 8], max_tokens=3), None, limit=1, rpc_timeout_s=1.0))
    generate, seen = _fake_generate([[1, 2, 3]] * 2, [1, None], [_Stub()] * 2)
    with pytest.raises(_Failed):
        list(run_migrating(generate, _Req(), _request([7, 8], max_tokens=3, presence_penalty=0.5), None, limit=3,
                           rpc_timeout_s=1.0))
    assert len(seen) == 1
    # lost before any token: even an inexact request moves (nothing was streamed)
    generate, seen = _fake_generate([[1, 2, 3]] * 2, [0, None], [_Stub()] * 2)
    out = list(run_migrating(generate, _Req(), _request([7, 8], max_tokens=3, presence_penalty=0.5), None,
                             limit=3, rpc_timeout_s=1.0))
    assert [t for r in out for t in r.token_ids] == [1, 2, 3] and len(seen) == 2


def test_a_lost_finish_ends_the_stream_with_length():
    generate, seen = _fake_generate([[1, 2, 3, 4]], [3], [_Stub()])
    out = list(run_migrating(generate, _Req(), _request([7, 8], max_tokens=3), None, limit=3, rpc_timeout_s=1.0))
    assert [t for r in out for t in r.token_ids] == [1, 2, 3]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 3
    assert len(seen) == 1
