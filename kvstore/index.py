"""The store's index in SQLite: one row per stored block with its traffic class, TTL, last use and size.

Every backend keeps its blobs behind this index, so TTL by class, the sweeper and the LRU eviction are one
piece of code whatever holds the bytes. The file survives restarts (the embedded store's blocks stay valid
across them) and several processes of one machine may share it (WAL journal, busy timeout): two prefill
instances on one host see each other's blocks.

Times are wall-clock seconds (`time.time()`), since expiries outlive processes; tests pass a clock.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    ref TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    class TEXT NOT NULL,
    expires_at REAL NOT NULL,
    last_used REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_last_used ON entries (last_used);
CREATE INDEX IF NOT EXISTS entries_expires_at ON entries (expires_at);
"""

_MAX_VARS = 500  # keys per IN (...) query, under SQLite's variable limit


@dataclass(frozen=True)
class IndexEntry:
    """One indexed block."""

    key: str
    ref: str
    """Where the backend keeps it (the embedded store: its directory's number; Mooncake: empty)."""
    nbytes: int
    traffic_class: str
    expires_at: float
    last_used: float


class StoreIndex:
    """Thread-safe SQLite index of stored blocks (one connection behind a lock)."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, timeout=10.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._scan_lock = threading.Lock()
        self._scan_db: sqlite3.Connection | None = None
        """A second connection for whole-index scans (`stats_by_class`): under WAL it reads a snapshot beside the
        main connection, so a scan of a large index never holds up lookups and writes behind `_lock`."""

    def close(self) -> None:
        with self._lock:
            self._db.close()
        with self._scan_lock:
            if self._scan_db is not None:
                self._scan_db.close()
                self._scan_db = None

    def _rows(self, sql: str, args=()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ------------------------------------------------------------------ writes

    def put(self, key: str, ref: str, nbytes: int, traffic_class: str, now: float, ttl_s: float) -> None:
        """Index a stored block (or refresh it: a rewrite keeps the longer of the two expiries)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
                "ref = excluded.ref, nbytes = excluded.nbytes, last_used = excluded.last_used, "
                "class = CASE WHEN excluded.expires_at >= entries.expires_at THEN excluded.class ELSE entries.class END, "
                "expires_at = MAX(entries.expires_at, excluded.expires_at)",
                (key, ref, nbytes, traffic_class, now + ttl_s, now, now))

    def touch(self, keys: list[str], traffic_class: str, now: float, ttl_s: float) -> None:
        """A hit: last use is now and the TTL restarts (never shortening an entry's expiry; the class whose
        TTL ends later wins)."""
        if not keys:
            return
        with self._lock:
            self._db.executemany(
                "UPDATE entries SET last_used = ?, "
                "class = CASE WHEN ? >= expires_at THEN ? ELSE class END, expires_at = MAX(expires_at, ?) "
                "WHERE key = ?", [(now, now + ttl_s, traffic_class, now + ttl_s, k) for k in keys])

    def remove(self, key: str) -> IndexEntry | None:
        """Drop a row; returns it (None if absent)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM entries WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))
        return _entry(row)

    def clear(self) -> list[IndexEntry]:
        """Drop every row; returns them."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM entries").fetchall()
            self._db.execute("DELETE FROM entries")
        return [_entry(r) for r in rows]

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> IndexEntry | None:
        rows = self._rows("SELECT * FROM entries WHERE key = ?", (key,))
        return _entry(rows[0]) if rows else None

    def present(self, keys: list[str], now: float) -> set[str]:
        """The listed keys that have a row that has not expired."""
        found: set[str] = set()
        for i in range(0, len(keys), _MAX_VARS):
            chunk = keys[i:i + _MAX_VARS]
            marks = ",".join("?" * len(chunk))
            found.update(r[0] for r in self._rows(
                f"SELECT key FROM entries WHERE key IN ({marks}) AND expires_at > ?", (*chunk, now)))
        return found

    def expired(self, now: float, limit: int = 1000) -> list[IndexEntry]:
        """Rows whose expiry has passed, oldest expiry first."""
        return [_entry(r) for r in self._rows(
            "SELECT * FROM entries WHERE expires_at <= ? ORDER BY expires_at LIMIT ?", (now, limit))]

    def least_recently_used(self, limit: int) -> list[IndexEntry]:
        """Rows in eviction order: least recently used (written or hit) first."""
        return [_entry(r) for r in self._rows("SELECT * FROM entries ORDER BY last_used, key LIMIT ?", (limit,))]

    def total_bytes(self) -> int:
        return int(self._rows("SELECT COALESCE(SUM(nbytes), 0) FROM entries")[0][0])

    def bytes_by_ref(self) -> dict[str, int]:
        return {r[0]: int(r[1]) for r in self._rows("SELECT ref, SUM(nbytes) FROM entries GROUP BY ref")}

    def stats_by_class(self) -> dict[str, tuple[int, int]]:
        """class -> (blocks, bytes). Blocks on a whole-index scan (on its own connection: see `_scan_db`)."""
        with self._scan_lock:
            if self._scan_db is None:
                self._scan_db = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False, isolation_level=None)
            rows = self._scan_db.execute("SELECT class, COUNT(*), SUM(nbytes) FROM entries GROUP BY class").fetchall()
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}

    def __len__(self) -> int:
        return int(self._rows("SELECT COUNT(*) FROM entries")[0][0])


def _entry(row: tuple) -> IndexEntry:
    key, ref, nbytes, cls, expires_at, last_used, _ = row
    return IndexEntry(key, ref, int(nbytes), cls, float(expires_at), float(last_used))
