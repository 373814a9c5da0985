"""What one model step computes: a flat, unpadded batch of tokens from many requests.

A step mixes prefill chunks and decode tokens of different requests. Tokens of one request are
contiguous in the flat batch and in position order. Each request brings its cache handles: a
bounded-state slot and a block table of compressed-entry blocks (see `engine.cache.kv_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deepinfer.engine.attention.base import AttentionMetadata


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` (a CPU tensor) on `device`, without making the host wait for the device.

    NOTE: a plain `.to("cuda")` of pageable memory copies synchronously: the calling thread waits for
    every kernel already queued on the stream. When the engine thread prepares step N+1 while step N
    runs (overlapped scheduling), that wait would undo the overlap; a pinned staging copy lets the
    transfer queue behind step N instead. The pinned block is recycled only after the copy has run
    (torch's caching host allocator records the stream).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class SeqChunk:
    """One request's share of a step."""

    slot: int
    """Bounded-state slot of the request."""
    block_table: list[int]
    """Block ids covering at least `num_computed_tokens + num_new_tokens` tokens."""
    num_computed_tokens: int
    """Tokens already in the cache (the first new token's position)."""
    num_new_tokens: int
    """Tokens of this request in the step."""
    state_start: int = 0
    """First position whose bounded state (window ring, compressor buffers) is valid in the slot.
    Larger than 0 while a request replays recent tokens to rebuild that state (bounded replay)."""
    num_frozen_tokens: int = 0
    """Compressed entries of windows ending at or before this position are already in the
    (possibly shared) blocks: they are read, never rewritten."""
    num_prompt_tokens: int | None = None
    """Length of the request's prompt (its original one: a resumed request's outputs do not count, nor the
    generated tokens a continuation carries in its prompt, `Request.num_original_prompt_tokens`), or None
    (unknown: side passes, tests). DeepSeek-V4.1's decoder-side bounded replay computes the layers after its
    last KV source only from position `num_prompt_tokens - sliding_window` on (`engine.models.deepseek_v41`)."""


@dataclass
class ForwardBatch:
    """A step's flat batch plus per-request cache handles.

    `logits_indices` selects the flat positions whose next-token logits are wanted (usually the
    last token of each request that finishes its prefill or decodes).
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    seqs: list[SeqChunk]
    logits_indices: torch.Tensor | None = None  # [num_logits] int64
    positions: torch.Tensor = field(init=False)  # [num_tokens] int64
    starts: list[int] = field(init=False)
    """Offset of each request's first token in the flat batch."""
    input_embeds: torch.Tensor | None = None
    """Optional [num_tokens, hidden] embeddings overriding `input_ids` rows where `embeds_mask` is set."""
    embeds_mask: torch.Tensor | None = None  # [num_tokens] bool
    attn_metadata: AttentionMetadata | None = None
    """The step's `engine.attention.AttentionMetadata`, set by the model runner when it prepares the step
    (None: the model builds it at the start of the forward)."""
    num_dummy_rows: int = 0
    """Trailing padding rows added to reach a CUDA-graph bucket (`engine.cuda_graph`): the cache's dummy slot
    and block at position 0, touching no request's state; no `logits_indices` entry points at them."""

    def __post_init__(self) -> None:
        n = sum(s.num_new_tokens for s in self.seqs)
        if self.input_ids.dim() != 1 or self.input_ids.numel() != n:
            raise ValueError(f"input_ids must be flat with {n} tokens (sum of num_new_tokens); got {tuple(self.input_ids.shape)}")
        # NOTE: Python ints into one tensor: a `torch.arange` per request + `cat` cost ~60 % of a 128-request
        # decode step's host preparation (CPU profile, 2026-12-05)
        pos: list[int] = []
        starts, off = [], 0
        for s in self.seqs:
            if s.num_new_tokens <= 0:
                raise ValueError("every SeqChunk needs num_new_tokens >= 1")
            starts.append(off)
            pos.extend(range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens))
            off += s.num_new_tokens
        self.starts = starts
        self.positions = (host_to_device(torch.tensor(pos, dtype=torch.long), self.input_ids.device) if pos
                          else self.input_ids.new_zeros(0))

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @classmethod
    def build(
        cls,
        token_ids: list[list[int]],
        seqs: list[SeqChunk],
        device: torch.device | str = "cpu",
        logits: str | list[int] = "last",
    ) -> ForwardBatch:
        """Flatten per-request new token ids; `logits='last'` wants the last token of each request."""
        flat = [t for ids in token_ids for t in ids]
        ids = host_to_device(torch.tensor(flat, dtype=torch.long), device)
        if logits == "last":
            idx, off = [], 0
            for s in seqs:
                off += s.num_new_tokens
                idx.append(off - 1)
        elif logits == "all":
            idx = list(range(len(flat)))
        else:
            idx = list(logits)
        return cls(input_ids=ids, seqs=seqs, logits_indices=host_to_device(torch.tensor(idx, dtype=torch.long), device))
