"""The engine loop: the one thread that touches a worker's core and its NIXL agents (neither is
thread-safe). gRPC handlers hand work over with `EngineLoop.post` / `EngineLoop.call`; the functions
run on the loop thread between two steps. Plus the deadline helper every handler uses.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

MAX_DEADLINE_S = (2**32 - 1) / 1000
"""The longest deadline a stage call carries (`deadline_ms` fields are uint32 ms); longer = none."""


def call_time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds left of a gRPC call's deadline; None when the caller set none (gRPC then reports a
    huge value that overflows timers and uint32 fields)."""
    remaining = context.time_remaining()
    return None if remaining is None or remaining >= MAX_DEADLINE_S else remaining


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
