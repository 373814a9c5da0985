"""The rank side of expert parallelism: installing EP MoE backends, idle steps, EPLB, load statistics.

A rank's model is the full model as loaded; `install_expert_parallel` wraps every MoE layer's backend
(the one the config chose, possibly swapped for its batch-invariant variant) in an
`ExpertParallelMoEBackend` that keeps only this rank's experts (`engine.moe.ep_backend`).

NOTE (this version): every rank still loads every expert's weights; the backend computes only its
own, and EPLB re-placement (`apply_rebalance`) therefore moves no weights (each rank re-packs from
the copy it holds). Loading only a rank's experts, and moving weights when EPLB re-places them, come
with real multi-GPU layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepinfer.engine.moe.ep_backend import AllToAllDispatcher, ExpertParallelMoEBackend, ExpertPlacement
from deepinfer.engine.moe.eplb import imbalance, rebalance


def moe_layers(model) -> list:
    """The model's MoE modules in the order its forward runs them (one per decoder layer).

    NOTE: the MTP layers' MoE are not here: speculative decoding is off with expert parallelism.
    """
    return [layer.ffn for layer in model.model.layers]


def install_expert_parallel(model, num_redundant_experts: int = 0, group=None) -> list[ExpertParallelMoEBackend]:
    """Wrap every MoE layer's backend for expert parallelism over `group` (the default group: collective
    over all ranks); the initial placement is `ExpertPlacement.contiguous`. Returns the new backends."""
    dispatcher = AllToAllDispatcher(group)
    backends = []
    for moe in moe_layers(model):
        placement = ExpertPlacement.contiguous(len(moe.experts), dispatcher.world_size, num_redundant_experts)
        moe.backend = ExpertParallelMoEBackend(moe.backend, dispatcher, placement)
        moe.prepare()
        backends.append(moe.backend)
    return backends


@torch.inference_mode()
def idle_step(model) -> None:
    """Blocks while this rank, with no tokens in the step, joins every MoE layer's dispatch and combine
    with zero rows, in forward order (the dummy batch of a rank without work).

    NOTE: inside the model's numerics context, as a forward would be: the rows this rank's experts receive
    from the other ranks must be computed with the same numerics (batch-invariant matmuls) as in a forward.
    """
    with model.numerics():
        for moe in moe_layers(model):
            w = moe.experts[0].w1.weight
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
    placement per layer (EPLB, deterministic from the summed integers) and re-prepares its experts;
    the counters restart. Returns the placements."""
    counts = torch.stack([b.expert_counts for b in backends])  # [L, E] int64 on the MoE device
    dist.all_reduce(counts)
    counts = counts.cpu().tolist()
    placements = []
    for moe, b, loads in zip(moe_layers(model), backends, counts):
        old = b.placement
        new = rebalance(loads, old.num_physical_experts, old.world_size, num_nodes=num_nodes)
        b.set_placement(new)
        moe.prepare()
        b.reset_counts()
        placements.append(new)
    return placements
