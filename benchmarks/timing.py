"""Timing helpers shared by the kernel benchmarks."""

from __future__ import annotations

import statistics
import time

import torch


def time_call(fn, device: torch.device, reps: int) -> float:
    """Median seconds of one `fn()` over `reps` timed calls (after 3 warmup calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
