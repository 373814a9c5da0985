"""`python -m vision_worker --model DIR --lb-address HOST:PORT [--port 0] ...`: run one vision instance.

Prints one JSON line on stdout once it serves and is registered:
`{"address": "127.0.0.1:54321", "instance_id": "vision-...", "agent": "vision-..."}`; logs go to
stderr. SIGTERM / SIGINT stop it (deregistering first); a `Drain` RPC makes it exit once drained.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

from engine.config_cli import config_from_args, make_parser
from vision_worker.config import VisionWorkerConfig


def _log_to_stderr() -> None:
    """Every log line goes to stderr; stdout carries only the address line.

    NOTE: importing NIXL installs a handler that writes NIXL's logs to stdout; it is moved to stderr.
    """
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import nixl._api  # noqa: F401

    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(VisionWorkerConfig, "python -m vision_worker", __doc__.splitlines()[0])
    config = config_from_args(VisionWorkerConfig, parser, argv)
    _log_to_stderr()
    from vision_worker.server import serve_vision

    worker = serve_vision(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=worker.stop, name="vision_worker-stop").start())
    print(json.dumps({"address": worker.address, "instance_id": worker.instance_id, "agent": worker.agent_name}),
          flush=True)
    while not worker.wait(0.5):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
