"""`python -m deepinfer.decode_worker --model DIR --lb-address HOST:PORT [--port 0] ...`: run one decode instance.

Prints one JSON line on stdout once it serves and is registered:
`{"address": "127.0.0.1:54321", "instance_id": "decode-...", "agent": "decode-..."}`; logs go to
stderr. SIGTERM / SIGINT stop it (deregistering first); a `Drain` RPC makes it exit once drained.
"""

from __future__ import annotations

import sys

from deepinfer.decode_worker.config import DecodeWorkerConfig
from deepinfer.serving.shell import run_worker_process


def _serve(config: DecodeWorkerConfig):
    from deepinfer.decode_worker.server import serve_decode

    return serve_decode(config)


def main(argv: list[str] | None = None) -> int:
    return run_worker_process(DecodeWorkerConfig, "python -m deepinfer.decode_worker", __doc__, argv, _serve)


if __name__ == "__main__":
    sys.exit(main())
