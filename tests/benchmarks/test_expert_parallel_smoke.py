"""benchmarks/expert_parallel.py on tiny sizes: the `moe` benchmark's two gloo ranks measure EPLB bringing a skewed
workload's imbalance down (the issue 25 target, <= 1.10), and the balance benchmark's pure parts (trace, perfect
split). The cluster part runs real processes for minutes and is not run here."""

from __future__ import annotations

import argparse

from deepinfer.benchmarks.expert_parallel import format_moe, make_trace, perfect_split, run_moe


def test_moe_benchmark_eplb_meets_the_imbalance_target():
    args = argparse.Namespace(ranks=2, experts=16, topk=4, redundant=4, hidden=32, inter=16, tokens=32, layers=2,
                              zipf=1.2, steps=6, seed=0, timeout_s=120.0)
    r = run_moe(args)
    before = [lay["imbalance"] for lay in r["contiguous"]["layers"]]
    after = [lay["imbalance"] for lay in r["eplb"]["layers"]]
    assert len(before) == len(after) == 2 and all(b >= 1.0 for b in before)
    assert max(after) <= 1.10 and sum(after) < sum(before)
    for phase in ("contiguous", "eplb"):  # every (token, expert) pair was computed by some rank, in both phases
        assert all(sum(lay["rows_per_rank"]) == 2 * 6 * 32 * 4 for lay in r[phase]["layers"])
    assert all(sorted(set(p)) == list(range(16)) and len(p) == 20 for p in r["eplb_placements"])
    assert "| eplb | 1 |" in format_moe(r)


def test_trace_is_bursty_and_the_perfect_split_is_balanced():
    args = argparse.Namespace(num_requests=10, bursts=3, prompt_len="8:16", output_len="4:40", seed=1)
    trace = make_trace(args)
    assert [r["burst"] for r in trace] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(8 <= len(r["prompt"]) <= 16 and 4 <= r["max_tokens"] <= 40 for r in trace)
    shares = perfect_split([r["max_tokens"] for r in trace], 2)
    assert sorted(i for s in shares for i in s) == list(range(10))
    totals = [sum(trace[i]["max_tokens"] for i in s) for s in shares]
    assert max(totals) - min(totals) <= max(r["max_tokens"] for r in trace)
    assert perfect_split([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]
