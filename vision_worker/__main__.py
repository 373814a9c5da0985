"""`python -m deepinfer.vision_worker --model DIR --lb-address HOST:PORT [--port 0] ...`: run one vision instance.

Prints one JSON line on stdout once it serves and is registered:
`{"address": "127.0.0.1:54321", "instance_id": "vision-...", "agent": "vision-..."}`; logs go to
stderr. SIGTERM / SIGINT stop it (deregistering first); a `Drain` RPC makes it exit once drained.
"""

from __future__ import annotations

import sys

from deepinfer.serving.shell import run_worker_process
from deepinfer.vision_worker.config import VisionWorkerConfig


def _serve(config: VisionWorkerConfig):
    from deepinfer.vision_worker.server import serve_vision

    return serve_vision(config)


def main(argv: list[str] | None = None) -> int:
    return run_worker_process(VisionWorkerConfig, "python -m deepinfer.vision_worker", __doc__, argv, _serve)


if __name__ == "__main__":
    sys.exit(main())
