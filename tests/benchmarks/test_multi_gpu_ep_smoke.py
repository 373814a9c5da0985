"""`benchmarks/multi_gpu_ep.py` (issue 30's one-call multi-GPU run) end to end on the CPU: `--quick` with 2 gloo
ranks runs every step (all-to-all, checkpoint, the three engines), EP and EPLB keep the greedy tokens, and the
report and its markdown carry every figure. The H200 figures come from the device run."""

from __future__ import annotations

import json

import pytest

from deepinfer.benchmarks import multi_gpu_ep


def test_compare_and_checkpoint_config():
    assert multi_gpu_ep.compare([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == {"equal": False,
                                                                           "first_difference": [None, 1]}
    assert multi_gpu_ep.compare([[1, 2]], [[1, 2, 3]])["first_difference"] == [2]
    for ranks in (1, 2, 3, 4, 8):
        cfg = multi_gpu_ep.ckpt_config(ranks, quick=False)
        assert cfg["n_routed_experts"] % ranks == 0 and cfg["n_routed_experts"] >= 16
        assert (cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]) == (4096, 2048, 129280)
        assert multi_gpu_ep.ckpt_config(ranks, quick=True)["n_routed_experts"] % ranks == 0


@pytest.mark.slow
def test_quick_run_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "r.json"
    report = multi_gpu_ep.main(["--device", "cpu", "--quick", "--ranks", "2", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["steps"].keys() == {"alltoall", "copy_rate", "checkpoint", "engine_one", "engine_ep", "engine_ep_eplb"}
    assert all(s["ok"] for s in saved["steps"].values()), saved["steps"]
    corr = report["correctness"]  # batch-invariant on the CPU: bit-identical greedy tokens
    assert corr["ep_vs_one"]["equal"] and corr["eplb_vs_no_eplb"]["equal"] and corr["ep_eplb_vs_one"]["equal"]
    assert all(x >= 1.0 for x in corr["imbalance_no_eplb"])
    cases = report["alltoall"]["cases"]
    assert [c["tokens_per_rank"] for c in cases] == [1, 4, 32] and cases[-1]["phase"] == "prefill"
    for c in cases:  # every (token, expert) pair computed by some rank; every phase timed
        assert sum(c["recv_rows_per_rank"]) == pytest.approx(2 * c["tokens_per_rank"] * 2)
        assert c["dispatch_ms"] > 0 and c["experts_ms"] > 0 and c["combine_ms"] > 0
    assert [d["per_gpu_batch"] for d in report["decode"]] == [1, 2]
    for d in report["decode"]:
        for side, ranks in (("one", 1), ("ep", 2)):
            x = d[side]
            assert x["tokens_per_step"] == x["requests"] == d["per_gpu_batch"] * ranks  # every request running
            assert x["tokens_per_s_per_gpu"] > 0 and 0 < x["fraction_of_roofline"] < 1
    text = multi_gpu_ep.format_report(report)
    assert "| EP 2 vs one process | True |" in text and "| prefill | 32 |" in text and "| 2 |" in text
