"""A stand-in for CUDA graphs, so the graph runners' logic runs on the CPU (`rerun_record`, a runner's `record`).

`record(fn)` computes the output buffer(s) without leaving a trace in the runner's cache (its tensors are restored,
as a capture runs nothing); the stand-in graph's `replay` re-runs `fn` on the *static* buffers and copies the
result into those buffers, as a real replay does. A missed input copy, a stale buffer or a result handed out
without copying shows as a wrong answer."""

from __future__ import annotations

import torch


def rerun_record(runner, fn):
    """`CudaGraphRunner.record` for the CPU: `(graph, out)` where `graph.replay()` re-runs `fn` into `out` (one
    tensor, or a tuple of them)."""
    saved = {k: v.clone() for k, v in vars(runner.cache).items() if isinstance(v, torch.Tensor)}
    out = fn()
    for k, v in saved.items():
        getattr(runner.cache, k).copy_(v)

    class _Graph:
        def replay(self):
            new = fn()
            if isinstance(out, torch.Tensor):
                out.copy_(new)
            else:
                for dst, src in zip(out, new, strict=True):
                    dst.copy_(src)

    return _Graph(), out
