"""Unit tests of speculative decoding's pieces: ring rollback, the acceptance rule and its sampling rows,
and the statistics of rejection sampling (chi-square against the target distribution)."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.sampling import SamplingParams
from deepinfer.engine.sampling.sampler import Sampler, SamplingBatch, exponential_noise, philox_uniform
from deepinfer.engine.spec_decode import (
    RingRollback,
    expand_bitmask,
    expand_verify_rows,
    max_draft_tokens,
    num_accepted,
    rejection_sample,
)
from deepinfer.engine.testing.presets import PRESETS


def _cache(num_slots: int = 3) -> V4KVCache:
    config = ModelConfig.from_hf_dict(PRESETS["tiny"].hf_config())
    cache = V4KVCache(config, num_blocks=2, block_size=8, num_slots=num_slots)
    g = torch.Generator().manual_seed(0)
    for t in cache.state_tensors().values():
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def test_max_draft_tokens_is_the_smallest_ring_minus_one():
    cache = _cache()
    assert max_draft_tokens(cache) == 7  # tiny: window 8, CSA ring 2 * 4, HCA ring 8


def test_restore_puts_back_exactly_the_rejected_rows():
    cache = _cache()
    before = {k: t.clone() for k, t in cache.state_tensors().items()}
    rb = RingRollback(cache)
    # slot 1 verifies positions 13..16 (after 12), slot 2 positions 3..5 (after 2)
    pairs = [(1, 13), (1, 14), (1, 15), (1, 16), (2, 3), (2, 4), (2, 5)]
    snap = rb.snapshot([s for s, _ in pairs], [p for _, p in pairs])
    for t in cache.state_tensors().values():  # the forward overwrites those rows (and an accepted row)
        if t.numel():
            for s, p in pairs + [(1, 12)]:
                t[:, s, p % t.shape[2]] = -7.0
    rejected = [False, True, True, True, False, False, True]  # slot 1 accepted 1 draft, slot 2 two
    rb.restore(snap, rejected)
    for name, t in cache.state_tensors().items():
        if not t.numel():
            continue
        R = t.shape[2]
        expect = before[name].clone()
        for (s, p), rej in zip(pairs + [(1, 12)], rejected + [False]):
            if not rej:
                expect[:, s, p % R] = -7.0
        torch.testing.assert_close(t, expect, rtol=0, atol=0)


def test_snapshot_checks_its_input():
    rb = RingRollback(_cache())
    with pytest.raises(ValueError, match="one slot per position"):
        rb.snapshot([0], [1, 2])
    snap = rb.snapshot([0], [1])
    with pytest.raises(ValueError, match="flags"):
        rb.restore(snap, [True, False])


def test_num_accepted_is_the_common_prefix():
    assert num_accepted([5], []) == 0
    assert num_accepted([1, 2, 3, 9], [1, 2, 3]) == 3
    assert num_accepted([1, 7, 3, 9], [1, 2, 3]) == 1
    assert num_accepted([4, 2, 3, 9], [1, 2, 3]) == 0
    with pytest.raises(ValueError, match="one sampled token per verified position"):
        num_accepted([1, 2], [1, 2])


def test_verify_rows_see_the_drafts_before_them():
    a, b = SamplingParams(temperature=0.0), SamplingParams(seed=3)
    params, outs, prompts, first = expand_verify_rows([a, b], [[7], []], [[1, 2], [3]], [[10, 11], []])
    assert params == [a, a, a, b] and first == [0, 3]
    assert outs == [[7], [7, 10], [7, 10, 11], []] and prompts == [[1, 2]] * 3 + [[3]]
    # sampling positions follow: prompt + outputs (+ drafts) is the index of the token sampled
    batch = SamplingBatch.build(params, outs, prompts)
    assert batch.positions.tolist() == [3, 4, 5, 1]
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[1] = 5
    new, rows = expand_bitmask(mask, [1], first, 4)
    assert rows == [3] and new[3].tolist() == [5, 5] and new.shape == (4, 2)
    assert expand_bitmask(None, None, first, 4) == (None, None)


def _chi2_ok(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson chi-square statistic below a generous bound (mean + 5 standard deviations)."""
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    dof = int(keep.sum()) - 1
    return stat < dof + 5 * math.sqrt(2 * dof)


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(one_hot_draft):
    V, L, N = 6, 2, 4000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(L + 1, V, generator=g) * 1.5, -1)  # target per position (context-free here)
    q = torch.softmax(torch.randn(L, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    seeds = torch.arange(N)
    u = philox_uniform(seeds, torch.zeros(N, dtype=torch.long), L, stream=1)  # [N, L]
    noise = torch.stack([exponential_noise(seeds, torch.full((N,), j), V) for j in range(L + 1)], 1)  # [N, L+1, V]
    if one_hot_draft:  # greedy drafts: q is one-hot at its argmax
        drafts = q.argmax(-1).repeat(N, 1)
        q = torch.nn.functional.one_hot(drafts[0], V).float()
    else:
        drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(L)], 1)
    for i in range(N):
        toks = rejection_sample(p, q, drafts[i].tolist(), u[i], noise[i])
        first[toks[0]] += 1
        if len(toks) > 1:
            second[toks[1]] += 1
    assert _chi2_ok(first, p[0])
    assert _chi2_ok(second, p[1])  # given the first token (the target here ignores context)


def test_sample_then_compare_is_rejection_sampling_with_greedy_drafts():
    """The engine's rule (sample every verified position, keep the prefix that matches the drafts)
    emits each position's token from the target, whatever the drafts."""
    V, N = 6, 3000
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    draft = int(p[0].argsort()[-2])  # a plausible but not the likeliest token
    sampler = Sampler(seed=0)
    firsts, seconds = torch.zeros(V), torch.zeros(V)
    params = [SamplingParams(seed=i) for i in range(N)]
    rows_params = [x for sp in params for x in (sp, sp)]
    outs = [x for _ in range(N) for x in ([], [draft])]
    batch = SamplingBatch.build(rows_params, outs, [[0]] * (2 * N))
    ids = sampler.sample(logits.repeat(N, 1), batch).sampled_token_ids.view(N, 2).tolist()
    for row in ids:
        m = num_accepted(row, [draft])
        firsts[row[0]] += 1
        if m:
            seconds[row[1]] += 1
    assert _chi2_ok(firsts, p[0])
    assert _chi2_ok(seconds, p[1])
    assert abs(seconds.sum().item() / N - p[0, draft].item()) < 5 * math.sqrt(p[0, draft] * (1 - p[0, draft]) / N)
