"""`KVTransferAgent`: one NIXL agent over one `V4KVCache`, moving compressed-KV blocks by WRITE.

The contract (who calls what, when, and what "finished" means) is the package docstring in
`kv_transfer/__init__.py`; this module is the mechanism:

* registration: every non-empty compressed pool (and, with `send_state=True`, every bounded-state
  tensor), as the cache layout describes it (`V4KVCache.pool_layouts`, `engine.cache.layout`), is
  registered once, at construction, as one region (`DRAM` for CPU tensors, `VRAM` for
  CUDA ones; the same code path keyed off `tensor.device`);
* descriptors: a transfer is a list of `(address, num_bytes, device_id)` rows on each side, one row
  per region x layer x run of consecutive block ids (a run is a stretch where source *and*
  destination ids both go up by one), row `i` of the local list landing on row `i` of the remote
  one;
* progress: there is no progress thread by default; `poll()` drives NIXL (transfer states on the
  sending side, notifications on the receiving side) and applies the leases.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.cache.layout import PoolLayout
from deepinfer.engine.latency import LatencyHistograms
from deepinfer.protos import kv_transfer_pb2

logger = logging.getLogger("kv_transfer")

LOOPBACK_UCX_ENV: dict[str, str] = {"UCX_TLS": "cma,tcp,self", "UCX_NET_DEVICES": "lo"}
"""UCX settings for processes on one host that must stay on loopback (tests, benchmarks).

NOTE: NIXL's UCX backend creates endpoints with peer-failure handling, which UCX's shared-memory
transports (posix, sysv) lack: a UCX_TLS without `tcp` makes backend creation fail with "no active
messages transport ... no peer failure handler". So `tcp` (on `lo`) carries NIXL's wire-up and
notifications, and `cma` (process_vm_writev, zero-copy, same host and user) carries the data. Where
cma is not permitted (ptrace restrictions), use `tcp,self`: UCX then emulates the WRITE over TCP.
"""

LOOPBACK_CUDA_UCX_ENV: dict[str, str] = {"UCX_TLS": "cuda_copy,cuda_ipc,tcp,self", "UCX_NET_DEVICES": "lo"}
"""UCX settings for processes on one host whose caches live on a GPU (pools registered as VRAM): `cuda_ipc` carries
the WRITE from one process's device memory into the other's (same GPU or peers over NVLink; measured on an H200
at 1,824 GB/s for 256 MiB, 0.88x a device copy), `cuda_copy` UCX's detection of CUDA memory (and host <-> device copies), `tcp` on
`lo` the wire-up and notifications (as in `LOOPBACK_UCX_ENV`: NIXL needs peer-failure handling). `cma` is left
out: it moves host memory only. `UCX_NET_DEVICES` names network devices only, so it does not hide the GPU."""


def loopback_ucx_env(device: str | torch.device) -> dict[str, str]:
    """The loopback UCX settings for an agent whose cache lives on `device`: `LOOPBACK_CUDA_UCX_ENV` for a CUDA
    device, else `LOOPBACK_UCX_ENV`. NOTE: UCX reads them once per process, when the first agent starts: every
    agent of a process (KV and image embeddings) lives on the engine's device, so one choice serves them all."""
    return dict(LOOPBACK_CUDA_UCX_ENV if torch.device(device).type == "cuda" else LOOPBACK_UCX_ENV)


NOTIF_MAGIC = b"DIKV1"
"""First bytes of every notification this package sends; others are ignored by `poll()`."""

_RECENT_DURATIONS = 256
_ROUTES = ("dram_to_dram", "dram_to_vram", "vram_to_dram", "vram_to_vram")
"""Source and destination memory types of a send, as its counter names spell them."""


def encode_notif(transfer_id: str, payload: bytes = b"") -> bytes:
    """The NIXL notification for a transfer: magic, 2-byte id length, id (UTF-8), caller payload."""
    tid = transfer_id.encode()
    if len(tid) > 0xFFFF:
        raise ValueError(f"transfer_id is {len(tid)} bytes long; keep it under 64 KiB (a request id is enough).")
    return NOTIF_MAGIC + len(tid).to_bytes(2, "big") + tid + bytes(payload)


def decode_notif(msg: bytes) -> tuple[str, bytes] | None:
    """`(transfer_id, payload)` of a notification from `encode_notif`, or None for any other message."""
    msg = bytes(msg)
    head = len(NOTIF_MAGIC)
    if not msg.startswith(NOTIF_MAGIC) or len(msg) < head + 2:
        return None
    n = int.from_bytes(msg[head:head + 2], "big")
    if len(msg) < head + 2 + n:
        return None
    return msg[head + 2:head + 2 + n].decode(), msg[head + 2 + n:]


def start_nixl_agent(name: str, backend: str, ucx_env: Mapping[str, str] | None, progress_thread: bool = False):
    """Blocks until a NIXL agent `name` has started `backend`; returns it. `ucx_env` is set in `os.environ` first
    (UCX reads it when the backend starts; process-wide). RuntimeError when the backend did not start."""
    for key, value in (ucx_env or {}).items():
        os.environ[key] = value
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[backend]))
    if backend not in agent.backends:
        raise RuntimeError(
            f"NIXL backend {backend!r} did not start (available plugins: {agent.get_plugin_list()}); "
            "see the NIXL log lines above."
        )
    return agent


def ended_transfers(transfers: dict, now: float, state_of: Callable) -> Iterator[tuple[str, Any, str]]:
    """`(transfer_id, entry, state)` of every transfer in `transfers` (id -> an entry with `failed` and `deadline`)
    that has ended, each removed from `transfers` as it is yielded: "DONE", "ERR" (NIXL's state, `state_of(entry)`,
    or `entry.failed`), or "PROC" past its deadline (the lease ran out first). The caller counts it and releases its
    handle; one still in progress within its deadline stays."""
    for transfer_id, entry in list(transfers.items()):
        state = "ERR" if entry.failed else state_of(entry)
        if state == "PROC" and now < entry.deadline:
            continue
        del transfers[transfer_id]
        yield transfer_id, entry, state


def new_notifications(nixl, log: logging.Logger) -> Iterator[tuple[str, bytes]]:
    """`(transfer_id, payload)` of every notification from `encode_notif` NIXL received since the last call (other
    messages are skipped); a failed read of them is logged to `log` and yields none."""
    try:
        notifs = nixl.get_new_notifs()
    except Exception as e:
        log.warning("reading NIXL notifications failed: %s", e)
        return
    for msgs in notifs.values():
        for msg in msgs:
            decoded = decode_notif(msg)
            if decoded is not None:
                yield decoded


@dataclass(frozen=True)
class RegionLayout:
    """One registered tensor `[num_layers, num_units, ...]` as a remote agent addresses it: the cache
    layout's `PoolLayout` (`engine.cache.layout`, the one owner of the byte arithmetic) plus where
    the tensor lives. On the wire it is a `deepinfer.v1.KVRegion` (`protos/kv_transfer.proto`).

    A unit is a block (compressed pools) or a slot (bounded-state tensors); unit `u` of layer `l`
    is the contiguous byte range `addr + l * layer_nbytes + u * unit_nbytes`, `unit_nbytes` long.
    """

    addr: int
    """Address of the tensor's first byte in its owner's address space (or on its GPU)."""
    nbytes: int
    """Registered length in bytes (the whole tensor)."""
    mem_type: str
    """NIXL memory type: 'DRAM' (CPU tensor) or 'VRAM' (CUDA tensor)."""
    dev_id: int
    """CUDA device index for VRAM, 0 for DRAM."""
    num_layers: int
    """Size of dim 0."""
    num_units: int
    """Size of dim 1 (blocks or slots)."""
    unit_nbytes: int
    """Bytes of one layer's unit."""
    layer_nbytes: int
    """Bytes of one layer (`num_units * unit_nbytes`)."""
    is_state: bool
    """True for a bounded-state tensor (units are slots), False for a compressed pool (blocks)."""

    @classmethod
    def of(cls, tensor: torch.Tensor, pool: PoolLayout) -> RegionLayout:
        """The region of a cache tensor laid out as `pool` describes (checked against the tensor)."""
        if not tensor.is_contiguous():
            raise ValueError("cache tensors must be contiguous to be registered with NIXL")
        if tuple(tensor.shape) != pool.shape or tensor.element_size() != pool.itemsize:
            raise ValueError(f"tensor {pool.name!r} is {tuple(tensor.shape)} x {tensor.element_size()} B, its layout "
                             f"says {pool.shape} x {pool.itemsize} B")
        return cls(
            addr=tensor.data_ptr(),
            nbytes=pool.nbytes,
            mem_type="VRAM" if tensor.device.type == "cuda" else "DRAM",
            dev_id=(tensor.device.index or 0) if tensor.device.type == "cuda" else 0,
            num_layers=pool.num_layers,
            num_units=pool.num_units,
            unit_nbytes=pool.unit_nbytes,
            layer_nbytes=pool.layer_nbytes,
            is_state=pool.is_state,
        )

    @property
    def pool(self) -> PoolLayout:
        """The region's layout as a `PoolLayout` (units as opaque bytes: `unit_shape = (unit_nbytes,)`)."""
        return PoolLayout("", self.num_layers, self.num_units, (self.unit_nbytes,), 1, self.is_state)

    def descs(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Rows `(address, num_bytes, dev_id)` for runs `[start, start + length)` of units, every layer."""
        return self.pool.run_descs(self.addr, starts, lengths, self.dev_id)

    def to_proto(self, name: str) -> kv_transfer_pb2.KVRegion:
        """This region as the wire message `deepinfer.v1.KVRegion`."""
        return kv_transfer_pb2.KVRegion(name=name, addr=self.addr, nbytes=self.nbytes, mem_type=self.mem_type,
                                        dev_id=self.dev_id, num_layers=self.num_layers, num_units=self.num_units,
                                        unit_nbytes=self.unit_nbytes, is_state=self.is_state)

    @classmethod
    def from_proto(cls, msg: kv_transfer_pb2.KVRegion) -> RegionLayout:
        return cls(addr=msg.addr, nbytes=msg.nbytes, mem_type=msg.mem_type, dev_id=msg.dev_id,
                   num_layers=msg.num_layers, num_units=msg.num_units, unit_nbytes=msg.unit_nbytes,
                   layer_nbytes=msg.num_units * msg.unit_nbytes, is_state=msg.is_state)


def layout_from_wire(
    layout: kv_transfer_pb2.KVLayout | bytes | Mapping[str, Mapping | RegionLayout],
) -> dict[str, RegionLayout]:
    """A peer's regions by name from a `deepinfer.v1.KVLayout` (message or serialized bytes), from
    `KVTransferAgent.pool_layout()`'s plain dict, or from an earlier result of this function."""
    if isinstance(layout, (bytes, bytearray, memoryview)):
        layout = kv_transfer_pb2.KVLayout.FromString(bytes(layout))
    if isinstance(layout, kv_transfer_pb2.KVLayout):
        return {r.name: RegionLayout.from_proto(r) for r in layout.regions}
    return {n: r if isinstance(r, RegionLayout) else RegionLayout(**dict(r)) for n, r in layout.items()}


def block_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Coalesce `src[i] -> dst[i]` into runs: `(src_starts, dst_starts, lengths)`.

    A run continues while both ids go up by one, so `[3, 4, 5] -> [10, 11, 2]` is two runs.
    """
    s = np.asarray(src_block_ids, dtype=np.int64)
    d = np.asarray(dst_block_ids, dtype=np.int64)
    cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(s)]))
    return s[starts], d[starts], ends - starts


@dataclass(frozen=True)
class AgentInfo:
    """What a sender needs to connect to one agent: its name, NIXL metadata and serialized `KVLayout`."""

    name: str
    metadata: bytes
    layout: bytes


@dataclass
class KVTransferEvents:
    """What one `poll()` observed. Each id appears in exactly one list, exactly once, ever."""

    sent_ids: list[str] = field(default_factory=list)
    """Sender: the WRITE completed; the source blocks may be freed."""
    send_failed_ids: list[str] = field(default_factory=list)
    """Sender: the WRITE failed or outlived its lease; free the source blocks and tell the decode side."""
    received_ids: list[str] = field(default_factory=list)
    """Receiver: the notification arrived, so the bytes are in the reserved blocks (`commit_kv`)."""
    expired_ids: list[str] = field(default_factory=list)
    """Receiver: the reservation's lease ran out first; free the reserved blocks (abort the request)."""
    payloads: dict[str, bytes] = field(default_factory=dict)
    """Receiver: the sender's `notify` bytes per received id."""

    def __bool__(self) -> bool:
        return bool(self.sent_ids or self.send_failed_ids or self.received_ids or self.expired_ids)


@dataclass
class _Send:
    transfer_id: str
    peer: str
    handle: object | None  # nixl_xfer_handle
    num_bytes: int
    num_blocks: int
    t_start: float
    deadline: float
    failed: bool = False
    route: str = "dram_to_dram"
    """`{local}_to_{remote}` memory types (lower case): which `kv_transfer_sent_bytes_*_to_*_total` it counts in."""


@dataclass
class _Expect:
    transfer_id: str
    dst_block_ids: list[int]
    dst_slot: int | None
    num_bytes: int
    t_start: float
    deadline: float


class KVTransferAgent:
    """A NIXL agent that registers one `V4KVCache` and moves its blocks to and from peers.

    Both roles live in one class because one process holds one NIXL agent: a prefill process uses
    `send_blocks`, a decode process `expect`; both call `poll()` once per loop iteration. Not
    thread-safe: call it from one thread (the engine loop).
    """

    def __init__(
        self,
        name: str,
        cache: V4KVCache,
        backend: str = "UCX",
        *,
        send_state: bool = False,
        send_lease_s: float = 30.0,
        unmatched_notif_ttl_s: float = 60.0,
        ucx_env: Mapping[str, str] | None = None,
        progress_thread: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Creates the NIXL agent and registers the cache's tensors.

        `send_state`: also register the bounded-state tensors so `send_blocks` can move a slot
        (both sides must agree). `send_lease_s`: default lease of a send. `unmatched_notif_ttl_s`:
        how long a notification waits for its `expect` (the two can cross on the control plane).
        `ucx_env`: UCX variables set in `os.environ` before the backend starts (UCX reads them
        then; they are process-wide), e.g. `LOOPBACK_UCX_ENV`. `progress_thread`: NIXL's progress
        thread; off by default because the Python wrapper starts it with zero delay, so it
        busy-polls one CPU core. `clock`: seconds, monotonic (tests may pass a fake one).
        """
        self.name = name
        self.cache = cache
        self.backend = backend
        self.send_state = send_state
        self.send_lease_s = send_lease_s
        self.unmatched_notif_ttl_s = unmatched_notif_ttl_s
        self._clock = clock
        self._nixl = start_nixl_agent(name, backend, ucx_env, progress_thread)
        self._regions: dict[str, RegionLayout] = {}
        self._reg_descs = []
        for region_name, pool in cache.pool_layouts.items():  # the cache layout's descriptors, in order
            if pool.is_empty or (pool.is_state and not send_state):
                continue
            region = RegionLayout.of(getattr(cache, region_name), pool)
            first = next(iter(self._regions.values()), region)
            if (region.mem_type, region.dev_id) != (first.mem_type, first.dev_id):  # one transfer, one memory type
                for reg in self._reg_descs:
                    self._nixl.deregister_memory(reg, backends=[backend])
                raise ValueError(f"cache tensor {region_name!r} is {region.mem_type} (device {region.dev_id}), the "
                                 f"others {first.mem_type} (device {first.dev_id}): keep a cache on one device")
            reg = self._nixl.get_reg_descs([(region.addr, region.nbytes, region.dev_id, "")], region.mem_type)
            self._nixl.register_memory(reg, backends=[backend])
            self._reg_descs.append(reg)
            self._regions[region_name] = region
        self._mem_type = next(iter(self._regions.values())).mem_type if self._regions else "DRAM"
        self._peers: dict[str, dict[str, RegionLayout]] = {}
        self._sends: dict[str, _Send] = {}
        self._expects: dict[str, _Expect] = {}
        self._arrived: dict[str, tuple[bytes, float]] = {}  # notifications not yet matched to an `expect`
        self._stuck_handles: list = []  # handles NIXL refused to release (could not cancel); retried
        self._durations: deque[float] = deque(maxlen=_RECENT_DURATIONS)
        self.latency = LatencyHistograms()
        """`kv_transfer`: each completed send, post to DONE (the serving shells export it, `engine.latency`)."""
        self._counters = {
            "kv_transfer_sent_bytes_total": 0,
            "kv_transfer_sent_blocks_total": 0,
            "kv_transfer_sends_done_total": 0,
            "kv_transfer_sends_failed_total": 0,
            "kv_transfer_received_bytes_total": 0,
            "kv_transfer_received_blocks_total": 0,
            "kv_transfer_recvs_done_total": 0,
            "kv_transfer_recvs_expired_total": 0,
            "kv_transfer_notifs_unmatched_total": 0,
            "kv_transfer_send_seconds_sum": 0.0,
            **{f"kv_transfer_sent_bytes_{route}_total": 0 for route in _ROUTES},
        }
        self._registered = {f"kv_transfer_registered_{m.lower()}_bytes": 0 for m in ("DRAM", "VRAM")}
        """Bytes of this agent's registered regions by memory type: a GPU cache registers VRAM only (its
        transfers then stay on the device: `kv_transfer_sent_bytes_vram_to_vram_total` on the sender)."""
        for region in self._regions.values():
            self._registered[f"kv_transfer_registered_{region.mem_type.lower()}_bytes"] += region.nbytes

    # ------------------------------------------------------------------ handshake (control plane)

    num_ranks = 1
    """Ranks whose pools this agent addresses (`kv_transfer.ranked.RankedAgents` addresses several)."""

    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered memory), for the control plane."""
        return self._nixl.get_agent_metadata()

    def agent_infos(self) -> dict[str, AgentInfo]:
        """What a sender needs to connect to each agent of this instance, by agent name (this one agent)."""
        return {self.name: AgentInfo(self.name, self.metadata(), self.layout().SerializeToString())}

    def locate(self, block_ids: Sequence[int], slot: int | None = None) -> tuple[str, list[int], int | None]:
        """`(agent name, block ids, slot)` a peer addresses to reach these blocks of this agent's cache (the
        identity here; `RankedAgents` maps an instance's global ids to a rank's agent and its local ids)."""
        return self.name, list(block_ids), slot

    def pool_layout(self) -> dict[str, dict]:
        """Per registered region (pool or state tensor): address, size, memory type, device and shape.

        Plain ints, strings and bools, so it can ride any control-plane message; a sender passes
        its peer's layout to `add_peer`.
        """
        return {n: asdict(r) for n, r in self._regions.items()}

    def layout(self) -> kv_transfer_pb2.KVLayout:
        """The same as `pool_layout()`, as the wire message `deepinfer.v1.KVLayout` (what a decode
        instance publishes in `ReserveResponse.agent_layout`, serialized)."""
        return kv_transfer_pb2.KVLayout(regions=[r.to_proto(n) for n, r in self._regions.items()])

    def add_peer(self, name: str, metadata: bytes,
                 layout: kv_transfer_pb2.KVLayout | bytes | Mapping[str, Mapping]) -> None:
        """Load a peer's metadata and layout so that `send_blocks` can write into it.

        Only the sending side needs this: notifications reach a receiver without it. A name seen
        before is replaced (a restarted peer). Raises `ValueError` if the peer's cache cannot hold
        this cache's blocks (other model, dtype or block size). `layout`: the peer's `layout()`
        (message or serialized bytes) or `pool_layout()`.
        """
        regions = layout_from_wire(layout)
        for n, mine in self._regions.items():
            theirs = regions.get(n)
            if theirs is None and mine.is_state:
                continue  # a peer that rebuilds its state by replay (sends carry no slot), or keeps no drafter state
            if theirs is None:
                raise ValueError(f"peer {name!r} has no region {n!r}; both sides must run the same model.")
            if (theirs.num_layers, theirs.unit_nbytes) != (mine.num_layers, mine.unit_nbytes):
                raise ValueError(
                    f"peer {name!r} region {n!r} is {theirs.num_layers} layers x {theirs.unit_nbytes} B per unit, "
                    f"ours {mine.num_layers} x {mine.unit_nbytes}; model config, cache dtype and block_size must match."
                )
        lacking = [n for n, r in regions.items() if r.is_state and n not in self._regions]
        if self.send_state and lacking:  # a sent slot would leave these of the peer's slot stale
            raise ValueError(f"peer {name!r} keeps bounded state {lacking} that this instance does not (a drafter's "
                             "state, e.g. dspark_keys: the DSpark rings); run this instance with the peer's "
                             "--speculative (dspark), or the peer with --bounded-state replay")
        self.remove_peer(name)
        loaded = self._nixl.add_remote_agent(metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != name:
            self._nixl.remove_remote_agent(loaded)
            raise ValueError(f"metadata is for agent {loaded!r}, not {name!r}")
        self._peers[name] = regions

    def remove_peer(self, name: str) -> None:
        """Forget a peer (membership change); in-flight sends to it fail at the next `poll()`."""
        if self._peers.pop(name, None) is not None:
            self._nixl.remove_remote_agent(name)

    # ------------------------------------------------------------------ sending (prefill side)

    def send_blocks(
        self,
        transfer_id: str,
        peer: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        notify: bytes = b"",
        *,
        src_slot: int | None = None,
        dst_slot: int | None = None,
        lease_s: float | None = None,
    ) -> int:
        """Start a WRITE of blocks `src_block_ids[i] -> dst_block_ids[i]` (every pool and layer) to `peer`.

        Returns at once with the number of bytes posted; the outcome comes from `poll()`
        (`sent_ids` or `send_failed_ids`, never both, exactly once, at the latest after
        `lease_s`). The peer receives a notification carrying `transfer_id` and `notify` once the
        bytes are in place. The source blocks must stay untouched until then. With
        `send_state=True`, `src_slot`/`dst_slot` also move one request's bounded state.
        """
        if transfer_id in self._sends:
            raise ValueError(f"transfer {transfer_id!r} is already in flight")
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; call add_peer with its metadata and layout first")
        if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
            raise ValueError(
                f"need as many destination as source blocks, at least one (got {len(src_block_ids)} -> {len(dst_block_ids)})"
            )
        if (src_slot is None) != (dst_slot is None) or (src_slot is not None and not self.send_state):
            raise ValueError("src_slot and dst_slot go together, and need an agent built with send_state=True")
        remote = self._peers[peer]
        _check_ids(src_block_ids, self.cache.num_blocks, "source block")
        _check_ids(dst_block_ids, next(r for r in remote.values() if not r.is_state).num_units,
                   f"destination block (peer {peer!r})")
        if src_slot is not None:
            if not any(r.is_state for r in remote.values()):
                raise ValueError(f"peer {peer!r} registered no bounded-state regions (it rebuilds state by replay)")
            _check_ids([src_slot], self.cache.num_slots, "source slot")
            _check_ids([dst_slot], next(r for r in remote.values() if r.is_state).num_units,
                       f"destination slot (peer {peer!r})")
        src_starts, dst_starts, lengths = block_runs(src_block_ids, dst_block_ids)
        one = np.ones(1, dtype=np.int64)
        local_rows, remote_rows = [], []
        for n, mine in self._regions.items():
            if not mine.is_state:
                local_rows.append(mine.descs(src_starts, lengths))
                remote_rows.append(remote[n].descs(dst_starts, lengths))
            elif src_slot is not None and n in remote:  # state the peer keeps (a drafter's only if it drafts)
                local_rows.append(mine.descs(np.array([src_slot]), one))
                remote_rows.append(remote[n].descs(np.array([dst_slot]), one))
        local = np.concatenate(local_rows)  # [num_descs, 3] (address, num_bytes, device)
        remote_descs = np.concatenate(remote_rows)
        remote_mem = next(iter(remote.values())).mem_type
        num_bytes = int(local[:, 1].sum())
        now = self._clock()
        send = _Send(transfer_id, peer, None, num_bytes, len(src_block_ids), now,
                     now + (self.send_lease_s if lease_s is None else lease_s),
                     route=f"{self._mem_type.lower()}_to_{remote_mem.lower()}")
        self._sends[transfer_id] = send
        try:
            send.handle = self._nixl.initialize_xfer(
                "WRITE",
                self._nixl.get_xfer_descs(local, self._mem_type),
                self._nixl.get_xfer_descs(remote_descs, remote_mem),
                peer,
                encode_notif(transfer_id, notify),
                backends=[self.backend],
            )
            if self._nixl.transfer(send.handle) == "ERR":
                send.failed = True
        except Exception as e:  # NIXL raises e.g. nixlRemoteDisconnectError when the peer is gone
            logger.warning("kv transfer %s to %s failed to start: %s", transfer_id, peer, e)
            send.failed = True
        return num_bytes

    # ------------------------------------------------------------------ receiving (decode side)

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], lease_s: float, *, dst_slot: int | None = None) -> None:
        """Record that `transfer_id` will write into `dst_block_ids` (reserved by the caller).

        `poll()` reports it exactly once: in `received_ids` when the sender's notification arrives,
        or in `expired_ids` after `lease_s` seconds without one.
        """
        if transfer_id in self._expects:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if dst_slot is not None and not self.send_state:
            raise ValueError("dst_slot needs an agent built with send_state=True")
        _check_ids(dst_block_ids, self.cache.num_blocks, "destination block")
        num_bytes = self.transfer_nbytes(len(dst_block_ids), dst_slot is not None)
        now = self._clock()
        self._expects[transfer_id] = _Expect(transfer_id, list(dst_block_ids), dst_slot, num_bytes, now, now + lease_s)

    def cancel_expect(self, transfer_id: str) -> bool:
        """Drop a reservation (the request was aborted); False if it was not pending.

        NOTE: a WRITE already posted by the sender cannot be recalled: free the blocks only once the
        sender has reported failure or its lease (shorter than this one) has surely passed.
        """
        return self._expects.pop(transfer_id, None) is not None

    def transfer_nbytes(self, num_blocks: int, with_slot: bool = False) -> int:
        """Bytes a transfer of `num_blocks` blocks (every pool and layer; `with_slot`: plus one slot of state) moves."""
        num_bytes = num_blocks * sum(r.num_layers * r.unit_nbytes for r in self._regions.values() if not r.is_state)
        if with_slot:
            num_bytes += sum(r.num_layers * r.unit_nbytes for r in self._regions.values() if r.is_state)
        return num_bytes

    def unmatched_notification_ids(self) -> list[str]:
        """Transfer ids whose notification arrived without an `expect` claiming it (yet)."""
        return list(self._arrived)

    def notification_arrived(self, transfer_id: str) -> bool:
        """Whether the sender's completion notification of `transfer_id` came without an `expect`
        claiming it (e.g. after `cancel_expect`): its bytes have landed, nothing more will."""
        return transfer_id in self._arrived

    # ------------------------------------------------------------------ progress

    def poll(self) -> KVTransferEvents:
        """Drive NIXL once (never blocks): finish, fail or expire sends and reservations."""
        ev = KVTransferEvents()
        now = self._clock()
        c = self._counters
        for tid, send, state in ended_transfers(self._sends, now, self._state):
            if state == "DONE":
                dt = now - send.t_start
                self._durations.append(dt)
                self.latency.observe("kv_transfer", dt)
                c["kv_transfer_send_seconds_sum"] += dt
                c["kv_transfer_sent_bytes_total"] += send.num_bytes
                c[f"kv_transfer_sent_bytes_{send.route}_total"] += send.num_bytes
                c["kv_transfer_sent_blocks_total"] += send.num_blocks
                c["kv_transfer_sends_done_total"] += 1
                ev.sent_ids.append(tid)
            else:
                if state == "PROC":
                    logger.warning("kv transfer %s to %s outlived its lease; releasing it", tid, send.peer)
                c["kv_transfer_sends_failed_total"] += 1
                ev.send_failed_ids.append(tid)
            self._release(send.handle)
        for h in self._stuck_handles[:]:
            self._stuck_handles.remove(h)
            self._release(h)
        for tid, payload in new_notifications(self._nixl, logger):
            self._arrived[tid] = (payload, now)
        for tid, (payload, t_seen) in list(self._arrived.items()):
            exp = self._expects.pop(tid, None)
            if exp is not None:
                del self._arrived[tid]
                c["kv_transfer_received_bytes_total"] += exp.num_bytes
                c["kv_transfer_received_blocks_total"] += len(exp.dst_block_ids)
                c["kv_transfer_recvs_done_total"] += 1
                ev.received_ids.append(tid)
                ev.payloads[tid] = payload
            elif now - t_seen > self.unmatched_notif_ttl_s:
                del self._arrived[tid]  # its reservation expired, was cancelled, or never came
                c["kv_transfer_notifs_unmatched_total"] += 1
                logger.warning("dropped the notification of kv transfer %s: no reservation claimed it", tid)
        for tid, exp in list(self._expects.items()):
            if now >= exp.deadline:
                del self._expects[tid]
                c["kv_transfer_recvs_expired_total"] += 1
                ev.expired_ids.append(tid)
        return ev

    def _state(self, send: _Send) -> str:
        try:
            return self._nixl.check_xfer_state(send.handle)
        except Exception as e:
            logger.warning("kv transfer %s to %s failed: %s", send.transfer_id, send.peer, e)
            return "ERR"

    def _release(self, handle) -> None:
        if handle is None:
            return
        try:
            handle.release()
        except Exception as e:  # still active and NIXL could not cancel it: retry on the next poll
            logger.warning("could not release a NIXL transfer handle yet: %s", e)
            self._stuck_handles.append(handle)

    # ------------------------------------------------------------------ introspection

    @property
    def num_inflight_sends(self) -> int:
        return len(self._sends)

    @property
    def num_pending_recvs(self) -> int:
        return len(self._expects)

    def stats(self) -> dict[str, float | int | list[float]]:
        """Counters (Prometheus-style names), gauges and the most recent send durations (seconds)."""
        out: dict[str, float | int | list[float]] = dict(self._counters)
        out["kv_transfer_send_seconds_count"] = out["kv_transfer_sends_done_total"]
        out["kv_transfer_inflight_sends"] = len(self._sends)
        out["kv_transfer_pending_recvs"] = len(self._expects)
        out.update(self._registered)
        out["kv_transfer_send_seconds_recent"] = list(self._durations)
        return out

    def close(self) -> None:
        """Release every handle and deregister the cache's memory; in-flight work is abandoned."""
        for send in self._sends.values():
            self._release(send.handle)
        self._sends.clear()
        self._expects.clear()
        for reg in self._reg_descs:
            try:
                self._nixl.deregister_memory(reg, backends=[self.backend])
            except Exception as e:
                logger.warning("deregistering cache memory failed: %s", e)
        self._reg_descs.clear()

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_ids(ids: Sequence[int], limit: int, what: str) -> None:
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise ValueError(f"{what} ids {bad} out of range [0, {limit})")
