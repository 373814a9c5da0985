"""Process-shell pieces every model-running stage shares (prefill and decode workers): the
engine-loop thread and the balancer membership thread. Lives in the shared library so the stages
need not import each other (DESIGN.md §2).

* `EngineLoop` — the one thread that touches a worker's core and its NIXL agent (neither is
  thread-safe). gRPC handlers hand work over with `post` / `call`; the functions run on the loop
  thread between two steps.
* `LoadReporter` — registers the instance with its stage's balancer and heartbeats its load,
  re-registering when the balancer forgot it; prefix-cache hashes travel as deltas.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from protos import loadbalancer_pb2, loadbalancer_pb2_grpc

MAX_DEADLINE_S = (2**32 - 1) / 1000
"""The longest deadline a stage call carries (`deadline_ms` fields are uint32 ms); longer = none."""


def call_time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of a gRPC call's deadline; None when the caller set none (gRPC then reports a
    huge value that overflows timers and uint32 fields)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining >= MAX_DEADLINE_S else remaining


STATS_METADATA_KEY = "deepinfer-stats-json"
"""Trailing-metadata key of `Health`: the instance's load and kv_transfer counters as one JSON object."""


class Aborted(Exception):
    """The request was aborted (Abort RPC, client gone, drain timeout) before it finished here."""


class LoopMode(enum.Enum):
    """What the loop has to do, which decides how long it sleeps between two steps."""

    COMPUTE = "compute"
    """Engine work is scheduled: step again at once."""
    POLL = "poll"
    """Only transfers are in flight: poll every `poll_interval_s`."""
    IDLE = "idle"
    """Nothing to do: wake on new work, or after `idle_interval_s`."""


class EngineLoop:
    """Blocks nobody: a daemon thread that runs `step()` until stopped, plus handed-over functions.

    Each iteration runs every posted function (FIFO), then `step()`, then sleeps as `mode()` says.
    An exception from `step()` is fatal: the loop records it in `error`, calls `on_fatal(exc)` and
    stops (the worker then reports itself unhealthy).
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], None],
        mode: Callable[[], LoopMode],
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        poll_interval_s: float = 0.001,
        idle_interval_s: float = 0.05,
    ) -> None:
        self._step = step
        self._mode = mode
        self._on_fatal = on_fatal
        self._poll_interval_s = poll_interval_s
        self._idle_interval_s = idle_interval_s
        self._tasks: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._tasks_lock = threading.Lock()
        self._is_closed = False  # set (under _tasks_lock) once the thread takes no more tasks
        self._wake = threading.Event()
        self._is_stopping = False
        self.error: str | None = None
        """Why the loop died (a step raised), or None while it runs."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._logger = logging.getLogger(name)

    @property
    def is_alive(self) -> bool:
        """True while the loop takes work (started, not stopped, no fatal error)."""
        return self._thread.is_alive() and not self._is_closed

    def start(self) -> None:
        self._thread.start()

    def post(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the loop thread (soon, between two steps); returns a future of its result."""
        fut: Future = Future()
        with self._tasks_lock:
            if self._is_closed:
                fut.set_exception(RuntimeError(f"the engine loop is not running ({self.error or 'stopped'})"))
                return fut
            self._tasks.append((fn, fut))
        self._wake.set()
        return fut

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Blocks until `fn()` ran on the loop thread; returns its result or raises its exception.

        Raises `concurrent.futures.TimeoutError` after `timeout` seconds (fn may still run later).
        """
        return self.post(fn).result(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Blocks until the loop thread ended (at most `timeout` s); pending functions fail."""
        self._is_stopping = True
        self._wake.set()
        if self._thread.ident is not None and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._is_stopping:
                self._run_tasks()
                self._step()
                mode = self._mode()
                if mode is not LoopMode.COMPUTE:
                    self._wake.wait(self._poll_interval_s if mode is LoopMode.POLL else self._idle_interval_s)
                    self._wake.clear()
        except BaseException as e:  # a dead loop must say why
            self.error = f"{type(e).__name__}: {e}"
            self._logger.exception("engine loop died")
            if self._on_fatal is not None:
                self._on_fatal(e)
        finally:
            self._fail_tasks()

    def _run_tasks(self) -> None:
        while self._tasks:
            fn, fut = self._tasks.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def _fail_tasks(self) -> None:
        with self._tasks_lock:
            self._is_closed = True
        while self._tasks:
            _, fut = self._tasks.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(f"the engine loop stopped ({self.error or 'shutdown'})"))


class LoadReporter:
    """Registers one instance with its stage's balancer and heartbeats its load (a daemon thread).

    `collect()` returns the current `LoadReport` (without hashes) and the full set of cached prefix
    hashes (None for instances without a prefix cache). Heartbeats carry the hashes as a delta
    against the previous successful report; a full set goes out after registration, when the
    balancer asks for it, and after a failed heartbeat (the lost delta cannot be replayed).
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
    ) -> None:
        self.lb_address = lb_address
        self._registration = registration
        self._collect = collect
        self._interval_s = interval_s
        self._rpc_timeout_s = rpc_timeout_s
        self._channel = grpc.insecure_channel(lb_address)
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
        """Send the next heartbeat now (e.g. the instance started draining)."""
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
            self._wake.wait(self._interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
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


def run_worker_process(config_cls: type, prog: str, doc: str, argv: list[str] | None, serve: Callable) -> int:
    """Blocks for a worker process's life (the `python -m <stage>_worker` entry of every stage).

    Parses `config_cls` from `argv` (CLI generated from the config), sends every log line to stderr,
    starts `serve(config)` (imported lazily by the caller's `serve`), makes SIGTERM / SIGINT stop it,
    prints one JSON line `{"address", "instance_id", "agent"}` on stdout once it serves, and returns 0
    when it stopped (a signal or a drain).
    """
    import json
    import signal
    import sys

    from engine.config_cli import config_from_args, make_parser

    config = config_from_args(config_cls, make_parser(config_cls, prog, doc.splitlines()[0]), argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import nixl._api  # noqa: F401

    # NOTE: importing NIXL installs a handler that writes NIXL's logs to stdout; stdout carries only
    # the address line, so it is moved to stderr
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    worker = serve(config)
    name = prog.split()[-1]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=worker.stop, name=f"{name}-stop").start())
    print(json.dumps({"address": worker.address, "instance_id": worker.instance_id, "agent": worker.agent_name}),
          flush=True)
    while not worker.wait(0.5):
        pass
    return 0


def health_response(worker: Any, context: grpc.ServicerContext, stage: int, loop_name: str,
                    timeout_s: float) -> Any:
    """A worker's `HealthResponse` (common.proto): healthy when its loop answers a stats call within
    `timeout_s`; the stats JSON travels as trailing metadata (`STATS_METADATA_KEY`).

    `worker` has `loop` (an `EngineLoop`), `_stats`, `is_draining` and `instance_id`; `stage` is a
    `common_pb2.Stage` value; `loop_name` names the loop in messages ("engine loop", "encode loop").
    """
    import concurrent.futures
    import json

    from protos import common_pb2

    message = ""
    try:
        stats = worker.loop.call(worker._stats, timeout_s)
        context.set_trailing_metadata(((STATS_METADATA_KEY, json.dumps(stats)),))
    except concurrent.futures.TimeoutError:
        message = f"the {loop_name} did not answer within {timeout_s} s"
    except Exception as e:
        message = f"the {loop_name} is not running: {worker.loop.error or e}"
    return common_pb2.HealthResponse(is_healthy=not message, is_draining=worker.is_draining,
                                     instance_id=worker.instance_id, stage=stage, message=message)
