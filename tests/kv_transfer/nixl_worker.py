"""A process that owns one `V4KVCache` and one `KVTransferAgent` and runs commands sent over a Pipe.

The Pipe stands in for the control plane (metadata, layouts, block ids); bytes of the cache move
only through NIXL. Tests read blocks back over the Pipe to compare them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

BLOCK_SIZE = 8  # tokens per block: a multiple of the tiny preset's compress rates (4, 8)
NUM_SLOTS = 4


def tiny_cache(num_blocks: int):
    """A `V4KVCache` for the `tiny` preset, float32 on the CPU."""
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.testing.presets import get_preset

    config = ModelConfig.from_hf_dict(get_preset("tiny").hf_config())
    return V4KVCache(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, num_slots=NUM_SLOTS)


def fill_cache(cache, seed: int) -> None:
    """Fill every pool and state tensor with seeded random data."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in list(cache.compressed_pools().values()) + list(cache.state_tensors().values()):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))


def serve(conn, name: str, num_blocks: int, ucx_env: dict[str, str], send_state: bool) -> None:
    """Worker main: build the cache and agent, then answer `(op, args)` messages until 'exit'."""
    import torch

    from deepinfer.kv_transfer import KVTransferAgent

    torch.set_num_threads(1)
    cache = tiny_cache(num_blocks)
    agent = KVTransferAgent(name, cache, ucx_env=ucx_env, send_state=send_state)

    def poll_until(transfer_ids: list[str], timeout_s: float) -> dict[str, Any]:
        seen: dict[str, Any] = {"sent_ids": [], "send_failed_ids": [], "received_ids": [], "expired_ids": [],
                                "payloads": {}}
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            ev = agent.poll()
            for key in ("sent_ids", "send_failed_ids", "received_ids", "expired_ids"):
                seen[key] += getattr(ev, key)
            seen["payloads"].update(ev.payloads)
            done = {i for k in ("sent_ids", "send_failed_ids", "received_ids", "expired_ids") for i in seen[k]}
            if set(transfer_ids) <= done:
                break
            time.sleep(0.001)
        seen["elapsed_s"] = time.monotonic() - t0
        return seen

    def read(block_ids: list[int], slot: int | None = None) -> dict[str, torch.Tensor]:
        out = {n: p[:, block_ids].clone() for n, p in cache.compressed_pools().items()}
        if slot is not None:
            out.update({n: t[:, slot].clone() for n, t in cache.state_tensors().items()})
        return out

    ops = {
        "hello": lambda: (agent.metadata(), agent.pool_layout(), os.getpid()),
        "fill": lambda seed: fill_cache(cache, seed),
        "read": read,
        "add_peer": agent.add_peer,
        "expect": lambda *a, **k: agent.expect(*a, **k),
        "send": lambda *a, **k: agent.send_blocks(*a, **k),
        "poll_until": poll_until,
        "stats": agent.stats,
        "exit": lambda: None,
    }
    while True:
        op, args, kwargs = conn.recv()
        try:
            conn.send(("ok", ops[op](*args, **kwargs)))
        except Exception as e:  # report, keep serving
            conn.send(("err", repr(e)))
        if op == "exit":
            agent.close()
            return


class Worker:
    """Parent-side handle of a `serve` process ('spawn' start method: a fresh interpreter)."""

    def __init__(self, name: str, num_blocks: int = 16, ucx_env: dict[str, str] | None = None,
                 send_state: bool = False) -> None:
        from deepinfer.kv_transfer import LOOPBACK_UCX_ENV

        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, name, num_blocks, dict(ucx_env or LOOPBACK_UCX_ENV),
                                                    send_state), daemon=True)
        self.proc.start()
        child.close()

    def call(self, op: str, *args, timeout_s: float = 30.0, **kwargs):
        """Blocks until the worker answers `op` (or raises after `timeout_s`)."""
        self.submit(op, *args, **kwargs)
        return self.result(op, timeout_s)

    def submit(self, op: str, *args, **kwargs) -> None:
        """Send `op` without waiting; pair with `result` (lets two workers poll at once)."""
        self.conn.send((op, args, kwargs))

    def result(self, op: str, timeout_s: float = 30.0):
        """Blocks until the worker answers the op submitted last."""
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.name} did not answer {op!r} within {timeout_s}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"worker {self.name} failed {op!r}: {value}")
        return value

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """Ask the worker to exit; kill it (by its pid) if it does not."""
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.join(5)
