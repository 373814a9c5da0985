"""`python -m deepinfer.loadbalancer --stage prefill --policy prefix_aware [--port 0]`: run one stage's balancer.

Prints one JSON line on stdout once it serves: `{"address": "127.0.0.1:54321", "stage": "prefill"}`;
logs go to stderr. SIGTERM / SIGINT stop it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from deepinfer.loadbalancer.config import LoadBalancerConfig
from deepinfer.loadbalancer.server import start_server
from deepinfer.serving.config_cli import config_from_args, make_parser
from deepinfer.serving.logs import LOGGING_HELP, configure_logging, logging_args


def main(argv: list[str] | None = None) -> int:
    level, fmt, argv = logging_args(argv)
    parser = make_parser(LoadBalancerConfig, "python -m deepinfer.loadbalancer", "Run one stage's balancer.")
    parser.epilog = LOGGING_HELP
    config = config_from_args(LoadBalancerConfig, parser, argv)
    configure_logging(level, fmt)
    running = start_server(f"{config.host}:{config.port}", config.stage, config.policy,
                           heartbeat_timeout_s=config.heartbeat_timeout_s)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    address = f"{config.advertise_host or config.host}:{running.port}"
    print(json.dumps({"address": address, "stage": config.stage}), flush=True)
    while not stopped.wait(0.5):
        pass
    running.server.stop(0.5).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
