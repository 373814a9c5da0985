"""Joining an instance's rank group: one torch.distributed process group per instance process.

Every rank process (rank 0 is the engine's own process) calls `join_group` once. The default group
carries the MoE dispatch/combine (gloo on CPU ranks, NCCL on GPUs); a second, always-gloo group
carries the control plane (each step's plan from rank 0, the logits back), since plans are Python
objects and stay on the host whatever the device.

A group may span nodes: rank 0's node slice is the engine's process and the rank processes it starts, each
other node slice's ranks are started on their node (`deploy.rank_slice`), and all of them meet at rank 0's
address (its node's IP and a free port, `GroupAddress`), consecutive ranks per node (`node_slices`).

NOTE: torch.distributed keeps one default group per process, so a process is a rank of at most one
instance at a time; `leave_group` ends it (the multi-rank executor's `close`).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the group's rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_address(address: str) -> tuple[str, int]:
    """`"host:port"` -> (host, port); raises ValueError saying what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a rank group address is 'host:port' (rank 0's node IP and a free port), not {address!r}")
    return host, int(port)


def node_slices(num_ranks: int, ranks_per_node: int) -> list[range]:
    """The ranks of each node slice of a group spanning nodes: consecutive runs of `ranks_per_node` (the last may
    be shorter); slice 0 holds rank 0 (the engine's process).

    NOTE: consecutive ranks share a node, so the ranks a layout groups together (EPLB's hierarchical placement
    packs an expert's replicas within a node) talk over the node's links (NVLink), the rest over the network."""
    if num_ranks < 1 or ranks_per_node < 1:
        raise ValueError(f"need num_ranks >= 1 and ranks_per_node >= 1, got {num_ranks} and {ranks_per_node}")
    return [range(a, min(a + ranks_per_node, num_ranks)) for a in range(0, num_ranks, ranks_per_node)]


def backend_for(device: str) -> str:
    """The torch.distributed backend of the MoE traffic for ranks on `device`: NCCL on CUDA, else gloo."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int, first_local_rank: int = 0) -> torch.device:
    """The device of rank `rank` when rank 0 runs on `device`: `cuda:{index + rank - first_local_rank}` on CUDA
    (one GPU per rank of one host; `first_local_rank`: the lowest rank on this rank's node, its node slice's
    first), the same device otherwise."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank - first_local_rank)


@dataclass(frozen=True)
class GroupAddress:
    """Where and how an instance's ranks meet (picklable: sent to the rank processes)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"
    """The backend of the default group (the MoE traffic): gloo or nccl."""
    timeout_s: float = 600.0
    """How long a rendezvous or collective may wait for the other ranks before it fails."""


RANK_SPEC_KEY = "deepinfer/rank_spec"
"""The key of the pickled `RankSpec` in rank 0's store (outside the group's own `default_pg/` keys)."""


def host_store(address: GroupAddress) -> dist.TCPStore:
    """Rank 0 of a group spanning nodes: start the group's TCP store at `address.port` before the ranks join, so
    rank 0 can publish what the other nodes' ranks need (`publish`) ahead of the rendezvous; pass it to
    `join_group(..., store=)`. Listens on every interface (the other nodes reach it at `address.host`)."""
    return dist.TCPStore(address.host, address.port, None, True, timedelta(seconds=address.timeout_s),
                         wait_for_workers=False)


def publish(store: dist.TCPStore, value, key: str = RANK_SPEC_KEY) -> None:
    import pickle

    store.set(key, pickle.dumps(value))


def fetch_published(address: GroupAddress, key: str = RANK_SPEC_KEY):
    """Blocks until rank 0 has published `key` in its store at `address` (up to `address.timeout_s`); its value.
    A node slice's actor calls it to learn its ranks' `RankSpec` (rank 0's memory fit decides the cache size)."""
    import pickle

    store = dist.TCPStore(address.host, address.port, None, False, timedelta(seconds=address.timeout_s))
    return pickle.loads(store.get(key))


def join_group(address: GroupAddress, rank: int, store: dist.TCPStore | None = None):
    """Blocks until all `world_size` ranks have joined; returns the control group (gloo).

    The default group (`address.backend`) is initialised for this process; rank 0 hosts the TCP store (`store`:
    the one `host_store` started, for a group spanning nodes; else `init_process_group` starts it).
    """
    if dist.is_initialized():
        raise RuntimeError("this process is already a rank of a torch.distributed group (one instance per "
                           "process); close the other multi-rank engine first")
    timeout = timedelta(seconds=address.timeout_s)
    if store is not None:  # NOTE: the prefix `init_method="tcp://..."` gives the other ranks' view of the store
        dist.init_process_group(address.backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=address.world_size, timeout=timeout)
    else:
        dist.init_process_group(address.backend, init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                                world_size=address.world_size, timeout=timeout)
    if address.backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def leave_group() -> None:
    """Ends this process's group membership (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
