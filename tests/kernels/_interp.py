"""`run_interpreted`: a test script run under `TRITON_INTERPRET=1` in a subprocess.

Triton reads the variable when it is imported, and the test process has imported it already (the kernels' modules
do), so the interpreted checks of the Triton kernels run as `python -c <script>` in a child process: repository root
as the working directory, the repository and its parent on PYTHONPATH (`tests.*` and `deepinfer.<folder>`
imports). The scripts print their verdict on stdout; the caller asserts on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(code: str, *args: str, timeout: float = 300) -> str:
    """`code` run with `TRITON_INTERPRET=1` (`args` its `sys.argv[1:]`); returns its stdout. Fails the test, showing
    stdout and stderr, when the script exits non-zero (an assertion in it); `subprocess.TimeoutExpired` past
    `timeout` seconds."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
