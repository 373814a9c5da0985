"""Confidence-scheduled verification: how many of its drafts each request verifies in the next step.

Verifying a draft costs target compute whether or not it is accepted. With a confidence `c(r, i)`
per draft (the estimated probability that draft `i` of request `r` is accepted given that the ones
before it were), the probability that draft `j` is accepted is the survival product
`a(r, j) = prod_{i <= j} c(r, i)`, which never grows with `j`. Verifying the drafts with the `K`
largest survivals over all (request, position) pairs therefore keeps a prefix of every request's
drafts (ties broken by position, then request, so every rank decides the same), and the expected
number of accepted drafts is the sum of the chosen survivals. The budget `K` maximises expected
emitted tokens per unit of step time, `(num_reqs + sum of the chosen a) / cost(num_reqs + K)`, over a
step-cost table (seconds of one target forward by total verified tokens) profiled per device and
model (`step_cost.StepCostTable`: `StepCostTable.cost_fn(num_reqs)` is the `step_cost` argument);
without a table, a linear cost `1 + K / num_reqs * cost_slope` (relative units) stands in.

Confidence: the checkpoint's confidence head over the draft's MTP hidden state and softmax
statistics (`confidence`, `confidence_head.safetensors`; trained for the built-in model by
`tools/demo_model/train_confidence.py`) or, for a checkpoint without one, the draft's own probability
under the MTP layer (`MTPDrafter.propose` reports both). The acceptance rule is unchanged, so whatever
this picks, outputs stay identical to non-speculative decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deepinfer.engine.spec_decode.step_cost import StepCostTable


def survival(confidences: Sequence[float]) -> list[float]:
    """Running products `a(j) = prod_{i <= j} c(i)` of one request's draft confidences."""
    out, a = [], 1.0
    for c in confidences:
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidences are probabilities in [0, 1], got {c}")
        a *= c
        out.append(a)
    return out


def top_k_prefixes(confidences: Sequence[Sequence[float]], k: int, floor: int = 0) -> list[int]:
    """Drafts to verify per request: the `k` (request, position) pairs of largest survival, every
    request getting at least `min(floor, its drafts)`; ties go to the smaller position, then the
    smaller request index. The result is a prefix length per request (survival never grows)."""
    num = [len(c) for c in confidences]
    lengths = [min(floor, n) for n in num]
    pairs = [(-a, j, r) for r, c in enumerate(confidences) for j, a in enumerate(survival(c)) if j >= lengths[r]]
    pairs.sort()
    for _, j, r in pairs[:max(0, k - sum(lengths))]:
        lengths[r] = max(lengths[r], j + 1)
    return lengths


def choose_verify_lengths(confidences: Sequence[Sequence[float]], step_cost: Callable[[int], float] | None = None,
                          floor: int = 0, cost_slope: float = 0.05, cost_table: StepCostTable | None = None
                          ) -> list[int]:
    """The per-request number of drafts to verify next step, maximising expected emitted tokens per
    second. `step_cost(num_tokens)`: seconds of a target forward over that many verified tokens; else
    `cost_table` (a profiled `StepCostTable`, read at this step's number of requests); else
    `1 + cost_slope * num_tokens / num_reqs` (relative units)."""
    num_reqs = len(confidences)
    if num_reqs == 0:
        return []
    if step_cost is None and cost_table is not None:
        step_cost = cost_table.cost_fn(num_reqs)
    if step_cost is None:
        def step_cost(n: int) -> float:
            return 1.0 + cost_slope * n / num_reqs
    base = [min(floor, len(c)) for c in confidences]
    pairs = sorted((-a, j, r) for r, c in enumerate(confidences) for j, a in enumerate(survival(c)) if j >= base[r])
    best_k, best_rate, gain = sum(base), -1.0, sum(a for c, b in zip(confidences, base) for a in survival(c)[:b])
    k = sum(base)
    rate = (num_reqs + gain) / step_cost(num_reqs + k)
    best_rate, best_k = rate, k
    for neg_a, _, _ in pairs:
        k += 1
        gain += -neg_a
        rate = (num_reqs + gain) / step_cost(num_reqs + k)
        if rate > best_rate:
            best_rate, best_k = rate, k
    return top_k_prefixes(confidences, best_k, floor)
