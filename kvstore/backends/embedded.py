"""The embedded backend: one file per block in one or more local directories (one per SSD).

Files are written and read with O_DIRECT through page-aligned buffers (an anonymous mmap), padded to 4 KiB:
the store's traffic is large sequential blobs read once per hit, which the page cache would only duplicate
(the engine already holds the hot prefixes in its pools). File systems that refuse O_DIRECT (tmpfs) get
buffered I/O. A blob is written to a temporary name and renamed into place, so a reader sees a whole file
or none; a torn file after a machine crash fails its checksum (`kvstore.block_format`) and is a miss.

NOTE (why not NIXL's POSIX file backend, which the `nixl` wheel ships): a NIXL file transfer needs the
memory and each file descriptor registered with an agent per transfer; one file per block of a few tens
to hundreds of KiB makes those registrations cost about as much as the I/O, and the CPU path gains nothing
over a plain aligned write. It fits a later GPU path (GDS: SSD <-> GPU memory without a bounce), where the
pools are registered once; the file layout here (one self-describing file per block) does not change then.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

from deepinfer.kvstore.backends.base import BlobBackend, StoreUnavailable

ALIGN = 4096


def _padded(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class DirectoryBackend(BlobBackend):
    """Block files `<dir>/<key[:2]>/<key>.blk` spread over `dirs` (the least filled one takes a new blob)."""

    name = "embedded"

    def __init__(self, dirs: tuple[str, ...] | list[str], *, direct_io: bool = True, fsync: bool = False) -> None:
        if not dirs:
            raise ValueError("the embedded KV store needs at least one directory")
        self.dirs = [os.path.abspath(d) for d in dirs]
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self.fsync = fsync
        self._tmp_ids = iter(range(1 << 62))
        self._tmp_lock = threading.Lock()

    def _path(self, key: str, ref: str) -> str:
        d = self.dirs[int(ref or 0) % len(self.dirs)]
        return os.path.join(d, key[:2], f"{key}.blk")

    def choose_ref(self, nbytes: int, bytes_by_ref: dict[str, int]) -> str:
        return str(min(range(len(self.dirs)), key=lambda i: (bytes_by_ref.get(str(i), 0), i)))

    # ------------------------------------------------------------------ I/O

    def _open(self, path: str, flags: int) -> tuple[int, bool]:
        if self.direct_io:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct_io = False  # this file system refuses O_DIRECT: buffered from now on
        return os.open(path, flags, 0o644), False

    def write(self, key: str, ref: str, blob: bytes, ttl_s: float | None = None) -> None:
        path = self._path(key, ref)
        with self._tmp_lock:
            tmp = f"{path}.tmp{os.getpid()}.{next(self._tmp_ids)}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, is_direct = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                if is_direct:
                    buf = mmap.mmap(-1, _padded(len(blob)))  # page-aligned, zero-filled padding
                    buf[:len(blob)] = blob
                    view = memoryview(buf)
                    try:
                        written = os.write(fd, view)
                    finally:
                        view.release()
                        buf.close()
                    if written != _padded(len(blob)):
                        raise OSError(errno.EIO, f"short write: {written} of {_padded(len(blob))} bytes")
                else:
                    os.write(fd, blob)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StoreUnavailable(f"writing block {key} to {path}: {e}") from e

    def read(self, key: str, ref: str) -> memoryview | bytes | None:
        path = self._path(key, ref)
        try:
            fd, is_direct = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"opening block {key} at {path}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            if not is_direct:
                return os.read(fd, size)
            buf = mmap.mmap(-1, _padded(size))
            n = os.readv(fd, [buf])
            return memoryview(buf)[:n]
        except OSError as e:
            raise StoreUnavailable(f"reading block {key} at {path}: {e}") from e
        finally:
            os.close(fd)

    def delete(self, key: str, ref: str) -> None:
        try:
            os.unlink(self._path(key, ref))
        except FileNotFoundError:
            pass
        except OSError:
            pass  # best effort: the index row is gone, so it is never read again

    def tamper(self, key: str, ref: str, fn) -> None:
        path = self._path(key, ref)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(fn(data))

    def remove_orphans(self, known: set[str], min_age_s: float = 600.0, now: float | None = None) -> int:
        """Delete block files (and stale temporaries) older than `min_age_s` that the index does not list
        (a crash between writing a file and indexing it); returns how many."""
        import time

        now = time.time() if now is None else now
        n = 0
        for d in self.dirs:
            for sub in os.listdir(d) if os.path.isdir(d) else ():
                sd = os.path.join(d, sub)
                if len(sub) != 2 or not os.path.isdir(sd):
                    continue
                for name in os.listdir(sd):
                    path = os.path.join(sd, name)
                    key = name.split(".", 1)[0]
                    try:
                        if key in known and name.endswith(".blk"):
                            continue
                        if now - os.path.getmtime(path) >= min_age_s:
                            os.unlink(path)
                            n += 1
                    except OSError:
                        pass
        return n
