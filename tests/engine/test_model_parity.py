"""The model against Hugging Face transformers' DeepseekV4ForCausalLM (the numerical oracle).

The oracle is "HF's forward over exactly the prefix, last position". HF's full-sequence forward
is not a valid oracle for earlier positions; `test_hf_full_forward_is_not_causal_under_index_ties`
shows why.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import PRESETS

transformers = pytest.importorskip("transformers")

# HF has no "softmax" router activation (ACT2FN lacks it), so that preset is checked against
# our own invariants only.
HF_PRESETS = [p for p in PRESETS if PRESETS[p].config.get("scoring_func") != "softmax" and p != "small"]
ALL_TINY = [p for p in PRESETS if p != "small"]
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 47, 64, 65, 100, 129, 200, 257]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(preset: str):
        if preset not in cache:
            path = make_checkpoint(tmp_path_factory.mktemp(preset), preset=preset, seed=1)
            ours, _ = load_checkpoint(path, dtype="float32")
            hf = None
            if preset in HF_PRESETS:
                hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            cache[preset] = (ours.eval(), hf, path)
        return cache[preset]

    return get


def _prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_prefix_logits_match_hf(checkpoints, preset):
    ours, hf, _ = checkpoints(preset)
    vocab = ours.config.vocab_size
    ids = _prompt(max(LENGTHS), vocab, seed=3)
    for L in LENGTHS:
        runner = ModelRunnerForTests(ours, max_seqs=1, max_len=L + 1)
        got = runner.prefill(0, ids[:L])
        ref = _hf_last_logits(hf, ids[:L])
        scale = ref.abs().max().item()
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-4 * max(scale, 1.0), f"{preset} L={L}: max|diff|={diff:.2e} (logit scale {scale:.2f})"


@pytest.mark.parametrize("preset", ALL_TINY)
def test_incremental_equals_full(checkpoints, preset):
    ours, _, _ = checkpoints(preset)
    ids = _prompt(90, ours.config.vocab_size, seed=5)
    prompt, tail = ids[:70], ids[70:]
    full = ModelRunnerForTests(ours, max_seqs=1, max_len=128)
    ref = full.run([(0, ids)], logits="all")  # [90, vocab]
    for chunk in (1, 3, 17, 70):
        r = ModelRunnerForTests(ours, max_seqs=1, max_len=128)
        rows = []
        for a in range(0, len(prompt), chunk):
            rows.append(r.run([(0, prompt[a:a + chunk])], logits="all"))
        for t in tail:  # then token by token
            rows.append(r.run([(0, [t])], logits="all"))
        got = torch.cat(rows)
        diff = (got - ref).abs().max().item()
        assert diff <= 1e-5 * max(ref.abs().max().item(), 1.0), f"{preset} chunk={chunk}: {diff:.2e}"


@pytest.mark.parametrize("preset", ALL_TINY)
def test_batched_equals_alone(checkpoints, preset):
    ours, _, _ = checkpoints(preset)
    vocab = ours.config.vocab_size
    prompts = [_prompt(n, vocab, seed=10 + n) for n in (1, 13, 40, 7, 66)]
    alone = []
    for p in prompts:
        r = ModelRunnerForTests(ours, max_seqs=1, max_len=128)
        alone.append(r.prefill(0, p))
    # together: prefill chunks of different requests in one step, then a mixed step
    r = ModelRunnerForTests(ours, max_seqs=len(prompts), max_len=128)
    first = r.run([(i, p[:-1]) for i, p in enumerate(prompts) if len(p) > 1])
    assert first.shape[0] == sum(len(p) > 1 for p in prompts)
    last = r.run([(i, p[-1:]) if len(p) > 1 else (i, p) for i, p in enumerate(prompts)])
    for i in range(len(prompts)):
        diff = (last[i] - alone[i]).abs().max().item()
        assert diff <= 1e-5 * max(alone[i].abs().max().item(), 1.0), f"{preset} request {i}: {diff:.2e}"


@pytest.mark.parametrize("preset", HF_PRESETS)
def test_greedy_matches_hf_prefix_oracle(checkpoints, preset):
    ours, hf, _ = checkpoints(preset)
    vocab = ours.config.vocab_size
    for seed, n in ((0, 5), (1, 23), (2, 40)):
        prompt = _prompt(n, vocab, seed=seed)
        runner = ModelRunnerForTests(ours, max_seqs=1, max_len=n + 40)
        got = runner.greedy(0, prompt, 32)
        seq = list(prompt)
        for _ in range(32):
            seq.append(int(_hf_last_logits(hf, seq).argmax()))
        assert got == seq[n:], f"{preset} prompt {seed}: ours {got} vs HF {seq[n:]}"


def test_logits_are_causal(checkpoints):
    """Logits at position p never depend on later tokens or on the batch length."""
    ours, _, _ = checkpoints("tiny")
    ids = _prompt(100, ours.config.vocab_size, seed=9)
    long = ModelRunnerForTests(ours, max_seqs=1, max_len=128).run([(0, ids)], logits="all")
    for L in (10, 33, 64, 99):
        short = ModelRunnerForTests(ours, max_seqs=1, max_len=128).run([(0, ids[:L])], logits="all")
        assert torch.allclose(short, long[:L], atol=1e-5, rtol=0), f"L={L}"
    other = list(ids)
    other[50:] = _prompt(50, ours.config.vocab_size, seed=99)
    changed = ModelRunnerForTests(ours, max_seqs=1, max_len=128).run([(0, other)], logits="all")
    assert torch.allclose(changed[:50], long[:50], atol=1e-5, rtol=0)


def test_hf_full_forward_is_not_causal_under_index_ties(tmp_path):
    """Why HF's full-sequence forward is not an oracle for earlier positions.

    The lightning indexer scores entry s for query t as sum_h w[t,h] * ReLU(q[t,h] . k[s]).
    Whenever every head's dot product is <= 0 the score is exactly 0, so with few index heads
    many entries tie. HF picks the top-k with `torch.topk` over a row padded with -inf up to
    the number of entries of the *whole forward* (L // rate), and torch.topk breaks ties in an
    order that depends on the tensor's shape. So as L crosses a multiple of the CSA rate, the
    entries chosen for an earlier query t can change, and HF's logits at t change with L.
    (HF's cached `generate` path deviates from its prefix forward for the same reason: each
    decode step's row has yet another length.) Without ties (index_topk >= entries) the
    effect vanishes. Our indexer breaks ties by entry index (a stable sort), so a query's
    selection depends only on what it can see; this test pins both facts.
    """
    from deepinfer.engine.testing.presets import get_preset

    cfg = get_preset("tiny").hf_config()
    cfg.update(index_n_heads=1, index_topk=2)  # one head: about half of all scores are exact zeros
    path = make_checkpoint(tmp_path / "ties", preset=cfg, seed=4)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_checkpoint(path)
    ids = _prompt(96, cfg["vocab_size"], seed=2)
    with torch.no_grad():
        hf_logits = {L: hf(torch.tensor([ids[:L]])).logits[0].float() for L in range(40, 97, 4)}
    p = 39
    spread = max((hf_logits[L][p] - hf_logits[40][p]).abs().max().item() for L in hf_logits)
    assert spread > 1e-3, "expected HF's logits at an early position to move with the forward length"
    ours_logits = [ModelRunnerForTests(ours, 1, 128).run([(0, ids[:L])], logits="all")[p] for L in (40, 64, 96)]
    for o in ours_logits[1:]:
        assert torch.allclose(o, ours_logits[0], atol=1e-5, rtol=0)
