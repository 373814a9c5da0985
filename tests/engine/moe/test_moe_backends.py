"""MoE backends (`engine.moe`): the registry, the torch backends against the per-expert oracle, and
what `prepare` must keep (checkpoint names, values, no extra memory, autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.models.deepseek_v4 import MoE
from deepinfer.engine.moe import MoEBackend, get_moe_backend, moe_backend_names, register_moe_backend
from deepinfer.engine.moe.torch_backend import TorchLoopMoEBackend, TorchMoEBackend
from deepinfer.engine.testing.presets import PRESETS


def _config(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict({**PRESETS["tiny"].hf_config(), **over})


def _moe(backend: str, seed: int = 0, is_hash: bool = False, **over) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(_config(**over), is_hash, backend)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        if is_hash:
            vocab, k = moe.gate.tid2eid.shape  # distinct experts per token id, as a real table has
            moe.gate.tid2eid.copy_(torch.rand(vocab, len(moe.experts)).argsort(dim=-1)[:, :k])
    return moe.requires_grad_(False)


def _oracle(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The per-expert loop as the model computed it before the backends: each expert over its tokens
    (in token order, slot order within a token), scattered back in ascending expert id, then the shared expert."""
    weights, idx = moe.gate(x, input_ids)
    out = torch.zeros_like(x)
    for e, ex in enumerate(moe.experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        g = F.linear(x[tok], ex.w1.weight).clamp(max=ex.limit)
        u = F.linear(x[tok], ex.w3.weight).clamp(min=-ex.limit, max=ex.limit)
        y = F.linear(F.silu(g) * u, ex.w2.weight) * weights[tok, slot][:, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out + moe.shared_experts(x)


def _inputs(num_tokens: int, seed: int = 1, hidden: int = 64, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=g), torch.randint(0, vocab, (num_tokens,), generator=g)


# ---------------------------------------------------------------------------- registry


def test_registry_names_and_errors():
    assert {"torch", "torch_loop"} <= set(moe_backend_names())
    assert get_moe_backend("torch") is TorchMoEBackend and get_moe_backend("torch_loop") is TorchLoopMoEBackend
    with pytest.raises(ValueError, match=r"unknown MoE backend 'fp8_magic'; known: .*torch, torch_loop"):
        get_moe_backend("fp8_magic")
    with pytest.raises(ValueError, match="unknown MoE backend"):
        MoE(_config(), False, "fp8_magic")
    with pytest.raises(ValueError, match="already registered"):
        register_moe_backend("torch")(type("Other", (TorchLoopMoEBackend,), {}))


def test_a_new_backend_registers_and_is_picked_by_name():
    @register_moe_backend("test_zero")
    class Zero(MoEBackend):
        def prepare(self, experts):
            self.prepared = len(experts)

        def forward(self, x, topk_weights, topk_ids):
            return torch.zeros_like(x)

    moe = _moe("test_zero")
    x, ids = _inputs(5)
    assert torch.equal(moe(x, ids), moe.shared_experts(x)) and moe.backend.prepared == 4
    assert "test_zero" in moe_backend_names()


# ---------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("is_hash", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 2, 9, 40])
def test_torch_backends_match_the_per_expert_oracle(is_hash, num_tokens):
    x, ids = _inputs(num_tokens, seed=num_tokens)
    loop, grouped = _moe("torch_loop", is_hash=is_hash), _moe("torch", is_hash=is_hash)
    ref = _oracle(loop, x, ids)
    out_loop = loop(x, ids)
    assert torch.equal(out_loop, ref)
    out_grouped = grouped(x, ids)
    assert grouped.backend.packed is not None  # the CPU takes the grouped path
    torch.testing.assert_close(out_grouped, ref, atol=1e-5, rtol=1e-5)
    if num_tokens == 1:  # the single-token path is shared by both backends
        assert torch.equal(out_grouped, out_loop)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_router_scoring_and_weights(scoring):
    moe = _moe("torch", scoring_func=scoring)
    x, ids = _inputs(6)
    weights, idx = moe.gate(x, ids)
    assert weights.shape == idx.shape == (6, 2) and idx.dtype == torch.int64
    torch.testing.assert_close(weights.sum(-1), torch.full((6,), moe.gate.scaling))


def test_bfloat16_grouped_matches_loop():
    loop, grouped = _moe("torch_loop").to(torch.bfloat16), _moe("torch").to(torch.bfloat16)
    x, ids = _inputs(12)
    x = x.bfloat16()
    torch.testing.assert_close(grouped(x, ids), loop(x, ids), atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------- prepare


def test_prepare_keeps_names_values_and_storage():
    moe = _moe("torch")
    before = {k: v.clone() for k, v in moe.state_dict().items()}
    moe.prepare()
    after = moe.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    w13, w2 = moe.backend.packed
    # every expert weight is a view into the two stacks: no second copy of the experts
    for e, ex in enumerate(moe.experts):
        assert ex.w1.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert ex.w3.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert ex.w2.weight.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
        assert torch.equal(w13[e].T, torch.cat([ex.w1.weight, ex.w3.weight]))


def test_forward_prepares_lazily_and_again_after_a_reload():
    moe = _moe("torch")
    x, ids = _inputs(7)
    assert moe.backend.packed is None
    first = moe(x, ids)
    assert moe.backend.packed is not None
    other = _moe("torch", seed=5)
    moe.load_state_dict(other.state_dict(), assign=True)  # new tensors: the packed stacks are stale
    torch.testing.assert_close(moe(x, ids), _oracle(other, x, ids), atol=1e-5, rtol=1e-5)
    assert not torch.equal(moe(x, ids), first)


def test_training_takes_the_loop_and_reaches_the_expert_weights():
    moe = _moe("torch").requires_grad_(True)
    x, ids = _inputs(8)
    moe(x, ids).sum().backward()
    assert moe.backend.packed is None  # prepared with grad enabled: parameters are left as they are
    assert any(ex.w1.weight.grad is not None and ex.w1.weight.grad.abs().sum() > 0 for ex in moe.experts)


# ---------------------------------------------------------------------------- through the model


def test_model_backends_are_picked_at_construction_and_agree(tmp_path):
    from deepinfer.engine.loader import load_checkpoint, load_weights, meta_parameters
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    path = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=2)
    fast, config = load_checkpoint(path)
    assert fast.model.ops.impl_names["sinkhorn"] == "numpy_cpu"
    assert all(layer.ffn.backend.packed is not None for layer in fast.model.layers)  # prepared by the loader
    with pytest.raises(ValueError, match="unknown MoE backend 'nope'"):
        DeepseekV4ForCausalLM(config, moe_backend="nope")
    looped, _ = load_checkpoint(path, moe_backend="torch_loop")
    assert all(isinstance(layer.ffn.backend, TorchLoopMoEBackend) for layer in looped.model.layers)
    with meta_parameters():
        plain = DeepseekV4ForCausalLM(config, moe_backend="torch_loop", op_impls={"sinkhorn": "torch"})
    plain = load_weights(plain, path).eval().requires_grad_(False)  # not prepared: the forward does it
    assert plain.model.ops.impl_names["sinkhorn"] == "torch"
    assert sorted(plain.state_dict()) == sorted(fast.state_dict())
    ids = torch.randint(2, config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    got = [ModelRunnerForTests(m, max_seqs=1, max_len=64).run([(0, ids)], logits="all") for m in (fast, plain)]
    # NOTE: observed bit-identical on the CPU; grouped and looped matmuls need not be in general
    torch.testing.assert_close(got[0], got[1], atol=1e-5, rtol=1e-5)
