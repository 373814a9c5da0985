"""Admission control: bounded queues per stage instead of unbounded waiting.

A stage instance admits a request only while fewer than `max_queued` requests wait for it; past
the bound it refuses with RESOURCE_EXHAUSTED (`serving.errors`), which the entrypoint treats as
retryable on another instance of the stage and, when every instance it tries is full, returns to
its client (gRPC RESOURCE_EXHAUSTED; the HTTP front answers 429 with Retry-After). The refusal's
message carries a retry hint estimated from the queue: `retry_after_s`.

```python
limit = AdmissionLimit(max_queued=96, stage="prefill", instance_id="prefill-0")
limit.check(num_queued=len(waiting), num_queued_tokens=tokens, tokens_per_s=measured)  # raises Refused
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.protos import common_pb2
from deepinfer.serving.errors import Refused

MIN_RETRY_AFTER_S = 1
"""The smallest retry hint (seconds): a full queue rarely drains faster."""
MAX_RETRY_AFTER_S = 60
"""The largest retry hint (seconds)."""


def retry_after_s(num_queued_tokens: int, tokens_per_s: float | None) -> int:
    """Seconds until the queue has probably drained: its tokens at the measured rate, clipped to
    [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]; MIN_RETRY_AFTER_S without a rate."""
    if not tokens_per_s or tokens_per_s <= 0:
        return MIN_RETRY_AFTER_S
    return int(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(num_queued_tokens / tokens_per_s))))


@dataclass(frozen=True)
class AdmissionLimit:
    """The bound of one stage instance's queue."""

    max_queued: int | None
    """Most requests waiting at once; None = unbounded."""
    stage: str
    instance_id: str

    def check(self, num_queued: int, num_queued_tokens: int = 0, tokens_per_s: float | None = None) -> None:
        """Raises `Refused(RESOURCE_EXHAUSTED)` with a retry hint when the queue is full."""
        if self.max_queued is None or num_queued < self.max_queued:
            return
        after = retry_after_s(num_queued_tokens, tokens_per_s)
        raise Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                      f"{self.stage} instance {self.instance_id} has {num_queued} requests queued (its bound is "
                      f"{self.max_queued}); retry after {after} s or on another instance")
