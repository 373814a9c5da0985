"""Smoke run of `benchmarks/serving.py` on a minimal sweep (tiny preset, 4 requests, one rate):
every part runs end to end and the results JSON and the plots have the expected shape. No timing
assertions: the figures of a 2-core CI machine are not the benchmark's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")

ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_minimal_sweep(tmp_path):
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "deepinfer.benchmarks.serving", "--preset", "tiny", "--rates", "8", "--num-requests", "4",
           "--prompt-len", "8:40", "--output-len", "3:6", "--warmup", "1", "--colocated-threads", "1",
           "--overhead-requests", "2", "--overhead-prompt-len", "16", "--nixl-mb", "0.5", "--nixl-reps", "1",
           "--json", str(out), "--plot-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())

    assert set(res["modes"]) == {"disaggregated", "colocated_t1"}
    for mode in res["modes"].values():
        (point,) = mode["points"]
        assert point["rate"] == 8.0
        s = point["summary"]
        assert s["num_completed"] == 4 and s["num_failed"] == 0
        assert s["num_output_tokens"] == res["workload"]["num_output_tokens_per_point"]
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(s[key]) == {"p50", "p99", "mean", "n"} and s[key]["p50"] > 0
        assert s["output_tokens_per_s"] > 0 and s["requests_per_s"] > 0

    over = res["overhead_max_tokens_1"]
    assert over["entrypoint"]["n"] == 2 and over["workers_direct"]["total"]["n"] == 2
    assert set(over["workers_direct"]) == {"total", "reserve", "prefill", "start"}
    assert over["offline_engine"]["n"] == 4
    assert "added_by_entrypoint_and_balancers_ms_p50" in over

    kv = res["kv_transfer_in_sweep"]
    assert kv["num_requests_sent"] == 6  # readiness probe + 1 warm-up + 4
    assert kv["kv_transfer_sends_done_total"] == kv["num_requests_sent"] and kv["kv_transfer_sends_failed_total"] == 0
    nixl = res["nixl_vs_memcpy"]
    assert nixl["bytes_intact"] is True
    for case in ("nixl_contiguous", "nixl_scattered", "torch_copy", "torch_index_copy"):
        assert nixl[f"{case}_gbps"] > 0
    assert res["machine"]["num_cpus_used"] >= 1 and res["date_utc"]
    for name in ("ttft", "itl", "throughput"):
        assert (tmp_path / f"serving_{name}.png").stat().st_size > 0
