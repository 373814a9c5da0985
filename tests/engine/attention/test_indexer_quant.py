"""The official reference's indexer numerics (`engine.attention.indexer_quant`, `EngineConfig.indexer_numerics`).

The Walsh-Hadamard rotation (known small cases, orthogonality), the FP4 simulation against hand-computed
values, the option's effect on the indexer's queries, keys and scores (and none by default), and
prefill == token-by-token decoding in "reference" mode.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepinfer.engine.attention.indexer_quant import (
    fp4_quant_dequant,
    hadamard_transform,
    rotate_and_quant,
    round_to_e2m1,
    set_indexer_numerics,
)
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.models.deepseek_v4 import Indexer, Rotary, apply_rope
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import get_preset

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_small_cases_and_orthogonality():
    s = 2**-0.5
    assert torch.allclose(hadamard_transform(torch.tensor([1.0, 0.0])), torch.tensor([s, s]))
    assert torch.allclose(hadamard_transform(torch.tensor([3.0, 1.0])), torch.tensor([4 * s, 2 * s]))
    # n = 4 by hand: rows of H_4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.allclose(hadamard_transform(x), torch.tensor([10.0, -2.0, -4.0, 0.0]) / 2)
    for n in (1, 2, 8, 64, 128):
        m = hadamard_transform(torch.eye(n, dtype=torch.float64))  # row i = e_i H / sqrt(n)
        assert torch.allclose(m, _sylvester(n).double() / math.sqrt(n))
        assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64))  # orthogonal
    x = torch.randn(3, 5, 128, dtype=torch.float64)
    # symmetric and orthogonal: an involution (to fp32 precision: the transform computes in fp32)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-5)
    assert hadamard_transform(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(AssertionError):
        hadamard_transform(torch.zeros(2, 12))


def test_round_to_e2m1_is_nearest_ties_to_even():
    v = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.3, 1.75, 2.4, 2.5, 2.6, 3.5, 4.9, 5.0, 5.1, 6.0, -0.75, -5.0, -0.1])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 2.0, 3.0, 4.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0, -0.0]
    assert round_to_e2m1(v).tolist() == want
    grid = torch.tensor(E2M1 + [-g for g in E2M1])
    assert torch.equal(round_to_e2m1(grid), grid)  # grid points are fixed


def test_fp4_quant_dequant_hand_computed():
    # block 0: amax 6 -> 6 * fp32(1/6) rounds to 1.0 -> scale 1: plain e2m1 rounding
    b0 = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, -2.6] + [0.0] * 22
    e0 = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -3.0] + [0.0] * 22
    # block 1: amax 3 -> scale 0.5: x / 0.5 rounded, times 0.5
    b1 = [3.0, 0.3, -1.1, 0.9] + [0.0] * 28  # /0.5: 6, 0.6, -2.2, 1.8 -> 6, 0.5, -2, 2
    e1 = [3.0, 0.25, -1.0, 1.0] + [0.0] * 28
    # block 2: amax 6.5 -> 6.5/6 > 1 -> scale 2: /2: 3.25, 1.2, -0.6 -> 3, 1, -0.5
    b2 = [6.5, 2.4, -1.2] + [0.0] * 29
    e2 = [6.0, 2.0, -1.0] + [0.0] * 29
    # block 3: all zero: the amax floor keeps the scale finite, zeros stay zeros
    x = torch.tensor([b0 + b1 + b2 + [0.0] * 32])
    want = torch.tensor([e0 + e1 + e2 + [0.0] * 32])
    assert torch.equal(fp4_quant_dequant(x), want)
    # scale invariance by powers of two; dtype kept
    assert torch.equal(fp4_quant_dequant(x * 2.0**-10), want * 2.0**-10)
    assert fp4_quant_dequant(x.to(torch.bfloat16)).dtype == torch.bfloat16
    # every output is an e2m1 value times its block's power-of-two scale, and the error is at most half a step
    y = torch.randn(4, 128, generator=torch.Generator().manual_seed(0)) * 3
    q = fp4_quant_dequant(y)
    amax = y.view(4, 4, 32).abs().amax(-1, keepdim=True)
    scale = 2.0 ** torch.ceil(torch.log2(amax / 6))
    assert torch.isin((q.view(4, 4, 32) / scale).abs(), torch.tensor(E2M1)).all()
    assert ((q - y).view(4, 4, 32).abs() <= scale).all()  # <= half of the largest step (2 * scale)


def _config(**over) -> ModelConfig:
    return ModelConfig.from_hf_dict({**get_preset("tiny").hf_config(), "index_head_dim": 64, **over})


def test_reference_numerics_rotate_and_quantize_queries_and_keys():
    torch.manual_seed(0)
    cfg = _config()
    ind = Indexer(cfg, 4)
    for p in ind.parameters():
        torch.nn.init.normal_(p, std=0.3)
    n, C = 6, 9
    q_res, x = torch.randn(n, cfg.q_lora_rank), torch.randn(n, cfg.hidden_size)
    keys = torch.randn(C, 64)
    cos, sin = Rotary(cfg.rope_compress, cfg.rope_head_dim)(torch.arange(n))
    q_plain = apply_rope(ind.wq_b(q_res).view(n, ind.num_heads, 64), cos, sin)

    def scores(q, k):  # the indexer's score, written out
        w = ind.weights_proj(x).float() * ind.num_heads**-0.5
        return (F.relu(torch.einsum("nhd,cd->nhc", q, k)) * 64**-0.5 * w[:, :, None]).sum(1)

    default = ind.score_batched(q_res, x, keys[None].expand(n, C, 64), cos, sin)
    assert torch.equal(default, scores(q_plain, keys))  # transformers numerics: as before, bit for bit
    ind.numerics = "reference"
    ref = ind.score_batched(q_res, x, keys[None].expand(n, C, 64), cos, sin)
    assert torch.equal(ref, scores(rotate_and_quant(q_plain), keys))  # the queries: after RoPE, rotated, FP4
    assert not torch.allclose(ref, default, atol=1e-3)
    # rotation alone leaves q.k unchanged (orthogonal); the change is the FP4 error
    kr = hadamard_transform(keys)
    assert torch.allclose(scores(hadamard_transform(q_plain), kr), default, atol=1e-5)
    # select (prefill) uses the same queries as score_batched (decode)
    vis = torch.ones(n, C, dtype=torch.bool)
    assert torch.equal(ind.select(q_res, x, keys, vis, cos, sin), ind.select_topk(ref, vis))

    # the compressor's entries: norm, RoPE, then rotation + FP4
    comp = ind.compressor
    r, w = comp.rate, comp.width
    cur, prev = torch.randn(3, r, w), torch.randn(3, r, w)
    gc, gp = torch.randn(3, r, w), torch.randn(3, r, w)
    windows = torch.tensor([0, 1, 2])
    rope = Rotary(cfg.rope_compress, cfg.rope_head_dim)(windows * r)
    plain = comp.compress_gathered(cur, gc, prev, gp, windows, rope)
    comp.rotate_quant = True
    assert torch.equal(comp.compress_gathered(cur, gc, prev, gp, windows, rope), rotate_and_quant(plain))


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    config = {**get_preset("tiny").hf_config(), "index_head_dim": 64}
    return make_checkpoint(tmp_path_factory.mktemp("tiny-index64"), preset=config, seed=2)


def test_set_indexer_numerics_and_default(tiny64, tmp_path):
    model, _ = load_checkpoint(tiny64, dtype="float32")
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert indexers and all(m.numerics == "transformers" and not m.compressor.rotate_quant for m in indexers)
    ref, _ = load_checkpoint(tiny64, dtype="float32", indexer_numerics="reference")
    assert all(m.numerics == "reference" and m.compressor.rotate_quant
               for m in ref.modules() if isinstance(m, Indexer))
    with pytest.raises(ValueError, match="indexer_numerics"):
        set_indexer_numerics(model, "fp8")
    small = make_checkpoint(tmp_path / "tiny16", preset="tiny", seed=2)  # index_head_dim 16 < one FP4 block
    with pytest.raises(ValueError, match="index_head_dim"):
        load_checkpoint(small, dtype="float32", indexer_numerics="reference")


def test_reference_mode_prefill_equals_token_by_token(tiny64):
    """"reference" numerics: one prefill chunk, chunks of 5 and token-by-token decoding agree; the logits differ
    from the default numerics' (the option reaches the selections)."""
    ids = torch.randint(2, 500, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, cfg = load_checkpoint(tiny64, dtype="float32", indexer_numerics="reference")
    ids = [t % cfg.vocab_size for t in ids]

    def run(model, chunk: int) -> torch.Tensor:
        runner = ModelRunnerForTests(model, max_seqs=1, max_len=len(ids) + 1)
        out = []
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                part = ids[start:start + chunk]
                if start == 0:
                    logits = runner.prefill(0, part)
                else:
                    logits = runner.run([(0, part)])[0]
                out.append(logits.reshape(-1, logits.shape[-1])[-1])  # last position of the chunk
        return torch.stack(out)

    # compare the logits at the positions both runs emit: every 5th chunk end (4, 9, ...) and the last
    one = run(ref, 1)  # [40, vocab]
    five = run(ref, 5)  # [8, vocab] at positions 4, 9, ..., 39
    torch.testing.assert_close(five, one[4::5], rtol=1e-4, atol=1e-4)
    whole = run(ref, len(ids))[-1]
    torch.testing.assert_close(whole, one[-1], rtol=1e-4, atol=1e-4)
    default, _ = load_checkpoint(tiny64, dtype="float32")
    assert not torch.allclose(run(default, 1), one, atol=1e-4)


def test_engine_config_plumbs_indexer_numerics(tiny64):
    from pydantic import ValidationError

    from deepinfer.engine.engine import Engine, EngineConfig

    assert EngineConfig().indexer_numerics == "transformers"
    with pytest.raises(ValidationError):
        EngineConfig(indexer_numerics="fp8")
    eng = Engine(EngineConfig(model=str(tiny64), max_model_len=128, indexer_numerics="reference"))
    modes = {(m.numerics, m.compressor.rotate_quant) for m in eng.model.modules() if isinstance(m, Indexer)}
    assert modes == {("reference", True)}
