"""Process logging shared by the deepinfer services: a level, text or JSON lines, and the id of the
request being served on every line logged while serving it.

```python
configure_logging("info", "json")          # once, in a process's main
with request_context("chatcmpl-1234"):     # lines logged inside carry request_id=chatcmpl-1234
    logger.info("prefill done")
```

The request id lives in a context variable, so it follows asyncio tasks and stays per thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

LOG_LEVELS = ("debug", "info", "warning", "error")
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("deepinfer_request_id", default="-")
"""The id of the request this task / thread serves ("-" outside a request)."""

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s [%(request_id)s] %(message)s"


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
