"""The one owner of the cache layout: layer kinds, block size, replay length and every pool's bytes.

Everything that needs to know how the DeepSeek-V4 cache is shaped reads it from here:

* `CacheLayout` (from the model config): which layers are sliding, CSA or HCA, each layer's index
  among layers of its kind, the compress rates, the default block size and `exact_replay_tokens`;
* `CacheLayout.pools(...)` (plus block count, block size, slot count and dtype): one `PoolLayout`
  per cache tensor, in registration order: the paged compressed pools first (`csa_entries`,
  `index_entries`, `hca_entries`: units are blocks), then the bounded-state tensors (`window_kv`
  and the compressor rings: units are slots).

`V4KVCache` allocates its tensors from those descriptors; `kv_transfer` registers and addresses
them through the same descriptors (`kv_transfer.RegionLayout` is a `PoolLayout` plus where the
tensor lives), and a KV store will key its entries by them. A new cache anatomy (another model
family, a quantized pool) is a new set of descriptors here, not new byte arithmetic elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LAYER_KINDS = {
    "sliding_attention": "sliding",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
"""Config `layer_types` name -> the cache's short kind name."""

COMPRESSED_POOL_NAMES = ("csa_entries", "index_entries", "hca_entries")
"""The paged pools (units are blocks), in registration order."""
STATE_TENSOR_NAMES = ("window_kv", "csa_buf_kv", "csa_buf_gate", "index_buf_kv", "index_buf_gate",
                      "hca_buf_kv", "hca_buf_gate")
"""The per-slot bounded-state tensors (units are slots), in registration order."""


def exact_replay_tokens(config) -> int:
    """Tokens before a prefix hit to recompute so the bounded state comes out exactly as cold.

    The sliding window's receptive field grows by `sliding_window - 1` tokens per layer: a
    replayed token's layer-l state is exact once `l * (window - 1)` replayed tokens precede it.
    The ring needs the last `window - 1` tokens exact at every layer and the compressor buffers
    the last `2 * rate - 1`, so `num_layers * (window - 1) + 2 * max_rate` tokens suffice.
    V4.1 (`V41Config`) adds its Engram history (`engram_history_tokens`): a replayed token's n-gram hashes
    read the `max_ngram - 1` tokens before it, unknown before the replay's first token.
    """
    max_rate = max(config.compress_rates.values())
    extra = getattr(config, "engram_history_tokens", 0)
    return config.num_hidden_layers * (config.sliding_window - 1) + 2 * max_rate + extra


def cache_layout(config):
    """The cache layout of a model config: `CacheLayout` for V4, `engine.cache.v41.V41CacheLayout` for a
    `V41Config` (only KV sources own compressed pools). Both give `pools(...)`, `compressed_bytes_per_token`,
    `default_block_size` and `check_block_size`."""
    if hasattr(config, "kv_source_layer_ids"):  # a V41Config (no import: engine.config is not needed here)
        from deepinfer.engine.cache.v41 import V41CacheLayout

        return V41CacheLayout.from_config(config)
    return CacheLayout.from_config(config)


def default_block_size(compress_rates) -> int:
    """Tokens per block when none is configured: the least common multiple of the compress rates,
    times the smallest factor that makes it at least 64 tokens where the rates allow."""
    lcm = math.lcm(*compress_rates)
    return lcm * max(1, 64 // lcm)


@dataclass(frozen=True)
class PoolLayout:
    """Byte layout of one contiguous cache tensor `[num_layers, num_units, *unit_shape]`.

    A unit is a block (compressed pools) or a slot (bounded-state tensors). NOTE: unit `u` of
    layer `l` is the one contiguous byte range `[l * layer_nbytes + u * unit_nbytes, + unit_nbytes)`
    from the tensor's first byte: that is what lets a transfer move a block as one range per layer.
    """

    name: str
    """The tensor's name (`V4KVCache` attribute, region name on the wire)."""
    num_layers: int
    """Size of dim 0: layers of this pool's kind (0: the model has none, the pool is empty)."""
    num_units: int
    """Size of dim 1: blocks or slots."""
    unit_shape: tuple[int, ...]
    """Shape of one layer's unit, e.g. `(entries_per_block, head_dim)`."""
    itemsize: int
    """Bytes per element (the cache dtype's)."""
    is_state: bool
    """True for a bounded-state tensor (units are slots), False for a paged pool (units are blocks)."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape `[num_layers, num_units, *unit_shape]`."""
        return (self.num_layers, self.num_units, *self.unit_shape)

    @property
    def unit_nbytes(self) -> int:
        """Bytes of one layer's unit."""
        return math.prod(self.unit_shape) * self.itemsize

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer (`num_units * unit_nbytes`)."""
        return self.num_units * self.unit_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor."""
        return self.num_layers * self.layer_nbytes

    @property
    def is_empty(self) -> bool:
        """No bytes (the model has no layer of this kind): nothing to register or move."""
        return self.nbytes == 0

    def unit_offset(self, layer: int, unit: int) -> int:
        """Byte offset of unit `unit` of layer `layer` from the tensor's first byte."""
        return layer * self.layer_nbytes + unit * self.unit_nbytes

    def byte_ranges(self, unit_ids) -> list[tuple[int, int, int]]:
        """`(unit_id, byte_offset, num_bytes)` of every listed unit, layer by layer (layer-major)."""
        n = self.unit_nbytes
        return [(u, self.unit_offset(layer, u), n) for layer in range(self.num_layers) for u in unit_ids]

    def run_descs(self, base_addr: int, starts: np.ndarray, lengths: np.ndarray, dev_id: int = 0) -> np.ndarray:
        """Rows `(address, num_bytes, dev_id)` `[num_layers * num_runs, 3]` for runs of units
        `[start, start + length)`, every layer (layer-major), of this tensor placed at `base_addr`."""
        layers = np.arange(self.num_layers, dtype=np.int64)
        addr = base_addr + layers[:, None] * self.layer_nbytes + starts[None, :] * self.unit_nbytes
        out = np.empty((addr.size, 3), dtype=np.uint64)  # [num_layers * num_runs, 3]
        out[:, 0] = addr.ravel()
        out[:, 1] = np.broadcast_to(lengths[None, :] * self.unit_nbytes, addr.shape).ravel()
        out[:, 2] = dev_id
        return out


@dataclass(frozen=True)
class CacheLayout:
    """Where each layer's state lives (its index among layers of its kind) and how big every pool is."""

    layer_kinds: tuple[str, ...]
    """Per layer: 'sliding', 'csa' or 'hca'."""
    kind_index: tuple[int, ...]
    """Per layer: index among layers of the same kind (-1 for sliding-only layers)."""
    num_csa_layers: int
    num_hca_layers: int
    csa_rate: int
    hca_rate: int
    head_dim: int = 0
    """Width of a main compressed entry and of a window row."""
    index_head_dim: int = 0
    """Width of a CSA indexer key."""
    sliding_window: int = 0
    """Rows of the window ring per layer and slot."""

    @classmethod
    def from_config(cls, config) -> CacheLayout:
        kinds, idx = [], []
        counts = {"sliding": 0, "csa": 0, "hca": 0}
        for t in config.layer_types:
            k = LAYER_KINDS[t]
            kinds.append(k)
            idx.append(counts[k] if k != "sliding" else -1)
            counts[k] += 1
        return cls(
            layer_kinds=tuple(kinds),
            kind_index=tuple(idx),
            num_csa_layers=counts["csa"],
            num_hca_layers=counts["hca"],
            csa_rate=config.compress_rates["compressed_sparse_attention"],
            hca_rate=config.compress_rates["heavily_compressed_attention"],
            head_dim=config.head_dim,
            index_head_dim=config.index_head_dim,
            sliding_window=config.sliding_window,
        )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def default_block_size(self) -> int:
        """See `default_block_size`: a multiple of every compress rate, at least 64 where they allow."""
        return default_block_size((self.csa_rate, self.hca_rate))

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError unless `block_size` is a multiple of every compress rate (a block must
        cover whole compressed entries in every pool, so one block id means one token span)."""
        for rate in (self.csa_rate, self.hca_rate):
            if block_size % rate:
                raise ValueError(
                    f"block_size ({block_size}) must be a multiple of every compress rate "
                    f"({self.csa_rate}, {self.hca_rate}); pick a multiple of their least common multiple."
                )

    def compressed_bytes_per_token(self, itemsize: int) -> float:
        """Bytes of compressed KV (CSA main + CSA indexer keys + HCA main) one token adds, all layers."""
        per_tok = self.num_csa_layers * (self.head_dim + self.index_head_dim) / self.csa_rate
        per_tok += self.num_hca_layers * self.head_dim / self.hca_rate
        return per_tok * itemsize

    def pools(self, num_blocks: int, block_size: int, num_slots: int, itemsize: int) -> dict[str, PoolLayout]:
        """Every cache tensor's `PoolLayout` by name: the paged pools, then the bounded state.

        - `csa_entries`  `[num_csa_layers, num_blocks, block_size // csa_rate, head_dim]`
        - `index_entries` `[num_csa_layers, num_blocks, block_size // csa_rate, index_head_dim]`
        - `hca_entries`  `[num_hca_layers, num_blocks, block_size // hca_rate, head_dim]`
        - `window_kv`    `[num_layers, num_slots, sliding_window, head_dim]`
        - `csa_buf_{kv,gate}` `[num_csa_layers, num_slots, 2 * csa_rate, 2 * head_dim]`
        - `index_buf_{kv,gate}` `[num_csa_layers, num_slots, 2 * csa_rate, 2 * index_head_dim]`
        - `hca_buf_{kv,gate}` `[num_hca_layers, num_slots, hca_rate, head_dim]`
        """
        self.check_block_size(block_size)
        D, ID, W = self.head_dim, self.index_head_dim, self.sliding_window
        rc, rh, nc, nh = self.csa_rate, self.hca_rate, self.num_csa_layers, self.num_hca_layers
        shapes = {
            "csa_entries": (nc, num_blocks, (block_size // rc, D)),
            "index_entries": (nc, num_blocks, (block_size // rc, ID)),
            "hca_entries": (nh, num_blocks, (block_size // rh, D)),
            "window_kv": (self.num_layers, num_slots, (W, D)),
            "csa_buf_kv": (nc, num_slots, (2 * rc, 2 * D)),
            "csa_buf_gate": (nc, num_slots, (2 * rc, 2 * D)),
            "index_buf_kv": (nc, num_slots, (2 * rc, 2 * ID)),
            "index_buf_gate": (nc, num_slots, (2 * rc, 2 * ID)),
            "hca_buf_kv": (nh, num_slots, (rh, D)),
            "hca_buf_gate": (nh, num_slots, (rh, D)),
        }
        return {name: PoolLayout(name, layers, units, unit, itemsize, name in STATE_TENSOR_NAMES)
                for name, (layers, units, unit) in shapes.items()}
