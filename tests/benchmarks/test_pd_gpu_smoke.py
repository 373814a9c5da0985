"""`benchmarks/pd_gpu.py --smoke` end to end on the CPU (tiny preset, float32, two short prompt lengths): both
modes run, each request's KV transfer is counted, and the JSON has the shape the GPU run fills. No timing
assertions: the figures of a 2-core CI machine are not the benchmark's (the H200's come from
deploy/device/pd_gpu.sh)."""

from __future__ import annotations

import json

import pytest

from deepinfer.benchmarks import pd_gpu

pytest.importorskip("nixl")


def test_pd_gpu_smoke_on_the_cpu(tmp_path):
    out = tmp_path / "pd.json"
    report = pd_gpu.main(["--smoke", "--json", str(out), "--keep-logs", str(tmp_path / "logs")])
    saved = json.loads(out.read_text())
    assert saved["cases"] == json.loads(json.dumps(report["cases"]))
    assert saved["engine"]["device"] == "cpu" and saved["config"] == "tiny"
    assert [c["prompt_len"] for c in saved["cases"]] == [16, 80]
    for case in saved["cases"]:
        assert len(case["colocated"]["ttft_s"]) == 1 and case["colocated"]["ttft_s"][0] > 0
        (req,) = case["disaggregated"]
        assert req["num_tokens"] == 3 and 0 < req["ttft_s"] <= req["e2e_s"]
        assert req["transfer_bytes"] > 0 and req["transfer_s"] > 0
        assert req["vram_to_vram_bytes"] == 0  # the CPU's pools are host memory
        s = case["summary"]
        assert s["all_bytes_vram_to_vram"] is False and s["transfer_ms_p50"] > 0
        assert set(s["workers_direct_ms_p50"]) == {"total", "reserve", "prefill", "start"}
    # a longer prompt moves more blocks (the bounded-state slot is the same size)
    assert saved["cases"][1]["summary"]["transfer_bytes"] > saved["cases"][0]["summary"]["transfer_bytes"]
    stats = saved["prefill_stats"]
    assert stats["kv_transfer_sends_failed_total"] == 0
    assert stats["kv_transfer_sent_bytes_dram_to_dram_total"] == stats["kv_transfer_sent_bytes_total"]
    assert (tmp_path / "logs" / "prefill.err").exists()
    table = pd_gpu.format_table(saved).splitlines()
    assert len(table) == 2 + 2 and table[2].startswith("| 16 |") and "| no |" in table[2]
