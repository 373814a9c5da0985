"""Loading one expert-parallel rank's share of a checkpoint (`engine.loader.load_checkpoint(routed_experts=...)`,
`engine.distributed.expert_parallel.rank_load_kwargs`): only the rank's routed experts are read from the shards
(quantized ones stay quantized), the others are `AbsentExpert`s, the EP backends are in place before the
first prepare, and the MTP layers are left out when speculative decoding is off (with it every rank loads them
whole: `engine.distributed.spec`, `engine.fit.WeightBytes(with_mtp)`)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.distributed.expert_parallel import (
    held_expert_bytes,
    held_experts_of,
    moe_layers,
    rank_load_kwargs,
)
from deepinfer.engine.loader import AbsentExpert, load_checkpoint, read_checkpoint_config
from deepinfer.engine.moe.ep_backend import ExpertParallelMoEBackend, ExpertPlacement
from deepinfer.engine.quant.linear import Fp4Linear
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def published_fp4(tmp_path_factory):
    cfg = {**PRESETS["tiny"].hf_config(), "n_routed_experts": 8}
    return make_checkpoint(tmp_path_factory.mktemp("pub8"), preset=cfg, seed=3, format="published", mtp_layers=1)


@pytest.mark.parametrize("rank", [0, 3])
def test_a_rank_reads_only_its_routed_experts_and_keeps_them_fp4(published_fp4, rank):
    full, mc = load_checkpoint(published_fp4)
    kw = rank_load_kwargs(mc, world_size=4, rank=rank, num_redundant_experts=4)
    part, _ = load_checkpoint(published_fp4, **kw)
    want = kw["routed_experts"][0]  # contiguous placement: 12 slots (8 experts + replicas of 0..3), 3 per rank
    assert want == ExpertPlacement.contiguous(8, 4, 4).local_experts(rank) and len(want) == 3
    assert held_experts_of(part) == [sorted(want)] * mc.num_hidden_layers
    for moe_p, moe_f in zip(moe_layers(part), moe_layers(full)):
        assert isinstance(moe_p.backend, ExpertParallelMoEBackend)  # installed before the first prepare
        for e, ex in enumerate(moe_p.experts):
            if e in want:
                assert isinstance(ex.w1, Fp4Linear)
                for (n, a), b in zip(ex.state_dict().items(), moe_f.experts[e].state_dict().values()):
                    assert torch.equal(a, b), n
            else:
                assert isinstance(ex, AbsentExpert) and not ex.state_dict()
    assert held_expert_bytes(part) * 8 == held_expert_bytes(full) * len(want)
    assert full.mtp and not part.mtp  # no MTP layers on a rank without speculative decoding
    # the shards' other experts were never read: the state dict lists only what this rank holds
    names = [n for n in part.state_dict() if ".ffn.experts." in n]
    assert {int(n.split(".experts.")[1].split(".")[0]) for n in names} == set(want)


def test_routed_experts_config_is_read_before_any_tensor(published_fp4):
    mc, _ = read_checkpoint_config(published_fp4)
    kw = rank_load_kwargs(mc, world_size=2, rank=1)
    assert kw["routed_experts"] == dict.fromkeys(range(mc.num_hidden_layers), [4, 5, 6, 7])
