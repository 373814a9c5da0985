"""The worker-shell base (`serving.shell`): health, abort, drain and stop states over a fake core, through
real gRPC on loopback (no engine, no NIXL)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from deepinfer.protos import common_pb2, loadbalancer_pb2, prefill_pb2, prefill_pb2_grpc
from deepinfer.protos.metadata import STATS_METADATA_KEY
from deepinfer.serving.errors import Refused
from deepinfer.serving.loop import LoopMode
from deepinfer.serving.shell import ShellServicer, WorkerShell, serve_worker


def _config(**overrides):
    fields = dict(instance_id="", agent_name="", host="127.0.0.1", port=0, advertise_host=None, lb_address=None,
                  datacenter="", heartbeat_interval_s=0.5, max_rpc_threads=4)
    return SimpleNamespace(**{**fields, **overrides})


class _Servicer(ShellServicer, prefill_pb2_grpc.PrefillServicer):
    """Only the shared RPCs (Prefill itself stays UNIMPLEMENTED)."""


class FakeWorker(WorkerShell):
    """A shell whose "core" is a set of request ids (loop-thread state)."""

    stage_name = "prefill"
    stage = common_pb2.STAGE_PREFILL

    def __init__(self, config) -> None:
        super().__init__(config)
        self.requests: set[str] = set()
        self.aborted: list[tuple[str, str]] = []
        self.is_closed = False
        self.fail_step = threading.Event()
        self._bind(prefill_pb2_grpc.add_PrefillServicer_to_server, _Servicer(self))

    def _step(self) -> None:
        if self.fail_step.is_set():
            raise RuntimeError("step failed")

    def _mode(self) -> LoopMode:
        return LoopMode.POLL

    def _abort(self, request_id: str, reason: str) -> bool:
        was_found = request_id in self.requests
        self.requests.discard(request_id)
        self.aborted.append((request_id, reason))
        return was_found

    def _abort_all(self) -> None:
        for request_id in sorted(self.requests):
            self._abort(request_id, "drain timeout")

    def _num_unfinished(self) -> int:
        return len(self.requests)

    def _on_fatal(self, exc: BaseException) -> None:
        self.requests.clear()

    def _load_and_hashes(self):
        return loadbalancer_pb2.LoadReport(num_running_requests=len(self.requests)), None

    def _stats(self) -> dict:
        return {"num_requests": len(self.requests)}

    def _close(self) -> None:
        self.is_closed = True


@pytest.fixture
def worker():
    w = serve_worker(FakeWorker, _config())
    yield w
    w.stop(grace_s=0)


@pytest.fixture
def stub(worker):
    with grpc.insecure_channel(worker.address) as channel:
        yield prefill_pb2_grpc.PrefillStub(channel)


def _add(worker, *request_ids):
    worker.loop.call(lambda: worker.requests.update(request_ids), 5)


def test_health_reports_stats_as_trailing_metadata(worker, stub):
    _add(worker, "r1")
    reply, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=5)
    assert reply.is_healthy and not reply.is_draining and not reply.message
    assert reply.stage == common_pb2.STAGE_PREFILL and reply.instance_id == worker.instance_id
    assert worker.instance_id.startswith("prefill-") and worker.agent_name == worker.instance_id
    stats = json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])
    assert isinstance(stats.pop("errors_by_cause"), dict)  # every stage's (process-wide, `serving.errors`)
    assert stats == {"num_requests": 1}


def test_abort_rpc_runs_on_the_loop(worker, stub):
    _add(worker, "r1")
    assert stub.Abort(common_pb2.AbortRequest(request_id="r1"), timeout=5).was_found
    assert not stub.Abort(common_pb2.AbortRequest(request_id="r1", reason="client gone"), timeout=5).was_found
    assert worker.aborted == [("r1", "Abort RPC"), ("r1", "client gone")]


def test_stage_rpcs_stay_the_subclass_s(stub):
    with pytest.raises(grpc.RpcError) as e:  # ShellServicer adds only Abort, Health and Drain
        stub.Prefill(prefill_pb2.PrefillRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_drain_refuses_new_work_and_stops_once_idle(worker, stub):
    worker.check_accepting()  # serving: no refusal
    _add(worker, "r1")
    assert stub.Drain(common_pb2.DrainRequest(), timeout=5).num_unfinished_requests == 1
    assert worker.is_draining
    with pytest.raises(Refused, match="is draining") as e:
        worker.check_accepting()
    assert e.value.code == common_pb2.ERROR_CODE_UNAVAILABLE
    assert stub.Health(common_pb2.HealthRequest(), timeout=5).is_draining
    assert not worker.wait(0.3)  # r1 still runs: no timeout, no abort
    worker.loop.call(lambda: worker.requests.clear(), 5)
    assert worker.wait(5)
    assert worker.is_closed and worker.aborted == [] and not worker.loop.is_alive


def test_drain_timeout_aborts_every_request(worker):
    _add(worker, "r1", "r2")
    assert worker.drain(timeout_s=0.05) == 2
    assert worker.wait(5)
    assert worker.aborted == [("r1", "drain timeout"), ("r2", "drain timeout")]


def test_a_dead_loop_is_unhealthy(worker, stub):
    worker.fail_step.set()
    deadline = time.monotonic() + 5
    while worker.loop.is_alive and time.monotonic() < deadline:
        time.sleep(0.01)
    reply = stub.Health(common_pb2.HealthRequest(), timeout=5)
    assert not reply.is_healthy and "step failed" in reply.message
    with pytest.raises(Refused, match="unhealthy: RuntimeError: step failed"):
        worker.check_accepting()
    load, hashes = worker._collect_load()
    assert not load.is_healthy and hashes is None
    with pytest.raises(grpc.RpcError) as e:
        stub.Abort(common_pb2.AbortRequest(request_id="r1"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_stop_is_idempotent():
    w = serve_worker(FakeWorker, _config(instance_id="p0", agent_name="agent-p0"))
    assert (w.instance_id, w.agent_name) == ("p0", "agent-p0") and w.address.startswith("127.0.0.1:")
    w.stop(grace_s=0)
    w.stop(grace_s=0)
    assert w.wait(0) and w.is_closed
