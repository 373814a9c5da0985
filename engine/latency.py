"""Latency histograms a process keeps for its `/metrics` (cumulative, Prometheus-shaped, no dependency).

```python
h = LatencyHistograms()
h.observe("queue", 0.012)
h.as_dict()   # {"queue": {"le": [...], "buckets": [cumulative counts, +Inf last], "sum": 0.012, "count": 1}}
```

The engine keeps one (`Engine.latency`: queue, prefill and step times), the serving shells add the KV
transfer's and report them all in `Health`; the HTTP front turns them into Prometheus histograms
(`entrypoint.http.metrics`). The entrypoint's phase times use the same shape.
Why not prometheus_client here: the figures live in worker processes that expose no HTTP port; they
travel as JSON in `Health` and are exported by the front, which owns the registry.
"""

from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Upper bounds (seconds) of the buckets: from a sub-millisecond decode step to a long prompt's prefill on CPU."""


class LatencyHistograms:
    """Named histograms of durations (seconds). Thread-safe: observed on an engine loop, read by `Health`."""

    def __init__(self, buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        if list(buckets_s) != sorted(buckets_s) or not buckets_s:
            raise ValueError(f"bucket bounds must be non-empty and increasing, got {buckets_s}")
        self.buckets_s = tuple(buckets_s)
        self._lock = threading.Lock()
        self._hists: dict[str, list] = {}
        """name -> [bucket counts (non-cumulative, +Inf last), sum, count]."""

    def observe(self, name: str, seconds: float) -> None:
        index = bisect.bisect_left(self.buckets_s, seconds)  # the first bound >= seconds (le semantics)
        with self._lock:
            h = self._hists.setdefault(name, [[0] * (len(self.buckets_s) + 1), 0.0, 0])
            h[0][index] += 1
            h[1] += seconds
            h[2] += 1

    def count(self, name: str) -> int:
        """Observations of `name` so far (0 when none)."""
        with self._lock:
            return self._hists[name][2] if name in self._hists else 0

    def as_dict(self) -> dict[str, dict]:
        """`{name: {"le": bounds, "buckets": cumulative counts (+Inf last), "sum", "count"}}` (JSON-ready)."""
        with self._lock:
            hists = {name: (list(h[0]), h[1], h[2]) for name, h in self._hists.items()}
        out = {}
        for name, (counts, total, n) in hists.items():
            cumulative, running = [], 0
            for c in counts:
                running += c
                cumulative.append(running)
            out[name] = {"le": list(self.buckets_s), "buckets": cumulative, "sum": total, "count": n}
        return out
