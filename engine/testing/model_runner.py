"""A minimal driver of the model over a cache, for tests and benchmarks (no scheduler).

Each sequence gets its own slot and a contiguous run of blocks; `run` takes a list of
`(seq_index, new_token_ids)` and executes them as one flat batch.
"""

from __future__ import annotations

import math

import torch

from engine.cache.kv_cache import V4KVCache
from engine.forward_batch import ForwardBatch, SeqChunk


class ModelRunnerForTests:
    """Drives `DeepseekV4ForCausalLM` for up to `max_seqs` sequences of up to `max_len` tokens."""

    def __init__(self, model, max_seqs: int = 4, max_len: int = 512, block_size: int | None = None) -> None:
        cfg = model.config
        self.block_size = block_size or math.lcm(*cfg.compress_rates.values())
        blocks_per_seq = -(-max_len // self.block_size)
        dtype = model.model.embed_tokens.weight.dtype
        device = model.model.embed_tokens.weight.device
        self.model = model
        self.cache = V4KVCache(cfg, blocks_per_seq * max_seqs, self.block_size, max_seqs, dtype=dtype, device=device)
        self.tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(max_seqs)]
        self.lens = [0] * max_seqs
        self.device = device

    def run(self, work: list[tuple[int, list[int]]], logits: str = "last") -> torch.Tensor:
        """One step over `(seq, new_token_ids)` pairs; returns float32 logits (last token of each, or all)."""
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], len(ids)) for i, ids in work]
        batch = ForwardBatch.build([ids for _, ids in work], seqs, device=self.device, logits=logits)
        out = self.model.step(batch, self.cache)
        for i, ids in work:
            self.lens[i] += len(ids)
        return out

    def prefill(self, seq: int, ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Feed `ids` in chunks; return the last token's logits [vocab]."""
        chunk = chunk or len(ids)
        out = None
        for a in range(0, len(ids), chunk):
            out = self.run([(seq, ids[a:a + chunk])])
        return out[0]

    def greedy(self, seq: int, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation of `prompt` for `num_tokens` tokens."""
        logits = self.prefill(seq, prompt)
        out = []
        for _ in range(num_tokens):
            t = int(logits.argmax())
            out.append(t)
            logits = self.run([(seq, [t])])[0]
        return out
