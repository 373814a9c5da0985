"""Bandwidth of a NIXL block transfer between two processes against a torch copy in one process.

    python -m deepinfer.benchmarks.kv_transfer [--mb 64] [--preset small] [--block-size 128] [--reps 5]
        [--ucx-tls cma,tcp,self] [--json OUT]

This process is the sender; a spawned process is the receiver. Both hold a `V4KVCache` of the
preset with enough blocks for `--mb` MiB of compressed KV, and UCX stays on loopback
(`UCX_NET_DEVICES=lo`, `--ucx-tls`). Cases, each the median GB/s (1e9 bytes/s) over `--reps`
after one warm-up transfer (which also wires up the connection):

- `nixl_contiguous`: blocks `0..n-1 -> 0..n-1`, so every pool x layer is one descriptor;
  timed from `send_blocks` to the sender's `poll()` reporting it sent (NIXL DONE);
- `nixl_scattered`: the same blocks to a random permutation of destination blocks, one
  descriptor per pool x layer x block;
- `torch_copy`: `dst.copy_(src)` of one flat buffer of the same number of bytes (a memcpy);
- `torch_index_copy`: `dst_pool[:, dst_ids] = src_pool[:, src_ids]` per pool, the scattered case
  done in one process (what a same-process import costs).

The receiver also checks that the last transfer's bytes arrived intact.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch

from deepinfer.kv_transfer.agent import KVTransferAgent, block_runs


def _cache(preset: str, num_blocks: int, block_size: int, dtype: torch.dtype):
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.testing.presets import get_preset

    config = ModelConfig.from_hf_dict(get_preset(preset).hf_config())
    return V4KVCache(config, num_blocks=num_blocks, block_size=block_size, num_slots=1, dtype=dtype)


def _receiver(conn, preset: str, num_blocks: int, block_size: int, dtype: torch.dtype, ucx_env: dict) -> None:
    """Receiver process: publish metadata, then poll; answer `expect` and report receipts and checksums."""
    torch.set_num_threads(1)
    cache = _cache(preset, num_blocks, block_size, dtype)
    agent = KVTransferAgent("bench-decode", cache, ucx_env=ucx_env)
    conn.send((agent.metadata(), agent.pool_layout()))
    while True:
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "stop":
                agent.close()
                return
            if msg[0] == "expect":
                agent.expect(msg[1], msg[2], 60.0)
            elif msg[0] == "checksum":
                conn.send(("checksum", [float(p[:, msg[1]].double().sum()) for p in cache.compressed_pools().values()]))
        for tid in agent.poll().received_ids:
            conn.send(("received", tid, time.monotonic()))
        time.sleep(0.0002)


def _median_gbps(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / 1e9


def run(mb: float = 64, preset: str = "small", block_size: int = 128, reps: int = 5,
        ucx_tls: str = "cma,tcp,self", dtype: torch.dtype = torch.float32) -> dict:
    """Blocks for the whole benchmark (a few seconds); returns the results and prints them."""
    torch.set_num_threads(1)
    ucx_env = {"UCX_TLS": ucx_tls, "UCX_NET_DEVICES": "lo"}
    probe = _cache(preset, 1, block_size, dtype)
    block_nbytes = sum(p[:, 0].numel() * p.element_size() for p in probe.compressed_pools().values())
    n = max(1, int(mb * 2**20) // block_nbytes)
    num_blocks = n
    num_bytes = n * block_nbytes
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, preset, num_blocks, block_size, dtype, ucx_env), daemon=True)
    proc.start()
    src = _cache(preset, num_blocks, block_size, dtype)
    g = torch.Generator().manual_seed(0)
    for p in src.compressed_pools().values():
        p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
    agent = KVTransferAgent("bench-prefill", src, ucx_env=ucx_env)
    results: dict = {"preset": preset, "block_size": block_size, "block_nbytes": block_nbytes, "num_blocks": n,
                     "num_bytes": num_bytes, "ucx_tls": ucx_tls, "reps": reps, "machine": platform.machine(),
                     "num_cpus": os.cpu_count()}
    try:
        md, layout = conn.recv()
        agent.add_peer("bench-decode", md, layout)
        ids = list(range(n))
        perm = torch.randperm(n, generator=g).tolist()
        for case, dst_ids in (("nixl_contiguous", ids), ("nixl_scattered", perm)):
            times = []
            for rep in range(reps + 1):
                tid = f"{case}-{rep}"
                conn.send(("expect", tid, dst_ids))
                t0 = time.monotonic()
                agent.send_blocks(tid, "bench-decode", ids, dst_ids)
                while True:
                    ev = agent.poll()
                    if ev.send_failed_ids:
                        raise RuntimeError(f"transfer {tid} failed")
                    if ev.sent_ids:
                        break
                dt = time.monotonic() - t0
                msg = conn.recv()
                assert msg[:2] == ("received", tid), msg
                if rep:
                    times.append(dt)
            results[case + "_gbps"] = _median_gbps(num_bytes, times)
            pool_layers = sum(p.shape[0] for p in src.compressed_pools().values() if p.numel())
            results[case + "_num_descs"] = pool_layers * len(block_runs(ids, dst_ids)[2])
        conn.send(("checksum", perm))
        _, remote_sums = conn.recv()
        mine = [float(p[:, ids].double().sum()) for p in src.compressed_pools().values()]
        results["bytes_intact"] = remote_sums == mine
    finally:
        conn.send(("stop",))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        agent.close()

    flat_src = torch.empty(num_bytes, dtype=torch.uint8).fill_(1)
    flat_dst = torch.empty_like(flat_src).fill_(0)
    dst = _cache(preset, num_blocks, block_size, dtype)
    times_copy, times_index = [], []
    src_idx, dst_idx = torch.tensor(ids), torch.tensor(perm)
    for rep in range(reps + 1):
        t0 = time.monotonic()
        flat_dst.copy_(flat_src)
        t1 = time.monotonic()
        for name, p in src.compressed_pools().items():
            dst.compressed_pools()[name][:, dst_idx] = p[:, src_idx]
        t2 = time.monotonic()
        if rep:
            times_copy.append(t1 - t0)
            times_index.append(t2 - t1)
    results["torch_copy_gbps"] = _median_gbps(num_bytes, times_copy)
    results["torch_index_copy_gbps"] = _median_gbps(num_bytes, times_index)
    print(f"{num_bytes / 2**20:.1f} MiB in {n} blocks of {block_nbytes} B ({preset}, block_size {block_size}), "
          f"UCX_TLS={ucx_tls}, median of {reps}:")
    for case in ("nixl_contiguous", "nixl_scattered", "torch_copy", "torch_index_copy"):
        descs = results.get(case + "_num_descs")
        extra = f"  ({descs} descriptors)" if descs else ""
        print(f"  {case:18s} {results[case + '_gbps']:7.2f} GB/s{extra}")
    print(f"  bytes intact at the receiver: {results['bytes_intact']}")
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64, help="MiB of compressed KV blocks to move")
    ap.add_argument("--preset", default="small", help="engine.testing.presets name")
    ap.add_argument("--block-size", type=int, default=128, help="tokens per cache block")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    ap.add_argument("--ucx-tls", default="cma,tcp,self", help="UCX_TLS for both processes (tcp is required)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    res = run(args.mb, args.preset, args.block_size, args.reps, args.ucx_tls)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
