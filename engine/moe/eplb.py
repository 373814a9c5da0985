"""Expert-parallel load balancing (EPLB): where each routed expert's replicas go, from measured loads.

With expert parallelism a rank's MoE time is set by the tokens its experts receive, and the step waits
for the busiest rank. Routing is skewed (a few hot experts), so an even split of the experts leaves
most ranks idle behind one. EPLB adds `num_redundant_experts` replicas of the hottest experts and packs
the replicas onto ranks so that every rank receives about the same number of tokens; the router then
spreads a replicated expert's tokens over its replicas (`engine.moe.ep_backend`).

The algorithm follows the family DeepSeek published with V3 (the `EPLB` repository's description; this
is an independent implementation):

* **replicate**: start from one slot per expert; give each extra slot to the expert with the largest
  load per replica (greedy, ties to the lower expert id);
* **pack**: sort items by load (descending) and put each on the least-loaded pack that still has room
  (every pack takes the same number of items), so packs end with near-equal loads;
* **hierarchical** (`num_groups % num_nodes == 0`): pack the expert *groups* onto nodes first (so a
  token's group-limited routing stays inside few nodes, which keeps inter-node traffic down), then
  replicate within each node and pack the node's slots onto its ranks;
* **global** (otherwise, e.g. one group or groups that do not divide over nodes): replicate over all
  ranks at once and pack the slots onto the ranks.

Two replicas of one expert are kept off the same rank when another rank with room has the same load.
The imbalance metric is max / mean tokens per rank (1.0 is perfect), `imbalance`.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.engine.moe.ep_backend import ExpertPlacement


def replicate(loads: Sequence[float], num_slots: int) -> list[int]:
    """The item of each of `num_slots` slots: every item once, then the extra slots to the item with the
    largest load per replica so far (greedy). Returned as a list of item ids, items first in order."""
    n = len(loads)
    if num_slots < n:
        raise ValueError(f"{num_slots} slots cannot hold {n} experts")
    count = [1] * n
    slots = list(range(n))
    for _ in range(num_slots - n):
        best = max(range(n), key=lambda i: (loads[i] / count[i], -i))
        count[best] += 1
        slots.append(best)
    return slots


def balanced_packing(loads: Sequence[float], num_packs: int, keys: Sequence[int] | None = None) -> list[list[int]]:
    """Indices of `loads` per pack: `len(loads) // num_packs` items each, heaviest first onto the least
    loaded pack with room (ties: a pack not yet holding an item of the same `keys[i]`, then the lower pack)."""
    n = len(loads)
    if n % num_packs:
        raise ValueError(f"{n} items cannot be split evenly over {num_packs} packs")
    cap = n // num_packs
    keys = list(range(n)) if keys is None else list(keys)
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    pack_load = [0.0] * num_packs
    for i in sorted(range(n), key=lambda i: (-loads[i], i)):
        open_packs = [p for p in range(num_packs) if len(packs[p]) < cap]
        p = min(open_packs, key=lambda p: (pack_load[p], any(keys[j] == keys[i] for j in packs[p]), p))
        packs[p].append(i)
        pack_load[p] += loads[i]
    return packs


def _place_on_ranks(experts: Sequence[int], loads: Sequence[float], num_slots: int, num_ranks: int) -> list[list[int]]:
    """Replicate `experts` (logical ids with `loads`) into `num_slots` slots and pack them onto `num_ranks`
    ranks; per rank its logical experts (ascending)."""
    slots = replicate(loads, num_slots)  # local item index per slot
    count = [slots.count(i) for i in range(len(experts))]
    slot_loads = [loads[i] / count[i] for i in slots]
    packs = balanced_packing(slot_loads, num_ranks, keys=slots)
    return [sorted(experts[slots[s]] for s in pack) for pack in packs]


def rebalance(loads: Sequence[float], num_physical_experts: int, num_ranks: int, num_groups: int = 1,
              num_nodes: int = 1) -> ExpertPlacement:
    """The placement of one MoE layer for measured per-expert `loads` (tokens per logical expert).

    `num_physical_experts` = experts + redundant replicas (a multiple of `num_ranks`); `num_groups`: the
    model's expert groups (group-limited routing; 1 without); `num_nodes`: nodes the ranks span (ranks
    `[n * R/N, (n+1) * R/N)` on node n). Hierarchical when the groups divide over the nodes, else global.
    """
    E = len(loads)
    if num_physical_experts % num_ranks or num_ranks % num_nodes or E % num_groups:
        raise ValueError(f"cannot place {E} experts in {num_groups} groups on {num_physical_experts} slots over "
                         f"{num_ranks} ranks on {num_nodes} nodes: slots must divide over ranks, ranks over nodes "
                         "and experts over groups")
    loads = [float(x) for x in loads]
    if num_groups % num_nodes:
        num_groups, num_nodes = 1, 1  # global policy
    group_size = E // num_groups
    group_loads = [sum(loads[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_groups = balanced_packing(group_loads, num_nodes)
    ranks_per_node, slots_per_node = num_ranks // num_nodes, num_physical_experts // num_nodes
    phy2log: list[int] = []
    for groups in node_groups:
        experts = [e for g in sorted(groups) for e in range(g * group_size, (g + 1) * group_size)]
        for rank_experts in _place_on_ranks(experts, [loads[e] for e in experts], slots_per_node, ranks_per_node):
            phy2log += rank_experts
    return ExpertPlacement(tuple(phy2log), E, num_ranks)


def rank_loads(loads: Sequence[float], placement: ExpertPlacement) -> list[float]:
    """Tokens per rank when each expert's load is split evenly over its replicas."""
    cnt = placement.replica_count()
    S = placement.slots_per_rank
    out = [0.0] * placement.world_size
    for p, e in enumerate(placement.phy2log):
        out[p // S] += loads[e] / cnt[e]
    return out


def imbalance(per_rank: Sequence[float]) -> float:
    """max / mean of per-rank loads (1.0: perfectly balanced; 1.0 as well when nothing was routed)."""
    mean = sum(per_rank) / len(per_rank)
    return max(per_rank) / mean if mean > 0 else 1.0
