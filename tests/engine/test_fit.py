"""The start-up fit check (engine/fit.py) with small fake numbers, and the engine refusing before loading."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.fit import (
    MEMORY_UTILIZATION,
    ModelDoesNotFitError,
    WeightBytes,
    available_device_bytes,
    check_fit,
    checkpoint_weight_bytes,
    plan_fit,
)
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import PRESETS

MIB = 1 << 20


def _config() -> ModelConfig:
    return ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config())


def _plan(weights: WeightBytes, device_bytes: int, max_model_len: int = 256, max_num_seqs: int = 4):
    return plan_fit(_config(), weights, dtype=torch.float32, device="cuda:0", device_bytes=device_bytes,
                    max_model_len=max_model_len, block_size=64, max_num_seqs=max_num_seqs)


def test_kv_numbers_match_the_cache_allocation():
    config = _config()
    r = _plan(WeightBytes(0, 0), 1 << 40)
    cache = V4KVCache(config, 3, 64, 2)  # 3 blocks, 2 slots: every byte is a block's or a slot's
    total = sum(t.numel() * t.element_size() for t in [*cache.compressed_pools().values(),
                                                        *cache.state_tensors().values()])
    assert total == 3 * r.block_bytes + 2 * r.state_bytes_per_seq
    assert r.kv_bytes_per_token == pytest.approx(r.block_bytes / 64)  # one block holds 64 tokens' entries
    assert r.bytes_per_seq == 4 * r.block_bytes + r.state_bytes_per_seq  # 256 tokens = 4 blocks


def test_sequences_that_fit_and_the_expert_parallel_count():
    per_seq = _plan(WeightBytes(0, 0), 1 << 40).bytes_per_seq
    weights = WeightBytes(expert_bytes=300 * MIB, other_bytes=50 * MIB)
    device = int((400 * MIB + 10 * per_seq) / MEMORY_UTILIZATION) + 1
    r = _plan(weights, device)
    assert r.fits and r.num_seqs_fit == 50 * MIB // per_seq + 10
    assert r.expert_parallel_devices() == 1
    small = _plan(weights, int(200 * MIB / MEMORY_UTILIZATION))  # 200 MiB usable: the 350 MiB do not fit
    assert not small.fits and small.num_seqs_fit == 0
    # 200 MiB - 50 MiB replicated - one sequence leaves < 150 MiB for experts: 300 MiB need 3 devices
    assert small.expert_parallel_devices() == 3
    assert weights.per_device(3) + per_seq <= small.usable_bytes
    assert "expert-parallel layout needs 3 such devices" in small.summary()
    hopeless = _plan(WeightBytes(10 * MIB, 500 * MIB), int(200 * MIB / MEMORY_UTILIZATION))
    assert hopeless.expert_parallel_devices() is None and "do not fit one device" in hopeless.summary()


def test_weight_bytes_from_headers(tmp_path):
    path = make_checkpoint(tmp_path / "ck", preset="tiny", seed=0, dtype="float32")
    w32 = checkpoint_weight_bytes(path, torch.float32)
    w16 = checkpoint_weight_bytes(path, torch.bfloat16)
    config = _config()
    e, i, h = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
    assert w32.expert_bytes == config.num_hidden_layers * e * 3 * i * h * 4
    assert w16.expert_bytes * 2 == w32.expert_bytes  # experts are cast to bf16
    assert w32.other_bytes > w16.other_bytes > w32.other_bytes // 2  # the fp32-kept set and tid2eid stay


def test_check_fit_refuses_with_the_numbers():
    path = builtin_model_path()
    config = ModelConfig.from_json_file(path / "config.json")
    kwargs = dict(dtype=torch.float32, device="cpu", max_model_len=1024, block_size=64, max_num_seqs=4)
    ok = check_fit(path, config, device_bytes=1 << 34, **kwargs)
    assert ok.fits and ok.weights.total > 0
    with pytest.raises(ModelDoesNotFitError, match=r"does not fit on cpu: weights 0\.\d\d GiB .*KV budget -0\.\d\d GiB holds 0 such sequences"):
        check_fit(path, config, device_bytes=ok.weights.total, **kwargs)
    with pytest.raises(ModelDoesNotFitError, match="num_blocks=1000000000 does not fit"):
        check_fit(path, config, device_bytes=1 << 34, num_blocks=10**9, **kwargs)
    assert available_device_bytes("cpu") > 0


def test_engine_refuses_before_loading(monkeypatch):
    import deepinfer.engine.fit as fit
    import deepinfer.engine.loader as loader
    from deepinfer.engine.engine import Engine

    monkeypatch.setattr(fit, "available_device_bytes", lambda device: 1 * MIB)
    monkeypatch.setattr(loader, "load_checkpoint", lambda *a, **k: pytest.fail("loaded before the fit check"))
    with pytest.raises(ModelDoesNotFitError, match="does not fit"):
        Engine(max_num_seqs=2, max_model_len=256)


def test_refusal_lists_expert_parallel_layouts_per_device():
    per_seq = _plan(WeightBytes(0, 0), 1 << 40).bytes_per_seq
    weights = WeightBytes(expert_bytes=800 * MIB, other_bytes=40 * MIB)
    usable = 180 * MIB + 3 * per_seq  # 40 + 800/n MiB of weights beside >= 1 sequence: n = 6
    r = _plan(weights, int(usable / MEMORY_UTILIZATION) + 1)
    assert not r.fits and r.expert_parallel_devices() == 6
    assert r.expert_parallel_bytes(6) == 40 * MIB + -(-800 * MIB // 6)
    assert r.expert_parallel_bytes(8) == 140 * MIB
    assert r.expert_parallel_num_seqs(8) == (r.usable_bytes - 140 * MIB) // per_seq
    assert r.expert_parallel_num_seqs(6) >= 1 and r.expert_parallel_num_seqs(5) == 0
    text = r.summary()
    assert "on cuda:0: EP over 6: 0.17 GiB weights per device" in text
    assert f"EP over 8: 0.14 GiB weights per device, {r.expert_parallel_num_seqs(8)} sequences" in text
    big = _plan(WeightBytes(expert_bytes=8000 * MIB, other_bytes=40 * MIB), int(usable / MEMORY_UTILIZATION) + 1)
    n = big.expert_parallel_devices()
    assert n > 8 and big.summary().index("EP over 8:") < big.summary().index(f"EP over {n}:")
    assert big.expert_parallel_num_seqs(8) == 0
