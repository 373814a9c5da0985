#!/usr/bin/env bash
# deepinfer developer entry point: `./dev.sh demo` (set up + run the main job) and
# `./dev.sh test` (set up + run the whole test suite). Both create ./.venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.deepinfer-installed"
# NOTE: set up once: later runs skip pip (seconds, not minutes) until pyproject.toml / setup.py change or
# DEEPINFER_REINSTALL=1 is set

say() { echo "# dev.sh: $*" >&2; }

setup() {
    if [ -z "${DEEPINFER_REINSTALL:-}" ] && [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] \
            && [ "$STAMP" -nt setup.py ] && "$PY" -c "import deepinfer" 2>/dev/null; then
        return
    fi
    say "setting up $VENV (first run, or the dependencies changed): this takes a few minutes"
    if [ ! -x "$PY" ]; then
        say "creating the virtual environment"
        python3 -m venv "$VENV"
    fi
    "$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # torch first, pinned to the CPU build that ships on this machine's disk (no CUDA download).
    "$PY" -c "import torch" 2>/dev/null || { say "installing torch (CPU build)"; "$PY" -m pip install -q "torch==2.13.0"; }
    # kvstore's Mooncake backend: its native library needs libibverbs.so.1 even over TCP (installed where we are
    # root with apt, as on CI; elsewhere its tests skip and say why). NOTE: --no-install-recommends keeps out
    # ibverbs-providers: the libibverbs bundled in the nixl wheel would load those system drivers, and with them a
    # second libnl-route, and every process using NIXL would then segfault at exit.
    if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1) \
            >/dev/null 2>&1 || true
    fi
    say "installing deepinfer and its dependencies (pip install -e '.[test,mooncake]')"
    "$PY" -m pip install -q -e ".[test,mooncake]"
    touch "$STAMP"
    say "$VENV is ready (later runs skip this; DEEPINFER_REINSTALL=1 forces it)"
}

case "${1:-}" in
    demo)
        setup
        shift
        exec "$VENV/bin/deepinfer" demo "$@"
        ;;
    test)
        setup
        shift
        "$VENV/bin/ruff" check .
        set +e
        "$PY" -m pytest -q --durations=25 "$@"  # the slowest tests in the log: CI keeps install + tests under 30 min
        rc=$?
        set -e
        if [ "$rc" -eq 5 ]; then
            echo "pytest collected no tests: failing" >&2
            exit 1
        fi
        exit "$rc"
        ;;
    *)
        echo "usage: ./dev.sh demo|test [args]" >&2
        exit 2
        ;;
esac
