"""The GPU path's transfer settings, checked on the CPU: `--loopback-ucx` picks CUDA transports for a cache on a
GPU (VRAM pools need `cuda_ipc` / `cuda_copy`; `cma` moves host memory only), and the agent counts what it
registered and sent by memory type, which is how a GPU run shows its KV moved VRAM -> VRAM."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from deepinfer.kv_transfer import LOOPBACK_CUDA_UCX_ENV, LOOPBACK_UCX_ENV, KVTransferAgent, loopback_ucx_env
from deepinfer.serving.shell import WorkerShell
from tests.kv_transfer.nixl_worker import fill_cache, tiny_cache

pytest.importorskip("nixl")

ROUTES = ("dram_to_dram", "dram_to_vram", "vram_to_dram", "vram_to_vram")


def test_loopback_env_follows_the_device():
    for device in ("cpu", torch.device("cpu")):
        assert loopback_ucx_env(device) == LOOPBACK_UCX_ENV
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        env = loopback_ucx_env(device)
        assert env == LOOPBACK_CUDA_UCX_ENV
        assert {"cuda_ipc", "cuda_copy", "tcp"} <= set(env["UCX_TLS"].split(",")), env
        assert "cma" not in env["UCX_TLS"] and env["UCX_NET_DEVICES"] == "lo"
    loopback_ucx_env("cuda")["UCX_TLS"] = "x"  # a copy: the module's settings stay as they are
    assert LOOPBACK_CUDA_UCX_ENV["UCX_TLS"] == "cuda_copy,cuda_ipc,tcp,self"


def test_worker_shell_env_by_device():
    """What a prefill / decode / vision worker hands its agents (`WorkerShell.ucx_env`)."""
    def env(loopback: bool, device: str):
        return WorkerShell.ucx_env.fget(SimpleNamespace(config=SimpleNamespace(loopback_ucx=loopback, device=device)))

    assert env(True, "cpu") == LOOPBACK_UCX_ENV
    assert env(True, "cuda:0") == LOOPBACK_CUDA_UCX_ENV
    assert env(False, "cuda:0") is None and env(False, "cpu") is None  # a cluster: UCX picks its transports


def test_registered_and_sent_bytes_by_memory_type():
    ca, cb = tiny_cache(8), tiny_cache(8)
    a = KVTransferAgent("routes-a", ca, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    b = KVTransferAgent("routes-b", cb, ucx_env=LOOPBACK_UCX_ENV, send_state=True)
    try:
        registered = sum(r["nbytes"] for r in a.pool_layout().values())
        for agent in (a, b):
            s = agent.stats()
            assert s["kv_transfer_registered_dram_bytes"] == registered > 0
            assert s["kv_transfer_registered_vram_bytes"] == 0
            assert all(s[f"kv_transfer_sent_bytes_{r}_total"] == 0 for r in ROUTES)
        fill_cache(ca, 1)
        a.add_peer("routes-b", b.metadata(), b.pool_layout())
        b.expect("req-r", [3, 4], 10.0, dst_slot=1)
        posted = a.send_blocks("req-r", "routes-b", [1, 2], [3, 4], src_slot=0, dst_slot=1)
        sent, got, t0 = [], [], time.monotonic()
        while time.monotonic() - t0 < 10.0 and not (sent and got):
            sent += a.poll().sent_ids
            got += b.poll().received_ids
        assert sent == ["req-r"] and got == ["req-r"]
        s = a.stats()
        assert s["kv_transfer_sent_bytes_dram_to_dram_total"] == s["kv_transfer_sent_bytes_total"] == posted
        assert all(s[f"kv_transfer_sent_bytes_{r}_total"] == 0 for r in ROUTES[1:])
        for name, p in ca.compressed_pools().items():
            assert torch.equal(cb.compressed_pools()[name][:, [3, 4]], p[:, [1, 2]]), name
    finally:
        a.close()
        b.close()


def test_a_cache_split_over_memory_types_is_refused(monkeypatch):
    """One transfer names one memory type per side: a cache with a tensor on another device cannot be sent whole."""
    from deepinfer.kv_transfer import agent as agent_mod

    real, calls = agent_mod.RegionLayout.of, []

    def of(tensor, pool):
        region = real(tensor, pool)
        calls.append(pool.name)
        return replace(region, mem_type="VRAM") if len(calls) == 2 else region

    monkeypatch.setattr(agent_mod.RegionLayout, "of", staticmethod(of))
    with pytest.raises(ValueError, match="keep a cache on one device"):
        KVTransferAgent("routes-split", tiny_cache(4), ucx_env=LOOPBACK_UCX_ENV)
    assert len(calls) == 2
