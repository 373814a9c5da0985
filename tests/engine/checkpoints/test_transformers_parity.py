"""Published-layout checkpoints against Hugging Face transformers, which loads the same files and
dequantizes them on the CPU (its FP8 integration needs `accelerate`; without it these tests skip).

transformers is the oracle as in tests/engine/test_model_parity.py: its forward over exactly the
prefix, last position. Our model keeps the FP8/FP4 weights quantized and dequantizes block by block
inside each matmul; transformers dequantizes the whole checkpoint at load; both compute in float32.

NOTE: where the lightning indexer's scores tie exactly at the top-k boundary (every head's ReLU zero
for several entries), we and transformers break the tie differently, and no causal rule could agree
with transformers there: it takes torch.topk on the CPU, whose tie order depends on the tensor's
shape, so its logits at a position change with the length of the forward that holds them. Ours is
the official reference's on CUDA (lower entry index first; `topk_mask`'s NOTE, issue 21 item 3), and
tests/engine/attention/test_indexer_ties.py checks that we agree with transformers on a tie-prone
model once its indexer breaks ties that way. The prompts here are therefore still the first seeds
whose forward (or greedy run) meets no such tie in our indexer; rows are causal, so every prefix of
a tie-free prompt is tie-free too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from safetensors.torch import load_file

import deepinfer.engine.models.deepseek_v4 as deepseek_v4
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests

from .conftest import VARIANTS

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate installed")

LENGTHS = [1, 2, 5, 8, 9, 17, 33, 64, 65, 100]
GREEDY_STEPS = 64


def _hf(path):
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "no GPU: dequantizing" is expected here
    try:
        return transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def models(published):
    cache = {}

    def get(name):
        if name not in cache:
            path = published(name)
            hf, info = _hf(path)
            ours, _ = load_checkpoint(path, "float32")
            cache[name] = (ours.eval(), hf.eval(), info)
        return cache[name]

    return get


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextlib.contextmanager
def _count_index_ties():
    """Count the indexer rows whose k-th and (k+1)-th best visible scores are equal (inside the block)."""
    ties = [0]
    original = deepseek_v4.topk_mask

    def spy(scores, visible, k):
        masked = scores.masked_fill(~visible, float("-inf"))
        if masked.shape[-1] > k:
            top = masked.topk(k + 1, dim=-1).values  # [n, k+1]
            ties[0] += int(((top[:, k - 1] == top[:, k]) & torch.isfinite(top[:, k])).sum())
        return original(scores, visible, k)

    deepseek_v4.topk_mask = spy
    try:
        yield ties
    finally:
        deepseek_v4.topk_mask = original


def _hf_last_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_transformers_loads_published_with_no_missing_or_unexpected_keys(models, dequantized, name):
    _, hf, info = models(name)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    # and dequantizes exactly as engine.quant.formats does (write_dequantized's copy)
    ref = load_file(dequantized(name) / "model.safetensors")
    sd = hf.state_dict()
    assert torch.equal(sd["model.layers.1.self_attn.q_a_proj.weight"], ref["model.layers.1.attn.wq_a.weight"])
    assert torch.equal(sd["model.layers.1.mlp.shared_experts.down_proj.weight"],
                       ref["model.layers.1.ffn.shared_experts.w2.weight"])
    w13 = torch.cat([ref["model.layers.2.ffn.experts.1.w1.weight"], ref["model.layers.2.ffn.experts.1.w3.weight"]])
    assert torch.equal(sd["model.layers.2.mlp.experts.gate_up_proj"][1], w13)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prefix_logprobs_match_transformers(models, name):
    ours, hf, _ = models(name)
    n = max(LENGTHS)
    for seed in range(3, 13):
        ids = _prompt(n, ours.config.vocab_size, seed=seed)
        with _count_index_ties() as ties:
            ModelRunnerForTests(ours, max_seqs=1, max_len=n + 1).prefill(0, ids)
        if not ties[0]:
            break
    else:
        pytest.fail(f"{name}: every prompt seed meets an indexer tie")
    worst = 0.0
    for L in LENGTHS:
        got = torch.log_softmax(ModelRunnerForTests(ours, max_seqs=1, max_len=L + 1).prefill(0, ids[:L]).float(), -1)
        worst = max(worst, (got - _hf_last_logprobs(hf, ids[:L])).abs().max().item())
    print(f"{name}: max |d logprob| {worst:.2e} over prefixes {LENGTHS} (prompt seed {seed})")
    assert worst <= 2e-3, f"{name}: max |d logprob| {worst:.2e} (prompt seed {seed})"


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_matches_transformers(models, name):
    ours, hf, _ = models(name)
    for seed in range(7, 17):
        prompt = _prompt(11, ours.config.vocab_size, seed=seed)
        with _count_index_ties() as ties:
            got = ModelRunnerForTests(ours, max_seqs=1, max_len=len(prompt) + GREEDY_STEPS + 1).greedy(
                0, prompt, GREEDY_STEPS)
        if not ties[0]:
            break
    else:
        pytest.fail(f"{name}: every prompt seed meets an indexer tie")
    seq = list(prompt)
    for _ in range(GREEDY_STEPS):
        seq.append(int(_hf_last_logprobs(hf, seq).argmax()))
    assert got == seq[len(prompt):]
