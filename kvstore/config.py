"""`KVStoreConfig`: the one frozen, validated description of a KV store (backend, places, TTLs, capacity)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DAY_S = 86400.0

DEFAULT_CLASS_TTLS_S: dict[str, float] = {"agent": 3 * DAY_S, "chat": 7 * DAY_S}
"""Seconds an entry lives after its last write or hit, by traffic class. DeepSeek's figures: agent traffic's
reuse is short-lived, chatbot traffic has a long tail (three days instead of seven cost it 0.5-1 % of hits)."""


def default_store_dir() -> str:
    """`$DEEPINFER_KVSTORE_DIR`, else `$XDG_CACHE_HOME/deepinfer/kvstore` (`~/.cache/...`)."""
    env = os.environ.get("DEEPINFER_KVSTORE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepinfer", "kvstore")


class KVStoreConfig(BaseModel):
    """Where compressed KV is kept, for how long, and how much of it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["embedded", "mooncake"] = "embedded"
    """embedded: block files in local directories (the default); mooncake: Mooncake Store via its master."""
    directories: tuple[str, ...] = ()
    """embedded: directories for block files (one per SSD; the index lives in the first); empty = one
    default directory (`$DEEPINFER_KVSTORE_DIR` or `~/.cache/deepinfer/kvstore`). mooncake: the first one
    holds the TTL index."""
    capacity_bytes: int = Field(64 << 30, gt=0)
    """Bytes of stored blocks (headers included) before LRU eviction starts (at `high_watermark`)."""
    high_watermark: float = Field(0.95, gt=0.0, le=1.0)
    """Fraction of `capacity_bytes` at which eviction starts."""
    low_watermark: float = Field(0.85, gt=0.0, le=1.0)
    """Fraction of `capacity_bytes` eviction brings usage down to (least recently used first)."""
    class_ttls_s: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_CLASS_TTLS_S))
    """Seconds an entry lives after its last write or hit, by traffic class (operator classes may be added)."""
    default_class: str = "chat"
    """Traffic class of a request that names none (and of an unknown class name)."""
    sweep_interval_s: float = Field(300.0, gt=0.0)
    """Seconds between sweeps of expired entries by the background sweeper."""
    lookup_timeout_s: float = Field(0.5, gt=0.0)
    """Longest a request waits for the store (prefix lookup + reading the blocks); past it: a miss."""
    min_blocks: int = Field(1, ge=1)
    """Prompts with fewer full blocks are neither stored nor looked up."""
    direct_io: bool = True
    """embedded: write and read block files with O_DIRECT (page-aligned buffers), bypassing the page cache;
    falls back to buffered I/O on file systems that refuse it (tmpfs)."""
    fsync: bool = False
    """embedded: fsync each block file before indexing it. Off: a block lost or torn by a machine crash is
    caught by its checksum and counted as a miss."""
    max_pending_writes: int = Field(4096, gt=0)
    """Blocks queued for the background writer; a save beyond it is dropped (counted), never waited for."""

    mooncake_master: str = "127.0.0.1:50051"
    """mooncake: the master's RPC address (`host:port`)."""
    mooncake_metadata_server: str = "http://127.0.0.1:8080/metadata"
    """mooncake: the transfer engine's metadata server (the master's embedded HTTP one, or etcd)."""
    mooncake_local_hostname: str = "127.0.0.1"
    """mooncake: this client's address as the other segments reach it."""
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_segment_bytes: int = Field(0, ge=0)
    """mooncake: memory this client contributes to the store's pool (0: none; the blocks live on storage clients,
    `MooncakeMaster(storage_bytes=...)` or `mooncake_client`, and outlive this process)."""
    mooncake_buffer_bytes: int = Field(64 << 20, gt=0)
    """mooncake: this client's local transfer buffer."""

    @model_validator(mode="after")
    def _check(self) -> KVStoreConfig:
        if self.low_watermark > self.high_watermark:
            raise ValueError(f"low_watermark ({self.low_watermark}) must not exceed high_watermark "
                             f"({self.high_watermark}); e.g. 0.85 and 0.95")
        for name, ttl in self.class_ttls_s.items():
            if not name or ttl <= 0:
                raise ValueError(f"class_ttls_s[{name!r}] = {ttl}: class names must be non-empty, TTLs positive seconds")
        if self.default_class not in self.class_ttls_s:
            raise ValueError(f"default_class {self.default_class!r} has no TTL; add it to class_ttls_s "
                             f"(known: {sorted(self.class_ttls_s)})")
        return self

    @property
    def dirs(self) -> tuple[str, ...]:
        """The directories in use (the default one when none was configured)."""
        return self.directories or (default_store_dir(),)

    def ttl_s(self, traffic_class: str | None) -> float:
        """TTL of a class; an unknown or missing class gets the default class's."""
        return self.class_ttls_s.get(traffic_class or self.default_class, self.class_ttls_s[self.default_class])

    def class_of(self, traffic_class: str | None) -> str:
        """The class name an entry is filed under (unknown names fall back to `default_class`)."""
        return traffic_class if traffic_class in self.class_ttls_s else self.default_class


def worker_store_config(kind: str, dirs: str, capacity_gb: float, mooncake_master: str, mooncake_metadata: str,
                        local_hostname: str) -> KVStoreConfig | None:
    """A worker's `KVStoreConfig` from its flat `kv_store*` fields (`kind` "off": None); `dirs` comma-separated."""
    if kind == "off":
        return None
    directories = tuple(d.strip() for d in dirs.split(",") if d.strip())
    return KVStoreConfig(backend=kind, directories=directories, capacity_bytes=int(capacity_gb * (1 << 30)),
                         mooncake_master=mooncake_master, mooncake_metadata_server=mooncake_metadata,
                         mooncake_local_hostname=local_hostname)
