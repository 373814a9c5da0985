"""`BlobBackend`: the small interface every place that holds stored blocks implements.

A backend moves opaque blobs by key (32 hex digits) and nothing else: TTLs, classes, eviction order,
integrity checks and metrics live above it (`kvstore.store.KVStore`, `kvstore.index`), so every backend
gets them alike and one contract suite tests them all (tests/kvstore). Methods may block (disk, network):
the store calls them from its writer thread or under its bounded lookup timeout, never bare on a hot path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class StoreUnavailable(RuntimeError):
    """The backend cannot be reached (or failed an operation); callers turn it into a miss."""


class BlobBackend(ABC):
    """Put / get / delete blobs by key."""

    name: str = "?"
    is_shared: bool = False
    """Other machines may write blocks this process's index does not know: lookups ask the backend too."""

    def choose_ref(self, nbytes: int, bytes_by_ref: dict[str, int]) -> str:
        """Where a new blob goes (the embedded store: which directory); opaque to the store."""
        return ""

    @abstractmethod
    def write(self, key: str, ref: str, blob: bytes, ttl_s: float | None = None) -> None:
        """Store `blob` under `key` (idempotent); `ttl_s`: how long the entry should be protected from the
        backend's own eviction (Mooncake's soft pin), if it has one. Raises StoreUnavailable on failure."""

    @abstractmethod
    def read(self, key: str, ref: str) -> bytes | memoryview | None:
        """The blob, or None when it is not there; raises StoreUnavailable when the backend fails."""

    @abstractmethod
    def delete(self, key: str, ref: str) -> None:
        """Remove the blob if present (best effort; never raises for a missing one)."""

    def exists(self, keys: list[str]) -> list[bool]:
        """Which keys the backend holds (only needed when `is_shared`)."""
        return [False] * len(keys)

    def tamper(self, key: str, ref: str, fn) -> None:
        """Tests only: replace a stored blob by `fn(blob)` (to check corruption is caught)."""
        raise NotImplementedError

    def retry_deletes(self) -> None:
        """Retry deletions the backend refused for a while (Mooncake's read leases); called by the sweeper."""
        return None

    def close(self) -> None:
        """Release connections and handles."""
        return None
