"""The start-up fit check of an expert-parallel instance (`engine.fit` with `expert_parallel_size` > 1):
weights and KV counted per rank (the replicated part plus the rank's expert slots, MTP left out without speculative decoding)."""

from __future__ import annotations

import torch

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.fit import MEMORY_UTILIZATION, WeightBytes, check_fit, checkpoint_weight_bytes, plan_fit
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import PRESETS

MIB = 1 << 20


def test_a_model_too_big_for_one_device_fits_per_rank_of_an_ep_layout():
    config = ModelConfig.from_hf_dict({**PRESETS["tiny"].hf_config(), "n_routed_experts": 8})
    weights = WeightBytes(expert_bytes=816 * MIB, other_bytes=44 * MIB, mtp_expert_bytes=16 * MIB, mtp_other_bytes=4 * MIB)
    kw = dict(dtype=torch.float32, device="cuda:0", device_bytes=int(300 * MIB / MEMORY_UTILIZATION) + 1,
              max_model_len=256, block_size=64, max_num_seqs=4)
    one = plan_fit(config, weights, **kw)
    assert not one.fits and one.rank_weight_bytes == 860 * MIB
    ep4 = plan_fit(config, weights, expert_parallel_size=4, **kw)  # 2 of 8 experts a rank: 40 + 800 / 4 MiB
    assert ep4.rank_weight_bytes == 240 * MIB and ep4.fits
    assert ep4.max_num_blocks > 0 and ep4.kv_budget_bytes == ep4.usable_bytes - 240 * MIB
    red = plan_fit(config, weights, expert_parallel_size=4, num_redundant_experts=4, **kw)  # 3 slots a rank
    assert red.rank_weight_bytes == 340 * MIB and not red.fits
    assert "per rank of expert_parallel_size 4 with 4 redundant experts" in red.summary()


def test_check_fit_splits_the_host_between_cpu_ranks(tmp_path):
    cfg = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8}
    path = make_checkpoint(tmp_path / "m", preset=cfg, seed=0)
    config = ModelConfig.from_hf_dict(cfg)
    w = checkpoint_weight_bytes(path, torch.float32)
    kw = dict(dtype=torch.float32, device="cpu", max_model_len=128, block_size=64, max_num_seqs=2)
    one = check_fit(path, config, **kw)
    ep = check_fit(path, config, expert_parallel_size=2, **kw)
    assert ep.rank_weight_bytes == w.other_bytes - w.mtp_other_bytes + (w.expert_bytes - w.mtp_expert_bytes) // 2
    assert abs(ep.device_bytes - one.device_bytes // 2) < 64 * MIB  # measured twice; the host's memory moves
