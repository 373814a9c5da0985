"""`python -m tests.e2e.launch_balancer --stage prefill --policy prefix_aware [--port 0]`: one balancer process.

Prints `{"address": "127.0.0.1:PORT"}` on stdout once it serves; SIGTERM stops it.

NOTE: a stand-in for `python -m loadbalancer`, which does not exist yet (loadbalancer/ is owned
elsewhere); it uses only `loadbalancer.server.start_server` and follows the same process contract
as the workers, so it can move to `loadbalancer/__main__.py` unchanged.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from loadbalancer.membership import DEFAULT_HEARTBEAT_TIMEOUT_S
from loadbalancer.policies import POLICIES
from loadbalancer.server import start_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.e2e.launch_balancer", description="Run one stage's balancer.")
    parser.add_argument("--stage", required=True, choices=["vision", "prefill", "decode"])
    parser.add_argument("--policy", required=True, choices=sorted(POLICIES))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = an ephemeral port")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT_S)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    running = start_server(f"{args.host}:{args.port}", args.stage, args.policy,
                           heartbeat_timeout_s=args.heartbeat_timeout_s)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    print(json.dumps({"address": f"{args.host}:{running.port}"}), flush=True)
    while not stopped.wait(0.5):
        pass
    running.server.stop(0.5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
