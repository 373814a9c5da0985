"""`benchmarks/v41_decoder_replay`: the CPU smoke run of its medium shape over two prompt lengths, and its
V4.1-Flash-width shape (`--shape flash`, the H200 run's) valid as a V4.1 config at Flash's widths."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the GPU run's; compressors stay float32
def test_two_lengths_report_one_run_each_with_less_work_replayed(tmp_path, dtype):
    from deepinfer.benchmarks.v41_decoder_replay import main

    res = main(["--prompt-len", "48,80", "--chunk", "32", "--layers", "6", "--hidden", "64", "--window", "16",
                "--reps", "1", "--threads", "1", "--dtype", dtype, "--json", str(tmp_path / "r.json")])
    assert [r["prompt_len"] for r in res["runs"]] == [48, 80]
    for r in res["runs"]:
        # the layers after the last KV source see only the last window: fewer FLOPs with replay on
        assert r["cases"]["on"]["flops"] < r["cases"]["off"]["flops"]
        assert r["last_logits_max_abs_diff"] >= 0 and r["cases"]["on"]["median_s"] > 0
    assert (tmp_path / "r.json").exists()


def test_flash_shape_is_a_valid_v41_config_at_flash_widths():
    from deepinfer.benchmarks.v41_decoder_replay import flash_config
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.models.deepseek_v41 import DeepseekV41ForCausalLM

    text = flash_config(10, 8, 128)
    cfg = V41Config.from_hf_dict({"model_type": "deepseek_v41", "text_config": text})
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.moe_intermediate_size) == (5120, 64, 512, 2304)
    assert cfg.kv_source_layer_ids == (2, 5) and cfg.compress_ratios[-1] == 1
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert 5e9 < params < 8e9  # ~13 GB in bfloat16: fits one H200 with room for a 32k prompt's activations
