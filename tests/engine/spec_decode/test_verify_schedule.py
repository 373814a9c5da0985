"""The confidence-scheduled verify budget on synthetic confidences and step costs."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.spec_decode.verify_schedule import choose_verify_lengths, survival, top_k_prefixes


def test_survival_is_a_running_product():
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    with pytest.raises(ValueError, match="probabilities"):
        survival([1.5])


def test_top_k_keeps_a_prefix_per_request_and_breaks_ties_by_position_then_request():
    conf = [[0.9, 0.9, 0.1], [0.5, 1.0, 1.0], [0.95, 0.2, 0.9]]
    # survivals: r0 .9 .81 .081; r1 .5 .5 .5; r2 .95 .19 .171
    assert top_k_prefixes(conf, 3) == [2, 0, 1]
    assert top_k_prefixes(conf, 4) == [2, 1, 1]
    assert top_k_prefixes(conf, 6) == [2, 3, 1]  # r1's tied survivals come position by position
    assert top_k_prefixes([[0.5], [0.5]], 1) == [1, 0]  # a tie at one position: the smaller request
    assert top_k_prefixes(conf, 0, floor=1) == [1, 1, 1]
    assert top_k_prefixes([[], [0.1, 0.1]], 0, floor=1) == [0, 1]
    rng = random.Random(0)
    for _ in range(50):
        conf = [[rng.random() for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 6))]
        k = rng.randint(0, 20)
        lengths = top_k_prefixes(conf, k)
        assert sum(lengths) == min(k, sum(len(c) for c in conf))
        chosen = [a for c, n in zip(conf, lengths) for a in survival(c)[:n]]
        left = [a for c, n in zip(conf, lengths) for a in survival(c)[n:]]
        assert not chosen or not left or min(chosen) >= max(left)


def test_budget_trades_expected_tokens_against_step_cost():
    conf = [[0.95, 0.9, 0.9], [0.1, 0.9, 0.9], [0.6, 0.5, 0.5]]
    # free verification: everything; very expensive verification: only the floor
    assert choose_verify_lengths(conf, step_cost=lambda n: 1.0) == [3, 3, 3]
    assert choose_verify_lengths(conf, step_cost=lambda n: float(n) ** 2, floor=1) == [1, 1, 1]
    assert choose_verify_lengths(conf, step_cost=lambda n: float(n) ** 2, floor=0) == [0, 0, 0]
    mid = choose_verify_lengths(conf, step_cost=lambda n: 1.0 + 0.1 * n, floor=0)
    assert mid[0] == 3 and mid[1] == 0  # confident drafts are verified, a likely miss is not
    assert choose_verify_lengths([]) == []
