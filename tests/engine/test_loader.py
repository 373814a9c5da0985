"""Checkpoint format, random checkpoints and the loader (engine/loader.py).

The lower-level tests run against `SpecModule`, a dummy module whose state_dict follows
`checkpoint_spec`; the tests marked `needs_model` use the real `DeepseekV4ForCausalLM` and skip only
while engine/models/deepseek_v4.py does not exist.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import weakref
from pathlib import Path

import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import deepinfer.engine.loader as loader_mod
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.loader import CheckpointError, WeightLoader, load_checkpoint, load_weights, meta_parameters
from deepinfer.engine.models.deepseek_v4_weights import FP32_KEPT_PATTERNS, checkpoint_spec, is_fp32_kept
from deepinfer.engine.testing.make_checkpoint import main as make_checkpoint_main
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import CSA, HCA, PRESETS, SLIDING

HAS_MODEL = importlib.util.find_spec("deepinfer.engine.models.deepseek_v4") is not None
needs_model = pytest.mark.skipif(not HAS_MODEL, reason="engine/models/deepseek_v4.py does not exist yet")
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")

_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I64": torch.int64}


class SpecModule(nn.Module):
    """A stand-in model: one parameter (floats) or buffer (ints) per spec entry, nothing else."""

    def __init__(self, spec):
        super().__init__()
        for name, s in spec.items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            if s.dtype.is_floating_point:
                module.register_parameter(leaf, nn.Parameter(torch.empty(s.shape, dtype=s.dtype)))
            else:
                module.register_buffer(leaf, torch.empty(s.shape, dtype=s.dtype))


def headers(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), sl.get_dtype())
    return out


def read_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def config_of(path: Path) -> ModelConfig:
    return ModelConfig.from_json_file(path)


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint `src` to `dst` as one model.safetensors after `edit(tensors)` changes the dict."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    tensors = read_all(src)
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def dummy_load(path: Path, dtype="float32") -> SpecModule:
    try:
        config = config_of(path)
    except (ValueError, FileNotFoundError):
        config = ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config())  # let the loader report it
    with meta_parameters():
        model = SpecModule(checkpoint_spec(config, dtype))
    return load_weights(model, path, dtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_sharded(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny_sharded", "tiny", seed=0, max_shard_size="200KB")


# ---------------------------------------------------------------------------- format and writers


@needs_hf
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_both_writers_match_the_spec(tmp_path, preset, dtype):
    ours = make_checkpoint(tmp_path / "ours", preset, seed=3, dtype=dtype)
    hf = make_checkpoint(tmp_path / "hf", preset, seed=3, dtype=dtype, writer="hf")
    spec = checkpoint_spec(config_of(ours), dtype)
    expected = {n: (s.shape, {v: k for k, v in _ST_DTYPES.items()}[s.dtype]) for n, s in spec.items()}
    assert headers(ours) == expected
    assert headers(hf) == expected
    assert config_of(hf) == config_of(ours)
    if preset.startswith("tiny"):
        hf_tensors, our_tensors = read_all(hf), read_all(ours)
        for name, t in our_tensors.items():
            assert torch.equal(hf_tensors[name], t), name


@needs_hf
@pytest.mark.parametrize("preset", ["tiny", "tiny-sigmoid", "tiny-yarn"])
def test_transformers_loads_our_checkpoint(tmp_path, preset):
    from transformers import DeepseekV4ForCausalLM

    path = make_checkpoint(tmp_path / preset, preset, seed=1, max_shard_size="300KB")
    model, info = DeepseekV4ForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = read_all(path)
    torch.testing.assert_close(model.model.embed_tokens.weight, ours["model.embed_tokens.weight"], rtol=0, atol=0)
    inter = PRESETS[preset].config["moe_intermediate_size"]
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj[1]  # [2 * inter, hidden]: w1 then w3
    assert torch.equal(gate_up[:inter], ours["model.layers.0.ffn.experts.1.w1.weight"])
    assert torch.equal(gate_up[inter:], ours["model.layers.0.ffn.experts.1.w3.weight"])


def test_spec_fp32_set_and_int_table():
    config = ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config())
    spec = checkpoint_spec(config, "bfloat16")
    kept = {n for n, s in spec.items() if s.dtype == torch.float32}
    assert kept == {n for n in spec if is_fp32_kept(n)}
    assert "model.layers.1.attn.indexer.compressor.ape" in kept and "model.layers.2.ffn.gate.bias" in kept
    assert "model.layers.1.attn.indexer.weights_proj.weight" not in kept  # HF keeps it bf16
    assert spec["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert "model.layers.0.ffn.gate.bias" not in spec and "model.layers.2.ffn.gate.tid2eid" not in spec
    assert len(FP32_KEPT_PATTERNS) == len(set(FP32_KEPT_PATTERNS))
    tied = checkpoint_spec(ModelConfig.from_hf_dict(PRESETS["tiny-sigmoid"].hf_config()))
    assert "head.weight" not in tied and "head.weight" in spec


def test_random_weights_are_seeded_and_nontrivial(tmp_path, tiny):
    again = read_all(make_checkpoint(tmp_path / "again", "tiny", seed=0))
    other = read_all(make_checkpoint(tmp_path / "other", "tiny", seed=1))
    base = read_all(tiny)
    for name, t in base.items():
        assert torch.equal(again[name], t), name
        assert not torch.equal(other[name], t), name
        if t.is_floating_point() and t.numel() > 1:
            assert t.std() > 0.01, f"{name} is (nearly) constant"
    tid2eid = base["model.layers.0.ffn.gate.tid2eid"]
    assert tid2eid.min() >= 0 and tid2eid.max() < PRESETS["tiny"].config["n_routed_experts"]
    assert all(len(set(row.tolist())) == tid2eid.shape[1] for row in tid2eid), "expert ids in a row must differ"
    bf16 = read_all(make_checkpoint(tmp_path / "bf16", "tiny", seed=0, dtype="bfloat16"))
    assert torch.equal(bf16["model.layers.1.attn.wq_a.weight"], base["model.layers.1.attn.wq_a.weight"].bfloat16())


def test_presets_cover_the_architecture():
    configs = {n: ModelConfig.from_hf_dict(p.hf_config()) for n, p in PRESETS.items()}
    layer_types = {t for c in configs.values() for t in c.layer_types}
    assert layer_types == {SLIDING, CSA, HCA}
    assert {t for c in configs.values() for t in c.mlp_layer_types} == {"hash_moe", "moe"}
    assert {c.scoring_func for c in configs.values()} == {"sqrtsoftplus", "sigmoid", "softmax"}
    assert any(c.tie_word_embeddings for c in configs.values())
    assert any(c.rope_compress.rope_type == "yarn" for c in configs.values())
    for name, c in configs.items():
        assert c.hc_mult > 1, name
        assert math.lcm(*c.compress_rates.values()) <= 32, name
        assert c.sliding_window <= 32, name
        assert c.index_topk < 128 // c.compress_rates[CSA], name  # a 128-token prompt makes top-k select
        assert ModelConfig.from_hf_dict(PRESETS[name].hf_config()) == c  # presets are not mutated


def test_cli_writes_sharded_checkpoint(tmp_path, capsys):
    out = make_checkpoint_main([str(tmp_path / "cli"), "--preset", "tiny", "--max-shard-size", "100KB", "--seed", "2"])
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    assert "tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        make_checkpoint_main([str(out), "--preset", "tiny"])  # not empty, no --overwrite
    assert set(dummy_load(out).state_dict()) == set(checkpoint_spec(config_of(out)))


# ---------------------------------------------------------------------------- loading


def test_load_weights_into_module_and_spec(tiny):
    stored = read_all(tiny)
    model = dummy_load(tiny)
    for name, t in model.state_dict().items():
        assert torch.equal(t, stored[name]), name
    state = load_weights(checkpoint_spec(config_of(tiny)), tiny)
    assert set(state) == set(stored)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(checkpoint_spec(config_of(tiny)), tiny, dtype="bfloat16")


def test_bf16_load_keeps_the_fp32_set(tiny):
    stored = read_all(tiny)
    model = dummy_load(tiny, "bfloat16")
    for name, t in model.state_dict().items():
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
        elif is_fp32_kept(name):
            assert t.dtype == torch.float32, name
            assert torch.equal(t, stored[name])
        else:
            assert t.dtype == torch.bfloat16, name
            assert torch.equal(t, stored[name].bfloat16())
    assert any(is_fp32_kept(n) for n in stored) and any(not is_fp32_kept(n) for n in stored)


def test_sharded_checkpoints_load(tiny, tiny_sharded, tmp_path):
    assert len(json.loads((tiny_sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 100
    assert len(list(tiny_sharded.glob("model-*-of-*.safetensors"))) > 1
    a, b = dummy_load(tiny).state_dict(), dummy_load(tiny_sharded).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    if importlib.util.find_spec("transformers") is not None:
        hf = make_checkpoint(tmp_path / "hf", "tiny", seed=0, writer="hf", max_shard_size="200KB")
        assert (hf / "model.safetensors.index.json").exists()
        c = dummy_load(hf).state_dict()
        assert all(torch.equal(a[n], c[n]) for n in a)


def test_loader_streams_one_tensor_at_a_time(tiny, monkeypatch):
    """Every raw tensor read from disk is released before the next read: peak RAM ~ model size."""
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("loader must use safe_open"))
    alive: list[weakref.ref] = []
    max_alive = 0
    real_safe_open = loader_mod.safe_open

    class CountingHandle:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def get_tensor(self, name):
            nonlocal max_alive
            max_alive = max(max_alive, sum(r() is not None for r in alive))
            t = self.inner.get_tensor(name)
            if not is_fp32_kept(name) and t.is_floating_point():  # these get converted to bf16
                alive.append(weakref.ref(t))
            return t

    monkeypatch.setattr(loader_mod, "safe_open", lambda *a, **k: CountingHandle(real_safe_open(*a, **k)))
    model = dummy_load(tiny, "bfloat16")
    assert len(alive) > 50 and max_alive == 0
    assert next(model.parameters()).device.type == "cpu"


def test_official_names_and_mtp_keys(tiny, tmp_path):
    def to_official(t):
        for ours, official in [
            ("model.embed_tokens.weight", "embed.weight"),
            ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_fn", "hc_head_fn"),
            ("model.hc_head.hc_base", "hc_head_base"),
            ("model.hc_head.hc_scale", "hc_head_scale"),
        ]:
            t[official] = t.pop(ours)
        for name in [n for n in t if n.startswith("model.layers.")]:
            t[name.removeprefix("model.")] = t.pop(name)
        t["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)

    path = rewrite(tiny, tmp_path / "official", to_official)
    a, b = dummy_load(tiny).state_dict(), dummy_load(path).state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    loader = WeightLoader(path, checkpoint_spec(config_of(path)))
    assert loader.skipped_names == ["mtp.0.attn.wq_a.weight"]
    assert loader.checkpoint_names["model.embed_tokens.weight"] == "embed.weight"


def test_progress_bar_only_for_large_checkpoints(tiny, monkeypatch):
    spec = checkpoint_spec(config_of(tiny))
    assert not WeightLoader(tiny, spec).show_progress
    assert WeightLoader(tiny, spec, progress=True).show_progress
    monkeypatch.setattr(loader_mod, "PROGRESS_MIN_TENSORS", 10)
    assert WeightLoader(tiny, spec).show_progress


# ---------------------------------------------------------------------------- errors


def _edit_case(tmp_path, tiny, edit) -> CheckpointError:
    path = rewrite(tiny, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as e:
        dummy_load(path)
    return e.value


def test_missing_tensors(tmp_path, tiny):
    err = _edit_case(tmp_path, tiny, lambda t: t.pop("model.layers.1.attn.wkv.weight"))
    assert "missing 1 tensor" in str(err) and "model.layers.1.attn.wkv.weight" in str(err)


def test_many_missing_tensors_are_counted(tmp_path, tiny):
    def drop_experts(t):
        for name in [n for n in t if n.startswith("model.layers.2.ffn.experts.")]:
            t.pop(name)

    msg = str(_edit_case(tmp_path, tiny, drop_experts))
    assert "missing 12 tensor(s)" in msg and "and 2 more" in msg and "model.layers.2.ffn.experts.0.w1.weight" in msg


def test_unexpected_tensor(tmp_path, tiny):
    err = _edit_case(tmp_path, tiny, lambda t: t.update({"model.layers.0.attn.extra.weight": torch.zeros(3)}))
    assert "unexpected" in str(err) and "model.layers.0.attn.extra.weight" in str(err)


def test_wrong_shape(tmp_path, tiny):
    name = "model.layers.1.attn.wq_a.weight"
    msg = str(_edit_case(tmp_path, tiny, lambda t: t.update({name: t[name].T.contiguous()})))
    assert name in msg and "[64, 32]" in msg and "expected [32, 64]" in msg


def test_wrong_dtypes(tmp_path, tiny):
    name, table = "model.layers.1.attn.wq_a.weight", "model.layers.0.ffn.gate.tid2eid"

    def edit(t):
        t[name] = t[name].to(torch.int32)
        t[table] = t[table].float()

    msg = str(_edit_case(tmp_path, tiny, edit))
    assert f"{name}: dtype I32" in msg and f"{table}: dtype F32" in msg and "integer" in msg


def test_int_table_widened_and_range_checked(tmp_path, tiny):
    table = "model.layers.0.ffn.gate.tid2eid"
    path = rewrite(tiny, tmp_path / "i32", lambda t: t.update({table: t[table].to(torch.int32)}))
    assert dummy_load(path).get_buffer(table).dtype == torch.int64

    def out_of_range(t):
        t[table] = t[table].clone()
        t[table][5, 0] = 99

    msg = str(_edit_case(tmp_path, tiny, out_of_range))
    assert table in msg and "99" in msg and "n_routed_experts" in msg


def test_float_storage_any_float_dtype_is_cast(tmp_path, tiny):
    name = "model.layers.1.attn.wq_a.weight"
    path = rewrite(tiny, tmp_path / "f16", lambda t: t.update({name: t[name].half()}))
    assert dummy_load(path).get_parameter(name).dtype == torch.float32


def test_broken_index(tmp_path, tiny_sharded):
    path = tmp_path / "broken"
    shutil.copytree(tiny_sharded, path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is not valid JSON"):
        dummy_load(path)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        dummy_load(path)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors\.index\.json"):
        dummy_load(path)


def test_index_points_to_missing_shard(tmp_path, tiny_sharded):
    path = tmp_path / "lost"
    shutil.copytree(tiny_sharded, path)
    lost = sorted(path.glob("model-*.safetensors"))[-1]
    lost.unlink()
    with pytest.raises(CheckpointError, match=lost.name):
        dummy_load(path)


def test_index_and_shard_disagree(tmp_path, tiny_sharded):
    path = tmp_path / "disagree"
    shutil.copytree(tiny_sharded, path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{name} \\(-> {shards[1]}\\)"):
        dummy_load(path)


def test_no_safetensors_and_damaged_files(tmp_path, tiny):
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(tiny / "config.json", path / "config.json")
    with pytest.raises(CheckpointError, match="no safetensors files"):
        dummy_load(path)
    (path / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        dummy_load(path)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_weights(SpecModule({}), tmp_path / "nowhere")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_weights(SpecModule({}), path)


@pytest.mark.parametrize(
    "quant, expected",
    [
        # (issue 21: DeepSeek's FP8 layout loads now, see tests/engine/checkpoints; V4.1's 32x32 blocks only in
        # V4.1's own layout, tests/engine/v41)
        ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}, "served only in their own layout"),
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ],
)
def test_unsupported_quantization_config(tmp_path, tiny, quant, expected):
    path = tmp_path / "quant"
    shutil.copytree(tiny, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(CheckpointError, match=expected) as e:
        dummy_load(path)
    assert "quantization_config" in str(e.value) and "config.json" in str(e.value)


def test_fp8_tensors(tmp_path, tiny):
    scale = "model.layers.1.attn.wq_a.scale"
    # (issue 21: quantized tensors load with DeepSeek's quantization_config; without one they are refused)
    err = _edit_case(tmp_path, tiny, lambda t: t.update({scale: torch.ones(1, 1)}))
    assert "quantized tensors without a quantization_config" in str(err) and scale in str(err)
    name = "model.layers.1.attn.wq_b.weight"
    err = _edit_case(tmp_path / "2", tiny, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    assert "quantized tensors without a quantization_config" in str(err) and name in str(err)


def test_model_that_disagrees_with_the_spec(tiny):
    spec = checkpoint_spec(config_of(tiny))
    spec.pop("model.layers.3.attn.wo_b.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.attn\.wo_b\.weight") as e:
        load_weights(SpecModule(spec), tiny)
    assert "SpecModule.state_dict() does not match checkpoint_spec" in str(e.value)


# ---------------------------------------------------------------------------- the real model


@needs_model
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_model_state_dict_is_the_spec(preset):
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = ModelConfig.from_hf_dict(PRESETS[preset].hf_config())
    with meta_parameters():
        model = DeepseekV4ForCausalLM(config)
    state = model.state_dict()
    spec = checkpoint_spec(config)
    assert sorted(state) == sorted(spec)
    assert {n: tuple(t.shape) for n, t in state.items()} == {n: s.shape for n, s in spec.items()}


@needs_model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_checkpoint_real_model(tiny, dtype):
    model, config = load_checkpoint(tiny, dtype=dtype)
    assert config == config_of(tiny) and not model.training
    stored, spec = read_all(tiny), checkpoint_spec(config, dtype)
    state = model.state_dict()
    for name, s in spec.items():
        assert state[name].dtype == s.dtype, name
        assert torch.equal(state[name], stored[name].to(s.dtype)), name
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


@needs_model
@needs_hf
def test_load_checkpoint_from_hf_writer(tmp_path):
    path = make_checkpoint(tmp_path / "hf", "tiny-sigmoid", seed=5, dtype="bfloat16", writer="hf")
    model, _ = load_checkpoint(path, dtype="bfloat16")
    stored = read_all(path)
    for name, t in model.state_dict().items():
        assert torch.equal(t, stored[name]), name
