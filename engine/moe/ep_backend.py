"""Expert parallelism for one MoE layer: routed experts split across the ranks of an instance.

An instance of `world_size` ranks runs attention data-parallel (each rank its own tokens) and its MoE
layers expert-parallel: rank r holds the routed experts that `ExpertPlacement` puts on it (its
*physical slots*, `num_physical_experts / world_size` of them: every logical expert once plus
`num_redundant_experts` replicas of hot ones, chosen by EPLB, `engine.moe.eplb`). Per layer and step:

  1. the router (in the model) gives each local token its top-k logical experts and weights;
  2. `ExpertParallelMoEBackend` picks one replica (a physical slot) per (token, expert) pair,
     spreading a replicated expert's pairs over its replicas, and so a destination rank per pair;
  3. the `Dispatcher` sends each pair's token row to its destination (`dispatch`); the destination
     runs its local experts over the rows it received through the *inner* backend (any `MoEBackend`:
     `torch`, `torch_loop`, `fp4`, the batch-invariant one; quantized FP8 / FP4 experts included);
  4. the dispatcher sends the expert outputs back (`combine`), and the home rank weights them and adds
     a token's experts in ascending expert id, one add at a time.

The shared expert stays in the model and runs locally on every rank.

Why step 4 is done at home and in that order: it is the arithmetic of the reference backends
(`torch`: `index_add_` of the weighted pairs in expert order from zero; the batch-invariant backend:
the same sum without the zero), so a token's routed output equals the single-process one bit for bit
whenever the inner backend's per-row expert outputs do not depend on which other rows share the
expert's matmul (guaranteed by `EngineConfig.batch_invariant`; on the CPU also true from 12 rows on,
`engine.batch_invariant`). Replicas hold the same weights, so the replica chosen does not matter either.

The `Dispatcher` is the seam for faster transports: `AllToAllDispatcher` is two `all_to_all_single`
calls each way over a torch.distributed group (gloo on CPU ranks, NCCL on GPUs); a DeepEP-class
dispatcher (NVLink / RDMA kernels, low-latency decode mode) implements the same two methods.

NOTE: every rank of the group must call `forward` of every MoE layer in every step, even with zero
tokens (a rank without requests runs a dummy batch, `engine.distributed`): dispatch and combine are
collectives.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.moe.base import MoEBackend


@dataclass(frozen=True)
class ExpertPlacement:
    """Which logical expert each physical slot holds; slots `[r * S, (r + 1) * S)` live on rank r.

    `phy2log[p]` is the logical expert of physical slot p (S = `len(phy2log) // world_size` slots per
    rank). Every logical expert has at least one slot; a rank may hold two replicas of one expert (they
    then share one local expert).
    """

    phy2log: tuple[int, ...]
    num_logical_experts: int
    world_size: int

    def __post_init__(self) -> None:
        P, E, W = len(self.phy2log), self.num_logical_experts, self.world_size
        if W < 1 or P % W:
            raise ValueError(f"{P} physical expert slots cannot be split evenly over {W} ranks; make "
                             "n_routed_experts + num_redundant_experts a multiple of expert_parallel_size")
        if any(not 0 <= e < E for e in self.phy2log) or len(set(self.phy2log)) != E:
            raise ValueError(f"a placement must hold each of the {E} logical experts at least once; got {self.phy2log}")

    @classmethod
    def contiguous(cls, num_logical_experts: int, world_size: int, num_redundant_experts: int = 0) -> ExpertPlacement:
        """The placement before any load is measured: experts in order, rank r holding a contiguous run, and
        the redundant slots filled with experts 0, 1, ... (EPLB replaces them once loads are known)."""
        E, R = num_logical_experts, num_redundant_experts
        if R > E * (world_size - 1) and world_size > 1:
            raise ValueError(f"num_redundant_experts={R} is more than one replica of each expert per rank allows")
        return cls(tuple(list(range(E)) + [i % E for i in range(R)]), E, world_size)

    @property
    def num_physical_experts(self) -> int:
        return len(self.phy2log)

    @property
    def slots_per_rank(self) -> int:
        return len(self.phy2log) // self.world_size

    def local_experts(self, rank: int) -> list[int]:
        """The logical experts rank `rank` holds, in slot order, without repeats (its local expert order)."""
        S = self.slots_per_rank
        return list(dict.fromkeys(self.phy2log[rank * S:(rank + 1) * S]))

    def replica_count(self) -> list[int]:
        """Per logical expert: how many physical slots hold it."""
        cnt = [0] * self.num_logical_experts
        for e in self.phy2log:
            cnt[e] += 1
        return cnt

    def tables(self, device: torch.device | str = "cpu") -> RoutingTables:
        """The lookup tensors `ExpertParallelMoEBackend` routes with."""
        E, S = self.num_logical_experts, self.slots_per_rank
        cnt = self.replica_count()
        log2phy = torch.full((E, max(cnt)), -1, dtype=torch.long)
        fill = [0] * E
        for p, e in enumerate(self.phy2log):
            log2phy[e, fill[e]] = p
            fill[e] += 1
        local_of = {}  # (rank, logical) -> local index
        for r in range(self.world_size):
            for i, e in enumerate(self.local_experts(r)):
                local_of[r, e] = i
        phy_rank = torch.tensor([p // S for p in range(len(self.phy2log))], dtype=torch.long)
        phy_local = torch.tensor([local_of[p // S, e] for p, e in enumerate(self.phy2log)], dtype=torch.long)
        return RoutingTables(log2phy.to(device), torch.tensor(cnt, dtype=torch.long, device=device),
                             phy_rank.to(device), phy_local.to(device))


@dataclass
class RoutingTables:
    """Device tensors of an `ExpertPlacement` for routing pairs to replicas."""

    log2phy: torch.Tensor  # [E, max_replicas] int64, -1 padded
    replica_count: torch.Tensor  # [E] int64
    phy_rank: torch.Tensor  # [P] int64: the rank of each physical slot
    phy_local: torch.Tensor  # [P] int64: the slot's local expert index on its rank


@dataclass
class DispatchHandle:
    """What `combine` needs to send expert outputs back: the row counts of the dispatch, both ways."""

    send_counts: list[int]
    """Rows sent to each rank."""
    recv_counts: list[int]
    """Rows received from each rank."""


class Dispatcher(ABC):
    """Moves token rows to the ranks owning their experts and the expert outputs back (a collective).

    `dispatch(x, dest_rank, local_ids)`: x [n, H] rows sorted by `dest_rank` [n] (ascending), each with the
    destination's local expert index `local_ids` [n] -> (received rows [m, H], their local expert ids [m],
    a handle). `combine(y, handle)`: the outputs [m, H] of the received rows, in received order -> [n, H]
    in the order of the dispatched rows. Every rank of the group calls both, zero rows included.
    """

    world_size: int
    rank: int

    @abstractmethod
    def dispatch(self, x: torch.Tensor, dest_rank: torch.Tensor,
                 local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
        """Blocks until every rank has its rows (see the class docstring)."""

    @abstractmethod
    def combine(self, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Blocks until every rank has its rows' outputs back (see the class docstring)."""


class AllToAllDispatcher(Dispatcher):
    """`Dispatcher` over `torch.distributed.all_to_all_single` (gloo on CPU ranks, NCCL on GPUs).

    Dispatch exchanges the per-rank row counts first (one small all-to-all), then the rows and their
    local expert ids; combine is one all-to-all with the split sizes swapped. NOTE: the counts are read
    on the host (`tolist`), so this dispatcher is not CUDA-graph safe.
    """

    def __init__(self, group=None, *, world_size: int | None = None, rank: int | None = None) -> None:
        """`world_size` and `rank` given: no torch.distributed call here (the dispatcher may be built before
        the group is joined, e.g. while the checkpoint loads); the group must be joined before `dispatch`."""
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.world_size = dist.get_world_size(group) if world_size is None else world_size
        self.rank = dist.get_rank(group) if rank is None else rank

    def dispatch(self, x, dest_rank, local_ids):
        W = self.world_size
        send = torch.bincount(dest_rank, minlength=W)  # [W]
        recv = torch.empty_like(send)
        self._dist.all_to_all_single(recv, send, group=self.group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        m = sum(recv_counts)
        recv_x = x.new_empty(m, x.shape[1])
        self._dist.all_to_all_single(recv_x, x.contiguous(), recv_counts, send_counts, group=self.group)
        recv_ids = local_ids.new_empty(m)
        self._dist.all_to_all_single(recv_ids, local_ids.contiguous(), recv_counts, send_counts, group=self.group)
        return recv_x, recv_ids, DispatchHandle(send_counts, recv_counts)

    def combine(self, y, handle):
        out = y.new_empty(sum(handle.send_counts), y.shape[1])
        self._dist.all_to_all_single(out, y.contiguous(), handle.send_counts, handle.recv_counts, group=self.group)
        return out


class ExpertParallelMoEBackend(MoEBackend):
    """Routed experts split over a rank group: dispatch, local experts (the inner backend), combine.

    Wraps the backend the model was built with (`inner`); `prepare(experts)` hands the inner backend only
    this rank's experts (`ExpertPlacement.local_experts`). `set_placement` swaps the placement (EPLB); the
    model's `MoE.prepare()` then re-prepares. Counts what it routes, for EPLB and the imbalance metric:
    `expert_counts` [E] (pairs of this rank's tokens per logical expert) and `num_recv_rows` (rows this
    rank's experts computed), since the last `reset_counts`.
    """

    name = "expert_parallel"

    def __init__(self, inner: MoEBackend, dispatcher: Dispatcher, placement: ExpertPlacement) -> None:
        if placement.world_size != dispatcher.world_size:
            raise ValueError(f"the placement is for {placement.world_size} ranks, the group has {dispatcher.world_size}")
        self.inner = inner
        self.dispatcher = dispatcher
        self.rank = dispatcher.rank
        self.placement = placement
        self.routing_impl = inner.routing_impl
        self.batch_invariant_safe = getattr(inner, "batch_invariant_safe", False) or inner.name in ("torch", "torch_loop")
        self.tables: RoutingTables | None = None
        self.expert_counts: torch.Tensor | None = None
        self.num_recv_rows = 0
        self.timings = {"dispatch": 0.0, "experts": 0.0, "combine": 0.0}
        """Host seconds in each phase since the last `reset_counts` (device time only where the collectives
        synchronise, as gloo's do; `benchmarks/expert_parallel.py` reads them)."""

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Adopt a new placement; takes effect at the next `prepare` (the caller runs `MoE.prepare()`)."""
        if (placement.world_size, placement.num_logical_experts) != (self.placement.world_size,
                                                                     self.placement.num_logical_experts):
            raise ValueError("a new placement must keep the group size and the number of experts")
        self.placement = placement

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        if len(experts) != self.placement.num_logical_experts:
            raise ValueError(f"the placement has {self.placement.num_logical_experts} experts, the layer {len(experts)}")
        device = experts[0].w1.weight.device
        self.inner.prepare([experts[e] for e in self.placement.local_experts(self.rank)])
        self.routing_impl = self.inner.routing_impl
        self.tables = self.placement.tables(device)
        if self.expert_counts is None or self.expert_counts.device != device:
            self.expert_counts = torch.zeros(len(experts), dtype=torch.long, device=device)

    def reset_counts(self) -> None:
        self.expert_counts.zero_()
        self.num_recv_rows = 0
        self.timings = dict.fromkeys(self.timings, 0.0)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        T, k = topk_ids.shape
        tb = self.tables
        flat_e = topk_ids.reshape(-1)  # [T*k] pairs in (token, slot) order
        # replica of each pair: an expert's pairs take its replicas in turn (starting at one set by the rank)
        by_expert = torch.argsort(flat_e, stable=True)
        counts = torch.bincount(flat_e, minlength=tb.replica_count.numel())
        first = torch.cumsum(counts, 0) - counts  # [E]: where each expert's pairs start in `by_expert`
        nth = torch.empty_like(flat_e)
        nth[by_expert] = torch.arange(T * k, device=x.device) - first[flat_e[by_expert]]
        self.expert_counts += counts
        rep = (nth + self.rank) % tb.replica_count[flat_e]
        phys = tb.log2phy[flat_e, rep]  # [T*k]
        dest = tb.phy_rank[phys]
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        t0 = time.perf_counter()
        recv_x, recv_ids, handle = self.dispatcher.dispatch(x[order // k], dest[order], tb.phy_local[phys[order]])
        t1 = time.perf_counter()
        self.num_recv_rows += recv_x.shape[0]
        if recv_x.shape[0]:
            ones = torch.ones(recv_x.shape[0], 1, dtype=torch.float32, device=x.device)
            recv_y = self.inner.forward(recv_x, ones, recv_ids[:, None])  # [m, H]: one expert per row, weight 1
        else:
            recv_y = recv_x
        t2 = time.perf_counter()
        y_sent = self.dispatcher.combine(recv_y, handle)  # [T*k, H] in `order`
        tm = self.timings
        tm["dispatch"] += t1 - t0
        tm["experts"] += t2 - t1
        tm["combine"] += time.perf_counter() - t2
        if T == 0:
            return x.new_zeros(0, x.shape[1])
        y = torch.empty_like(y_sent)
        y[order] = y_sent  # back to (token, slot) order
        # home: weight, then a token's experts in ascending expert id, one add at a time (see module docstring)
        slot_order = torch.argsort(topk_ids, dim=1, stable=True)  # [T, k]
        w = topk_weights.gather(1, slot_order).to(x.dtype)  # [T, k]
        y = y.view(T, k, -1).gather(1, slot_order[:, :, None].expand(T, k, y.shape[-1]))  # [T, k, H]
        out = y[:, 0] * w[:, :1]
        for j in range(1, k):
            out = out + y[:, j] * w[:, j:j + 1]
        return out
