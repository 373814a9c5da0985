"""`python -m deepinfer.prefill_worker --model DIR --lb-address HOST:PORT [--port 0] ...`: run one prefill instance.

Prints one JSON line on stdout once it serves and is registered:
`{"address": "127.0.0.1:54321", "instance_id": "prefill-...", "agent": "prefill-..."}`; logs go to
stderr. SIGTERM / SIGINT stop it (deregistering first); a `Drain` RPC makes it exit once drained.
"""

from __future__ import annotations

import sys

from deepinfer.prefill_worker.config import PrefillWorkerConfig
from deepinfer.serving.shell import run_worker_process


def _serve(config: PrefillWorkerConfig):
    from deepinfer.prefill_worker.server import serve_prefill

    return serve_prefill(config)


def main(argv: list[str] | None = None) -> int:
    return run_worker_process(PrefillWorkerConfig, "python -m deepinfer.prefill_worker", __doc__, argv, _serve)


if __name__ == "__main__":
    sys.exit(main())
