"""Run the token-level entrypoint: `python -m deepinfer.entrypoint --model DIR --prefill-lb-address HOST:PORT
--decode-lb-address HOST:PORT [--port 0]`.

Prints one JSON line on stdout once it serves: `{"address": "127.0.0.1:54321", "instance_id": "entrypoint-..."}`;
logs go to stderr. SIGTERM / SIGINT stop it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading

from deepinfer.entrypoint.config import EntrypointConfig
from deepinfer.serving.config_cli import config_from_args, make_parser
from deepinfer.serving.logs import LOGGING_HELP, configure_logging, logging_args


def main(argv: list[str] | None = None) -> int:
    level, fmt, argv = logging_args(argv)
    parser = make_parser(EntrypointConfig, "python -m deepinfer.entrypoint", "Run the token-level entrypoint.")
    parser.epilog = LOGGING_HELP
    config = config_from_args(EntrypointConfig, parser, argv)
    if not config.prefill_lb_address or not config.decode_lb_address:
        parser.error("give --prefill-lb-address and --decode-lb-address")
    configure_logging(level, fmt)
    from deepinfer.entrypoint.server import serve_entrypoint

    server = serve_entrypoint(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=server.stop, name="entrypoint-stop").start())
    print(json.dumps({"address": server.address, "instance_id": server.instance_id}), flush=True)
    while not server.wait(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
