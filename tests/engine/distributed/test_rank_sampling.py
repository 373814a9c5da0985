"""Sampling on the ranks (`engine.distributed.sampling`), in process: a rank's subset of the step's sampling
inputs, with rank 0's seeds resolved, samples exactly the rows the whole batch samples."""

from __future__ import annotations

import torch

from deepinfer.engine.distributed.sampling import resolve_seeds, select_rows
from deepinfer.engine.sampling import SamplingParams
from deepinfer.engine.sampling.sampler import Sampler, SamplingBatch


def test_rows_sampled_per_rank_equal_the_whole_batch():
    params = [
        SamplingParams(temperature=0.8, seed=3, logprobs=2, logit_bias={1: 2.0, 7: -1.0}),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, min_tokens=4),
        SamplingParams(temperature=1.0, top_k=5, logprobs=0, logit_bias={3: 1.5}),
        SamplingParams(temperature=0.6, top_p=0.8, min_p=0.1, presence_penalty=0.3, min_tokens=2),
        SamplingParams(temperature=1.2),
    ]
    outputs = [[1, 2], [3], [], [4, 4], [5]]
    prompts = [[6, 7], [8], [9, 1], [2], [3, 3]]
    batch = SamplingBatch.build(params, outputs, prompts, positions=[5, 6, 7, 8, 9], eos_token_ids=(0,))
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    whole = Sampler(seed=11).sample(logits, batch)
    gen = torch.Generator().manual_seed(11)  # rank 0's sampler generator, as `Sampler(seed=11)` has it
    resolved = resolve_seeds(batch, gen)
    assert bool(resolved.has_seed.all())
    tokens, lps = [None] * 5, [None] * 5
    for rows in ([3, 0], [4, 1, 2]):  # two ranks, rows in each rank's logits order
        part = select_rows(resolved, rows)
        assert part.num_reqs == len(rows)
        out = Sampler(seed=999).sample(logits[rows], part)  # a rank's sampler draws nothing of its own
        for r, t, lp in zip(rows, out.sampled_token_ids.tolist(), out.request_logprobs()):
            tokens[r], lps[r] = t, lp
    assert tokens == whole.sampled_token_ids.tolist()
    assert lps == whole.request_logprobs()


def test_an_all_greedy_step_draws_no_seed():
    batch = SamplingBatch.build([SamplingParams(temperature=0.0)] * 2, [[], []], [[1], [2]])
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    assert resolve_seeds(batch, gen) is batch and torch.equal(gen.get_state(), state)
