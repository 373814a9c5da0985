"""Sampling on the ranks: each rank samples the rows of its own requests, so no logits travel.

The sampler's draws are row-independent (`engine.sampling.sampler`): a row's exponential noise depends only
on its seed and the position it samples, and every logits transform is per row. Only the per-step seeds of
rows without a request seed come from a stateful generator (rank 0's sampler). So rank 0 draws those seeds
exactly as its own `Sampler.sample` would (`resolve_seeds`: the same generator, the same draw, only when the
step is not all greedy), writes them into the batch as if each row had its seed, and ships each rank its
rows (`select_rows`); a rank's sampler then draws the same token and logprobs as the single-process
engine, bit for bit. Rank 0 receives token ids and per-row logprobs (a few numbers a row) instead of
`[rows, vocab]` float32 logits.
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.engine.sampling.sampler import SamplingBatch

_ROW_FIELDS = ("temperatures", "is_greedy", "top_k", "top_p", "min_p", "presence_penalties", "frequency_penalties",
               "repetition_penalties", "seeds", "has_seed", "positions", "output_token_ids", "prompt_token_ids",
               "token_bitmask")
"""`SamplingBatch` tensors with one row per request (first dimension `num_reqs`)."""


def resolve_seeds(batch: SamplingBatch, generator: torch.Generator) -> SamplingBatch:
    """`batch` with every row seeded: rows without a request seed get the per-step seed `Sampler.sample` would
    draw for them from `generator` (the same draw, advancing `generator` the same way); unchanged when the
    step is all greedy (the sampler then draws nothing)."""
    if batch.all_greedy:
        return batch
    step_seeds = torch.randint(0, 2**62, (batch.num_reqs,), generator=generator, dtype=torch.int64)
    seeds = torch.where(batch.has_seed, batch.seeds, step_seeds.to(batch.seeds.device))
    return dataclasses.replace(batch, seeds=seeds, has_seed=torch.ones_like(batch.has_seed))


def select_rows(batch: SamplingBatch, rows: list[int]) -> SamplingBatch:
    """The sampling inputs of `rows` (in that order) as a batch of their own, on the host (picklable).

    Flags (`all_greedy`, `has_top_k`, ...) are kept: a stage enabled for rows that do not need it is exact
    identity there. `max_num_logprobs` stays the batch's, so each rank's logprobs have the same width.
    """
    pos = {r: i for i, r in enumerate(rows)}
    idx = torch.tensor(rows, dtype=torch.long)
    changes: dict = {"num_reqs": len(rows), "num_logprobs": [batch.num_logprobs[r] for r in rows]}
    for name in _ROW_FIELDS:
        t = getattr(batch, name)
        changes[name] = None if t is None else t.cpu()[idx]
    for prefix, cols in (("logit_bias", ("token_ids", "values")), ("min_tokens", ("token_ids",))):
        row_ids = getattr(batch, f"{prefix}_row_ids")
        if row_ids is None:
            continue
        keep = [i for i, r in enumerate(row_ids.tolist()) if r in pos]
        keep_t = torch.tensor(keep, dtype=torch.long)
        changes[f"{prefix}_row_ids"] = (torch.tensor([pos[r] for r in row_ids.tolist() if r in pos], dtype=torch.long)
                                        if keep else None)
        for c in cols:
            changes[f"{prefix}_{c}"] = getattr(batch, f"{prefix}_{c}").cpu()[keep_t] if keep else None
    if batch.token_bitmask_row_ids is not None:
        changes["token_bitmask_row_ids"] = [pos[r] for r in batch.token_bitmask_row_ids if r in pos]
    return dataclasses.replace(batch, **changes)


def to_device(batch: SamplingBatch, device: torch.device) -> SamplingBatch:
    """`batch` with its tensors on `device` (a rank's own)."""
    return dataclasses.replace(batch, **{f.name: getattr(batch, f.name).to(device)
                                         for f in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, f.name), torch.Tensor)})
