"""API keys and their per-key policy: a name for logs and metrics, a concurrency limit, a request-rate
limit and the KV store's traffic class of the key's requests.

A key is configured as one string, through the channels keys already travel (`--api-key`, the YAML's
`http.api_keys`, `DEEPINFER_API_KEY` / `DEEPINFER_API_KEY_FILE`; several comma-separated):

```
sk-team-a-secret;name=team-a;class=agent;max_concurrent=8;rpm=120
sk-plain                                  # the server-wide defaults below
```

Options after the key, `;`-separated: `name` (label in metrics and logs; default `key-` + the first 8 hex
digits of the key's SHA-256, so no key value ever reaches a label or a log), `class` (`agent` / `chat`: the
KV store's traffic class, carried to the stages as `GenerateRequest.kv_traffic_class`), `max_concurrent`
(generation requests of the key in flight at once) and `rpm` (generation requests per minute). Unset
options take the server's defaults (`HttpConfig.key_max_concurrent_requests`, `key_requests_per_minute`,
`default_traffic_class`; 0 = no limit). Past a limit the request gets 429 with Retry-After in the API's
own error shape (`KeyLimiter.admit`).

NOTE: the rate limit is a token bucket holding `rpm` requests, refilled at `rpm / 60` per second: a key may
spend a minute's requests in a burst, and never more than `rpm` in any minute on average.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from dataclasses import dataclass

from deepinfer.entrypoint.http.errors import ApiError

TRAFFIC_CLASSES = ("agent", "chat")
"""Traffic classes a key may name (the KV store's TTL classes; `kvstore.config`)."""

NO_KEY = "none"
"""The key name of requests on a server that needs no key."""


@dataclass(frozen=True)
class ApiKey:
    """One accepted key and its policy (None / "" = the server default)."""

    secret: bytes
    name: str
    traffic_class: str = ""
    max_concurrent: int | None = None
    requests_per_minute: float | None = None


def key_name(secret: str) -> str:
    """The default label of a key: `key-` + 8 hex digits of its SHA-256 (the key cannot be recovered)."""
    return "key-" + hashlib.sha256(secret.encode()).hexdigest()[:8]


def parse_keys(text: str) -> list[ApiKey]:
    """The keys of a comma-separated key list (each `KEY[;option=value...]`); ValueError naming a bad option
    (never the key itself)."""
    keys = []
    for item in text.split(","):
        parts = [p.strip() for p in item.split(";")]
        secret = parts[0]
        if not secret:
            if any(parts[1:]):
                raise ValueError("an API key entry has options but no key; write KEY;option=value")
            continue
        name = key_name(secret)
        options: dict = {}
        for part in parts[1:]:
            if not part:
                continue
            option, sep, value = part.partition("=")
            option, value = option.strip(), value.strip()
            if not sep or not value:
                raise ValueError(f"API key {name}: option {option!r} needs a value (option=value)")
            if option == "name":
                name = value
            elif option == "class":
                if value not in TRAFFIC_CLASSES:
                    raise ValueError(f"API key {name}: class must be one of {', '.join(TRAFFIC_CLASSES)}, got {value!r}")
                options["traffic_class"] = value
            elif option in ("max_concurrent", "rpm"):
                try:
                    number = int(value) if option == "max_concurrent" else float(value)
                except ValueError:
                    raise ValueError(f"API key {name}: {option} must be a number, got {value!r}") from None
                if number < 0 or not math.isfinite(number):
                    raise ValueError(f"API key {name}: {option} must be >= 0 (0 = no limit), got {value!r}")
                options["max_concurrent" if option == "max_concurrent" else "requests_per_minute"] = number
            else:
                raise ValueError(f"API key {name}: unknown option {option!r}; use name, class, max_concurrent, rpm")
        keys.append(ApiKey(secret.encode("latin-1"), name, **options))
    return keys


def find_key(keys: list[ApiKey], given: str) -> ApiKey | None:
    """The key matching `given`, or None. Every key is compared (no early exit), so the time taken does not
    tell which matched."""
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode("latin-1", "replace"), key.secret):
            found = key
    return found


class _Bucket:
    def __init__(self, rate_per_s: float, capacity: float) -> None:
        self.rate_per_s, self.capacity = rate_per_s, capacity
        self.tokens, self.t = capacity, time.monotonic()

    def take(self) -> float:
        """Take one request; 0 when allowed, else the seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate_per_s)
        self.t = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate_per_s


class KeyLimiter:
    """Per-key concurrency and request-rate limits (event-loop state: no locks, one thread)."""

    def __init__(self, default_max_concurrent: int = 0, default_requests_per_minute: float = 0.0,
                 default_traffic_class: str = "", retry_after_s: int = 1) -> None:
        self.default_max_concurrent = default_max_concurrent
        self.default_requests_per_minute = default_requests_per_minute
        self.default_traffic_class = default_traffic_class
        self.retry_after_s = retry_after_s
        self._inflight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}

    def traffic_class(self, key: ApiKey | None) -> str:
        """The KV store's traffic class of a key's requests ("" = the store's default)."""
        return (key.traffic_class if key is not None and key.traffic_class else "") or self.default_traffic_class

    def admit(self, key: ApiKey | None) -> str:
        """Admit one generation request of `key` (None: no key needed); returns the key's name.

        Raises a 429 `ApiError` (code `rate_limit_exceeded`, with Retry-After) past the key's concurrency or
        rate limit; an admitted request must be `release`d once answered.
        """
        name = key.name if key is not None else NO_KEY
        max_concurrent = key.max_concurrent if key is not None and key.max_concurrent is not None \
            else self.default_max_concurrent
        rpm = key.requests_per_minute if key is not None and key.requests_per_minute is not None \
            else self.default_requests_per_minute
        if max_concurrent and self._inflight.get(name, 0) >= max_concurrent:
            raise ApiError(429, f"API key {name} has {max_concurrent} requests in flight, its limit; retry when one "
                           "finished", code="rate_limit_exceeded", retry_after_s=self.retry_after_s)
        if rpm:
            bucket = self._buckets.get(name)
            if bucket is None or bucket.capacity != max(1.0, rpm):
                bucket = self._buckets[name] = _Bucket(rpm / 60.0, max(1.0, rpm))
            wait_s = bucket.take()
            if wait_s:
                raise ApiError(429, f"API key {name} is limited to {rpm:g} requests per minute; retry later",
                               code="rate_limit_exceeded", retry_after_s=max(1, math.ceil(wait_s)))
        self._inflight[name] = self._inflight.get(name, 0) + 1
        return name

    def release(self, name: str) -> None:
        self._inflight[name] = max(0, self._inflight.get(name, 0) - 1)

    def num_inflight(self, name: str) -> int:
        return self._inflight.get(name, 0)
