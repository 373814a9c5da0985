"""config.json is parsed once per process (`engine.config.read_config_json`), and the loader alone decides
about quantization (`engine.loader.read_checkpoint_config`), so every stage accepts the same checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deepinfer.engine.config import ModelConfig, read_config_json
from deepinfer.engine.loader import CheckpointError, read_checkpoint_config
from deepinfer.engine.testing.make_checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cfg"), preset="tiny", seed=0)


def test_parsed_once_until_the_file_changes(tmp_path, monkeypatch):
    file = tmp_path / "config.json"
    file.write_text(json.dumps({"a": 1}))
    reads = []
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: reads.append(self) or original(self, *a, **k))
    first = read_config_json(tmp_path)
    first["a"] = 2  # callers get a copy: the cached parse stays intact
    assert read_config_json(file) == {"a": 1} and len(reads) == 1
    file.write_text(json.dumps({"a": 10}))
    os.utime(file, ns=(1, 1))  # a different version even within the clock's resolution
    assert read_config_json(tmp_path) == {"a": 10} and len(reads) == 2


def test_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        read_config_json(tmp_path)


def test_the_loader_alone_decides_about_quantization(tmp_path, tiny):
    raw = read_config_json(tiny)
    path = tmp_path / "quant"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "awq"}}))
    ModelConfig.from_json_file(path)  # the model's shape is valid; the weights' storage is not its business
    with pytest.raises(CheckpointError, match="quant_method 'awq' is not supported"):
        read_checkpoint_config(path)
    config, quant = read_checkpoint_config(tiny)
    assert quant is None and config == ModelConfig.from_json_file(tiny)


def test_auto_backends_resolve_for_the_device_the_mode_and_the_model():
    """`attention_backend` / `moe_backend` "auto" (the default): the fused Triton backends on a CUDA device, the torch
    references on the CPU; in batch-invariant mode on CUDA the Triton backends too (the mode swaps them for its
    variants); DeepSeek-V4.1 keeps the torch backends (its static-decode graphs are opt-in)."""
    from deepinfer.engine.config import ModelConfig, V41Config
    from deepinfer.engine.engine import EngineConfig, resolve_backends
    from deepinfer.engine.testing.presets import get_preset
    from deepinfer.kernels import mhc

    v4 = ModelConfig.from_hf_dict(get_preset("tiny").hf_config())
    v41 = V41Config.from_hf_dict({"model_type": "deepseek_v41", "text_config": dict(_tiny_v41_text())})
    cpu = resolve_backends(EngineConfig(), v4)
    assert (cpu.attention_backend, cpu.moe_backend) == ("torch", "torch")
    explicit = EngineConfig(attention_backend="triton", moe_backend="torch_loop")
    assert resolve_backends(explicit, v4) is explicit  # nothing "auto": untouched
    triton = "triton" if mhc.triton is not None else "torch"
    gpu = resolve_backends(EngineConfig(device="cuda"), v4)
    assert (gpu.attention_backend, gpu.moe_backend) == (triton, triton)
    gpu41 = resolve_backends(EngineConfig(device="cuda"), v41)
    assert (gpu41.attention_backend, gpu41.moe_backend) == ("torch", "torch")
    bi = resolve_backends(EngineConfig(device="cuda", batch_invariant=True), v4)  # the mode's Triton variants
    assert (bi.attention_backend, bi.moe_backend) == (triton, triton)
    bi_cpu = resolve_backends(EngineConfig(batch_invariant=True), v4)
    assert (bi_cpu.attention_backend, bi_cpu.moe_backend) == ("torch", "torch")
    bi41 = resolve_backends(EngineConfig(device="cuda", batch_invariant=True), v41)
    assert (bi41.attention_backend, bi41.moe_backend) == ("torch", "torch")


def _tiny_v41_text() -> dict:
    from tests.engine.v41.configs import tiny_config

    return tiny_config()["text_config"]
