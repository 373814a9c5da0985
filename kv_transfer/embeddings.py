"""Image embeddings over NIXL: the vision stage holds them in registered memory, the prefill READs them.

The contract, as for KV (`kv_transfer/__init__.py`): only descriptors travel on the control plane
(`deepinfer.v1.ImageEmbeddings`: agent name + metadata, address, length, dtype, rows); the bytes move
only through NIXL, here by READ from the consumer (prefill) side, which is the initiator.

Pieces
------
* `RowAllocator`: first-fit allocation of contiguous row ranges in a `[num_rows, hidden]` buffer.
* `EmbeddingAgent`: one NIXL agent over one such buffer, registered once at construction and kept
  for the agent's life (the buffer is never reallocated). The vision worker encodes into its rows
  and publishes `descriptor(start, num_rows)`; the prefill worker allocates rows of its own, posts
  `read(transfer_id, source, local_start)` and `poll()`s until NIXL reports the READ DONE (or
  ERR, or its lease ran out), then copies `rows(start, n)` out and frees them.

Who calls what, and when
------------------------
1. Vision V: encodes an image into rows it holds for the request (its own lease), answers Encode
   with one `EmbeddingSource` (as `ImageEmbeddings`) per image.
2. Decode D (during Reserve, `read_now`: blocking, a few ms) and prefill P (`read(...)` per image,
   polled by its loop): `connect(peer, metadata)` (cached by metadata digest), then READs with the
   transfer ids `{request_id}/{i}`; each READ carries a notification (`encode_notif`, transfer id +
   b"read") that V's `poll()` reports in `read_by_peer_ids`: V only counts it
   (`embeddings_served_*`): the hold itself ends by the control plane (Vision.Release after the
   prefill answered) or V's lease. A holder NIXL cannot reach raises `HolderUnreachable`.
3. P: `poll()` -> `EmbeddingEvents.done_ids` (bytes are in P's rows) or `failed_ids` (peer gone,
   transport error, lease). A READ never writes into V's memory, so a late or failed READ can only
   spoil P's own destination rows, which P frees only after the READ reported.

NOTE: the holder must `poll()` while READs of its rows may come, as a KV receiver must: UCX needs
the passive side's progress to finish wire-up and (over tcp) the transfer; measured here, a READ
whose holder never polls stays in PROC. The vision loop polls every step (every 1 ms while it holds
requests). Not thread-safe: one thread (the worker loop) calls an agent. Metrics: `stats()` returns
`embeddings_read_{bytes,rows}_total`, `embeddings_reads_{done,failed}_total` (reader side) and
`embeddings_served_{bytes,reads}_total` (holder side, from the READ notifications).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from deepinfer.kv_transfer.agent import encode_notif, ended_transfers, new_notifications, start_nixl_agent

logger = logging.getLogger("kv_transfer.embeddings")

READ_NOTIF_PAYLOAD = b"read"
"""Payload of the notification a READ leaves at the holder (the transfer id rides with it)."""


class HolderUnreachable(RuntimeError):
    """NIXL cannot connect to the agent holding the embeddings (its process is gone): they are lost."""


class RowAllocator:
    """First-fit allocator of contiguous row ranges in `[0, num_rows)` (free ranges kept sorted, merged)."""

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"num_rows must be > 0, got {num_rows}")
        self.num_rows = num_rows
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_rows]

    @property
    def num_free_rows(self) -> int:
        return sum(self._lengths)

    def alloc(self, num_rows: int) -> int | None:
        """The first row of a free run of `num_rows` rows, now taken; None if no run is long enough."""
        if num_rows <= 0:
            raise ValueError(f"num_rows must be > 0, got {num_rows}")
        for i, length in enumerate(self._lengths):
            if length >= num_rows:
                start = self._starts[i]
                if length == num_rows:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += num_rows
                    self._lengths[i] -= num_rows
                return start
        return None

    def free(self, start: int, num_rows: int) -> None:
        """Give back rows `[start, start + num_rows)` (taken by `alloc`); neighbours merge."""
        if start < 0 or num_rows <= 0 or start + num_rows > self.num_rows:
            raise ValueError(f"rows [{start}, {start + num_rows}) are outside [0, {self.num_rows})")
        i = bisect.bisect_left(self._starts, start)
        if (i < len(self._starts) and self._starts[i] < start + num_rows) or (
                i > 0 and self._starts[i - 1] + self._lengths[i - 1] > start):
            raise ValueError(f"rows [{start}, {start + num_rows}) are (partly) free already")
        self._starts.insert(i, start)
        self._lengths.insert(i, num_rows)
        if i + 1 < len(self._starts) and start + num_rows == self._starts[i + 1]:  # merge right
            self._lengths[i] += self._lengths.pop(i + 1)
            self._starts.pop(i + 1)
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # merge left
            self._lengths[i - 1] += self._lengths.pop(i)
            self._starts.pop(i)


@dataclass(frozen=True)
class EmbeddingSource:
    """Where one image's embeddings lie in a holder's registered memory (mirrors `deepinfer.v1.ImageEmbeddings`)."""

    agent_name: str
    """The holder's agent name."""
    agent_metadata: bytes
    """The holder's NIXL metadata (to connect)."""
    addr: int
    """Address of the first byte (in the holder's address space or GPU)."""
    num_bytes: int
    """Length: num_rows * hidden_size * itemsize."""
    num_rows: int
    """Embedding rows (image tokens)."""
    hidden_size: int
    """Values per row."""
    dtype: str
    """torch dtype name, e.g. "float32"."""
    mem_type: str = "DRAM"
    """"DRAM" or "VRAM"."""
    dev_id: int = 0
    """CUDA device index for VRAM, 0 for DRAM."""

    @classmethod
    def from_proto(cls, msg) -> EmbeddingSource:
        """The source a `deepinfer.v1.ImageEmbeddings` message describes."""
        return cls(msg.agent_name, bytes(msg.agent_metadata), msg.addr, msg.num_bytes, msg.num_tokens,
                   msg.hidden_size, msg.dtype, msg.mem_type or "DRAM", msg.dev_id)


@dataclass
class EmbeddingEvents:
    """What one `poll()` observed; each transfer id appears once, in one list, ever."""

    done_ids: list[str] = field(default_factory=list)
    """Reader: the READ completed; the rows hold the embeddings."""
    failed_ids: list[str] = field(default_factory=list)
    """Reader: the READ failed or outlived its lease; free the rows, fail the request."""
    read_by_peer_ids: list[str] = field(default_factory=list)
    """Holder: a peer finished reading (its READ's notification)."""


@dataclass
class _Read:
    transfer_id: str
    handle: object | None
    num_bytes: int
    num_rows: int
    deadline: float
    failed: bool = False


class EmbeddingAgent:
    """A NIXL agent over one registered `[num_rows, hidden_size]` buffer of embeddings.

    The holder (vision) writes rows and publishes `descriptor`s; the reader (prefill) READs them
    into rows of its own buffer. One class for both roles because one process needs one agent for
    embeddings either way. Not thread-safe.
    """

    def __init__(
        self,
        name: str,
        num_rows: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "UCX",
        *,
        read_lease_s: float = 30.0,
        ucx_env: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Creates the NIXL agent and registers the buffer. `ucx_env`: as for `KVTransferAgent`
        (process-wide UCX variables set before the backend starts, e.g. `LOOPBACK_UCX_ENV`)."""
        self.name = name
        self.backend = backend
        self.hidden_size = hidden_size
        self.read_lease_s = read_lease_s
        self._clock = clock
        self.buffer = torch.zeros(num_rows, hidden_size, dtype=dtype, device=device)  # [num_rows, hidden]
        self.allocator = RowAllocator(num_rows)
        self.mem_type = "VRAM" if self.buffer.device.type == "cuda" else "DRAM"
        self.dev_id = (self.buffer.device.index or 0) if self.buffer.device.type == "cuda" else 0
        self._row_nbytes = hidden_size * self.buffer.element_size()
        self._nixl = start_nixl_agent(name, backend, ucx_env)
        self._reg = self._nixl.get_reg_descs(
            [(self.buffer.data_ptr(), self.buffer.numel() * self.buffer.element_size(), self.dev_id, "")],
            self.mem_type)
        self._nixl.register_memory(self._reg, backends=[backend])
        self._peers: dict[str, bytes] = {}  # name -> metadata digest
        self._reads: dict[str, _Read] = {}
        self._counters = {
            "embeddings_read_bytes_total": 0,
            "embeddings_read_rows_total": 0,
            "embeddings_reads_done_total": 0,
            "embeddings_reads_failed_total": 0,
            "embeddings_served_bytes_total": 0,
            "embeddings_served_reads_total": 0,
        }
        self._served_bytes: dict[str, int] = {}  # transfer id -> bytes, for reads announced by the holder

    # ------------------------------------------------------------------ holder side

    def metadata(self) -> bytes:
        """This agent's NIXL metadata, for the control plane."""
        return self._nixl.get_agent_metadata()

    def rows(self, start: int, num_rows: int) -> torch.Tensor:
        """A view of rows `[start, start + num_rows)` of the registered buffer."""
        return self.buffer[start:start + num_rows]

    def descriptor(self, start: int, num_rows: int, metadata: bytes | None = None) -> EmbeddingSource:
        """Where rows `[start, start + num_rows)` lie, for a reader on another process."""
        if start < 0 or num_rows <= 0 or start + num_rows > self.buffer.shape[0]:
            raise ValueError(f"rows [{start}, {start + num_rows}) are outside [0, {self.buffer.shape[0]})")
        return EmbeddingSource(
            self.name, self.metadata() if metadata is None else metadata,
            self.buffer.data_ptr() + start * self._row_nbytes, num_rows * self._row_nbytes, num_rows,
            self.hidden_size, str(self.buffer.dtype).removeprefix("torch."), self.mem_type, self.dev_id)

    def expect_read(self, transfer_id: str, num_bytes: int) -> None:
        """Count `num_bytes` as served whenever a READ tagged `transfer_id` reports its notification
        (until `forget_expected_read`)."""
        self._served_bytes[transfer_id] = num_bytes

    # ------------------------------------------------------------------ reader side

    def connect(self, name: str, metadata: bytes) -> None:
        """Load a holder's metadata (once per name and metadata: a restarted holder is re-added).

        Raises `HolderUnreachable` when NIXL cannot load it (the holder is gone)."""
        digest = hashlib.sha256(metadata).digest()
        if self._peers.get(name) == digest:
            return
        if name in self._peers:
            self._nixl.remove_remote_agent(name)
            del self._peers[name]
        try:
            loaded = self._nixl.add_remote_agent(metadata)
        except Exception as e:  # e.g. nixlBackendError when the holder's process is gone
            raise HolderUnreachable(f"cannot connect to embedding holder {name!r}: {e}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            self._nixl.remove_remote_agent(loaded)
            raise ValueError(f"metadata is for agent {loaded!r}, not {name!r}")
        self._peers[name] = digest

    def read(self, transfer_id: str, source: EmbeddingSource, local_start: int, *, lease_s: float | None = None) -> int:
        """Start a READ of `source` into local rows `[local_start, local_start + source.num_rows)`.

        Returns at once with the bytes posted; `poll()` reports the outcome (`done_ids` or
        `failed_ids`, exactly once, at the latest after the lease). Raises ValueError for a source
        that does not fit this buffer (other hidden size or dtype) or an unknown peer.
        """
        if transfer_id in self._reads:
            raise ValueError(f"read {transfer_id!r} is already in flight")
        if source.agent_name not in self._peers:
            raise ValueError(f"unknown embedding holder {source.agent_name!r}; connect() first")
        expected_dtype = str(self.buffer.dtype).removeprefix("torch.")
        if source.hidden_size != self.hidden_size or source.dtype != expected_dtype:
            raise ValueError(f"embeddings of {source.agent_name!r} are {source.hidden_size} x {source.dtype}, this "
                             f"buffer holds {self.hidden_size} x {expected_dtype}; run one model everywhere")
        if source.num_bytes != source.num_rows * self._row_nbytes:
            raise ValueError(f"source length {source.num_bytes} B is not {source.num_rows} rows of {self._row_nbytes} B")
        if local_start < 0 or local_start + source.num_rows > self.buffer.shape[0]:
            raise ValueError(f"local rows [{local_start}, {local_start + source.num_rows}) are outside the buffer")
        local = [(self.buffer.data_ptr() + local_start * self._row_nbytes, source.num_bytes, self.dev_id)]
        remote = [(source.addr, source.num_bytes, source.dev_id)]
        now = self._clock()
        entry = _Read(transfer_id, None, source.num_bytes, source.num_rows,
                      now + (self.read_lease_s if lease_s is None else lease_s))
        self._reads[transfer_id] = entry
        try:
            entry.handle = self._nixl.initialize_xfer(
                "READ", self._nixl.get_xfer_descs(local, self.mem_type),
                self._nixl.get_xfer_descs(remote, source.mem_type), source.agent_name,
                encode_notif(transfer_id, READ_NOTIF_PAYLOAD), backends=[self.backend])
            if self._nixl.transfer(entry.handle) == "ERR":
                entry.failed = True
        except Exception as e:  # e.g. the holder is gone
            logger.warning("embedding read %s from %s failed to start: %s", transfer_id, source.agent_name, e)
            entry.failed = True
        return source.num_bytes

    def read_now(self, transfer_id_prefix: str, sources: list[EmbeddingSource], timeout_s: float = 3.0) -> list[torch.Tensor]:
        """Blocks until every source is READ (transfer ids `{prefix}/{i}`): copies of the embeddings, one
        `[num_rows, hidden]` tensor per source. Raises RuntimeError when a READ fails or outlives
        `timeout_s` (its rows stay taken until then), ValueError for a bad source or no room.

        NOTE: polls this agent itself: use it on an agent that has no `read()`s of its own in flight
        (their events would be consumed here).
        """
        if self._reads:
            raise ValueError("read_now needs an agent without reads in flight")
        starts: list[int] = []
        try:
            for source in sources:
                start = self.allocator.alloc(source.num_rows)
                if start is None:
                    raise ValueError(f"no room for {source.num_rows} embedding rows ({self.allocator.num_free_rows} "
                                     f"of {self.allocator.num_rows} free)")
                starts.append(start)
            for source in sources:  # every connection first: nothing is in flight when one fails
                self.connect(source.agent_name, source.agent_metadata)
            for i, (source, start) in enumerate(zip(sources, starts)):
                self.read(f"{transfer_id_prefix}/{i}", source, start, lease_s=timeout_s)
            pending = {f"{transfer_id_prefix}/{i}" for i in range(len(sources))}
            failed = []
            while pending:
                ev = self.poll()
                pending -= set(ev.done_ids) | set(ev.failed_ids)
                failed += ev.failed_ids
                if pending:
                    time.sleep(0.0002)
            if failed:
                raise RuntimeError(f"reading image embeddings failed ({sorted(failed)})")
            return [self.rows(start, s.num_rows).clone() for s, start in zip(sources, starts)]
        finally:
            for source, start in zip(sources, starts):
                self.allocator.free(start, source.num_rows)

    # ------------------------------------------------------------------ progress

    def poll(self) -> EmbeddingEvents:
        """Drive NIXL once (never blocks): finish or fail READs, collect READ notifications."""
        ev = EmbeddingEvents()
        now = self._clock()
        c = self._counters
        for tid, entry, state in ended_transfers(self._reads, now, self._state):
            if state == "DONE":
                c["embeddings_read_bytes_total"] += entry.num_bytes
                c["embeddings_read_rows_total"] += entry.num_rows
                c["embeddings_reads_done_total"] += 1
                ev.done_ids.append(tid)
            else:
                c["embeddings_reads_failed_total"] += 1
                ev.failed_ids.append(tid)
            self._release(entry.handle)
        for tid, payload in new_notifications(self._nixl, logger):
            if payload == READ_NOTIF_PAYLOAD:
                c["embeddings_served_reads_total"] += 1
                # NOTE: not popped: a request's rows may be read by several stages (prefill and decode)
                c["embeddings_served_bytes_total"] += self._served_bytes.get(tid, 0)
                ev.read_by_peer_ids.append(tid)
        return ev

    def forget_expected_read(self, transfer_id: str) -> None:
        """Stop waiting for the notification of `transfer_id` (its hold ended)."""
        self._served_bytes.pop(transfer_id, None)

    def _state(self, entry: _Read) -> str:
        try:
            return self._nixl.check_xfer_state(entry.handle)
        except Exception as e:
            logger.warning("embedding read %s failed: %s", entry.transfer_id, e)
            return "ERR"

    def _release(self, handle) -> None:
        if handle is None:
            return
        try:
            handle.release()
        except Exception as e:
            logger.warning("could not release a NIXL transfer handle: %s", e)

    @property
    def num_inflight_reads(self) -> int:
        return len(self._reads)

    def stats(self) -> dict[str, int]:
        """Counters (Prometheus-style names) and gauges."""
        out = dict(self._counters)
        out["embeddings_inflight_reads"] = len(self._reads)
        out["embeddings_rows_free"] = self.allocator.num_free_rows
        out["embeddings_rows_total"] = self.allocator.num_rows
        return out

    def close(self) -> None:
        """Release every handle and deregister the buffer."""
        for entry in self._reads.values():
            self._release(entry.handle)
        self._reads.clear()
        try:
            self._nixl.deregister_memory(self._reg, backends=[self.backend])
        except Exception as e:
            logger.warning("deregistering the embedding buffer failed: %s", e)
