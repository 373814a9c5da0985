"""Service processes on this host without Ray: each role started as `python -m MODULE ...`, which
prints one JSON line with its address once it serves (balancers, workers, entrypoint, HTTP front).
Benchmarks and tests use it to run a cluster of real processes; `deploy/` launches with Ray.

```python
procs = ServiceProcesses(logdir, env={**os.environ, "OMP_NUM_THREADS": "1"})
procs.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill"])
procs.wait_ready()["prefill_lb"]["address"]
procs.stop()   # front to back, SIGTERM then SIGKILL
```
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the processes' working directory."""

STOP_ORDER: tuple[tuple[str, ...], ...] = (
    ("http",), ("entrypoint",), ("vision", "prefill", "decode"), ("vision_lb", "prefill_lb", "decode_lb"))
"""Front to back, so workers can still deregister from their balancers; other names stop last."""


class ProcessStartError(RuntimeError):
    """A process exited, or did not print its address, before serving."""


class ServiceProcesses:
    """Named `python -m` processes, stdout/stderr in `logdir/NAME.out|.err`; `info[name]` is the JSON
    line each printed when it started serving."""

    def __init__(self, logdir: str | Path, env: Mapping[str, str] | None = None) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(env) if env is not None else None
        self.procs: dict[str, subprocess.Popen] = {}
        self.info: dict[str, dict] = {}

    def spawn(self, name: str, args: Sequence[str], netns: str | None = None,
              env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start `python -m deepinfer.<args[0]> *args[1:]` as `name` (not waiting for it); `args[0]` is a
        module of the deepinfer namespace (`loadbalancer`, `prefill_worker`, `entrypoint.http`, ...).
        `netns`: run it inside that network namespace (`deploy.netns`; `ip netns exec` execs, so the
        pid is the process's own); `env`: variables added to this one's environment."""
        module = args[0] if args[0].startswith("deepinfer.") else f"deepinfer.{args[0]}"
        prefix = ["ip", "netns", "exec", netns] if netns else []
        proc_env = self.env if env is None else {**(self.env if self.env is not None else os.environ), **env}
        self.procs[name] = subprocess.Popen(
            [*prefix, sys.executable, "-m", module, *args[1:]], cwd=ROOT, env=proc_env, stdin=subprocess.DEVNULL,
            stdout=open(self.logdir / f"{name}.out", "w"), stderr=open(self.logdir / f"{name}.err", "w"))
        return self.procs[name]

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.1) -> dict[str, dict]:
        """Blocks until every process printed its JSON address line; returns `info`. Raises
        `ProcessStartError` with the stderr tail of one that died, or after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.info) < len(self.procs):
            for name, proc in self.procs.items():
                if name in self.info:
                    continue
                lines = [ln for ln in (self.logdir / f"{name}.out").read_text().splitlines() if ln.startswith("{")]
                if lines:
                    self.info[name] = json.loads(lines[0])
                elif proc.poll() is not None:
                    err = (self.logdir / f"{name}.err").read_text()[-3000:]
                    raise ProcessStartError(f"{name} exited with {proc.returncode} before serving:\n{err}")
            if time.monotonic() > deadline:
                raise ProcessStartError(f"not ready after {timeout_s} s: {sorted(set(self.procs) - set(self.info))}")
            time.sleep(poll_s)
        return self.info

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM group by group in `STOP_ORDER` (then the rest); kill what outlives `timeout_s`."""
        known = {n for group in STOP_ORDER for n in group}
        for group in (*STOP_ORDER, tuple(n for n in self.procs if n not in known)):
            procs = [self.procs[n] for n in group if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout_s)
