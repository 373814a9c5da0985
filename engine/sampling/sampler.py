"""Batched, vectorised token sampler.

One step: the engine builds a `SamplingBatch` from its running requests (`SamplingBatch.build`), runs
the model to get logits `[num_reqs, vocab]`, and calls `Sampler.sample`. The pipeline, all as tensor
ops over the whole batch:

1. raw logprobs (`log_softmax` of the model logits) if any request asked for logprobs;
2. logits processing: `min_tokens` blocking, `logit_bias`, repetition / frequency / presence
   penalties, then the structured-output token bitmask (`Sampler.process_logits`);
3. greedy rows take the argmax of the processed logits;
4. other rows: temperature, top-k, top-p, min-p, then an exponential race (Gumbel-max in probability
   space): `argmax(probs / E)` with `E ~ Exp(1)` per token.

NOTE: reproducibility. The exponential noise is not drawn from a stateful generator: each element is
`Philox4x32-10(counter=(token_id // 4, position, stream, position >> 32), key=seed)`, computed with
exact 32-bit arithmetic in int64 tensors. A row's noise therefore depends only on its request's seed
and on the position of the token being generated, never on the other rows or on the row index, so a
seeded request draws the same token whatever batch it runs in. Rows without a seed get a fresh random
seed per step from the sampler's own `torch.Generator`. Every per-row transform above is also exact
identity for a disabled option (temperature 1, penalty 0, top-p 1, ...), so enabling an option on one
row does not perturb another row's numbers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.engine.forward_batch import host_to_device  # pinned, non-blocking copies (no host wait)
from deepinfer.engine.sampling.params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Philox4x32 round multipliers and Weyl key increments (Salmon et al., SC'11 / Random123).
_PHILOX_M0 = 0xD2511F53
_PHILOX_M1 = 0xCD9E8D57
_PHILOX_W0 = 0x9E3779B9
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10

NOISE_STREAM_SAMPLE = 0
"""Counter word that separates the sampler's noise from other users of the same (seed, position)
(e.g. a future speculative-decoding acceptance test uses another stream)."""


# ---------------------------------------------------------------------------------------------------
# Counter-based random numbers
# ---------------------------------------------------------------------------------------------------


def _mulhilo32(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of `a * multiplier` for `a` in [0, 2^32) held in int64.

    The 64-bit product would overflow int64, so the multiplier is split into 16-bit halves and every
    intermediate stays below 2^49.
    """
    m_hi, m_lo = multiplier >> 16, multiplier & 0xFFFF
    upper = a * m_hi  # < 2^48
    lower = a * m_lo + ((upper & 0xFFFF) << 16)  # < 2^49
    lo = lower & _MASK32
    hi = (upper >> 16) + (lower >> 32)  # exact, < 2^32
    return hi, lo


def _philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on broadcastable int64 tensors whose values are 32-bit words in [0, 2^32)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for round_index in range(_PHILOX_ROUNDS):
        if round_index:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo32(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo32(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox_uniform(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int = NOISE_STREAM_SAMPLE
) -> torch.Tensor:
    """Uniform noise in (0, 1), `[num_reqs, vocab_size]` float32, a pure function of (seed, position, token id).

    `seeds` `[num_reqs]` int64 (any 64-bit pattern), `positions` `[num_reqs]` int64 >= 0.
    """
    device = seeds.device
    num_groups = (vocab_size + 3) // 4  # one Philox call yields 4 words: tokens 4g .. 4g+3
    seeds = seeds.to(torch.int64)[:, None]  # [num_reqs, 1]
    positions = positions.to(torch.int64)[:, None]  # [num_reqs, 1]
    key = (seeds & _MASK32, (seeds >> 32) & _MASK32)
    group_ids = torch.arange(num_groups, device=device, dtype=torch.int64)[None, :]  # [1, num_groups]
    stream_word = torch.full_like(positions, stream & _MASK32)
    counter = (group_ids, positions & _MASK32, stream_word, (positions >> 32) & _MASK32)
    words = torch.stack(_philox4x32_10(counter, key), dim=-1)  # [num_reqs, num_groups, 4]
    words = words.reshape(words.shape[0], num_groups * 4)[:, :vocab_size]  # [num_reqs, vocab]
    # Top 23 bits -> (k + 0.5) / 2^23: exactly representable in float32, strictly inside (0, 1).
    return ((words >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise `[num_reqs, vocab_size]` float32 (> 0), a pure function of (seed, position, token id)."""
    return -torch.log(philox_uniform(seeds, positions, vocab_size))


# ---------------------------------------------------------------------------------------------------
# Batch inputs
# ---------------------------------------------------------------------------------------------------


def _to_int64_seed(seed: int) -> int:
    """Map any Python int to the int64 with the same low 64 bits."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _pad_token_ids(token_ids_list: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """`[len(token_ids_list), max_len]` int64, each row's ids then -1 padding; built with one copy."""
    num_rows = len(token_ids_list)
    lengths = torch.tensor([len(ids) for ids in token_ids_list], dtype=torch.int64)  # [num_rows]
    max_len = int(lengths.max()) if num_rows else 0
    padded = torch.full((num_rows, max_len), -1, dtype=torch.int64)
    if max_len:
        flat_ids = torch.tensor(list(itertools.chain.from_iterable(token_ids_list)), dtype=torch.int64)
        row_ids = torch.repeat_interleave(torch.arange(num_rows), lengths)  # [total]
        starts = torch.cumsum(lengths, 0) - lengths  # [num_rows]
        col_ids = torch.arange(flat_ids.numel()) - torch.repeat_interleave(starts, lengths)  # [total]
        padded[row_ids, col_ids] = flat_ids
    return host_to_device(padded, device)


def count_tokens(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token per row, `[num_rows, vocab_size]` float32, from -1-padded ids (scatter_add)."""
    num_rows = padded_token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=padded_token_ids.device)
    if padded_token_ids.numel():
        # Padding goes to a spare column `vocab_size` that is dropped afterwards.
        index = torch.where(padded_token_ids < 0, vocab_size, padded_token_ids)  # [num_rows, max_len]
        counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


@dataclass
class SamplingBatch:
    """Sampling inputs of one step for `num_reqs` requests, as tensors with one row per request.

    Built once per step by `build`. Optional tensors are None when no row of the batch needs them,
    and the `has_*` flags let `Sampler.sample` skip whole stages.
    """

    num_reqs: int
    temperatures: torch.Tensor  # [num_reqs] float32; 1.0 on greedy rows (never divides by zero)
    is_greedy: torch.Tensor  # [num_reqs] bool
    top_k: torch.Tensor  # [num_reqs] int64; 0 = disabled
    top_p: torch.Tensor  # [num_reqs] float32; 1.0 = disabled
    min_p: torch.Tensor  # [num_reqs] float32; 0.0 = disabled
    presence_penalties: torch.Tensor  # [num_reqs] float32
    frequency_penalties: torch.Tensor  # [num_reqs] float32
    repetition_penalties: torch.Tensor  # [num_reqs] float32
    seeds: torch.Tensor  # [num_reqs] int64 (low 64 bits of the request seed); 0 where not has_seed
    has_seed: torch.Tensor  # [num_reqs] bool
    positions: torch.Tensor  # [num_reqs] int64; index of the token being sampled in its sequence
    output_token_ids: torch.Tensor | None  # [num_reqs, max_num_output_tokens] int64, -1 padded
    prompt_token_ids: torch.Tensor | None  # [num_reqs, max_num_prompt_tokens] int64, -1 padded
    logit_bias_row_ids: torch.Tensor | None  # [num_biases] int64
    logit_bias_token_ids: torch.Tensor | None  # [num_biases] int64
    logit_bias_values: torch.Tensor | None  # [num_biases] float32
    min_tokens_row_ids: torch.Tensor | None  # [num_blocked] int64
    min_tokens_token_ids: torch.Tensor | None  # [num_blocked] int64
    num_logprobs: list[int | None]  # per request: SamplingParams.logprobs
    max_num_logprobs: int | None  # max over num_logprobs; None when no request wants logprobs
    all_greedy: bool
    all_random: bool
    has_top_k: bool
    has_top_p: bool
    has_min_p: bool
    has_additive_penalties: bool  # presence or frequency
    has_repetition_penalty: bool
    token_bitmask: torch.Tensor | None = None
    """[num_reqs, ceil(vocab / 32)] int32 allowed-token bits from the requests' grammars (structured
    output; all ones on unconstrained rows), filled by the engine; None when no row has a constraint."""
    token_bitmask_row_ids: list[int] | None = None
    """The rows `token_bitmask` constrains (the others are skipped); None = every row."""

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids_list: Sequence[Sequence[int]],
        prompt_token_ids_list: Sequence[Sequence[int]],
        positions: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        *,
        eos_token_ids: Sequence[int] = (),
    ) -> SamplingBatch:
        """Gather the per-request state of one step into tensors on `device`.

        `output_token_ids_list[i]` are request i's generated tokens so far, `prompt_token_ids_list[i]`
        its prompt; `positions[i]` the index of the token being sampled (default: prompt + output
        length). `eos_token_ids` are the model's EOS ids, blocked while `min_tokens` is unmet.
        """
        num_reqs = len(params_list)
        if len(output_token_ids_list) != num_reqs or len(prompt_token_ids_list) != num_reqs:
            raise ValueError(
                f"got {num_reqs} params, {len(output_token_ids_list)} output id lists and "
                f"{len(prompt_token_ids_list)} prompt id lists; need one of each per request"
            )
        if positions is None:
            positions = [len(p) + len(o) for p, o in zip(prompt_token_ids_list, output_token_ids_list)]
        elif len(positions) != num_reqs:
            raise ValueError(f"got {len(positions)} positions for {num_reqs} requests")

        is_greedy = [p.is_greedy for p in params_list]
        is_random = [not g for g in is_greedy]
        uses_additive = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params_list]
        uses_repetition = [p.repetition_penalty != 1.0 for p in params_list]

        def floats(values: list[float]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.float32), device)

        def ints(values: list[int]) -> torch.Tensor:
            return host_to_device(torch.tensor(values, dtype=torch.int64), device)

        # Token histories only for rows with penalties; the others stay empty (all padding).
        output_token_ids = prompt_token_ids = None
        if any(uses_additive) or any(uses_repetition):
            output_token_ids = _pad_token_ids(
                [ids if a or r else () for ids, a, r in zip(output_token_ids_list, uses_additive, uses_repetition)],
                device,
            )
        if any(uses_repetition):
            prompt_token_ids = _pad_token_ids(
                [ids if r else () for ids, r in zip(prompt_token_ids_list, uses_repetition)], device
            )

        bias_rows: list[int] = []
        bias_token_ids: list[int] = []
        bias_values: list[float] = []
        blocked_rows: list[int] = []
        blocked_token_ids: list[int] = []
        for row, (params, output_ids) in enumerate(zip(params_list, output_token_ids_list)):
            if params.logit_bias:
                bias_rows.extend([row] * len(params.logit_bias))
                bias_token_ids.extend(params.logit_bias.keys())
                bias_values.extend(params.logit_bias.values())
            if len(output_ids) < params.min_tokens:
                blocked = params.min_tokens_blocked_ids(eos_token_ids)
                blocked_rows.extend([row] * len(blocked))
                blocked_token_ids.extend(blocked)

        num_logprobs = [p.logprobs for p in params_list]
        requested = [k for k in num_logprobs if k is not None]
        return cls(
            num_reqs=num_reqs,
            temperatures=floats([1.0 if g else p.temperature for p, g in zip(params_list, is_greedy)]),
            is_greedy=host_to_device(torch.tensor(is_greedy, dtype=torch.bool), device),
            top_k=ints([max(p.top_k, 0) for p in params_list]),
            top_p=floats([p.top_p for p in params_list]),
            min_p=floats([p.min_p for p in params_list]),
            presence_penalties=floats([p.presence_penalty for p in params_list]),
            frequency_penalties=floats([p.frequency_penalty for p in params_list]),
            repetition_penalties=floats([p.repetition_penalty for p in params_list]),
            seeds=ints([0 if p.seed is None else _to_int64_seed(p.seed) for p in params_list]),
            has_seed=host_to_device(torch.tensor([p.seed is not None for p in params_list], dtype=torch.bool), device),
            positions=ints(list(positions)),
            output_token_ids=output_token_ids,
            prompt_token_ids=prompt_token_ids,
            logit_bias_row_ids=ints(bias_rows) if bias_rows else None,
            logit_bias_token_ids=ints(bias_token_ids) if bias_rows else None,
            logit_bias_values=floats(bias_values) if bias_rows else None,
            min_tokens_row_ids=ints(blocked_rows) if blocked_rows else None,
            min_tokens_token_ids=ints(blocked_token_ids) if blocked_rows else None,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            has_top_k=any(r and p.top_k > 0 for p, r in zip(params_list, is_random)),
            has_top_p=any(r and p.top_p < 1.0 for p, r in zip(params_list, is_random)),
            has_min_p=any(r and p.min_p > 0.0 for p, r in zip(params_list, is_random)),
            has_additive_penalties=any(uses_additive),
            has_repetition_penalty=any(uses_repetition),
        )


# ---------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled (or prompt) token, for one request, as plain Python values."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]  # the request's `logprobs` most likely tokens, most likely first
    top_logprobs: list[float]


@dataclass
class LogprobsTensors:
    """Logprobs of given tokens plus the top-`num_logprobs` alternatives, for `num_rows` rows."""

    token_ids: torch.Tensor  # [num_rows] int64, the tokens scored
    token_logprobs: torch.Tensor  # [num_rows] float32
    token_ranks: torch.Tensor  # [num_rows] int64, 1 = most likely
    top_token_ids: torch.Tensor  # [num_rows, num_logprobs] int64
    top_logprobs: torch.Tensor  # [num_rows, num_logprobs] float32

    def tolists(self, num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Per row, a `TokenLogprobs` truncated to that row's count (None where the count is None).

        One device-to-host copy per tensor for the whole batch.
        """
        token_ids = self.token_ids.tolist()
        token_logprobs = self.token_logprobs.tolist()
        token_ranks = self.token_ranks.tolist()
        top_token_ids = self.top_token_ids.tolist()
        top_logprobs = self.top_logprobs.tolist()
        results: list[TokenLogprobs | None] = []
        for row, count in enumerate(num_logprobs):
            if count is None:
                results.append(None)
                continue
            results.append(
                TokenLogprobs(
                    token_id=token_ids[row],
                    logprob=token_logprobs[row],
                    rank=token_ranks[row],
                    top_token_ids=top_token_ids[row][:count],
                    top_logprobs=top_logprobs[row][:count],
                )
            )
        return results


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Score `token_ids` `[num_rows]` against normalised `logprobs` `[num_rows, vocab]` and take the top ones.

    Used for sampled tokens (one row per request) and for prompt logprobs (row i = the logits at prompt
    position i, token i+1 the one scored).
    """
    token_ids = token_ids.to(torch.int64)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [num_rows]
    token_ranks = (logprobs > token_logprobs[:, None]).sum(dim=-1) + 1  # [num_rows]
    if num_logprobs > 0:
        top_logprobs, top_token_ids = logprobs.topk(num_logprobs, dim=-1)  # [num_rows, num_logprobs]
    else:
        top_logprobs = logprobs.new_empty(logprobs.shape[0], 0)
        top_token_ids = token_ids.new_empty(logprobs.shape[0], 0)
    return LogprobsTensors(token_ids, token_logprobs, token_ranks, top_token_ids, top_logprobs)


@dataclass
class SamplerOutput:
    """Result of one `Sampler.sample` call."""

    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None  # raw-logit logprobs of the sampled tokens; None if none asked
    num_logprobs: list[int | None]  # per request, how many top logprobs it asked for

    def request_logprobs(self) -> list[TokenLogprobs | None]:
        """Per request, its sampled token's logprobs with exactly the number of top entries it asked for."""
        if self.logprobs is None:
            return [None] * len(self.num_logprobs)
        return self.logprobs.tolists(self.num_logprobs)


# ---------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------


class Sampler:
    """Turns a step's logits `[num_reqs, vocab]` into one token per request (see the module docstring).

    `seed` seeds the generator that supplies per-step seeds to requests that have none; it does not
    affect requests with their own seed.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator(device="cpu")
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of `logits` `[num_reqs, vocab]` (float32) with `batch`'s parameters."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_reqs:
            raise ValueError(f"logits must be [num_reqs={batch.num_reqs}, vocab], got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")

        logprobs = None
        if batch.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # [num_reqs, vocab]

        processed = self.process_logits(logits, batch)  # [num_reqs, vocab]
        if batch.all_greedy:
            sampled = processed.argmax(dim=-1)
        else:
            random_ids = self._sample_random(processed, batch)  # [num_reqs]
            if batch.all_random:
                sampled = random_ids
            else:
                sampled = torch.where(batch.is_greedy, processed.argmax(dim=-1), random_ids)

        if batch.max_num_logprobs is not None:
            logprobs = compute_logprobs(raw_logprobs, sampled, batch.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, num_logprobs=batch.num_logprobs)

    def process_logits(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Apply min_tokens blocking, logit bias and penalties; returns new logits `[num_reqs, vocab]`.

        Order (as vLLM): min_tokens, logit bias, repetition, frequency, presence, then the grammar
        bitmask (disallowed tokens -> -inf), so the penalties never revive a disallowed token.
        """
        logits = logits.clone()
        if batch.min_tokens_row_ids is not None:
            logits[batch.min_tokens_row_ids, batch.min_tokens_token_ids] = float("-inf")
        if batch.logit_bias_row_ids is not None:
            logits.index_put_(
                (batch.logit_bias_row_ids, batch.logit_bias_token_ids), batch.logit_bias_values, accumulate=True
            )
        if batch.output_token_ids is not None:
            logits = self._apply_penalties(logits, batch)
        if batch.token_bitmask is not None:
            from deepinfer.engine.structured_output import apply_bitmask

            apply_bitmask(logits, batch.token_bitmask, batch.token_bitmask_row_ids)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition (prompt + output), frequency and presence (output only, as OpenAI) penalties."""
        vocab_size = logits.shape[-1]
        output_counts = count_tokens(batch.output_token_ids, vocab_size)  # [num_reqs, vocab]
        if batch.has_repetition_penalty:
            seen = output_counts > 0  # [num_reqs, vocab]
            if batch.prompt_token_ids is not None:
                seen |= count_tokens(batch.prompt_token_ids, vocab_size) > 0
            penalties = batch.repetition_penalties[:, None]  # [num_reqs, 1]
            penalized = torch.where(logits > 0, logits / penalties, logits * penalties)
            logits = torch.where(seen, penalized, logits)
        if batch.has_additive_penalties:
            logits = logits - batch.frequency_penalties[:, None] * output_counts
            logits = logits - batch.presence_penalties[:, None] * (output_counts > 0).to(logits.dtype)
        return logits

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race; `[num_reqs]` token ids."""
        num_reqs, vocab_size = logits.shape
        logits = logits / batch.temperatures[:, None]
        if batch.has_top_k or batch.has_top_p:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.has_top_k, batch.has_top_p)
        probs = torch.softmax(logits, dim=-1)  # [num_reqs, vocab]
        if batch.has_min_p:
            max_probs = probs.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
            probs = probs.masked_fill(probs < batch.min_p[:, None] * max_probs, 0.0)

        step_seeds = torch.randint(0, 2**62, (num_reqs,), generator=self._generator, dtype=torch.int64)
        seeds = torch.where(batch.has_seed, batch.seeds, host_to_device(step_seeds, logits.device))  # [num_reqs]
        noise = exponential_noise(seeds, batch.positions, vocab_size)  # [num_reqs, vocab]
        return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, has_top_k: bool, has_top_p: bool
) -> torch.Tensor:
    """Mask logits `[num_reqs, vocab]` outside each row's top-k, then outside its nucleus, to -inf.

    NOTE: cut-offs are logit thresholds, so tokens tied with the last kept token are kept too; the
    result does not depend on how the sort orders ties. Disabled rows get a -inf threshold (no-op).
    """
    vocab_size = logits.shape[-1]
    sorted_logits = logits.sort(dim=-1, descending=True).values  # [num_reqs, vocab]
    if has_top_k:
        k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k)  # [num_reqs]
        kth_logits = sorted_logits.gather(1, (k - 1)[:, None])  # [num_reqs, 1]
        kth_logits = torch.where((top_k <= 0)[:, None], float("-inf"), kth_logits)
        logits = logits.masked_fill(logits < kth_logits, float("-inf"))
        ranks = torch.arange(vocab_size, device=logits.device)[None, :]  # [1, vocab]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if has_top_p:
        sorted_probs = torch.softmax(sorted_logits, dim=-1)  # [num_reqs, vocab]
        # Mass strictly before each token; the most likely token has 0 < top_p, so one token always stays.
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [num_reqs, vocab]
        num_kept = (mass_before < top_p[:, None]).sum(dim=-1)  # [num_reqs], >= 1
        last_kept_logits = sorted_logits.gather(1, (num_kept - 1)[:, None])  # [num_reqs, 1]
        last_kept_logits = torch.where((top_p >= 1.0)[:, None], float("-inf"), last_kept_logits)
        logits = logits.masked_fill(logits < last_kept_logits, float("-inf"))
    return logits
