"""The start-up memory plan with speculative decoding (engine/fit.py, `speculative=`): an expert-parallel rank holds
the MTP layers whole when speculation is on (and none of them when it is off), and the drafter's per-slot state (V4's
MTP window cache, V4.1's DSpark `dspark_keys` rings) is counted. Measured against what the CPU builds: the loaded
ranks' tensors and the drafters' allocations."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.distributed.expert_parallel import rank_load_kwargs
from deepinfer.engine.engine import Engine
from deepinfer.engine.fit import (
    MEMORY_UTILIZATION,
    ModelDoesNotFitError,
    WeightBytes,
    check_fit,
    checkpoint_weight_bytes,
    plan_fit,
)
from deepinfer.engine.loader import load_checkpoint, read_checkpoint_config
from deepinfer.engine.testing.make_checkpoint import _write_ours, make_checkpoint, random_weights
from deepinfer.engine.testing.make_checkpoint import main as make_checkpoint_main
from deepinfer.engine.testing.presets import PRESETS

MIB = 1 << 20
HF = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8, "num_nextn_predict_layers": 1}


@pytest.fixture(scope="module")
def v4_published(tmp_path_factory):
    """Published layout (FP8 linears, FP4 routed experts kept as stored) with one MTP layer, 8 experts."""
    return make_checkpoint(tmp_path_factory.mktemp("fit_pub"), preset={**HF, "num_nextn_predict_layers": 0},
                           seed=3, format="published", mtp_layers=1)


@pytest.fixture(scope="module")
def v4_float(tmp_path_factory):
    """deepinfer's float32 layout with one MTP layer (loaded in bfloat16: the fp32-kept set stays float32)."""
    out = tmp_path_factory.mktemp("fit_f32")
    _write_ours(out, HF, random_weights(ModelConfig.from_hf_dict(HF), torch.float32, seed=6, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


@pytest.fixture(scope="module")
def v41_dspark(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit_v41")
    return str(make_checkpoint_main([str(out), "--format", "published-v41", "--dspark", "--seed", "3",
                                     "--overwrite"]))


def _held_bytes(module) -> int:
    """Bytes of the weights `module` holds (its state dict; shared tensors once, absent experts hold none)."""
    seen, total = set(), 0
    for t in module.state_dict(keep_vars=True).values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _tightest(plan) -> int:
    """The least device bytes on which `plan` (made without speculation) still fits one sequence of max_model_len."""
    need = plan.rank_weight_bytes + plan.blocks_per_seq * plan.block_bytes + plan.num_slots * plan.state_bytes_per_seq
    return int(need / MEMORY_UTILIZATION) + 1


def _plan(path, config, dtype, **kw):
    w = checkpoint_weight_bytes(path, dtype)
    return plan_fit(config, w, dtype=dtype, device="cuda:0", device_bytes=1 << 40, max_model_len=128, block_size=64,
                    max_num_seqs=4, **kw)


@pytest.mark.parametrize("which,dtype", [("v4_published", torch.float32), ("v4_float", torch.bfloat16)])
def test_rank_weight_bytes_equal_what_the_ranks_load(request, which, dtype):
    """One device, and each rank of EP 2 (and EP 4 with 4 redundant experts) with and without speculation: the
    plan's weight bytes are the loaded model's, byte for byte; speculation adds the whole MTP layer per rank."""
    path = request.getfixturevalue(which)
    mc, _ = read_checkpoint_config(path)
    full, _ = load_checkpoint(path, dtype=dtype)
    assert full.mtp is not None and _held_bytes(full) == _plan(path, mc, dtype).rank_weight_bytes
    for ep, redundant, ranks in ((2, 0, (0, 1)), (4, 4, (3,))):
        for speculative in (None, "mtp"):
            plan = _plan(path, mc, dtype, expert_parallel_size=ep, num_redundant_experts=redundant,
                         speculative=speculative)
            for rank in ranks:
                # the engine's own loading rule (`Engine.__init__`, `engine.distributed.worker`)
                part, _ = load_checkpoint(path, dtype=dtype, **rank_load_kwargs(
                    mc, ep, rank, redundant, load_mtp=speculative is not None))
                assert bool(part.mtp) == (speculative is not None)
                assert _held_bytes(part) == plan.rank_weight_bytes, (ep, rank, speculative)
    w = checkpoint_weight_bytes(path, dtype)
    assert w.mtp_bytes == _held_bytes(full.mtp) > w.mtp_expert_bytes > 0
    with_mtp = _plan(path, mc, dtype, expert_parallel_size=2, speculative="mtp")
    assert with_mtp.rank_weight_bytes - w.per_rank(2, mc.n_routed_experts) == w.mtp_bytes  # what the old plan missed


def test_v41_dspark_stages_are_the_mtp_bytes(v41_dspark):
    """V4.1's DSpark stages (`mtp.*`) are what the plan counts as MTP layers: their bytes as loaded (FP8 / FP4 kept),
    whole on an expert-parallel rank with speculation, left out without."""
    config, _ = read_checkpoint_config(v41_dspark)
    from deepinfer.engine.models.deepseek_v41 import dequantized_at_load, kept_float32

    w = checkpoint_weight_bytes(v41_dspark, torch.bfloat16, dequantized_at_load, kept_float32)
    model, _ = load_checkpoint(v41_dspark, dtype="bfloat16")
    assert len(model.mtp) == config.num_nextn_predict_layers == 3
    assert _held_bytes(model) == w.total and _held_bytes(model.mtp) == w.mtp_bytes > w.mtp_expert_bytes > 0
    kw = dict(dtype=torch.bfloat16, device="cuda:0", device_bytes=1 << 40, max_model_len=64, block_size=8,
              max_num_seqs=4, expert_parallel_size=2, engram_placement="device")
    on, off = plan_fit(config, w, speculative="dspark", **kw), plan_fit(config, w, **kw)
    assert on.rank_weight_bytes - off.rank_weight_bytes == w.mtp_bytes


def test_mtp_drafter_state_equals_its_allocation(v4_float):
    """`speculative="mtp"` in one process: the drafter's window cache is what the plan counts, and the engine's
    cache plus the drafter's state are the plan's bytes for the blocks and slots it allocated."""
    engine = Engine(model=v4_float, max_num_seqs=3, max_model_len=128, dtype="bfloat16", speculative="mtp")
    fit, cache = engine.fit, engine.spec.drafter.cache
    allocated = sum(t.numel() * t.element_size() for t in (*cache.compressed_pools().values(),
                                                           *cache.state_tensors().values()))
    assert fit.drafter_state_bytes_per_seq == 8 * 32 * 2  # one MTP layer: window 8 x head_dim 32, bf16
    assert fit.drafter_state_bytes == allocated == 3 * fit.drafter_state_bytes_per_seq
    main = sum(t.numel() * t.element_size() for t in (*engine.cache.compressed_pools().values(),
                                                      *engine.cache.state_tensors().values()))
    assert main + allocated == engine.cache.num_blocks * fit.block_bytes + 3 * fit.state_bytes_per_seq + allocated
    assert "mtp drafter state" in fit.summary() and "for 3 slots" in fit.summary()
    assert Engine(model=v4_float, max_num_seqs=3, max_model_len=128).fit.drafter_state_bytes == 0


def test_dspark_drafter_state_equals_its_rings(v41_dspark):
    """`speculative="dspark"`: the `dspark_keys` rings (a cache state pool) are the plan's drafter state, the dummy
    slot's rings included."""
    engine = Engine(model=v41_dspark, max_num_seqs=4, max_model_len=64, block_size=8, dtype="bfloat16",
                    speculative="dspark")
    fit, rings = engine.fit, engine.spec.drafter.rings
    config = engine.model_config
    assert engine.cache.tensors["dspark_keys"] is rings
    per_slot = config.num_nextn_predict_layers * config.sliding_window * config.head_dim * 2
    assert fit.drafter_state_bytes_per_seq == per_slot and fit.drafter_fixed_bytes == per_slot
    assert fit.drafter_state_bytes == rings.numel() * rings.element_size() == 5 * per_slot
    assert "dspark drafter state" in fit.summary()


def test_speculation_shrinks_the_cache_or_refuses_where_the_old_plan_accepted(v4_published):
    """EP 2 with speculation: the old plan (the MTP layer absent, no drafter state) accepted a device that holds
    one sequence; the new one refuses it, naming the MTP layers and the drafter. With room, the cache shrinks by
    exactly those bytes."""
    mc, _ = read_checkpoint_config(v4_published)
    kw = dict(dtype=torch.float32, device="cuda:0", max_model_len=128, block_size=64, max_num_seqs=2,
              expert_parallel_size=2)
    old = check_fit(v4_published, mc, device_bytes=1 << 34, **kw)  # what the plan was: speculation not counted
    tight = _tightest(old)
    assert check_fit(v4_published, mc, device_bytes=tight, **kw).fits
    with pytest.raises(ModelDoesNotFitError, match=r"(?s)does not fit on cuda:0: .*MTP layers [\d.]+ KiB whole on "
                       r"each rank \(speculative='mtp'\).*mtp drafter state.*speculative=None frees them"):
        check_fit(v4_published, mc, device_bytes=tight, speculative="mtp", **kw)

    w = old.weights
    roomy = int((old.rank_weight_bytes + 40 * old.bytes_per_seq) / MEMORY_UTILIZATION)
    before = check_fit(v4_published, mc, device_bytes=roomy, **kw)
    after = check_fit(v4_published, mc, device_bytes=roomy, speculative="mtp", **kw)
    spent = w.mtp_bytes + after.num_slots * after.drafter_state_bytes_per_seq
    left = before.kv_budget_bytes - before.num_slots * before.state_bytes_per_seq
    assert after.max_num_blocks == (left - spent) // before.block_bytes < before.max_num_blocks
    with pytest.raises(ModelDoesNotFitError, match=r"num_blocks=\d+ does not fit.*speculative=None frees them"):
        check_fit(v4_published, mc, device_bytes=roomy, num_blocks=before.max_num_blocks, speculative="mtp", **kw)


def test_dspark_state_refuses_where_the_old_plan_accepted(v41_dspark):
    """V4.1 on one device: the DSpark rings alone tip a device that held exactly the plan's sequences."""
    config, _ = read_checkpoint_config(v41_dspark)
    kw = dict(dtype=torch.bfloat16, device="cuda:0", max_model_len=64, block_size=8, max_num_seqs=4,
              engram_placement="device")
    old = check_fit(v41_dspark, config, device_bytes=1 << 34, **kw)
    tight = _tightest(old)
    assert check_fit(v41_dspark, config, device_bytes=tight, **kw).fits
    with pytest.raises(ModelDoesNotFitError, match=r"dspark drafter state.*speculative=None frees them"):
        check_fit(v41_dspark, config, device_bytes=tight, speculative="dspark", **kw)


def test_expert_parallel_hints_follow_the_mtp_rule():
    """The layouts a refusal suggests count the MTP layers as ranks would load them: whole with speculation (not
    split with the decoder layers' experts), absent without."""
    config = ModelConfig.from_hf_dict(HF)
    w = WeightBytes(expert_bytes=816 * MIB, other_bytes=44 * MIB, mtp_expert_bytes=16 * MIB, mtp_other_bytes=4 * MIB)
    assert w.per_device(8) == 40 * MIB + 100 * MIB and w.per_device(8, with_mtp=True) == 60 * MIB + 100 * MIB
    kw = dict(dtype=torch.float32, device="cuda:0", device_bytes=int(100 * MIB / MEMORY_UTILIZATION),
              max_model_len=128, block_size=64, max_num_seqs=2)
    off, on = plan_fit(config, w, **kw), plan_fit(config, w, speculative="mtp", **kw)
    assert not on.fits and on.expert_parallel_bytes(8) - off.expert_parallel_bytes(8) == 20 * MIB
    assert on.expert_parallel_devices() > off.expert_parallel_devices()


def test_dspark_state_of_v41_flash_is_384_kib_a_request():
    """DeepSeek-V4.1-Flash in bf16: 3 stages x 128 window rows x 512 (the figure `dspark_drafter` states), plus the
    dummy slot's once; nothing without speculation."""
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.fit import drafter_slot_bytes
    from tests.engine.v41.configs import flash_config

    config = V41Config.from_hf_dict(flash_config())
    assert drafter_slot_bytes(config, "dspark", 2) == (384 << 10, 384 << 10)
    assert drafter_slot_bytes(config, None, 2) == (0, 0)
