"""`./dev.sh demo` (issue 31, first-run friction): it says what it is installing instead of staying silent,
and a second run does not reinstall (pip runs once, until pyproject.toml changes or DEEPINFER_REINSTALL=1).
Runs a copy of dev.sh over a fake virtual environment whose `python` and `deepinfer` only log their calls."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tree(tmp_path):
    for name in ("dev.sh", "pyproject.toml", "setup.py"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, tmp_path / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    for name, body in (("python", f'echo "python $*" >> {log}'), ("deepinfer", f'echo "deepinfer $*" >> {log}')):
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    fake = tmp_path / "fakebin"  # the apt / ldconfig branch must not run here: libibverbs "is installed"
    fake.mkdir()
    (fake / "ldconfig").write_text("#!/usr/bin/env bash\necho '\tlibibverbs.so.1 (libc6,x86-64) => /x'\n")
    (fake / "ldconfig").chmod(0o755)
    return tmp_path, log, {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}


def _demo(tree, **env):
    path, log, base = tree
    log.write_text("")
    r = subprocess.run(["bash", str(path / "dev.sh"), "demo", "--max-tokens", "4"], cwd=path, capture_output=True,
                       text=True, timeout=60, env={**base, **env})
    assert r.returncode == 0, r.stderr
    return r.stderr, log.read_text()


def test_dev_sh_installs_once_and_says_so(tree):
    err, calls = _demo(tree)
    assert "pip install -q -e .[test,mooncake]" in calls and "deepinfer demo --max-tokens 4" in calls
    assert "# dev.sh: setting up .venv" in err and "installing deepinfer" in err and "is ready" in err
    err, calls = _demo(tree)  # the second run: no pip, no messages, straight to the demo
    assert "pip" not in calls and "deepinfer demo --max-tokens 4" in calls and "dev.sh" not in err
    err, calls = _demo(tree, DEEPINFER_REINSTALL="1")
    assert "pip install -q -e .[test,mooncake]" in calls
    (tree[0] / "pyproject.toml").touch()  # the dependencies may have changed: set up again
    os.utime(tree[0] / "pyproject.toml", (4e9, 4e9))
    err, calls = _demo(tree)
    assert "pip install -q -e .[test,mooncake]" in calls
