"""A balancer restart, in-process (issue 26; fast): the entrypoint's pick waits for a killed balancer
to serve again on its address and for the worker to re-register on its next heartbeat, instead of
failing the request; the bookkeeping behind it (`StageOutages.mark_out`, `StageLiveness` noticing an
unreachable balancer). The same across real processes under load: tests/e2e/test_chaos_balancer.py."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest

from deepinfer.entrypoint.config import EntrypointConfig
from deepinfer.entrypoint.migration import StageLiveness, StageOutages
from deepinfer.entrypoint.server import EntrypointServicer, _Failed, _Request
from deepinfer.loadbalancer.server import start_server
from deepinfer.protos import common_pb2, loadbalancer_pb2
from deepinfer.serving.membership import LoadReporter

HEARTBEAT_TIMEOUT_S = 0.6


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_unreachable_balancer_puts_its_stage_out_without_extending_the_window():
    clock = _Clock()
    outages = StageOutages(wait_s=30.0, clock=clock)
    outages.mark_out("decode")
    assert outages.wait_until("decode") == 130.0
    assert outages.wait_until("prefill") is None
    clock.now = 120.0
    outages.mark_out("decode")  # every failed poll marks again: a balancer that stays away is not waited for forever
    assert outages.wait_until("decode") == 130.0
    clock.now = 131.0
    assert outages.wait_until("decode") is None
    outages.mark_out("decode")  # a later outage starts its own window
    assert outages.wait_until("decode") == 161.0
    assert not outages.is_known_lost("decode-0")  # no instance was lost


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class _DeadBalancer:
    def ListInstances(self, request, timeout=None):
        raise _Unavailable()


def test_liveness_reports_an_unreachable_balancer_and_marks_nothing_lost():
    seen = threading.Event()
    liveness = StageLiveness(_DeadBalancer(), interval_s=0.02, stage="decode", on_lost=lambda iid: pytest.fail(iid),
                             on_balancer_unreachable=seen.set)
    try:
        req = _Request("r1")
        req.decode = ("decode-0", object())
        liveness.watch(req, "decode-0", object())
        assert seen.wait(5.0)
        assert req.lost_decode_id is None
    finally:
        liveness.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reporter(lb_address: str) -> LoadReporter:
    registration = loadbalancer_pb2.RegisterRequest(instance_id="decode-0", stage=common_pb2.STAGE_DECODE,
                                                    address="127.0.0.1:1")
    load = loadbalancer_pb2.LoadReport(is_healthy=True, num_kv_blocks_total=64)
    return LoadReporter(lb_address, registration, lambda: (load, None))


def test_a_pick_waits_for_a_killed_balancer_restarted_on_its_address():
    port = _free_port()
    address = f"127.0.0.1:{port}"
    running = start_server(address, "decode", "kv_load", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    reporter = _reporter(address)
    reporter.start()
    servicer = EntrypointServicer(EntrypointConfig(prefill_lb_address="127.0.0.1:1", decode_lb_address=address,
                                                   rpc_timeout_s=2.0, liveness_probe_timeout_s=0.3),
                                  "entrypoint-test", vocab_size=1000, max_model_len=256)
    restarted = []
    try:
        pick = loadbalancer_pb2.PickRequest(request_id="r1", stage=common_pb2.STAGE_DECODE, num_prompt_tokens=4)
        assert servicer._pick(_Request("r1"), "decode", servicer.decode_lb, pick, None).instance_id == "decode-0"
        running.server.stop(0).wait()  # the balancer dies: it forgets decode-0

        def restart() -> None:
            time.sleep(1.0)
            restarted.append(start_server(address, "decode", "kv_load", heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))

        threading.Thread(target=restart, daemon=True).start()
        t = time.monotonic()
        pick = loadbalancer_pb2.PickRequest(request_id="r2", stage=common_pb2.STAGE_DECODE, num_prompt_tokens=4)
        chosen = servicer._pick(_Request("r2"), "decode", servicer.decode_lb, pick, time.monotonic() + 20.0)
        waited = time.monotonic() - t
        assert chosen.instance_id == "decode-0"  # re-registered with the new balancer by its heartbeat
        assert 1.0 <= waited < 8.0, waited
        assert "decode-0" in {i.instance_id for i in servicer.decode_lb.ListInstances(
            loadbalancer_pb2.ListInstancesRequest(), timeout=2).instances}
    finally:
        reporter.stop(deregister=False)
        servicer.close()
        for r in restarted:
            r.server.stop(0)


def test_a_balancer_that_answers_no_instance_still_fails_at_once():
    port = _free_port()
    address = f"127.0.0.1:{port}"
    running = start_server(address, "decode", "kv_load")
    servicer = EntrypointServicer(EntrypointConfig(prefill_lb_address="127.0.0.1:1", decode_lb_address=address),
                                  "entrypoint-test", vocab_size=1000, max_model_len=256)
    try:
        pick = loadbalancer_pb2.PickRequest(request_id="r1", stage=common_pb2.STAGE_DECODE, num_prompt_tokens=4)
        t = time.monotonic()
        with pytest.raises(_Failed) as e:
            servicer._pick(_Request("r1"), "decode", servicer.decode_lb, pick, time.monotonic() + 20.0)
        assert e.value.status == grpc.StatusCode.UNAVAILABLE and "no decode instance" in str(e.value)
        assert time.monotonic() - t < 2.0  # nobody saw the stage fail: no waiting (a drained stage)
    finally:
        servicer.close()
        running.server.stop(0)


# ------------------------------------------------------------------ a lost vision instance (one of its stage)


class _NoInstance(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "no vision instance can be picked"


class _Done:
    def __init__(self, value=None, error=None) -> None:
        self.value, self.error = value, error

    def result(self):
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self):
        return False


class _VisionBalancer:
    """A balancer listing what `instances` holds (id -> address); Pick honours the exclusions."""

    def __init__(self, instances: dict[str, str]) -> None:
        self.instances = instances
        outer = self

        class Pick:
            @staticmethod
            def future(request, timeout=None):
                free = [i for i in outer.instances if i not in request.exclude_instance_ids]
                if not free:
                    return _Done(error=_NoInstance())
                return _Done(loadbalancer_pb2.PickResponse(instance=outer._instance(free[0])))

        self.Pick = Pick

    def _instance(self, instance_id: str):
        return loadbalancer_pb2.Instance(instance_id=instance_id, address=self.instances[instance_id],
                                         load=loadbalancer_pb2.LoadReport(is_healthy=True))

    def ListInstances(self, request, timeout=None):
        return loadbalancer_pb2.ListInstancesResponse(instances=[self._instance(i) for i in self.instances])


def test_a_pick_waits_for_the_only_vision_instance_restarted_under_its_id(monkeypatch):
    """The lost instance is still listed (its heartbeats not timed out): the pick excludes it while it does
    not answer, and takes it again once it serves at its new address (before: excluded for good)."""
    servicer = EntrypointServicer(EntrypointConfig(prefill_lb_address="127.0.0.1:1", decode_lb_address="127.0.0.1:2",
                                                   outage_wait_s=20.0),
                                  "entrypoint-test", vocab_size=1000, max_model_len=256)
    lb = _VisionBalancer({"vision-0": "127.0.0.1:10"})
    monkeypatch.setattr(servicer, "_probe", lambda stage, address: address == "127.0.0.1:11")  # the restarted one
    try:
        servicer.outages.mark_lost("vision", "vision-0", "127.0.0.1:10")  # its Encode broke with UNAVAILABLE
        threading.Timer(0.6, lambda: lb.instances.update({"vision-0": "127.0.0.1:11"})).start()
        t = time.monotonic()
        pick = loadbalancer_pb2.PickRequest(request_id="r1", stage=common_pb2.STAGE_VISION, num_prompt_tokens=4)
        chosen = servicer._pick(_Request("r1"), "vision", lb, pick, time.monotonic() + 10.0)
        assert (chosen.instance_id, chosen.address) == ("vision-0", "127.0.0.1:11")
        assert 0.5 <= time.monotonic() - t < 5.0
    finally:
        servicer.close()


def test_a_vision_instance_killed_between_calls_puts_the_stage_out():
    from deepinfer.entrypoint.migration import StageMembership

    outages = StageOutages(wait_s=30.0)
    answering = {"127.0.0.1:12"}
    lb = _VisionBalancer({"vision-0": "127.0.0.1:10", "vision-1": "127.0.0.1:11", "vision-2": "127.0.0.1:12"})
    watch = StageMembership(lb, "vision", outages, probe=lambda address: address in answering, interval_s=60.0)
    try:
        assert watch.poll() == [] and outages.wait_until("vision") is None
        lb.instances.pop("vision-0")  # its heartbeats timed out: it died between two Encode calls
        lb.instances.pop("vision-2")  # deregistered but still answers (a balancer hiccup, a drain's end)
        assert watch.poll() == ["vision-0"]
        assert outages.wait_until("vision") is not None and outages.is_known_lost("vision-0")
        assert not outages.is_known_lost("vision-2")
    finally:
        watch.close()


def test_a_drained_vision_instance_leaving_is_not_an_outage():
    from deepinfer.entrypoint.migration import StageMembership

    outages = StageOutages(wait_s=30.0)
    lb = _VisionBalancer({"vision-0": "127.0.0.1:10"})
    draining = lb._instance
    lb._instance = lambda i: loadbalancer_pb2.Instance(
        instance_id=i, address=lb.instances[i], load=loadbalancer_pb2.LoadReport(is_healthy=True, is_draining=True))
    watch = StageMembership(lb, "vision", outages, probe=lambda address: False, interval_s=60.0)
    try:
        watch.poll()
        lb._instance = draining
        lb.instances.clear()  # drained, then deregistered and gone: image requests fail at once, as before
        assert watch.poll() == [] and outages.wait_until("vision") is None
    finally:
        watch.close()
