"""Run the HTTP front: `python -m deepinfer.entrypoint.http --entrypoint HOST:PORT [--host 127.0.0.1] [--port 8000]
[--model DIR] [--served-model-name NAME] [--api-key KEY] ...` (one flag per `HttpConfig` field).

Prints one JSON line on stdout once it listens: `{"address": "http://127.0.0.1:8000"}`; logs go to
stderr (`--log-level`, `--log-format text|json`; one `entrypoint.http.access` line per request unless
`--no-access-log`). SIGTERM / SIGINT stop it (uvicorn's graceful shutdown).
"""

from __future__ import annotations

import json
import sys

from deepinfer.entrypoint.http.config import HttpConfig
from deepinfer.serving.config_cli import config_from_args, make_parser
from deepinfer.serving.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(HttpConfig, "python -m deepinfer.entrypoint.http", "Run the HTTP front of the token entrypoint.")
    config = config_from_args(HttpConfig, parser, argv)
    if not config.entrypoint:
        parser.error("give --entrypoint HOST:PORT (the token-level gRPC entrypoint)")
    configure_logging(config.log_level, config.log_format)
    from deepinfer.entrypoint.http.app import serve

    serve(config, on_ready=lambda address: print(json.dumps({"address": address}), flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
