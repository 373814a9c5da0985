"""`benchmarks/op_inventory` on the CPU: a decode step's launch sites per layer with the CUDA op choices.

Run as `python -m deepinfer.benchmarks.op_inventory` in a subprocess: `TRITON_INTERPRET=1` must be set before
triton is imported, and this process may have imported it already."""

from __future__ import annotations

import json

import pytest

from tests.kernels._kernel_checks import run_module_interpreted


def test_inventory_counts_the_cuda_kernels_of_every_layer(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "inv.json"
    run_module_interpreted("deepinfer.benchmarks.op_inventory", "--batch", "2", "--context", "24", "--json", str(out))
    report = json.loads(out.read_text())
    layers = report["layers"]
    for label in ("layer0 (SWA)", "layer2 (CSA)", "layer3 (HCA)"):
        ops = layers[label]["ops"]
        # the CUDA defaults ran (not the torch references): fused decode attention, mHC, MoE kernels
        for kernel, calls in (("triton._decode_attn_kernel", 1), ("triton._mhc_mix_split_kernel", 2),
                              ("triton._moe_up_kernel", 1)):
            assert ops.get(kernel) == calls, (label, kernel, ops)
        assert not any(n in ops for n in ("aten.view", "aten.empty", "aten.t")), ops  # no kernel: not counted
        assert layers[label]["total"] == sum(ops.values())
    assert "triton._indexer_scores_kernel" in layers["layer2 (CSA)"]["ops"]  # only the CSA layer indexes
    assert "triton._indexer_scores_kernel" not in layers["layer3 (HCA)"]["ops"]
    assert report["total"] == sum(v["total"] for v in layers.values())
