"""MoE backends over quantized experts: "torch" and "torch_loop" with Fp8Linear / Fp4Linear experts (by
calling the modules), and the grouped "fp4" backend, all against a per-expert oracle on the dequantized
weights; the "fp4" backend's packing keeps names, values and storage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("pydantic")  # the model config needs it (bare GPU machines run this folder without it)

from deepinfer.engine.config import ModelConfig  # noqa: E402
from deepinfer.engine.models.deepseek_v4 import MoE  # noqa: E402
from deepinfer.engine.moe import get_moe_backend  # noqa: E402
from deepinfer.engine.moe.fp4_backend import Fp4MoEBackend  # noqa: E402
from deepinfer.engine.quant import Fp4Linear, Fp8Linear  # noqa: E402
from deepinfer.engine.testing.presets import PRESETS  # noqa: E402


def _moe(backend: str, quant: type, seed: int = 0) -> MoE:
    """The tiny preset's MoE with its routed experts' linears replaced by `quant` modules (random weights)."""
    torch.manual_seed(seed)
    moe = MoE(ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config()), False, backend)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        for ex in moe.experts:
            for name in ("w1", "w2", "w3"):
                w = getattr(ex, name).weight
                setattr(ex, name, quant.from_float(w) if quant is Fp4Linear else quant.from_float(w, (16, 32)))
    return moe.requires_grad_(False)


def _oracle(moe: MoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per expert over its tokens with the dequantized float32 weights, scattered back in expert order."""
    weights, idx = moe.gate(x, ids)
    out = torch.zeros_like(x)
    for e, ex in enumerate(moe.experts):
        tok, slot = (idx == e).nonzero(as_tuple=True)
        if len(tok) == 0:
            continue
        g = F.linear(x[tok], ex.w1.dequantized()).clamp(max=ex.limit)
        u = F.linear(x[tok], ex.w3.dequantized()).clamp(min=-ex.limit, max=ex.limit)
        y = F.linear(F.silu(g) * u, ex.w2.dequantized()) * weights[tok, slot][:, None]
        out.index_add_(0, tok, y)
    return out + moe.shared_experts(x)


def _inputs(num_tokens: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, 64, generator=g), torch.randint(0, 128, (num_tokens,), generator=g)


@pytest.mark.parametrize("backend, quant", [("torch", Fp8Linear), ("torch_loop", Fp8Linear), ("torch", Fp4Linear),
                                            ("torch_loop", Fp4Linear), ("fp4", Fp4Linear)])
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_backends_over_quantized_experts_match_the_oracle(backend, quant, num_tokens):
    moe = _moe(backend, quant)
    x, ids = _inputs(num_tokens, seed=num_tokens)
    out = moe(x, ids)
    if backend == "torch":
        assert moe.backend.packed is None  # grouped_mm is for plain float weights: quantized experts loop
    torch.testing.assert_close(out, _oracle(moe, x, ids), atol=1e-5, rtol=1e-5)


def test_fp4_backend_agrees_with_the_loop_and_keeps_names_values_storage():
    grouped, loop = _moe("fp4", Fp4Linear), _moe("torch_loop", Fp4Linear)
    before = {k: v.clone() for k, v in grouped.state_dict().items()}
    grouped.prepare()
    after = grouped.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k].view(torch.uint8), before[k].view(torch.uint8)) for k in before)
    w13, s13, w2, s2 = grouped.backend.packed
    assert grouped.backend.impl_name == "torch"
    for ex in grouped.experts:  # views into the stacks: no second copy of the experts
        assert ex.w1.weight.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
        assert ex.w3.scale.untyped_storage().data_ptr() == s13.untyped_storage().data_ptr()
        assert ex.w2.weight.untyped_storage().data_ptr() == w2.untyped_storage().data_ptr()
        assert ex.w2.scale.untyped_storage().data_ptr() == s2.untyped_storage().data_ptr()
    x, ids = _inputs(33)
    torch.testing.assert_close(grouped(x, ids), loop(x, ids), atol=1e-5, rtol=1e-5)
    weights, idx = grouped.gate(x, ids)
    xb = x.bfloat16()  # bf16 activations through the routed experts alone (the gate stays float32)
    torch.testing.assert_close(grouped.backend(xb, weights, idx).float(), loop.backend(xb, weights, idx).float(),
                               atol=2e-2, rtol=2e-2)


def test_fp4_backend_refuses_other_experts():
    assert get_moe_backend("fp4") is Fp4MoEBackend
    with pytest.raises(ValueError, match=r"needs Fp4Linear experts; expert 0.w1 is Fp8Linear .*moe_backend='torch'"):
        _moe("fp4", Fp8Linear).prepare()


def test_fp4_backend_through_a_published_checkpoint(tmp_path):
    """The loader's kept-quantized experts (published layout, FP4 experts) run through "fp4" as through
    "torch" (the per-expert loop calling the Fp4Linear modules)."""
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    path = make_checkpoint(tmp_path / "pub", preset="tiny", seed=3, format="published")
    looped, config = load_checkpoint(path, moe_backend="torch", progress=False)
    grouped, _ = load_checkpoint(path, moe_backend="fp4", progress=False)
    assert all(isinstance(layer.ffn.backend, Fp4MoEBackend) and layer.ffn.backend.packed is not None
               for layer in grouped.model.layers)
    assert all(layer.ffn.backend.packed is None for layer in looped.model.layers)  # quantized: no _grouped_mm
    ids = torch.randint(2, config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    got = [ModelRunnerForTests(m, max_seqs=1, max_len=64).run([(0, ids)], logits="all") for m in (looped, grouped)]
    torch.testing.assert_close(got[1], got[0], atol=1e-5, rtol=1e-5)
