"""Process logging shared by the deepinfer services: a level, text or JSON lines, and the id of the
request being served on every line logged while serving it.

```python
configure_logging("info", "json")          # once, in a process's main
with request_context("chatcmpl-1234"):     # lines logged inside carry request_id=chatcmpl-1234
    logger.info("prefill done")
```

The request id lives in a context variable, so it follows asyncio tasks and stays per thread; every
deepinfer gRPC server sets it for each call's handler from the request's `request_id`
(`serving.auth.RequestIds`), so a request's lines on every stage carry the id the HTTP front gave it.

Every process takes `--log-level debug|info|warning|error` and `--log-format text|json`
(`logging_args`); unset, `DEEPINFER_LOG_LEVEL` / `DEEPINFER_LOG_FORMAT` from the environment apply,
so a launcher sets them once for all of a cluster's processes.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import os
import sys
import time
from collections.abc import Iterator

LOG_LEVELS = ("debug", "info", "warning", "error")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("deepinfer_request_id", default="-")
"""The id of the request this task / thread serves ("-" outside a request)."""

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"
LEVEL_ENV, FORMAT_ENV = "DEEPINFER_LOG_LEVEL", "DEEPINFER_LOG_FORMAT"
"""Environment defaults of every process's log level and format (a launcher sets them for all)."""


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Log lines inside carry `request_id`."""
    token = REQUEST_ID.set(request_id or "-")
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request_id, and any `extra={...}` fields
    a call passes under the `fields` key (e.g. the access log's status and duration)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
               "request_id": getattr(record, "request_id", "-")}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> None:
    """Set the root logger: `level` (debug | info | warning | error), `fmt` text or json, on `stream`
    (default stderr); replaces handlers set before (e.g. by `logging.basicConfig`)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LOG_LEVELS)}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: use text or json")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def logging_args(argv: list[str] | None) -> tuple[str, str, list[str]]:
    """Split `--log-level` / `--log-format` off a process's command line: `(level, fmt, the other args)`.

    Defaults: `DEEPINFER_LOG_LEVEL` / `DEEPINFER_LOG_FORMAT`, else info / text. Exits (argparse) on a bad
    value. The process's own parser (generated from its config model) then parses the other args.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=os.environ.get(LEVEL_ENV, "info").lower())
    parser.add_argument("--log-format", choices=("text", "json"), default=os.environ.get(FORMAT_ENV, "text").lower())
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.log_level not in LOG_LEVELS or args.log_format not in ("text", "json"):
        parser.error(f"{LEVEL_ENV} / {FORMAT_ENV}: use one of {', '.join(LOG_LEVELS)} / text or json")
    return args.log_level, args.log_format, rest


LOGGING_HELP = "Logging: --log-level debug|info|warning|error (default info), --log-format text|json (default text)."
"""Epilog of every process's --help (the flags are parsed apart from its config, `logging_args`)."""


def configure_logging_from_env() -> None:
    """`configure_logging` with `DEEPINFER_LOG_LEVEL` / `DEEPINFER_LOG_FORMAT` (default info / text), for
    processes without a command line of their own (Ray actors of `deepinfer up`)."""
    level, fmt, _ = logging_args([])
    configure_logging(level, fmt)
