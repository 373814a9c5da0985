"""Lossless acceptance of draft tokens, and the per-position sampling rows it needs.

The engine's rule (`num_accepted`): a request verifying drafts `d_1 .. d_L` gets one sampling row per
verified position `j = 0 .. L` (the logits at position `p + j`, after its own logits processors: the
penalties and `min_tokens` see the outputs followed by `d_1 .. d_j`, the seeded noise is that of the
position being sampled). The sampler draws `x_j` from every row exactly as it would without
speculation; the request keeps `x_0 .. x_m`, where `m` is the first `j` with `x_j != d_{j+1}` (or `L`).

NOTE: why this is lossless. Row `j` is only kept when `x_0 .. x_{j-1}` equal the drafts, i.e. when
its context is exactly the sequence so far, so every kept `x_j` is distributed as the
non-speculative sampler's token at that position (and for a seeded request it *is* that token: the
noise depends on (seed, position) only, `engine.sampling.sampler`). For drafts proposed greedily (a
one-hot draft distribution `q = e_d`) this is standard rejection sampling: `d` is accepted with
probability `min(1, p(d) / q(d)) = p(d)`, and on rejection the token comes from `norm(max(0, p - q))`
= `p` conditioned on `!= d`, which is what `x_j | x_j != d` is. Greedy rows take the argmax, so
greedy outputs equal non-speculative ones token for token.

`rejection_sample` is the general rule for drafts drawn from a non-degenerate `q` (a later
sampling drafter); it is tested against the target distribution with a chi-square bound.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.engine.sampling.params import SamplingParams


def num_accepted(sampled: Sequence[int], drafts: Sequence[int]) -> int:
    """Drafts accepted: the length of the common prefix of `sampled[:len(drafts)]` and `drafts`.

    `sampled` has one token per verified position (`len(drafts) + 1`); the request then keeps
    `sampled[:num_accepted + 1]`.
    """
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"need one sampled token per verified position ({len(drafts) + 1}), got {len(sampled)}")
    m = 0
    while m < len(drafts) and sampled[m] == drafts[m]:
        m += 1
    return m


def expand_verify_rows(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[list[int]],
    prompt_token_ids: Sequence[list[int]],
    drafts: Sequence[Sequence[int]],
) -> tuple[list[SamplingParams], list[list[int]], list[list[int]], list[int]]:
    """One sampling row per verified position: request `i` gets `1 + len(drafts[i])` rows, row `j`
    with the outputs followed by `drafts[i][:j]` (so its penalties, `min_tokens` and sampling position
    are those of that position). Returns (params, outputs, prompts, first row of each request)."""
    rows_params: list[SamplingParams] = []
    rows_outs: list[list[int]] = []
    rows_prompts: list[list[int]] = []
    first_rows: list[int] = []
    for p, outs, prompt, d in zip(params, output_token_ids, prompt_token_ids, drafts, strict=True):
        first_rows.append(len(rows_params))
        for j in range(len(d) + 1):
            rows_params.append(p)
            rows_outs.append(list(outs) + list(d[:j]) if j else outs)
            rows_prompts.append(prompt)
    return rows_params, rows_outs, rows_prompts, first_rows


def expand_bitmask(bitmask: torch.Tensor | None, row_ids: list[int] | None, first_rows: list[int],
                   num_rows: int) -> tuple[torch.Tensor | None, list[int] | None]:
    """A per-request grammar bitmask `[num_reqs, words]` moved to the expanded rows `[num_rows, words]`.

    NOTE: only the first row of a constrained request is constrained, which is right only for a request
    without drafts; the engine masks every verify row of a constrained request itself
    (`GrammarState.fill_verify_bitmask`: row `j` as after drafts `1 .. j`)."""
    if bitmask is None:
        return None, None
    out = torch.full((num_rows, bitmask.shape[1]), -1, dtype=bitmask.dtype, device=bitmask.device)
    rows = list(range(bitmask.shape[0])) if row_ids is None else row_ids
    new_ids = [first_rows[r] for r in rows]
    out[new_ids] = bitmask[rows]
    return out, new_ids


def rejection_sample(
    target_probs: torch.Tensor,  # [L + 1, V] the target's distribution at each verified position
    draft_probs: torch.Tensor,  # [L, V] the drafter's distribution each draft was drawn from
    draft_token_ids: Sequence[int],  # [L]
    uniforms: torch.Tensor,  # [L] in (0, 1): the acceptance tests
    noise: torch.Tensor,  # [L + 1, V] Exp(1) noise: the residual / bonus draws (exponential race)
) -> list[int]:
    """Standard speculative rejection sampling for one request: the tokens it emits (`1 .. L + 1`).

    Draft `j` is accepted when `u_j * q_j(d_j) < p_j(d_j)`; the first rejected position emits a
    draw from `norm(max(0, p_j - q_j))`, and a fully accepted block a bonus draw from `p_L`. The
    emitted sequence is distributed exactly as `L + 1` (or fewer) draws from the target.
    """
    L = len(draft_token_ids)
    if target_probs.shape[0] != L + 1 or draft_probs.shape[0] != L:
        raise ValueError(f"need {L + 1} target rows and {L} draft rows; got {target_probs.shape[0]} and "
                         f"{draft_probs.shape[0]}")
    out: list[int] = []
    for j, d in enumerate(draft_token_ids):
        p, q = target_probs[j, d].item(), draft_probs[j, d].item()
        if uniforms[j].item() * q < p:
            out.append(int(d))
            continue
        residual = (target_probs[j] - draft_probs[j]).clamp(min=0)
        out.append(int((residual / noise[j]).argmax()))
        return out
    out.append(int((target_probs[L] / noise[L]).argmax()))
    return out
