"""Where stored blocks' bytes live: `BlobBackend` (`base`), the embedded directories (`embedded`) and
Mooncake Store (`mooncake`). `make_backend(config)` picks one from `KVStoreConfig.backend`."""

from __future__ import annotations

from deepinfer.kvstore.backends.base import BlobBackend, StoreUnavailable
from deepinfer.kvstore.config import KVStoreConfig


def make_backend(config: KVStoreConfig) -> BlobBackend:
    """The backend `config.backend` names (imports Mooncake only when asked for)."""
    if config.backend == "embedded":
        from deepinfer.kvstore.backends.embedded import DirectoryBackend

        return DirectoryBackend(config.dirs, direct_io=config.direct_io, fsync=config.fsync)
    if config.backend == "mooncake":
        from deepinfer.kvstore.backends.mooncake import MooncakeBackend

        return MooncakeBackend(config)
    raise ValueError(f"unknown KV store backend {config.backend!r}; use embedded or mooncake")


__all__ = ["BlobBackend", "StoreUnavailable", "make_backend"]
