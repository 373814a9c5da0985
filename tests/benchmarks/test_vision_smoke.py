"""Smoke run of `benchmarks/vision.py` with minimal counts: every part (encode at batch 1 and 8, TTFT,
vision 1 -> 2) runs end to end through real processes and the JSON has the expected shape. No timing
assertions: the figures of a 2-core CI machine are not the benchmark's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytest.importorskip("PIL")

ROOT = Path(__file__).resolve().parents[2]


def test_vision_benchmark_minimal_run(tmp_path):
    out = tmp_path / "vision.json"
    cmd = [sys.executable, "-m", "deepinfer.benchmarks.vision", "--images", "2", "--ttft-repeats", "1", "--requests", "2",
           "--concurrency", "2", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    for batch in ("batch1", "batch8"):
        assert res["encode"][batch]["images"] == 2 and res["encode"][batch]["images_per_s"] > 0
    assert set(res["ttft"]["median_ms"]) == {"image", "text_same_length", "text_without_image"}
    assert set(res["scaling"]) == {"vision1", "vision2"}
    assert sum(res["scaling"]["vision2"]["images_encoded_by"].values()) == 2
