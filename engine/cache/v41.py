"""DeepSeek-V4.1's cache anatomy (docs/V4_1.md §2, §4): only KV sources own compressed entries.

V4.1 layers with `compress_ratio > 0` *read* a compressed KV, but only the KV sources
(`kv_source_layer_ids`) compute and store one; every later layer of the same ratio reads the latest
source's entries (and index keys). So the paged pools have one row per KV source, not per layer:

* paged (units are blocks; a block covers `block_size` tokens, a multiple of every ratio):
  - `entries_r{r}`    `[sources of ratio r, num_blocks, block_size // r, head_dim]` — the compressed KV
    (normed, rotated at the group's first token);
  - `index_keys_r{r}` `[sources of ratio r, num_blocks, block_size // r, index_head_dim]` — the indexer
    keys derived from the same latent (`wk`, `k_norm`, rotated);
* bounded state (units are slots):
  - `window_kv` `[num_layers, num_slots, sliding_window, head_dim]` — every layer's ring, as in V4;
  - `comp_kv_r{r}` `[sources of ratio r, num_slots, r, head_dim]` (and `comp_gate_r{r}` for r > 1) — the
    projected tokens of the unfinished group (V4.1's groups do not overlap, so `r` rows);
  - `engram_tokens` `[1, num_slots, engram_max_ngram_size - 1]` (int64) — the request's last token ids, the
    history each new token's n-gram hashes read (position `p` in row `p % (max_ngram - 1)`).

Prefix hashing, the block pool and bounded replay work as for V4 (one block table per request; the
bounded state is rebuilt by recomputing recent tokens, `exact_replay_tokens`).

Padding rows (CUDA-graph decode) use `dummy_slot` / `dummy_block`, ids one past the real ranges as in `V4KVCache`,
owning no memory (the pools keep their `PoolLayout` shapes): the static decode path of
`engine.models.deepseek_v41.PagedAttention` reads clamped rows for them, masks them, and writes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.engine.cache.layout import PoolLayout, default_block_size


@dataclass(frozen=True)
class V41CacheLayout:
    """Where each V4.1 layer's state lives and how big every pool is (the V4.1 counterpart of `CacheLayout`)."""

    num_layers: int
    ratios: tuple[int, ...]
    """Per layer: its compress ratio (0: window only)."""
    source_of: tuple[int, ...]
    """Per layer: the KV source whose entries it reads (-1: window only)."""
    source_row: tuple[int, ...]
    """Per layer: the row of its KV source in that ratio's pools (-1: window only)."""
    pool_ratios: tuple[int, ...]
    """The distinct ratios of the KV sources, descending (pool order)."""
    sources_per_ratio: tuple[int, ...]
    """Number of KV sources of each ratio in `pool_ratios`."""
    head_dim: int
    index_head_dim: int
    sliding_window: int
    engram_history: int
    """Token ids kept per slot for the Engram hashes (`engram_max_ngram_size - 1`; 0 without Engram)."""

    @classmethod
    def from_config(cls, config) -> V41CacheLayout:
        """From a `V41Config` (backbone layers only: DSpark stages are not built)."""
        n = config.num_hidden_layers
        ratios = tuple(config.compress_ratios[:n])
        pool_ratios = tuple(sorted({ratios[s] for s in config.kv_source_layer_ids}, reverse=True))
        rows: dict[int, int] = {}
        counts = dict.fromkeys(pool_ratios, 0)
        for s in sorted(config.kv_source_layer_ids):
            rows[s] = counts[ratios[s]]
            counts[ratios[s]] += 1
        src = tuple(-1 if config.kv_source_of(i) is None else config.kv_source_of(i) for i in range(n))
        return cls(
            num_layers=n, ratios=ratios, source_of=src,
            source_row=tuple(-1 if s < 0 else rows[s] for s in src),
            pool_ratios=pool_ratios, sources_per_ratio=tuple(counts[r] for r in pool_ratios),
            head_dim=config.head_dim, index_head_dim=config.index_head_dim, sliding_window=config.sliding_window,
            engram_history=config.engram_max_ngram_size - 1 if config.engram_layer_ids else 0,
        )

    @property
    def compress_rates(self) -> tuple[int, ...]:
        return self.pool_ratios

    @property
    def default_block_size(self) -> int:
        """A multiple of every ratio, at least 64 tokens where they allow (`default_block_size`)."""
        return default_block_size(self.pool_ratios or (1,))

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError unless `block_size` is a multiple of every ratio (one block id = one token span)."""
        for r in self.pool_ratios:
            if block_size % r:
                raise ValueError(f"block_size ({block_size}) must be a multiple of every compress ratio "
                                 f"{list(self.pool_ratios)}; pick a multiple of {math.lcm(*self.pool_ratios)}.")

    def compressed_bytes_per_token(self, itemsize: int) -> float:
        """Bytes of compressed KV (entries + index keys of every KV source) one token adds, at `itemsize`."""
        per_tok = sum(n * (self.head_dim + self.index_head_dim) / r
                      for r, n in zip(self.pool_ratios, self.sources_per_ratio))
        return per_tok * itemsize

    def pools(self, num_blocks: int, block_size: int, num_slots: int, itemsize: int) -> dict[str, PoolLayout]:
        """Every cache tensor's `PoolLayout` by name: the paged pools, then the bounded state (module docstring)."""
        self.check_block_size(block_size)
        D, ID, W = self.head_dim, self.index_head_dim, self.sliding_window
        out: dict[str, PoolLayout] = {}
        for r, n in zip(self.pool_ratios, self.sources_per_ratio):
            out[f"entries_r{r}"] = PoolLayout(f"entries_r{r}", n, num_blocks, (block_size // r, D), itemsize, False)
            out[f"index_keys_r{r}"] = PoolLayout(f"index_keys_r{r}", n, num_blocks, (block_size // r, ID), itemsize,
                                                 False)
        out["window_kv"] = PoolLayout("window_kv", self.num_layers, num_slots, (W, D), itemsize, True)
        for r, n in zip(self.pool_ratios, self.sources_per_ratio):
            out[f"comp_kv_r{r}"] = PoolLayout(f"comp_kv_r{r}", n, num_slots, (r, D), itemsize, True)
            if r > 1:
                out[f"comp_gate_r{r}"] = PoolLayout(f"comp_gate_r{r}", n, num_slots, (r, D), itemsize, True)
        if self.engram_history:
            out["engram_tokens"] = PoolLayout("engram_tokens", 1, num_slots, (self.engram_history,), 8, True)
        return out


class V41KVCache:
    """V4.1's paged pools (one row per KV source) plus per-slot bounded state; the surface of `V4KVCache`
    (pool layouts, dummy ids, block byte ranges, block / slot copies) over `V41CacheLayout`'s pools."""

    def __init__(self, config, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", max_model_len: int | None = None) -> None:
        lay = V41CacheLayout.from_config(config)
        self.config, self.layout = config, lay
        self.num_blocks, self.block_size, self.num_slots = num_blocks, block_size, num_slots
        self.dtype, self.device = dtype, torch.device(device)
        self.pool_layouts = lay.pools(num_blocks, block_size, num_slots, torch.tensor([], dtype=dtype).element_size())
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.max_blocks_per_seq = num_blocks if max_model_len is None else -(-max_model_len // block_size)
        self.dummy_slot = num_slots
        self.dummy_block = num_blocks
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.zeros(p.shape, dtype=torch.int64 if name == "engram_tokens" else dtype, device=self.device)
            for name, p in self.pool_layouts.items()
        }
        # each tensor by attribute too, as V4KVCache: the transfer agent and the KV store address a pool
        # as `getattr(cache, pool_layout.name)`
        for name, t in self.tensors.items():
            setattr(self, name, t)
        self.window_kv: torch.Tensor  # [num_layers, num_slots, W, D]

    def add_state(self, name: str, tensor: torch.Tensor) -> None:
        """Make `tensor` ([layers, slots, ...], slot = dim 1, contiguous) part of every slot's bounded state: it is
        then a state pool (`pool_layouts`, `state_tensors`, `getattr(cache, name)`) that `copy_slot` copies and a
        transfer agent built afterwards registers and moves with a slot (the DSpark drafter's window rings,
        `spec_decode.dspark_drafter`). Call it before any agent is built."""
        if name in self.tensors:
            raise ValueError(f"cache tensor {name!r} already exists")
        if tensor.dim() < 2 or tensor.shape[1] < self.num_slots or not tensor.is_contiguous():
            raise ValueError(f"state tensor {name!r} must be contiguous [layers, slots >= {self.num_slots}, ...], got "
                             f"{tuple(tensor.shape)}")
        self.pool_layouts[name] = PoolLayout(name, tensor.shape[0], tensor.shape[1], tuple(tensor.shape[2:]),
                                             tensor.element_size(), True)
        self.tensors[name] = tensor
        setattr(self, name, tensor)

    def entries(self, ratio: int) -> torch.Tensor:
        """`entries_r{ratio}` [sources, num_blocks, block_size // ratio, head_dim]."""
        return self.tensors[f"entries_r{ratio}"]

    def index_keys(self, ratio: int) -> torch.Tensor:
        """`index_keys_r{ratio}` [sources, num_blocks, block_size // ratio, index_head_dim]."""
        return self.tensors[f"index_keys_r{ratio}"]

    def compressed_pools(self) -> dict[str, torch.Tensor]:
        """The paged pools by name (what a transfer engine registers)."""
        return {n: self.tensors[n] for n, p in self.pool_layouts.items() if not p.is_state}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot bounded-state tensors by name (slot is dim 1 of each)."""
        return {n: self.tensors[n] for n, p in self.pool_layouts.items() if p.is_state}

    def bytes_per_token(self) -> float:
        return self.layout.compressed_bytes_per_token(torch.tensor([], dtype=self.dtype).element_size())

    def block_byte_ranges(self, block_ids: list[int]) -> list[tuple[str, int, int, int]]:
        """For each paged pool, layer and block: `(pool_name, block_id, byte_offset, num_bytes)`."""
        return [(name, b, off, n) for name, pool in self.pool_layouts.items() if not pool.is_state and not pool.is_empty
                for (b, off, n) in pool.byte_ranges(block_ids)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every paged pool."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for pool in self.compressed_pools().values():
            pool[:, dst] = pool[:, src]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one request's bounded state into another slot."""
        for t in self.state_tensors().values():
            t[:, dst] = t[:, src]
