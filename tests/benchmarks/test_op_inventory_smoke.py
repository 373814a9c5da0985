"""`benchmarks/op_inventory` on the CPU: a decode step's launch sites per layer with the CUDA op choices.

Run as `python -m deepinfer.benchmarks.op_inventory` in a subprocess: `TRITON_INTERPRET=1` must be set before
triton is imported, and this process may have imported it already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_inventory_counts_the_cuda_kernels_of_every_layer(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "inv.json"
    run = subprocess.run([sys.executable, "-m", "deepinfer.benchmarks.op_inventory", "--batch", "2", "--context", "24",
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    layers = report["layers"]
    for label in ("layer0 (SWA)", "layer2 (CSA)", "layer3 (HCA)"):
        ops = layers[label]["ops"]
        # the CUDA defaults ran (not the torch references): fused decode attention, mHC, MoE kernels
        for kernel, calls in (("triton._decode_attn_kernel", 1), ("triton._mhc_mix_kernel", 2),
                              ("triton._moe_up_kernel", 1)):
            assert ops.get(kernel) == calls, (label, kernel, ops)
        assert not any(n in ops for n in ("aten.view", "aten.empty", "aten.t")), ops  # no kernel: not counted
        assert layers[label]["total"] == sum(ops.values())
    assert "triton._indexer_scores_kernel" in layers["layer2 (CSA)"]["ops"]  # only the CSA layer indexes
    assert "triton._indexer_scores_kernel" not in layers["layer3 (HCA)"]["ops"]
    assert report["total"] == sum(v["total"] for v in layers.values())
