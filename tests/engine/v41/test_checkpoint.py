"""`make_checkpoint --format published-v41`: a tiny V4.1 checkpoint in the published tensor layout (FP8 with
32x32 UE8M0 blocks, FP4 experts, FP8 Engram tables with 1x32 row scales), its round trip through
`deepseek_v41.load_published`, and the paged engine's loader reading it (and refusing DSpark stages without target layers)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deepinfer.engine.config import V41Config
from deepinfer.engine.loader import CheckpointError, read_checkpoint_config
from deepinfer.engine.models.deepseek_v41 import load_published, published_storage
from deepinfer.engine.quant.formats import dequant_fp8_block
from deepinfer.engine.testing.make_checkpoint import (
    TINY_V41_TEXT_CONFIG,
    make_checkpoint,
    random_v41_model,
)
from tests.engine.v41.reference import Reference


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41") / "ck", format="published-v41", seed=5)


def _stored(path):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_published_layout(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "deepseek_v41" and config["text_config"]["model_type"] == "deepseek_v41_text"
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    st = _stored(ckpt)
    assert st["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert st["layers.0.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert tuple(st["layers.0.attn.wq_b.scale"].shape) == (128 // 32, 32 // 32)  # [out/32, in/32]
    assert st["layers.0.ffn.experts.1.w2.weight"].dtype == torch.int8  # FP4, two per byte
    assert tuple(st["layers.4.engram.embed.weight"].shape) == (138, 32)
    assert tuple(st["layers.4.engram.embed.scale"].shape) == (138, 1)
    assert st["layers.3.hc_ffn_fn"].dtype == torch.float32 and st["layers.3.attn.attn_sink"].dtype == torch.float32
    assert st["layers.2.attn.compressor.wgate.weight"].dtype == torch.bfloat16
    assert "layers.5.attn.compressor.wgate.weight" not in st and "layers.3.attn.compressor.wkv.weight" not in st
    assert "layers.4.attn.indexer.wk.weight" not in st and "hc_head_fn" not in st
    assert published_storage("layers.1.engram.wkv.weight") == "fp8"


def test_round_trip(ckpt):
    """load_published dequantizes exactly; the weights are the random model's up to quantization."""
    model = load_published(ckpt)
    st = _stored(ckpt)
    loaded = model.state_dict()
    torch.testing.assert_close(loaded["layers.0.attn.wkv.weight"],
                               dequant_fp8_block(st["layers.0.attn.wkv.weight"], st["layers.0.attn.wkv.scale"], (32, 32)),
                               rtol=0, atol=0)
    original = random_v41_model(V41Config.from_json_file(ckpt), seed=5).state_dict()
    for name in ("layers.0.attn.wkv.weight", "layers.1.engram.embed.weight", "layers.2.ffn.experts.0.w3.weight",
                 "layers.2.attn.compressor.wkv.weight", "layers.0.hc_attn_fn"):
        err = (loaded[name] - original[name]).abs().max() / original[name].abs().max()
        assert err < 0.2, (name, float(err))
    torch.testing.assert_close(loaded["layers.0.hc_attn_fn"], original["layers.0.hc_attn_fn"], rtol=0, atol=0)


def test_loaded_checkpoint_matches_reference(ckpt):
    model = load_published(ckpt)
    cfg = model.config
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,),
                              generator=torch.Generator().manual_seed(2))
    model.set_engram_token_map(token_map)
    ids = torch.randint(3, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model.forward_full(ids)
        want = Reference(cfg, model.state_dict(), token_map).forward(ids[None])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_engine_loader_reads_it_as_v41(ckpt, tmp_path):
    """The engine's loader accepts the text-only tiny V4.1 (a `V41Config`); it still refuses what is not built."""
    config, quant = read_checkpoint_config(ckpt)
    assert isinstance(config, V41Config) and quant["weight_block_size"] == [32, 32]
    raw = json.loads((ckpt / "config.json").read_text())
    # DSpark stages load now (tests/engine/v41/test_dspark.py); stages without the layers that feed them do not
    raw["text_config"].update(num_nextn_predict_layers=1, dspark_block_size=4,
                              compress_ratios=raw["text_config"]["compress_ratios"] + [0])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"DeepSeek-V4.1.*Not served yet:.*DSpark.*dspark_target_layer_ids"):
        read_checkpoint_config(tmp_path)


def test_tiny_config_is_valid_and_fp8_aligned():
    cfg = V41Config.from_hf_dict({"model_type": "deepseek_v41", "text_config": TINY_V41_TEXT_CONFIG})
    assert cfg.hidden_size % 32 == 0 and cfg.engram_head_dim % 32 == 0
