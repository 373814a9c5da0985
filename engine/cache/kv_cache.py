"""The tensors of the DeepSeek-V4 cache, laid out as DESIGN.md §4 describes.

Two anatomies live side by side:

* **Compressed entries** grow with the sequence and are paged. One pool tensor per kind:

  - `csa_entries`  `[num_csa_layers, num_blocks, block_size // csa_rate, head_dim]`
  - `index_entries` `[num_csa_layers, num_blocks, block_size // csa_rate, index_head_dim]`
  - `hca_entries`  `[num_hca_layers, num_blocks, block_size // hca_rate, head_dim]`

  A block covers `block_size` *tokens* (a multiple of every compress rate), so one block id
  addresses the same token span in every pool and every layer: a request has one block table.
  Entry `w` of a request lives in block `block_table[w // entries_per_block]` at offset
  `w % entries_per_block`. These are what is prefix-shared, transferred prefill → decode and stored.

* **Bounded state** has a fixed size per running request and lives in a *slot*:

  - `window_kv`  `[num_layers, num_slots, sliding_window, head_dim]` — ring of the last window
    tokens' K=V (after norm and RoPE), token at position `p` in row `p % sliding_window`;
  - compressor buffers, per compressor, rings of the projected (kv, gate) of the last
    `(1 + overlap) * rate` tokens (the unfinished window, plus for CSA the previous complete
    window whose first half feeds the overlapping entry): `csa_buf_*` `[num_csa_layers, num_slots,
    2 * csa_rate, 2 * head_dim]`, `index_buf_*` (same with `index_head_dim`), `hca_buf_*`
    `[num_hca_layers, num_slots, hca_rate, head_dim]`.

  None of it depends on anything but the last `sliding_window` (or `2 * rate`) tokens, so it can
  be rebuilt by recomputing recent tokens (bounded replay) instead of being stored or sent.

All pools are plain contiguous tensors so a transfer engine can register them and move blocks by
byte range (`block_byte_ranges`). Their shapes and byte layouts come from `engine.cache.layout`
(`CacheLayout.pools`), the one owner of the layout.

**Padding rows** (CUDA-graph decode): a decode batch padded to its captured size fills its extra rows
with `dummy_slot`, a block table of `dummy_block` and position 0. Both are ids one past the real ranges
(`num_slots`, `num_blocks`), which the slot and block allocators never hand out.
NOTE: they own no memory. The pools stay exactly the `PoolLayout` shapes (layer-major: one more unit
per layer would move every layer's bytes and change the transfer layout), so a padding row must touch
no tensor through them: a graph-safe attention backend (`AttentionBackend.cuda_graph_safe`) masks, on
the device, every read and write of a row whose slot is `dummy_slot` or whose block is `dummy_block`
(at position 0 a row sees no compressed entry and completes no window, so only its ring writes and the
read of its own ring row are masked). The `torch` backend never sees padding rows.
"""

from __future__ import annotations

import torch

from deepinfer.engine.cache.layout import CacheLayout, PoolLayout, cache_layout
from deepinfer.engine.config import ModelConfig

__all__ = ["CacheLayout", "PoolLayout", "V4KVCache", "compressed_bytes_per_token", "make_kv_cache"]


def compressed_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> float:
    """Bytes of compressed KV (CSA main + CSA indexer keys + HCA main) one token adds, all layers."""
    return cache_layout(config).compressed_bytes_per_token(torch.tensor([], dtype=dtype).element_size())


def make_kv_cache(config, num_blocks: int, block_size: int, num_slots: int, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", max_model_len: int | None = None):
    """The cache of a model config: `V4KVCache`, or `engine.cache.v41.V41KVCache` for a V4.1 config (its pools
    follow the KV-source ownership)."""
    if hasattr(config, "kv_source_layer_ids"):
        from deepinfer.engine.cache.v41 import V41KVCache

        return V41KVCache(config, num_blocks, block_size, num_slots, dtype, device, max_model_len)
    return V4KVCache(config, num_blocks, block_size, num_slots, dtype=dtype, device=device, max_model_len=max_model_len)


class V4KVCache:
    """Paged compressed-entry pools plus per-slot bounded state for one model instance."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_model_len: int | None = None,
    ) -> None:
        """`max_model_len`: the longest sequence (prompt + output) a request may reach; it sets
        `max_blocks_per_seq` (the width of a graph-safe backend's padded block tables). None: every block
        of the pool (`num_blocks`), the bound when no limit is known (large pools: pass the limit)."""
        lay = CacheLayout.from_config(config)
        self.config = config
        self.layout = lay
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        self.pool_layouts: dict[str, PoolLayout] = lay.pools(num_blocks, block_size, num_slots,
                                                             torch.tensor([], dtype=dtype).element_size())
        """Every tensor's `PoolLayout` (raises ValueError first for a block size that is no multiple of
        every compress rate): the shapes below come from these descriptors."""
        if max_model_len is not None and max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.max_blocks_per_seq = num_blocks if max_model_len is None else -(-max_model_len // block_size)
        """Blocks one request can hold at most: `ceil(max_model_len / block_size)`, or `num_blocks` without a
        `max_model_len`. Padded block tables (graph-safe decode metadata) are this wide."""
        self.dummy_slot = num_slots
        """The slot id of padding rows: no request gets it, it owns no memory (see the module docstring)."""
        self.dummy_block = num_blocks
        """The block id padding rows' block tables hold: no request gets it, it owns no memory."""
        self.csa_entries_per_block = block_size // lay.csa_rate
        self.hca_entries_per_block = block_size // lay.hca_rate
        for name, pool in self.pool_layouts.items():
            setattr(self, name, torch.zeros(pool.shape, dtype=dtype, device=self.device))
        # compressed entries (paged)
        self.csa_entries: torch.Tensor  # [num_csa_layers, num_blocks, csa_entries_per_block, head_dim]
        self.index_entries: torch.Tensor  # [num_csa_layers, num_blocks, csa_entries_per_block, index_head_dim]
        self.hca_entries: torch.Tensor  # [num_hca_layers, num_blocks, hca_entries_per_block, head_dim]
        # bounded state (per slot)
        self.window_kv: torch.Tensor  # [num_layers, num_slots, sliding_window, head_dim]
        self.csa_buf_kv: torch.Tensor  # [num_csa_layers, num_slots, 2 * csa_rate, 2 * head_dim]
        self.csa_buf_gate: torch.Tensor  # same as csa_buf_kv
        self.index_buf_kv: torch.Tensor  # [num_csa_layers, num_slots, 2 * csa_rate, 2 * index_head_dim]
        self.index_buf_gate: torch.Tensor  # same as index_buf_kv
        self.hca_buf_kv: torch.Tensor  # [num_hca_layers, num_slots, hca_rate, head_dim]
        self.hca_buf_gate: torch.Tensor  # same as hca_buf_kv

    # ------------------------------------------------------------------ introspection

    def compressed_pools(self) -> dict[str, torch.Tensor]:
        """The paged pools by name (what a transfer engine registers)."""
        return {"csa_entries": self.csa_entries, "index_entries": self.index_entries, "hca_entries": self.hca_entries}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The per-slot bounded-state tensors by name (slot is dim 1 of each)."""
        return {
            "window_kv": self.window_kv,
            "csa_buf_kv": self.csa_buf_kv,
            "csa_buf_gate": self.csa_buf_gate,
            "index_buf_kv": self.index_buf_kv,
            "index_buf_gate": self.index_buf_gate,
            "hca_buf_kv": self.hca_buf_kv,
            "hca_buf_gate": self.hca_buf_gate,
        }

    def bytes_per_token(self) -> float:
        """Bytes of compressed KV per token for this cache's config and dtype."""
        return compressed_bytes_per_token(self.config, self.dtype)

    def block_byte_ranges(self, block_ids: list[int]) -> list[tuple[str, int, int, int]]:
        """For each pool, layer and block: `(pool_name, block_id, byte_offset, num_bytes)` of its data.

        Offsets are relative to the pool tensor's first byte; a pool is `[layers, blocks, ...]`
        so one block of one layer is one contiguous range.
        """
        return [(name, b, off, n) for name, pool in self.pool_layouts.items() if not pool.is_state and not pool.is_empty
                for (b, off, n) in pool.byte_ranges(block_ids)]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks `src -> dst` in every pool (used when a forked request copies a partial block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for pool in self.compressed_pools().values():
            pool[:, dst] = pool[:, src]

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one request's bounded state into another slot (n > 1 children start from the parent)."""
        for t in self.state_tensors().values():
            t[:, dst] = t[:, src]
