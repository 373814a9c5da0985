"""The rank side of expert parallelism: installing EP MoE backends, idle steps, EPLB, load statistics.

A rank's model holds only its own routed experts: the loader reads just the experts of the initial
placement (`held_experts`, passed as `load_checkpoint(routed_experts=...)`; the others are
`engine.loader.AbsentExpert`s, never read), and `install_expert_parallel` wraps every MoE layer's
backend (the one the config chose, swapped for its batch-invariant variant when asked) in an
`ExpertParallelMoEBackend` that hands its inner backend only those experts
(`engine.moe.ep_backend`), before the backends are first prepared (so no rank ever packs another's
experts). Quantized (FP8 / FP4) experts stay quantized.

EPLB re-placement (`apply_rebalance`) moves weights: every rank computes the same new placement from
the summed loads; each expert a rank gains is sent by the lowest rank that held it (point-to-point,
raw bytes, so any dtype travels), experts a rank loses become `AbsentExpert`s, and the layer is
re-prepared. Replicas and moved copies are byte copies, so outputs do not change.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.engine.moe.ep_backend import AllToAllDispatcher, ExpertParallelMoEBackend, ExpertPlacement
from deepinfer.engine.moe.eplb import imbalance, rebalance


def moe_layers(model) -> list:
    """The model's MoE modules in the order its forward runs them (one per decoder layer).

    NOTE: the MTP layers' MoE are not here: their experts are whole on every rank (`engine.distributed.spec`).
    """
    return [layer.ffn for layer in model.model.layers]


def held_experts(num_layers: int, num_experts: int, world_size: int, rank: int,
                 num_redundant_experts: int = 0) -> dict[int, list[int]]:
    """Per decoder layer, the routed experts rank `rank` holds under the initial (contiguous) placement: the
    `routed_experts` argument of `engine.loader.load_checkpoint` for that rank."""
    placement = ExpertPlacement.contiguous(num_experts, world_size, num_redundant_experts)
    return dict.fromkeys(range(num_layers), placement.local_experts(rank))


def rank_load_kwargs(model_config, world_size: int, rank: int, num_redundant_experts: int = 0,
                     batch_invariant: bool = False, load_mtp: bool = False) -> dict:
    """The `engine.loader.load_checkpoint` keyword arguments that load rank `rank`'s share of an expert-parallel
    instance: only its routed experts (`held_experts`), and its EP backends installed before the first
    prepare (so no rank ever packs experts it does not hold). `load_mtp` (speculative decoding on): the MTP
    layers too, with all their experts, their MoE running locally (`engine.distributed.spec`)."""
    def before_prepare(model) -> None:
        install_expert_parallel(model, num_redundant_experts, world_size=world_size, rank=rank,
                                batch_invariant=batch_invariant, prepare=False)

    return dict(routed_experts=held_experts(model_config.num_hidden_layers, model_config.n_routed_experts, world_size,
                                            rank, num_redundant_experts),
                before_prepare=before_prepare, load_mtp=load_mtp)


def install_expert_parallel(model, num_redundant_experts: int = 0, group=None, *, world_size: int | None = None,
                            rank: int | None = None, batch_invariant: bool = False,
                            prepare: bool = True) -> list[ExpertParallelMoEBackend]:
    """Wrap every MoE layer's backend for expert parallelism over `group` (the default group: collective
    over all ranks); the initial placement is `ExpertPlacement.contiguous`. Returns the new backends.

    `world_size`/`rank` given: callable before the group is joined (the loader's `before_prepare` hook, with
    `prepare=False`: the model's `prepare_for_inference` prepares next). `batch_invariant`: the inner backend
    is the batch-invariant variant of the model's (`engine.batch_invariant`), since the mode's later swap sees
    only the wrapper. Idempotent: a model already wrapped returns its backends.
    """
    existing = ep_backends(model)
    if existing is not None:
        return existing
    dispatcher = AllToAllDispatcher(group, world_size=world_size, rank=rank)
    backends = []
    for moe in moe_layers(model):
        inner = moe.backend
        if batch_invariant:
            from deepinfer.engine.batch_invariant import _swap_moe

            inner = _swap_moe(inner)
        placement = ExpertPlacement.contiguous(len(moe.experts), dispatcher.world_size, num_redundant_experts)
        moe.backend = ExpertParallelMoEBackend(inner, dispatcher, placement)
        if prepare:
            moe.prepare()
        backends.append(moe.backend)
    return backends


def ep_backends(model) -> list[ExpertParallelMoEBackend] | None:
    """The model's expert-parallel backends per MoE layer, or None when it is not wrapped."""
    backends = [moe.backend for moe in moe_layers(model)]
    return backends if all(isinstance(b, ExpertParallelMoEBackend) for b in backends) else None


def held_experts_of(model) -> list[list[int]]:
    """Per MoE layer: the routed experts whose weights this process holds (not `AbsentExpert`s)."""
    return [[e for e, ex in enumerate(moe.experts) if not getattr(ex, "is_absent", False)] for moe in moe_layers(model)]


def held_expert_bytes(model) -> int:
    """Bytes of the routed-expert weights this process holds (its own experts; absent ones count zero)."""
    seen, total = set(), 0
    for moe in moe_layers(model):
        for ex in moe.experts:
            for t in _expert_tensors(ex):
                key = (t.untyped_storage().data_ptr(), t.storage_offset())
                if t.numel() and key not in seen:
                    seen.add(key)
                    total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def idle_step(model) -> None:
    """Blocks while this rank, with no tokens in the step, joins every MoE layer's dispatch and combine
    with zero rows, in forward order (the dummy batch of a rank without work).

    NOTE: inside the model's numerics context, as a forward would be: the rows this rank's experts receive
    from the other ranks must be computed with the same numerics (batch-invariant matmuls) as in a forward.
    """
    with model.numerics():
        for moe in moe_layers(model):
            w = moe.gate.weight
            H, k = moe.gate.weight.shape[1], moe.gate.topk
            x = torch.zeros(0, H, dtype=moe.gate.weight.dtype, device=w.device)
            moe.backend(x, torch.zeros(0, k, dtype=torch.float32, device=w.device),
                        torch.zeros(0, k, dtype=torch.long, device=w.device))


@dataclass
class LayerLoad:
    """One MoE layer's load since the last reset, as one rank measured it."""

    expert_counts: list[int]
    """(token, expert) pairs of this rank's tokens per logical expert."""
    num_recv_rows: int
    """Rows this rank's experts computed (tokens received, any rank's)."""


def layer_loads(backends: list[ExpertParallelMoEBackend], reset: bool = False) -> list[LayerLoad]:
    """This rank's `LayerLoad` per MoE layer; `reset` zeroes the counters afterwards."""
    out = [LayerLoad(b.expert_counts.tolist(), b.num_recv_rows) for b in backends]
    if reset:
        for b in backends:
            b.reset_counts()
    return out


def imbalance_of(per_rank_loads: list[list[LayerLoad]]) -> list[float]:
    """Per MoE layer: max / mean rows computed per rank (`per_rank_loads[rank][layer]`)."""
    num_layers = len(per_rank_loads[0])
    return [imbalance([float(r[i].num_recv_rows) for r in per_rank_loads]) for i in range(num_layers)]


def apply_rebalance(model, backends: list[ExpertParallelMoEBackend], num_nodes: int = 1) -> list[ExpertPlacement]:
    """Blocks while every rank (a collective) sums the measured expert counts, computes the same new
    placement per layer (EPLB, deterministic from the summed integers), receives the experts it gains from
    the ranks holding them (`move_experts`) and re-prepares its experts; the counters restart. Returns the
    placements."""
    counts = torch.stack([b.expert_counts for b in backends])  # [L, E] int64 on the MoE device
    dist.all_reduce(counts)
    counts = counts.cpu().tolist()
    placements = []
    for moe, b, loads in zip(moe_layers(model), backends, counts):
        old = b.placement
        new = rebalance(loads, old.num_physical_experts, old.world_size, num_nodes=num_nodes)
        move_experts(moe, old, new, b.rank)
        b.set_placement(new)
        moe.prepare()
        b.reset_counts()
        placements.append(new)
    return placements


def _expert_tensors(expert) -> list[torch.Tensor]:
    """An expert's tensors in a fixed order (by name): what travels when it moves."""
    named = dict(expert.named_parameters())
    named.update(expert.named_buffers())
    return [named[n] for n in sorted(named)]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _empty_like_expert(template):
    """A new expert module of `template`'s structure with fresh (uninitialised, contiguous) tensors."""
    new = copy.copy(template)
    new._parameters = {n: None if p is None else nn.Parameter(torch.empty_like(p, memory_format=torch.contiguous_format),
                                                              requires_grad=False)
                       for n, p in template._parameters.items()}
    new._buffers = {n: None if b is None else torch.empty_like(b, memory_format=torch.contiguous_format)
                    for n, b in template._buffers.items()}
    new._modules = {n: None if m is None else _empty_like_expert(m) for n, m in template._modules.items()}
    return new


def move_experts(moe, old: ExpertPlacement, new: ExpertPlacement, rank: int, group=None) -> None:
    """Blocks while the ranks exchange the routed experts of one MoE layer for a placement change (every rank
    calls it with the same `old` and `new`): each expert rank d gains is sent by the lowest rank holding it
    under `old`; experts this rank no longer holds become `AbsentExpert`s (their memory is freed once the
    backend re-prepares). The caller then sets the placement and re-prepares the layer.

    NOTE: tensors travel as raw bytes (FP8 / FP4 / scales included); the send and receive lists are built in
    the same order on every rank (destination, expert, tensor name), so each pair of ranks matches up.
    """
    from deepinfer.engine.loader import AbsentExpert

    W = old.world_size
    old_held = [set(old.local_experts(r)) for r in range(W)]
    new_held = [set(new.local_experts(r)) for r in range(W)]
    template = moe.experts[min(old_held[rank])]
    device = moe.gate.weight.device
    ops, keep_alive, received = [], [], {}
    for dst in range(W):
        for e in sorted(new_held[dst] - old_held[dst]):
            src = min(r for r in range(W) if e in old_held[r])
            if src == rank:
                for t in _expert_tensors(moe.experts[e]):
                    buf = _as_bytes(t.detach().contiguous())
                    keep_alive.append(buf)
                    ops.append(dist.P2POp(dist.isend, buf, dst, group))
            elif dst == rank:
                received[e] = _empty_like_expert(template)
                for t in _expert_tensors(received[e]):
                    ops.append(dist.P2POp(dist.irecv, _as_bytes(t.data), src, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for e, module in received.items():
        moe.experts[e] = module
    for e in old_held[rank] - new_held[rank]:
        moe.experts[e] = AbsentExpert(template.limit, device)
