"""`run_interpreted`: a test script run under `TRITON_INTERPRET=1` in a subprocess.

Triton reads the variable when it is imported, and the test process has imported it already (the kernels' modules
do), so the interpreted checks of the Triton kernels run as `python -c <script>` in a child process: repository root
as the working directory, the repository and its parent on PYTHONPATH (`tests.*` and `deepinfer.<folder>`
imports). The scripts print their verdict on stdout; the caller asserts on it.

Prefetch (CI time): the test process runs torch single-threaded (tests/conftest.py), so on a two-core machine one
core idles while the in-process tests run. A module whose script takes no per-test arguments registers it at import
(`prefetch_interpreted(script, tests=(...))`); once collection is done, tests/conftest.py hands the selected tests to
`start_prefetch`, and one background thread runs the registered scripts one at a time, in the order their tests
come. `run_interpreted` then takes the finished (or running) child's output instead of starting its own, and runs the
script itself when the child has not started yet, or when the `DEEPINFER_*` / `TRITON_*` environment differs from
the one the child ran with (a test that sets a knob gets its own run). The scripts and their verdicts are the same
either way; `DEEPINFER_TEST_PREFETCH=0` turns the prefetch off.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _child_env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}


def _env_key() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("DEEPINFER_", "TRITON_"))))


class _Job:
    """One registered script: queued -> running (the background thread) or taken (its test ran it) -> done."""

    def __init__(self, code: str, args: tuple[str, ...], timeout: float, module: str, tests: tuple[str, ...],
                 make_args=None):
        self.code, self.args, self.timeout, self.module, self.tests = code, args, timeout, module, tests
        self.make_args = make_args
        self.state = "queued"
        self.done = threading.Event()
        self.env_key: tuple = ()
        self.result: tuple[int, str, str] | BaseException | None = None
        self.proc: subprocess.Popen | None = None


_JOBS: dict[tuple, _Job] = {}
_LOCK = threading.Lock()
_STOP = threading.Event()


def prefetch_interpreted(code: str, *args: str, tests: tuple[str, ...], timeout: float = 300, make_args=None) -> None:
    """Register `code` (with `args`) for the background run; `tests` names the calling module's test functions that
    call `run_interpreted` with exactly these (the run is started only where one of them was selected).

    `make_args`: for a script whose arguments are paths its test makes (a checkpoint from a fixed seed, a scratch
    directory): called in the background thread to make equivalent ones in a directory of its own, and the run
    then serves the test whatever paths it passes."""
    module = sys._getframe(1).f_globals["__name__"]
    key = (code, None) if make_args is not None else (code, args)
    _JOBS.setdefault(key, _Job(code, args, timeout, module, tuple(tests), make_args))


def _run_job(job: _Job) -> None:
    job.env_key = _env_key()
    scratch = None
    try:
        if job.make_args is not None:
            scratch = tempfile.mkdtemp(prefix="interp-prefetch-")
            job.args = tuple(job.make_args(Path(scratch)))
        job.proc = subprocess.Popen([sys.executable, "-c", job.code, *job.args], cwd=ROOT, env=_child_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = job.proc.communicate(timeout=job.timeout)
            job.result = (job.proc.returncode, out, err)
        except subprocess.TimeoutExpired as exc:
            job.proc.kill()
            job.proc.communicate()
            job.result = exc
    except BaseException as exc:  # noqa: BLE001 - handed to the test that waits for it
        job.result = exc
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        job.done.set()


def start_prefetch(selected: list[tuple[str, str]]) -> None:
    """Start the background runs of the registered scripts whose tests are among `selected` ((module, function)
    pairs in run order), in that order."""
    if os.environ.get("DEEPINFER_TEST_PREFETCH", "1") == "0":
        return
    first = {}
    for i, key in enumerate(selected):
        first.setdefault(key, i)
    order = []
    for job in _JOBS.values():
        hits = [first[(job.module, t)] for t in job.tests if (job.module, t) in first]
        if hits:
            order.append((min(hits), job))
    jobs = [job for _, job in sorted(order, key=lambda p: p[0])]
    if not jobs:
        return

    def worker() -> None:
        for job in jobs:
            with _LOCK:
                if _STOP.is_set() or job.state != "queued":
                    continue
                job.state = "running"
            _run_job(job)

    threading.Thread(target=worker, name="interpreted-prefetch", daemon=True).start()


def stop_prefetch() -> None:
    """No new background runs; a running child is killed (the session is over)."""
    _STOP.set()
    with _LOCK:
        for job in _JOBS.values():
            if job.state == "running" and job.proc is not None and job.proc.poll() is None:
                job.proc.kill()


def run_interpreted(code: str, *args: str, timeout: float = 300) -> str:
    """`code` run with `TRITON_INTERPRET=1` (`args` its `sys.argv[1:]`); returns its stdout. Fails the test, showing
    stdout and stderr, when the script exits non-zero (an assertion in it); `subprocess.TimeoutExpired` past
    `timeout` seconds. A prefetched run of the same script and arguments under the same environment is used."""
    job = _JOBS.get((code, args)) or _JOBS.get((code, None))
    if job is not None:
        with _LOCK:
            mine = job.state == "queued"
            job.state = "taken" if mine else job.state
        if not mine:
            job.done.wait()
            if job.env_key == _env_key():
                if isinstance(job.result, subprocess.TimeoutExpired):
                    raise job.result
                if isinstance(job.result, tuple):
                    returncode, out, err = job.result
                    assert returncode == 0, out + err
                    return out
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=_child_env(), capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
