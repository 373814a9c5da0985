"""Smoke test of benchmarks/kv_store.py at a tiny size (the embedded backend, one short prompt)."""

from __future__ import annotations

from deepinfer.benchmarks.kv_store import main


def test_kv_store_benchmark_smoke(tmp_path):
    res = main(["--mb", "4", "--backends", "embedded", "--lengths", "256", "--sessions", "300",
                "--dir", str(tmp_path), "--json", str(tmp_path / "out.json")])
    bw = res["bandwidth"][0]
    assert bw["backend"] == "embedded" and bw["write_gbps"] > 0 and bw["read_gbps"] > 0
    assert res["bytes_per_token_v4_flash"] == {"bf16": 6584.0, "fp8": 3292.0}
    (row,) = res["ttft"]
    assert row["store_loaded_tokens"] == 192 and row["cold_s"] > 0 and row["store_hit_s"] > 0
    chat = res["ttl_simulation"]["chat"]
    assert chat["7.0"] >= chat["3.0"] >= chat["1.0"]
    assert (tmp_path / "out.json").exists()
