"""The Mooncake Store backend (clusters): blobs in Mooncake's distributed memory pool, through its master.

`MooncakeBackend` is a client (`mooncake.store.MooncakeDistributedStore`, from the `mooncake-transfer-engine`
wheel: the `mooncake` extra) that contributes `mooncake_segment_bytes` of memory to the pool and puts / gets
blobs under `dkv/<key>`. `MooncakeMaster` starts a `mooncake_master` process (with its embedded HTTP
metadata server) for tests and for `deepinfer up` when a cluster asks for one.

NOTE: Mooncake protects an object from its own eviction for a *soft pin* TTL (default 30 min, capped by
the master's `max_kv_soft_pin_ttl`, 24 h by default); entries never expire by themselves. We put with a soft
pin as long as the class TTL (the master is started with a cap of 8 days so 7-day chat entries stay
pinned), and our sweeper (`KVStore.sweep`) deletes what the class TTLs expire. Mooncake also holds a short
read lease after each get, during which a remove is refused; refused removes are retried by the sweeper.

The native library needs the system's `libibverbs.so.1` even for TCP (Debian: `apt-get install
--no-install-recommends libibverbs1`). NOTE: not `ibverbs-providers` on a machine that also runs NIXL from its
wheel: the wheel's own libibverbs loads the system's drivers, with them a second libnl-route, and processes
using NIXL then crash at exit.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time

from deepinfer.kvstore.backends.base import BlobBackend, StoreUnavailable
from deepinfer.kvstore.config import KVStoreConfig

KEY_PREFIX = "dkv/"
MAX_SOFT_PIN_S = 8 * 86400.0
"""The soft-pin cap `MooncakeMaster` starts the master with (covers the 7-day chat TTL)."""
_LEASE_REFUSED = -706  # remove refused while a read lease holds the object


def import_mooncake():
    """The `mooncake.store` module; raises ImportError saying how to install it."""
    try:
        from mooncake import store
    except ImportError as e:
        raise ImportError(
            f"the Mooncake KV store backend needs the mooncake-transfer-engine wheel and the system's libibverbs "
            f"(pip install 'deepinfer[mooncake]'; apt-get install --no-install-recommends libibverbs1): {e}") from e
    return store


def find_master_binary(name: str = "mooncake_master") -> str:
    """Path of a Mooncake binary (`mooncake_master`, `mooncake_client`): the one shipped inside the installed
    `mooncake` package (the console scripts wrap it), else the one on PATH."""
    try:
        import mooncake

        packaged = os.path.join(os.path.dirname(mooncake.__file__), name)
        if os.access(packaged, os.X_OK):
            return packaged
    except ImportError:
        pass
    exe = shutil.which(name)
    if exe is None:
        raise FileNotFoundError(f"{name} not found in the mooncake package nor on PATH (pip install 'deepinfer[mooncake]')")
    return exe


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_port(host: str, port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


class MooncakeMaster:
    """A `mooncake_master` process on `host` (its RPC port and its embedded HTTP metadata server)."""

    def __init__(self, host: str = "127.0.0.1", rpc_port: int | None = None, http_port: int | None = None,
                 *, storage_bytes: int = 256 << 20, max_soft_pin_s: float = MAX_SOFT_PIN_S, lease_ms: int = 200,
                 log_path: str | None = None, start_timeout_s: float = 15.0) -> None:
        """`storage_bytes`: memory of a standalone storage client (`mooncake_client`) started beside the master
        (0: none; the blocks then live in the workers' own segments and go with them)."""
        self.host = host
        self.rpc_port = rpc_port or _free_port(host)
        self.http_port = http_port or _free_port(host)
        hours = max(1, int(-(-max_soft_pin_s // 3600)))
        args = [find_master_binary(), f"--rpc_port={self.rpc_port}", f"--rpc_address={host}",
                "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
                f"--http_metadata_server_port={self.http_port}", f"--max_kv_soft_pin_ttl={hours}h",
                f"--default_kv_soft_pin_ttl={hours}h", f"--default_kv_lease_ttl={lease_ms}",
                f"--metrics_port={_free_port(host)}"]
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.storage_proc: subprocess.Popen | None = None
        deadline = time.monotonic() + start_timeout_s
        if not (_wait_port(host, self.rpc_port, deadline) and _wait_port(host, self.http_port, deadline)):
            rc = self.proc.poll()
            self.stop()
            raise RuntimeError(f"mooncake_master did not start listening on {host}:{self.rpc_port} within "
                               f"{start_timeout_s} s (exit code {rc}); see its log {log_path or '(not kept)'}")
        if storage_bytes:
            # NOTE: Mooncake keeps objects in the memory segments its clients mount; a worker's segment (and what
            # was put there) goes when the worker does. A standalone storage client holds the blocks instead.
            port = _free_port(host)
            self.storage_proc = subprocess.Popen(
                [find_master_binary("mooncake_client"), f"--host={host}", f"--port={port}",
                 f"--global_segment_size={storage_bytes}", f"--master_server_address={self.address}",
                 f"--metadata_server={self.metadata_server}", "--protocol=tcp"],
                stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
            if not _wait_port(host, port, deadline):
                rc = self.storage_proc.poll()
                self.stop()
                raise RuntimeError(f"the Mooncake storage client did not start within {start_timeout_s} s "
                                   f"(exit code {rc}); see {log_path or '(no log kept)'}")

    @property
    def address(self) -> str:
        """`host:rpc_port` (`KVStoreConfig.mooncake_master`)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The metadata URL (`KVStoreConfig.mooncake_metadata_server`)."""
        return f"http://{self.host}:{self.http_port}/metadata"

    def stop(self) -> None:
        """Blocks until the storage client and the master exited (SIGTERM, then SIGKILL after 5 s)."""
        for proc in (self.storage_proc, self.proc):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()


class MooncakeBackend(BlobBackend):
    """Blobs in Mooncake Store under `dkv/<key>`."""

    name = "mooncake"
    is_shared = True

    def __init__(self, config: KVStoreConfig, setup_timeout_s: float = 10.0) -> None:
        store = import_mooncake()
        self._mod = store
        self._client = store.MooncakeDistributedStore()
        rc: list[int] = []
        # NOTE: setup retries for a long time when the master is unreachable: bound it in a daemon thread
        t = threading.Thread(target=lambda: rc.append(self._client.setup(
            config.mooncake_local_hostname, config.mooncake_metadata_server, config.mooncake_segment_bytes,
            config.mooncake_buffer_bytes, config.mooncake_protocol, "", config.mooncake_master)), daemon=True)
        t.start()
        t.join(setup_timeout_s)
        if not rc or rc[0] != 0:
            raise StoreUnavailable(f"Mooncake client setup against master {config.mooncake_master} failed "
                                   f"({'timed out' if not rc else f'code {rc[0]}'})")
        self._lock = threading.Lock()
        self._pending_deletes: set[str] = set()

    def _config(self, ttl_s: float | None):
        cfg = self._mod.ReplicateConfig()
        if ttl_s:
            cfg.soft_pin_action = self._mod.SoftPinAction.ENABLE
            cfg.soft_pin_ttl_ms = int(min(ttl_s, MAX_SOFT_PIN_S) * 1000)
        return cfg

    def write(self, key: str, ref: str, blob: bytes, ttl_s: float | None = None) -> None:
        rc = self._client.put(KEY_PREFIX + key, blob, self._config(ttl_s))
        if rc != 0:
            raise StoreUnavailable(f"Mooncake put of block {key} failed (code {rc})")
        with self._lock:  # NOTE: a key names its content, so an old copy whose remove was refused is as good
            self._pending_deletes.discard(key)

    def read(self, key: str, ref: str) -> bytes | None:
        if key in self._pending_deletes:
            return None  # deleted by us, its remove still refused by a read lease
        data = self._client.get(KEY_PREFIX + key)
        return data if data else None

    def delete(self, key: str, ref: str) -> None:
        rc = self._client.remove(KEY_PREFIX + key)
        with self._lock:
            if rc == _LEASE_REFUSED:
                self._pending_deletes.add(key)
            else:
                self._pending_deletes.discard(key)

    def retry_deletes(self) -> None:
        with self._lock:
            keys = list(self._pending_deletes)
        for k in keys:
            self.delete(k, "")

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        found = self._client.batch_is_exist([KEY_PREFIX + k for k in keys])
        return [r == 1 and k not in self._pending_deletes for k, r in zip(keys, found)]

    def tamper(self, key: str, ref: str, fn) -> None:
        blob = self.read(key, ref)
        deadline = time.monotonic() + 5.0
        while self._client.remove(KEY_PREFIX + key) == _LEASE_REFUSED and time.monotonic() < deadline:
            time.sleep(0.05)
        self.write(key, ref, fn(bytes(blob)))

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass
