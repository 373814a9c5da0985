"""`deepinfer store stats|evict|clear`: the KV store's figures and housekeeping from the command line.

`add_store_parser(subparsers)` adds the `store` command to a CLI (deploy/cli.py's), `run_store(args)` runs
it; both read the store the flags describe (`--dir`; the embedded default directory when none is given;
deploy/cli.py fills in the directory of a recorded cluster). `store_stats(dirs)` is what `deepinfer status`
shows. An embedded directory that does not exist is reported, never created.

NOTE: these open the store without its writer and sweeper threads (`start_threads=False`), so running them
beside live prefill instances is safe: no orphan cleanup races their writes, and SQLite serialises the index.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from deepinfer.kvstore.config import KVStoreConfig, default_store_dir
from deepinfer.kvstore.store import KVStore


def add_store_parser(subparsers) -> argparse.ArgumentParser:
    """The `store` command with its `stats`, `evict` and `clear` actions."""
    p = subparsers.add_parser("store", help="the persistent KV store: stats, evict (LRU) or clear")
    p.add_argument("action", choices=("stats", "evict", "clear"))
    p.add_argument("--backend", choices=("embedded", "mooncake"), default="embedded")
    p.add_argument("--dir", "--dirs", dest="dirs", default="",
                   help="comma-separated store directories (default: the embedded default)")
    p.add_argument("--mooncake-master", default="127.0.0.1:50051")
    p.add_argument("--mooncake-metadata", default="http://127.0.0.1:8080/metadata")
    p.add_argument("--bytes", type=float, default=0.0, help="evict: GiB to free, least recently used first")
    p.add_argument("--expired", action="store_true", help="evict: remove expired entries (a sweep) first")
    p.add_argument("--json", action="store_true", help="stats: print JSON")
    return p


def run_store(args) -> int:
    """Run a parsed `store` command; returns the exit code."""
    dirs = tuple(d.strip() for d in args.dirs.split(",") if d.strip())
    if args.backend == "embedded" and not os.path.isdir((dirs or (default_store_dir(),))[0]):
        print(f"no KV store in {(dirs or (default_store_dir(),))[0]} (nothing stored there yet)", file=sys.stderr)
        return 1
    config = KVStoreConfig(backend=args.backend, directories=dirs, mooncake_master=args.mooncake_master,
                           mooncake_metadata_server=args.mooncake_metadata)
    store = KVStore(config, start_threads=False)
    try:
        if args.action == "stats":
            st = store.stats()
            print(json.dumps(st, indent=2) if args.json else format_stats(st))
        elif args.action == "evict":
            n = store.sweep() if args.expired else 0
            m = store.evict(int(args.bytes * (1 << 30))) if args.bytes else 0
            print(f"removed {n} expired and evicted {m} least recently used blocks")
        else:
            print(f"cleared {store.clear()} blocks")
    finally:
        store.close()
    return 0


def store_stats(dirs: tuple[str, ...]) -> dict | None:
    """`KVStore.stats()` of the embedded store in `dirs` (its index is in the first), or None when that
    directory does not exist (nothing was stored yet). The per-process counters (hit rate, loads) are this
    reader's, hence empty: the serving instances export theirs (Health stats, metrics)."""
    if not dirs or not os.path.isdir(dirs[0]):
        return None
    store = KVStore(KVStoreConfig(backend="embedded", directories=tuple(dirs)), start_threads=False)
    try:
        return store.stats()
    finally:
        store.close()


def format_stats(st: dict) -> str:
    """Human-readable `KVStore.stats()` (what `deepinfer store stats` and `deepinfer status` print)."""
    gib = 1 << 30
    lines = [f"KV store ({st['backend']}): {st['blocks']} blocks, {st['bytes'] / gib:.3f} GiB of "
             f"{st['capacity_bytes'] / gib:.1f} GiB"]
    for c, v in st["classes"].items():
        lines.append(f"  {c:<10} {v['blocks']:>10} blocks {v['bytes'] / gib:>9.3f} GiB  ttl {v['ttl_s'] / 86400:.1f} d")
    return "\n".join(lines)


def format_instance_figures(rows: list[dict]) -> str:
    """The serving instances' live store figures, one line each (what `deepinfer status` adds below the store's
    own): per traffic class the hit rate and loads, then blocks written, evicted, expired, corrupt, dropped and
    degraded lookups since the instance started. `rows` are the controller's status rows (their `stats`: the
    instance's Health stats, `KVStore.health_stats`); instances without a store are left out; "" when none has."""
    mib = 1 << 20
    lines = []
    for row in rows:
        st = row.get("stats") or {}
        if "kvstore_loads_total" not in st:
            continue
        classes = st.get("kvstore_classes") or {}
        per_class = ", ".join(f"{c} {100 * v.get('hit_rate', 0.0):.0f}% hit / {v.get('loads', 0)} loads"
                              for c, v in sorted(classes.items()) if v.get("lookup_blocks"))
        extra = ""
        if st.get("kvstore_conversation_blocks_saved_total"):
            extra = f", {st['kvstore_conversation_blocks_saved_total']} conversation blocks saved"
        lines.append(f"  {row.get('stage', '?')} {row.get('instance_id', '?')}: {per_class or 'no lookups'}; "
                     f"written {st.get('kvstore_written_bytes_total', 0) / mib:.1f} MiB{extra}, "
                     f"{st.get('kvstore_evictions_total', 0)} evicted, {st.get('kvstore_expirations_total', 0)} expired, "
                     f"{st.get('kvstore_corrupt_blocks_total', 0)} corrupt, {st.get('kvstore_dropped_writes_total', 0)} "
                     f"dropped, {st.get('kvstore_degraded_lookups_total', 0)} degraded lookups")
    return "\n".join(["KV store per instance (since it started):", *lines]) if lines else ""


def main(argv: list[str] | None = None) -> int:
    """`store ...` alone (for tests and tools)."""
    parser = argparse.ArgumentParser(prog="deepinfer")
    add_store_parser(parser.add_subparsers(dest="cmd", required=True))
    return run_store(parser.parse_args(argv))
