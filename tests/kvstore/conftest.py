"""Backends for the KV store contract suite: the embedded directories, and Mooncake Store with a real
`mooncake_master` started on loopback (skipped, with the reason, where its wheel or libibverbs is missing)."""

from __future__ import annotations

import pytest

from deepinfer.kvstore import KVStoreConfig


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """A `mooncake_master` on 127.0.0.1 (RPC + embedded HTTP metadata server), stopped at the end."""
    try:
        from deepinfer.kvstore.backends.mooncake import MooncakeMaster, import_mooncake

        import_mooncake()
    except (ImportError, OSError) as e:
        pytest.skip(f"Mooncake Store cannot run here: {e}")
    log = tmp_path_factory.mktemp("mooncake") / "master.log"
    try:
        master = MooncakeMaster(log_path=str(log))
    except (OSError, RuntimeError) as e:
        pytest.skip(f"mooncake_master did not start: {e}")
    yield master
    master.stop()


@pytest.fixture(params=["embedded", "mooncake"])
def store_config(request, tmp_path):
    """A function that makes a `KVStoreConfig` of the parametrised backend (extra fields as keywords)."""
    if request.param == "mooncake":
        master = request.getfixturevalue("mooncake_master")
        base = {"backend": "mooncake", "directories": (str(tmp_path / "index"),),
                "mooncake_master": master.address, "mooncake_metadata_server": master.metadata_server,
                "mooncake_segment_bytes": 0, "mooncake_buffer_bytes": 16 << 20}
    else:
        base = {"backend": "embedded", "directories": (str(tmp_path / "ssd0"), str(tmp_path / "ssd1"))}

    def make(**kw) -> KVStoreConfig:
        return KVStoreConfig(**{**base, **kw})

    make.backend = request.param
    return make
