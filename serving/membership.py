"""Balancer membership of a worker instance: `LoadReporter` registers the instance with its stage's
balancer and heartbeats its load, re-registering when the balancer forgot it; prefix-cache hashes
travel as deltas (protos/loadbalancer.proto).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from deepinfer.protos import loadbalancer_pb2, loadbalancer_pb2_grpc
from deepinfer.serving.auth import secure_channel

BALANCER_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000)]
"""Options of every channel to a balancer: reconnect within a second of its coming back.

NOTE: a channel whose server died backs off between connection attempts, by default from 1 s
growing to 2 minutes; a balancer restarted on the same address would then stay unreached (workers
not re-registered, picks refused) long after it serves again. Capping the backoff at 1 s keeps a
balancer restart a few-second outage (issue 26: a balancer kill is survived)."""


REPORT_NOW_MIN_GAP_S = 0.02
"""The least time between two heartbeats that `LoadReporter.report_now` asks for: a decode instance that ends a
thousand requests a second sends at most fifty reports, each with what all of them freed."""


class LoadReporter:
    """Registers one instance with its stage's balancer and heartbeats its load (a daemon thread).

    `collect()` returns the current `LoadReport` (without hashes) and the full set of cached prefix
    hashes (None for instances without a prefix cache). Heartbeats carry the hashes as a delta
    against the previous successful report; a full set goes out after registration, when the
    balancer asks for it, and after a failed heartbeat (the lost delta cannot be replayed).

    A balancer that restarted (same address) has forgotten every instance: its answer to the next
    heartbeat (`is_known=False`) makes the reporter register again, so the instance is pickable again
    one heartbeat interval after the balancer serves (`BALANCER_CHANNEL_OPTIONS` bound the reconnect).
    """

    def __init__(
        self,
        lb_address: str,
        registration: loadbalancer_pb2.RegisterRequest,
        collect: Callable[[], tuple[loadbalancer_pb2.LoadReport, frozenset[int] | None]],
        *,
        interval_s: float | None = None,
        rpc_timeout_s: float = 2.0,
        logger_name: str = "worker",
        min_report_gap_s: float = REPORT_NOW_MIN_GAP_S,
    ) -> None:
        self.lb_address = lb_address
        self._registration = registration
        self._collect = collect
        self._interval_s = interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._min_report_gap_s = min_report_gap_s
        self._last_report = 0.0  # monotonic time of the latest heartbeat sent (or tried)
        # carries the cluster secret (serving.auth); reconnects fast after a balancer restart
        self._channel = secure_channel(lb_address, options=BALANCER_CHANNEL_OPTIONS)
        self._stub = loadbalancer_pb2_grpc.LoadBalancerStub(self._channel)
        self._sent_hashes: frozenset[int] | None = None  # None: the next report carries the full set
        self._is_registered = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{logger_name}-heartbeat", daemon=True)
        self._logger = logging.getLogger(logger_name)
        self._num_failures = 0

    def start(self, register_timeout_s: float = 30.0) -> None:
        """Blocks until registered (retrying for `register_timeout_s`), then heartbeats in the background.

        Raises RuntimeError naming the balancer when it cannot be reached in time.
        """
        deadline = time.monotonic() + register_timeout_s
        while True:
            try:
                self._register()
                break
            except grpc.RpcError as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"cannot register with the balancer at {self.lb_address}: {e.code().name} {e.details()}; "
                        "check --lb-address and that the balancer runs"
                    ) from None
                time.sleep(0.2)
        self._thread.start()

    def report_now(self) -> None:
        """Send the next heartbeat now (e.g. the instance started draining, or a decode request ended and freed its
        slot and blocks), or `min_report_gap_s` after the previous one: calls in between share that report."""
        self._wake.set()

    def stop(self, deregister: bool = True) -> None:
        """Blocks until the heartbeat thread ended; then deregisters (best effort) and closes the channel."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(5.0)
        if deregister and self._is_registered:
            try:
                self._stub.Deregister(
                    loadbalancer_pb2.DeregisterRequest(instance_id=self._registration.instance_id),
                    timeout=self._rpc_timeout_s,
                )
            except grpc.RpcError as e:
                self._logger.warning("deregistering from %s failed: %s", self.lb_address, e.code().name)
            self._is_registered = False
        self._channel.close()

    def _report(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int] | None]:
        load, hashes = self._collect()
        report = loadbalancer_pb2.LoadReport()
        report.CopyFrom(load)
        if hashes is not None:
            if self._sent_hashes is None:
                report.cached_block_hashes.extend(sorted(hashes))
            else:
                report.is_cached_hashes_delta = True
                report.cached_block_hashes.extend(sorted(hashes - self._sent_hashes))
                report.evicted_block_hashes.extend(sorted(self._sent_hashes - hashes))
        return report, hashes

    def _register(self) -> None:
        self._sent_hashes = None
        report, hashes = self._report()
        request = loadbalancer_pb2.RegisterRequest()
        request.CopyFrom(self._registration)
        request.load.CopyFrom(report)
        reply = self._stub.Register(request, timeout=self._rpc_timeout_s)
        self._sent_hashes = hashes
        self._is_registered = True
        asked_s = max(0.05, reply.heartbeat_interval_ms / 1000)
        self._interval_s = asked_s if self._interval_s is None else min(self._interval_s, asked_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self._interval_s)
            if woken and self._min_report_gap_s > 0:  # report_now: at most one report per gap (they coalesce)
                wait_s = self._last_report + self._min_report_gap_s - time.monotonic()
                if wait_s > 0 and self._stop.wait(wait_s):
                    break
            self._wake.clear()
            if self._stop.is_set():
                break
            self._last_report = time.monotonic()
            try:
                report, hashes = self._report()
                reply = self._stub.Heartbeat(
                    loadbalancer_pb2.HeartbeatRequest(instance_id=self._registration.instance_id, load=report),
                    timeout=self._rpc_timeout_s,
                )
                if not reply.is_known:
                    self._logger.info("the balancer at %s forgot this instance; registering again", self.lb_address)
                    self._register()
                else:
                    self._sent_hashes = None if reply.needs_full_cached_hashes else hashes
                if self._num_failures:
                    self._logger.info("heartbeats to %s work again", self.lb_address)
                self._num_failures = 0
            except grpc.RpcError as e:
                self._sent_hashes = None
                if self._num_failures == 0:
                    self._logger.warning("heartbeat to %s failed: %s %s", self.lb_address, e.code().name, e.details())
                self._num_failures += 1
            except Exception:  # keep heartbeating; collect() may time out while the loop is busy
                self._logger.exception("collecting the load report failed")
