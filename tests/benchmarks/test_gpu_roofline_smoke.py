"""`benchmarks/gpu_roofline.py` end to end on the CPU with the tiny preset (the accounting and the report;
the H200 figures come from a GPU run)."""

from __future__ import annotations

import json

from deepinfer.benchmarks import gpu_roofline


def test_roofline_report_on_the_cpu(tmp_path):
    out = tmp_path / "r.json"
    report = gpu_roofline.main(["--config", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,3",
                                "--context", "20", "--steps", "2", "--prefill-tokens", "40", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [c["batch"] for c in saved["decode"]] == [1, 3]
    for c in report["decode"]:
        b = c["bytes"]
        assert b["total"] == b["weights_dense"] + b["weights_routed"] + b["kv_and_state"] > 0
        assert all(1 <= h <= 4 for h in c["experts_hit"])  # tiny: 4 experts, top-2
        assert c["ms_per_step"] > 0 and 0 < c["fraction_of_roofline"]
        assert "ms_per_step_graphs" not in c and any("not CUDA" in r for r in c["graph_blockers"])
    (p,) = report["prefill"]
    assert p["flops"]["total"] > p["flops"]["linear"] > 0 and p["mfu"] > 0


def test_decode_bytes_count_only_the_experts_hit():
    import torch

    from deepinfer.engine.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(gpu_roofline.CONFIGS["tiny"]())
    model = gpu_roofline.build_model(cfg, torch.device("cpu"), torch.float32)
    one = gpu_roofline.decode_bytes(model, 1, 16, [1, 1, 1, 1])
    two = gpu_roofline.decode_bytes(model, 1, 16, [2, 1, 1, 1])
    ex = model.model.layers[0].ffn.experts[0]
    assert two["total"] - one["total"] == sum(getattr(ex, w).weight.numel() * 4 for w in ("w1", "w2", "w3"))
    longer = gpu_roofline.decode_bytes(model, 1, 64, [1, 1, 1, 1])
    assert longer["kv_and_state"] > one["kv_and_state"] and longer["weights_dense"] == one["weights_dense"]


def test_published_weights_count_the_quantized_bytes_and_the_same_flops():
    """`--weights published`: the published layout's linears become `Fp8Linear` / `Fp4Linear` (their codes and
    scales are the bytes a step reads); the FLOPs stay those of the logical shapes."""
    import torch

    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear

    cfg = ModelConfig.from_hf_dict(gpu_roofline.CONFIGS["tiny"]())
    plain = gpu_roofline.build_model(cfg, torch.device("cpu"), torch.bfloat16)
    pub = gpu_roofline.build_model(cfg, torch.device("cpu"), torch.bfloat16, weights="published")
    base = gpu_roofline.build_model(cfg, torch.device("cpu"), torch.bfloat16, weights="published-base")
    ex = pub.model.layers[0].ffn.experts[0]
    assert isinstance(ex.w1, Fp4Linear) and isinstance(pub.model.layers[0].attn.wq_a, Fp8Linear)
    assert isinstance(base.model.layers[0].ffn.experts[0].w1, Fp8Linear)
    assert base.model.layers[0].ffn.experts[0].w1.scale.dtype == torch.float32  # the *-Base scales
    assert pub.model.layers[0].attn.wq_a.scale.dtype == torch.float8_e8m0fnu
    hits = [2, 2, 2, 2]
    b_plain, b_pub = (gpu_roofline.decode_bytes(m, 1, 16, hits) for m in (plain, pub))
    w1 = ex.w1
    assert b_pub["weights_routed"] == 4 * 2 * 3 * (w1.out_features * w1.in_features // 2 + w1.scale.numel())
    assert b_pub["weights_routed"] < b_plain["weights_routed"] and b_pub["weights_dense"] < b_plain["weights_dense"]
    assert gpu_roofline.prefill_flops(pub, 32) == gpu_roofline.prefill_flops(plain, 32)
    assert gpu_roofline.prefill_flops(base, 32) == gpu_roofline.prefill_flops(plain, 32)
