"""`serving.membership.LoadReporter` against a real balancer on loopback: `report_now` sends a heartbeat at once,
and a burst of calls shares one report per `min_report_gap_s` (a decode instance ending many requests a second
must not flood its balancer)."""

from __future__ import annotations

import socket
import threading
import time

from deepinfer.loadbalancer.server import start_server
from deepinfer.protos import common_pb2, loadbalancer_pb2
from deepinfer.serving.membership import LoadReporter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_report_now_sends_at_once_and_a_burst_shares_reports():
    address = f"127.0.0.1:{_free_port()}"
    running = start_server(address, "decode", "kv_load", heartbeat_timeout_s=60.0)
    reports: list[float] = []
    lock = threading.Lock()

    def collect():
        with lock:
            reports.append(time.monotonic())
        return loadbalancer_pb2.LoadReport(is_healthy=True, num_kv_blocks_total=64), None

    registration = loadbalancer_pb2.RegisterRequest(instance_id="decode-0", stage=common_pb2.STAGE_DECODE,
                                                    address="127.0.0.1:1")
    reporter = LoadReporter(address, registration, collect, interval_s=30.0, min_report_gap_s=0.2)
    try:
        reporter.start()
        time.sleep(0.05)
        with lock:
            registered = len(reports)  # the registration's report; no heartbeat for 30 s without report_now
        reporter.report_now()
        deadline = time.monotonic() + 5.0
        while len(reports) == registered and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(reports) == registered + 1  # one heartbeat, at once (well within the 0.2 s gap)
        first = reports[-1]
        for _ in range(50):  # a burst right after it: one more report, no sooner than the gap
            reporter.report_now()
        deadline = time.monotonic() + 5.0
        while len(reports) == registered + 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.3)
        assert len(reports) == registered + 2
        assert reports[-1] - first >= 0.19
    finally:
        reporter.stop(deregister=False)
        running.server.stop(0)
