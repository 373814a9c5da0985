"""Joining an instance's rank group: one torch.distributed process group per instance process.

Every rank process (rank 0 is the engine's own process) calls `join_group` once. The default group
carries the MoE dispatch/combine (gloo on CPU ranks, NCCL on GPUs); a second, always-gloo group
carries the control plane (each step's plan from rank 0, the logits back), since plans are Python
objects and stay on the host whatever the device.

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


def backend_for(device: str) -> str:
    """The torch.distributed backend of the MoE traffic for ranks on `device`: NCCL on CUDA, else gloo."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> torch.device:
    """The device of rank `rank` when rank 0 runs on `device`: `cuda:{index + rank}` on CUDA (one GPU per
    rank of one host), the same device otherwise."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


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


def join_group(address: GroupAddress, rank: int):
    """Blocks until all `world_size` ranks have joined; returns the control group (gloo).

    The default group (`address.backend`) is initialised for this process; rank 0 hosts the TCP store.
    """
    if dist.is_initialized():
        raise RuntimeError("this process is already a rank of a torch.distributed group (one instance per "
                           "process); close the other multi-rank engine first")
    timeout = timedelta(seconds=address.timeout_s)
    dist.init_process_group(address.backend, init_method=f"tcp://{address.host}:{address.port}", rank=rank,
                            world_size=address.world_size, timeout=timeout)
    if address.backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo", timeout=timeout)


def leave_group() -> None:
    """Ends this process's group membership (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
