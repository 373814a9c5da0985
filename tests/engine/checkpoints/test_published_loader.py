"""The loader on DeepSeek's published layout: name map, FP8/FP4 tensors kept quantized, MTP, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.loader import CheckpointError, load_checkpoint, read_checkpoint_config
from deepinfer.engine.models.deepseek_v4_weights import (
    checkpoint_spec,
    mtp_checkpoint_spec,
    official_to_spec_name,
    published_storage,
    spec_to_published_name,
)
from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import get_preset

from .conftest import VARIANTS


def _stored(path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(path / file, framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    assert set(out) == set(index)
    return out


def _copy_with(src, dst, edit_tensors=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_tensors is not None:
        weight_map = {}
        for file in sorted(dst.glob("*.safetensors")):
            tensors = load_file(file)
            edit_tensors(tensors)
            save_file(tensors, file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
        (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_name_map_round_trips_every_tensor():
    config = ModelConfig.from_hf_dict({**get_preset("tiny").hf_config(), "num_nextn_predict_layers": 1})
    names = [*checkpoint_spec(config), *mtp_checkpoint_spec(config)]
    published = [spec_to_published_name(n) for n in names]
    assert len(set(published)) == len(names)
    assert all(official_to_spec_name(p) == n for p, n in zip(published, names, strict=True))
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight",
            "layers.1.attn.compressor.norm.weight", "mtp.0.attn.kv_norm.weight", "mtp.0.e_proj.weight"} <= set(published)
    assert not any(p.startswith("model.") for p in published)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_published_layout_and_dtypes(published, name):
    path = published(name)
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1  # shards + index
    raw = json.loads((path / "config.json").read_text())
    base = VARIANTS[name].get("base", False)
    q = raw["quantization_config"]
    assert {k: q[k] for k in ("activation_scheme", "fmt", "quant_method", "scale_fmt", "weight_block_size")} == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]}
    expert_dtype = "fp8" if base else "fp4"
    assert (q if VARIANTS[name].get("expert_dtype_in") == "quantization_config" else raw)["expert_dtype"] == expert_dtype
    assert raw["topk_method"] == "noaux_tc" and "compress_ratios" in raw and "qk_rope_head_dim" in raw
    assert len(raw["compress_ratios"]) == raw["num_hidden_layers"] + raw["num_nextn_predict_layers"]
    tensors = _stored(path)
    scale_dtype = torch.float32 if base else torch.float8_e8m0fnu
    kinds = {"fp8": 0, "fp4": 0}
    for pub, t in tensors.items():
        if pub.endswith(".scale"):
            continue
        kind = published_storage(official_to_spec_name(pub), expert_dtype)
        if kind == "fp8":
            assert t.dtype == torch.float8_e4m3fn and tensors[pub.removesuffix("weight") + "scale"].dtype == scale_dtype
        elif kind == "fp4":
            s = tensors[pub.removesuffix("weight") + "scale"]
            assert t.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu and s.shape[1] * 16 == t.shape[1]
        else:
            assert t.dtype == {"fp32": torch.float32, "bf16": torch.bfloat16, "int": torch.int64}[kind], pub
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds["fp8"] > 0 and (kinds["fp4"] > 0) == (not base)
    assert any(n.startswith("mtp.0.") for n in tensors) == (VARIANTS[name].get("mtp_layers", 1) > 0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_round_trip_keeps_tensors_as_published(published, name):
    path = published(name)
    model, config = load_checkpoint(path, "bfloat16")
    state = model.state_dict()
    stored = _stored(path)
    assert {official_to_spec_name(n) for n in stored} == set(state)
    for pub, t in stored.items():
        held = state[official_to_spec_name(pub)]
        if t.dtype in (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu) or pub.endswith(".scale"):
            assert held.dtype == t.dtype and torch.equal(held.view(torch.uint8), t.view(torch.uint8)), pub
        else:
            assert torch.equal(held, t.to(held.dtype)), pub
    layer = model.model.layers[1]
    assert isinstance(layer.attn.wq_a, Fp8Linear) and isinstance(layer.ffn.shared_experts.w2, Fp8Linear)
    expert_type = Fp8Linear if VARIANTS[name].get("base") else Fp4Linear
    assert all(isinstance(e.w1, expert_type) for e in layer.ffn.experts)
    assert isinstance(layer.ffn.gate.weight, torch.nn.Parameter) and layer.ffn.gate.weight.dtype == torch.bfloat16
    assert (model.mtp is not None) == (VARIANTS[name].get("mtp_layers", 1) > 0)
    if model.mtp is not None:
        assert isinstance(model.mtp[0].e_proj, Fp8Linear)


@pytest.mark.parametrize("name", ["tiny-fp4", "tiny-base"])
def test_resident_bytes_match_checkpoint_bytes(published, name):
    path = published(name)
    model, _ = load_checkpoint(path, "bfloat16")
    stored = _stored(path)
    quantized = [(n, m) for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp4Linear))]
    assert len(quantized) > 40
    for n, m in quantized:
        pub = spec_to_published_name(n + ".weight").removesuffix("weight")
        on_disk = sum(stored[pub + s].numel() * stored[pub + s].element_size() for s in ("weight", "scale"))
        assert m.resident_nbytes() == on_disk, n
    resident = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    on_disk = sum(t.numel() * t.element_size() for t in stored.values())
    assert abs(resident - on_disk) <= 0.05 * on_disk, (resident, on_disk)


@pytest.mark.parametrize("name", ["tiny-fp4", "tiny-yarn-v41-spelling", "tiny-base"])
def test_quantized_model_matches_its_dequantized_copy(published, dequantized, name):
    """Held quantized (block-wise dequantization inside the matmul) == the dense model of the exact dequantization."""
    ours, config = load_checkpoint(published(name), "float32")
    dense, _ = load_checkpoint(dequantized(name), "float32")
    ids = torch.randint(2, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a = ModelRunnerForTests(ours, max_seqs=1, max_len=64).run([(0, ids)], logits="all")
    b = ModelRunnerForTests(dense, max_seqs=1, max_len=64).run([(0, ids)], logits="all")
    assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)


def test_both_layouts_name_the_same_model(published, dequantized):
    """The transformers layout (write_dequantized) and the published one load into the same module names."""
    a, _ = load_checkpoint(published("tiny-fp4"), "float32")
    b, _ = load_checkpoint(dequantized("tiny-fp4"), "float32")
    assert set(a.state_dict()) - set(b.state_dict()) == {n for n in a.state_dict() if n.endswith(".scale")}


# ------------------------------------------------------------------ config.json in the official spelling


def test_official_config_spelling(published):
    config, quant = read_checkpoint_config(published("tiny-fp4"))
    preset = ModelConfig.from_hf_dict(get_preset("tiny").hf_config())
    assert config.layer_types == preset.layer_types and config.mlp_layer_types == preset.mlp_layer_types
    assert config.compress_rates == preset.compress_rates and config.rope_head_dim == preset.rope_head_dim
    assert config.num_nextn_predict_layers == 1 and quant["expert_dtype"] == "fp4"
    yarn, _ = read_checkpoint_config(published("tiny-yarn-v41-spelling"))
    assert yarn.rope_compress.rope_type == "yarn" and yarn.rope_compress.factor == 4.0


def test_flash_like_config_parses():
    ratios = [0, 0] + [4, 128] * 20 + [4]  # 43 layers
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "compress_ratios": ratios + [0],
           "num_hash_layers": 3, "qk_rope_head_dim": 64, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
           "n_shared_experts": 1, "norm_topk_prob": True, "num_key_value_heads": 1, "hidden_act": "silu",
           "expert_dtype": "fp4", "num_nextn_predict_layers": 1,
           "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                            "original_max_position_embeddings": 65536}}
    config = ModelConfig.from_hf_dict(raw)
    assert len(config.layer_types) == 43 and config.layer_types[2] == "compressed_sparse_attention"
    assert config.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert config.rope_compress.rope_type == "yarn" and config.rope_compress.factor == 16
    with pytest.raises(ValueError, match="topk_method"):
        ModelConfig.from_hf_dict({**raw, "topk_method": "greedy"})
    with pytest.raises(ValueError, match="compress_ratios"):
        ModelConfig.from_hf_dict({**raw, "compress_ratios": ratios + [0, 0]})


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    "edit_config, expected",
    [
        (lambda c: c["quantization_config"].update(quant_method="mxfp4"), "quant_method 'mxfp4' is not supported"),
        (lambda c: c["quantization_config"].update(weight_block_size=[32, 32]), "served only in their own layout"),
        (lambda c: c.update(engram_layer_ids=[1]), r"Engram tables.*served only in their own layout"),
        (lambda c: c["quantization_config"].update(weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\]"),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), r"quantization_config\.fmt='e5m2'"),
        (lambda c: c["quantization_config"].update(group_size=4), r"does not understand: \['group_size'\]"),
    ],
)
def test_refused_configs(published, tmp_path, edit_config, expected):
    path = _copy_with(published("tiny-fp4"), tmp_path / "edited", edit_config=edit_config)
    with pytest.raises(CheckpointError, match=expected) as e:
        load_checkpoint(path)
    assert "config.json" in str(e.value)


def _drop(name):
    return lambda t: t.pop(name, None)


@pytest.mark.parametrize(
    "variant, edit_tensors, edit_config, expected",
    [
        ("tiny-fp4", lambda t: t.update({"layers.1.attn.wq_b.scale": torch.ones(2, 1).to(torch.float8_e8m0fnu)})
         if "layers.1.attn.wq_b.scale" in t else None, None,
         r"(?<!model\.)layers\.1\.attn\.wq_b\.scale: scale grid \[2, 1\].*expected \[1, 1\]"),
        ("tiny-fp4", lambda t: t.update({"layers.2.ffn.experts.1.w3.scale": torch.ones(32, 1).to(torch.float8_e8m0fnu)})
         if "layers.2.ffn.experts.1.w3.scale" in t else None, None, r"layers\.2\.ffn\.experts\.1\.w3\.scale: scale grid"),
        ("tiny-fp4", _drop("layers.0.attn.wkv.scale"), None, r"layers\.0\.attn\.wkv\.weight is stored F8_E4M3.*without"),
        ("tiny-base", None, lambda c: c.update(expert_dtype="fp4"), r"experts\.0\.w1\.weight is stored FP8.*expert_dtype='fp4'"),
        ("tiny-fp4", lambda t: t.update({"layers.0.attn.wq_a.scale": torch.ones(1, 1, dtype=torch.float16)})
         if "layers.0.attn.wq_a.scale" in t else None, None, r"layers\.0\.attn\.wq_a\.scale: scale dtype F16"),
    ],
)
def test_refused_tensors(published, tmp_path, variant, edit_tensors, edit_config, expected):
    path = _copy_with(published(variant), tmp_path / "edited", edit_tensors, edit_config)
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(path)


def test_make_checkpoint_cli_writes_published(tmp_path, capsys):
    from deepinfer.engine.testing.make_checkpoint import main

    out = main([str(tmp_path / "base"), "--preset", "tiny-sigmoid", "--format", "published", "--base",
                "--expert-dtype-in", "quantization_config", "--mtp-layers", "1"])
    assert "published, experts fp8, Base" in capsys.readouterr().out
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["expert_dtype"] == "fp8" and "expert_dtype" not in raw
    model, _ = load_checkpoint(out, "float32")
    assert isinstance(model.model.layers[0].ffn.experts[0].w2, Fp8Linear)
    assert model.model.layers[0].ffn.experts[0].w2.scale.dtype == torch.float32


def test_grouped_wo_a_is_one_gemm_over_the_quantized_weight(published, dequantized, monkeypatch):
    ours, config = load_checkpoint(published("tiny-wide-o"), "float32")
    attn = ours.model.layers[0].attn
    G, R = config.o_groups, config.o_lora_rank
    assert isinstance(attn.wo_a, Fp8Linear) and attn.wo_a.row_groups_usable(G)
    x = torch.randn(5, attn.wo_a.in_features * G, generator=torch.Generator().manual_seed(3))
    w = attn.wo_a.dequantized()  # [G*R, in]
    want = torch.cat([x[:, g * w.shape[1]:(g + 1) * w.shape[1]] @ w[g * R:(g + 1) * R].T for g in range(G)], dim=1)
    torch.testing.assert_close(attn.wo_a.forward_row_groups(x, G), want, atol=1e-5, rtol=1e-5)
    calls = []
    real = attn.wo_a.forward_row_groups
    monkeypatch.setattr(type(attn.wo_a), "forward_row_groups",
                        lambda self, *a, **k: calls.append(1) or real.__func__(self, *a, **k))
    dense, _ = load_checkpoint(dequantized("tiny-wide-o"), "float32")
    ids = torch.randint(2, config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    a = ModelRunnerForTests(ours, max_seqs=1, max_len=32).run([(0, ids)], logits="all")
    b = ModelRunnerForTests(dense, max_seqs=1, max_len=32).run([(0, ids)], logits="all")
    assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)
    assert len(calls) == config.num_hidden_layers  # one grouped GEMM a layer


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-fp4", "tiny-wide-o", "tiny-base"])
def test_published_on_cuda_matches_cpu(published, name):
    """Kept quantized on the GPU (Triton FP8/FP4 kernels) vs the CPU reference in the same compute dtype,
    float32 and bfloat16.

    NOTE: bf16 rounding alone moves tiny-wide-o's logits by 0.61 from float32 on the CPU (measured 2026-12-04);
    with the torch small ops the H200's bf16 run agreed with the CPU's bf16 run to 2e-6, with the fused kernels
    it sits inside that envelope (below).
    """
    config = load_checkpoint(published(name), "float32")[1]
    ids = torch.randint(2, config.vocab_size, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    ref32 = None
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 5e-2)):
        cpu, _ = load_checkpoint(published(name), dtype)
        ref = ModelRunnerForTests(cpu, max_seqs=1, max_len=64).run([(0, ids)], logits="all").float()
        scale = max(ref.abs().max().item(), 1.0)
        gpu, _ = load_checkpoint(published(name), dtype, device="cuda")
        assert isinstance(gpu.model.layers[1].attn.wq_a, Fp8Linear) and gpu.model.layers[1].attn.wq_a.weight.is_cuda
        got = ModelRunnerForTests(gpu, max_seqs=1, max_len=64).run([(0, ids)], logits="all").float().cpu()
        bound = tol * scale
        if ref32 is None:
            ref32 = ref
        else:
            # NOTE: on CUDA the fused mHC / norm+RoPE / output-projection kernels keep float32 where the CPU's torch
            # ops round to bf16 between steps (H200, 2026-12-05: GPU vs CPU bf16 0.61 on tiny-wide-o, as far as CPU
            # bf16 is from float32): bf16 is held to bf16's own rounding envelope around float32
            bound = max(bound, 1.5 * (ref - ref32).abs().max().item())
            assert (got - ref32).abs().max().item() <= bound, f"{name} {dtype} vs float32"
        assert (got - ref).abs().max().item() <= bound, f"{name} {dtype}"


def test_mtp_layer_runs_quantized_like_its_dequantized_copy(published, dequantized):
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.cache.layout import default_block_size
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk

    def mtp_logits(model, ids):
        config, T = model.config, len(ids) - 1
        block_size = default_block_size(config.compress_rates.values())
        num_blocks = -(-T // block_size)
        batch = ForwardBatch.build([ids[:T]], [SeqChunk(slot=0, block_table=list(range(num_blocks)),
                                                        num_computed_tokens=0, num_new_tokens=T)], logits="all")
        with torch.inference_mode():
            _, streams = model(batch, V4KVCache(config, num_blocks, block_size, 1), return_streams=True)
            nxt = ForwardBatch.build([ids[1:]], [SeqChunk(slot=0, block_table=[], num_computed_tokens=0,
                                                          num_new_tokens=T)], logits="all")
            return model.mtp_step(streams, nxt, model.mtp[0].make_cache(1))  # [T, vocab]

    ours, config = load_checkpoint(published("tiny-fp4"), "float32")
    dense, _ = load_checkpoint(dequantized("tiny-fp4"), "float32")
    assert isinstance(ours.mtp[0].ffn.experts[0].w1, Fp4Linear)
    ids = torch.randint(2, config.vocab_size, (22,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = mtp_logits(ours, ids), mtp_logits(dense, ids)
    assert (a - b).abs().max().item() <= 1e-4 * max(b.abs().max().item(), 1.0)
