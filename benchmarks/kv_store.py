"""The persistent KV store (issue 27): backend bandwidth, TTFT with and without a store hit, bytes per token.

    python -m deepinfer.benchmarks.kv_store [--mb 256] [--lengths 4096,16384,65536] [--backends embedded,mooncake]
        [--dir DIR] [--json OUT]

- `bandwidth`: write and read GB/s (1e9 bytes/s) of each backend for `--mb` MiB of V4-Flash-sized blocks (128
  tokens of compressed KV in bf16, 823 KiB each), block by block through `KVStore.put` / `KVStore.get` (header,
  CRC32, index and all), against a torch copy of the same bytes (a memcpy). The embedded store writes to
  `--dir` (default: a temporary directory) with O_DIRECT; Mooncake runs a master and a storage client on
  loopback (TCP).
- `ttft`: seconds to the first token of a prompt of each length on the tiny test model (CPU, one request):
  cold (nothing cached), local prefix hit (the same engine again), and store hit (the engine's prefix cache
  reset, so the prefix comes from the embedded store, then bounded replay).
- `bytes_per_token`: compressed KV per token of V4-Flash's published shape (engine.config defaults: 43 layers,
  20 CSA at rate 4 with 128-wide indexer keys, 23 HCA at rate 128, head_dim 512) in bf16 and FP8, and
  `storage_tb`: what 3 and 7 days of a given input-token rate leave in the store (44 % of input tokens new).
- `ttl_simulation`: token-weighted hit rate against the TTL for two synthetic traffic mixes (a chat mix with a
  heavy-tailed return gap, an agent mix of tight tool loops); the mixes are made up to show the shape of
  DeepSeek's observation (3 instead of 7 days costs chat about 0.5-1 % of hits, agents nothing), not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from deepinfer.kvstore import KVStore, KVStoreConfig, chain_keys


def bytes_per_token() -> dict[str, float]:
    from deepinfer.engine.cache.layout import CacheLayout
    from deepinfer.engine.config import ModelConfig

    lay = CacheLayout.from_config(ModelConfig.from_hf_dict({}))
    return {"bf16": lay.compressed_bytes_per_token(2), "fp8": lay.compressed_bytes_per_token(1)}


def bandwidth(backend: str, mb: float, directory: str | None) -> dict:
    block_nbytes = int(bytes_per_token()["bf16"] * 128)
    n = max(1, int(mb * (1 << 20) // block_nbytes))
    payloads = [os.urandom(block_nbytes) for _ in range(min(n, 8))]
    keys = chain_keys(os.urandom(16), list(range(n * 128)), 128)
    master = None
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        kw: dict = {"directories": (tmp,), "capacity_bytes": 1 << 40}
        if backend == "mooncake":
            from deepinfer.kvstore.backends.mooncake import MooncakeMaster

            master = MooncakeMaster(storage_bytes=int(mb * 1.5 * (1 << 20)) + (64 << 20))
            kw.update(backend="mooncake", mooncake_master=master.address, mooncake_metadata_server=master.metadata_server,
                      mooncake_buffer_bytes=64 << 20)
        store = KVStore(KVStoreConfig(**kw), start_threads=False)
        try:
            t = time.perf_counter()
            for i, k in enumerate(keys):
                assert store.put(k, keys[i - 1] if i else None, payloads[i % len(payloads)], "chat")
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            got = store.load_prefix(keys, "chat")
            read_s = time.perf_counter() - t
            assert len(got) == n
        finally:
            store.close()
            if master is not None:
                master.stop()
    src = torch.empty(n * block_nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    total = n * block_nbytes
    return {"backend": backend, "num_blocks": n, "block_nbytes": block_nbytes, "write_gbps": total / write_s / 1e9,
            "read_gbps": total / read_s / 1e9, "memcpy_gbps": total / statistics.median(times) / 1e9}


def _first_token_s(engine, conn, prompt: list[int], params) -> tuple[float, int]:
    """Seconds from `add_request` to the first token (the store lookup and load included); tokens loaded."""
    t = time.perf_counter()
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    first = None
    while first is None or engine.num_kv_holds:
        engine.poll_kv_connector()
        if engine.has_runnable_requests():
            for o in engine.step():
                if o.request_id == rid and o.outputs[0].token_ids and first is None:
                    first = time.perf_counter() - t
    return first, conn.pop_loaded_tokens(rid)


def ttft(lengths: list[int], directory: str | None) -> list[dict]:
    from deepinfer.engine.engine import Engine, EngineConfig
    from deepinfer.engine.kv_connector.store_connector import attach_store
    from deepinfer.engine.sampling import SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ckpt = str(make_checkpoint(os.path.join(tmp, "tiny"), preset="tiny", seed=7))
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for n in lengths:
            engine = Engine(EngineConfig(model=ckpt, max_num_seqs=2, max_model_len=n + 8, max_num_batched_tokens=4096))
            store = KVStore(KVStoreConfig(directories=(os.path.join(tmp, f"store{n}"),), lookup_timeout_s=60.0))
            conn = attach_store(engine, store)
            prompt = torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()

            cold, _ = _first_token_s(engine, conn, prompt, params)
            store.flush(600.0)
            local, _ = _first_token_s(engine, conn, prompt, params)
            assert engine.kv_manager.block_pool.reset_prefix_cache(), "blocks still in use"
            hit, loaded = _first_token_s(engine, conn, prompt, params)
            rows.append({"prompt_tokens": n, "cold_s": cold, "local_hit_s": local, "store_hit_s": hit,
                         "store_loaded_tokens": loaded, "stored_bytes": store.stats()["bytes"]})
            store.close()
    return rows


def _sessions(rng, kind: str, num_sessions: int) -> list[tuple[list[float], list[int]]]:
    """Synthetic conversations: per session the gaps (s) before each request after the first and the tokens each
    request adds to the context. chat: a few quick turns, then returns after heavy-tailed gaps (lognormal,
    median 8 h, sigma 1.7); agent: long tool loops with second-scale gaps, rare returns (median 2 h)."""
    import numpy as np

    out = []
    for _ in range(num_sessions):
        if kind == "chat":
            n_turns = 1 + rng.geometric(1 / 4)
            gaps = list(rng.exponential(180.0, n_turns - 1))
            for _ in range(rng.geometric(1 / 1.5) - 1):  # returns to the conversation, each with a few turns
                gaps.append(float(np.exp(rng.normal(np.log(8 * 3600.0), 1.7))))
                gaps += list(rng.exponential(180.0, rng.geometric(1 / 3) - 1))
        else:
            n_steps = 1 + rng.geometric(1 / 20)
            gaps = list(np.exp(rng.normal(np.log(20.0), 1.0, n_steps - 1)))
            if rng.random() < 0.05:
                gaps.append(float(np.exp(rng.normal(np.log(2 * 3600.0), 1.0))))
                gaps += list(np.exp(rng.normal(np.log(20.0), 1.0, rng.geometric(1 / 10) - 1)))
        added = list(rng.integers(200, 2000, len(gaps) + 1))
        out.append((gaps, added))
    return out


def simulate_ttl(ttls_days: list[float], num_sessions: int = 20000, seed: int = 0) -> dict:
    """Token-weighted hit rate against the TTL for the two synthetic mixes: a request's cached tokens are its
    conversation's context so far when the previous request of the conversation came within the TTL (a hit or
    a write restarts it), else 0. Capacity is unbounded: only the TTL decides."""
    import numpy as np

    res = {}
    for kind in ("chat", "agent"):
        rng = np.random.default_rng(seed)
        sessions = _sessions(rng, kind, num_sessions)
        rates = {}
        for ttl_d in ttls_days:
            ttl = ttl_d * 86400.0
            hit = total = 0
            for gaps, added in sessions:
                ctx = added[0]
                total += ctx
                for gap, add in zip(gaps, added[1:]):
                    total += ctx + add
                    if gap <= ttl:
                        hit += ctx
                    ctx += add
            rates[str(ttl_d)] = hit / total
        res[kind] = rates
    return res


def storage_tb(input_tokens_per_s: float, days: float, bytes_per_tok: float, unique_fraction: float = 0.44) -> float:
    """TB of compressed KV that `days` of traffic leave in the store: the non-hitting (newly computed) share of
    the input tokens, `unique_fraction` (DeepSeek: 56 % of input tokens hit, so 44 % are new), times the bytes."""
    return input_tokens_per_s * unique_fraction * days * 86400.0 * bytes_per_tok / 1e12


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=256, help="MiB of blocks per backend for the bandwidth case")
    ap.add_argument("--backends", default="embedded,mooncake")
    ap.add_argument("--lengths", default="4096,16384,65536", help="prompt lengths of the TTFT case ('' = skip)")
    ap.add_argument("--sessions", type=int, default=20000, help="synthetic conversations per mix (TTL simulation)")
    ap.add_argument("--dir", default=None, help="where the embedded store's files go (default: the temp dir)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    res: dict = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                 "bytes_per_token_v4_flash": bytes_per_token(), "bandwidth": [], "ttft": []}
    for b in [b for b in args.backends.split(",") if b]:
        try:
            res["bandwidth"].append(bandwidth(b, args.mb, args.dir))
        except (ImportError, OSError, RuntimeError) as e:
            res["bandwidth"].append({"backend": b, "skipped": str(e)})
    res["ttl_simulation"] = simulate_ttl([0.25, 1.0, 3.0, 7.0, 14.0], args.sessions)
    bpt = res["bytes_per_token_v4_flash"]
    res["storage_tb"] = {f"{tps}_tokens_per_s": {f"{d}d_{k}": storage_tb(tps, d, b) for d in (3, 7) for k, b in bpt.items()}
                         for tps in (10_000, 100_000)}
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if lengths:
        res["ttft"] = ttft(lengths, args.dir)
    print(json.dumps(res, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
