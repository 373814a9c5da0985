"""The attention seam: per-layer specs, the step's metadata, the backend interface and its registry.

* `LayerSpec` — what one layer is (kind, compress rate, window, ...), frozen, derived once from the
  cache layout (`layer_specs`). Backends branch on the spec, never on strings sprinkled in the math.
* `AttentionMetadata` — everything about the step's batch that attention reads, built ONCE per step
  by the model runner (`build_attention_metadata`) from the `ForwardBatch` and shared by all layers.
  Every shape in it comes from the scheduler's host ints, never from a device value, so the decode
  path of a layer performs no host synchronisation (no `.item()`, `.tolist()`, `.nonzero()`) and no
  per-layer bookkeeping. Prefill chunks keep host ints (offsets, lengths) beside their index tensors.
  A backend may build its own form through the `AttentionBackend.build_metadata` hook: a CUDA-graph-safe
  backend (`cuda_graph_safe`) asks for *static* decode rows (`DecodeRows.is_static`), whose tensors have
  shapes set by the batch size and the cache geometry alone and whose host values do not change from
  step to step, so a captured graph can replay with the next step's tensors copied in.
* `AttentionBackend` — takes a layer's projections (`AttentionInputs`), its spec, the cache and the
  metadata; does the cache I/O and the attention core; returns `[num_tokens, num_heads, head_dim]`.
* The registry — `register_attention_backend(name)` / `get_attention_backend(name)` /
  `attention_backend_names()` (the names feed CLI choices).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.cache.layout import CacheLayout
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.registry import Registry

if TYPE_CHECKING:
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.forward_batch import ForwardBatch
    from deepinfer.engine.spec_decode.verify_rows import VerifyRows

RopeTable = tuple[torch.Tensor, torch.Tensor]
"""(cos, sin), each `[n, rope_head_dim // 2]` (already multiplied by the flavour's attention factor)."""

RopeFn = Callable[[torch.Tensor], RopeTable]
"""Positions `[n]` -> their `RopeTable` (the model's `Rotary` of one flavour)."""


# --------------------------------------------------------------------------- per-layer spec


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer, as the cache layout sees it."""

    layer_idx: int
    kind: str
    """'sliding' (window only), 'csa' (window + overlapping compressor + indexer top-k) or 'hca'
    (window + non-overlapping compressor, all entries attended)."""
    kind_index: int
    """Index among layers of the same kind: the layer's row in that kind's pools (-1 for sliding)."""
    compress_rate: int
    """Tokens per compressed entry (0 for sliding layers)."""
    window: int
    """Sliding window (keys per query, itself included)."""
    is_overlap: bool
    """The compressor's entry `w` also reads window `w - 1` (CSA)."""
    has_indexer: bool
    """A lightning indexer selects the top-k entries per query (CSA)."""
    rope: str
    """RoPE flavour of the layer's queries and keys: 'main' (sliding layers) or 'compress'."""

    @property
    def is_compressed(self) -> bool:
        return self.compress_rate > 0

    @property
    def ring_len(self) -> int:
        """Rows of the compressor's per-slot ring buffers (`(1 + overlap) * rate`)."""
        return (2 if self.is_overlap else 1) * self.compress_rate

    def entries_per_block(self, block_size: int) -> int:
        """Compressed entries per cache block (blocks cover `block_size` tokens)."""
        return block_size // self.compress_rate if self.compress_rate else 0


def layer_specs(config: ModelConfig) -> tuple[LayerSpec, ...]:
    """The spec of every layer of `config`, from its `CacheLayout`."""
    lay = CacheLayout.from_config(config)
    rates = {"sliding": 0, "csa": lay.csa_rate, "hca": lay.hca_rate}
    return tuple(
        LayerSpec(
            layer_idx=i,
            kind=kind,
            kind_index=lay.kind_index[i],
            compress_rate=rates[kind],
            window=config.sliding_window,
            is_overlap=kind == "csa",
            has_indexer=kind == "csa",
            rope="main" if kind == "sliding" else "compress",
        )
        for i, kind in enumerate(lay.layer_kinds)
    )


def _compressor_keys(specs: tuple[LayerSpec, ...]) -> list[tuple[int, bool]]:
    """Distinct `(rate, is_overlap)` compressor geometries of the model."""
    return sorted({(s.compress_rate, s.is_overlap) for s in specs if s.is_compressed})


# --------------------------------------------------------------------------- step metadata


@dataclass
class DecodeCompressorRows:
    """The decode rows' work for one compressor geometry `(rate, is_overlap)`.

    Every row writes its token into its ring; the `num_done` rows whose token ends a window (that is
    not a frozen, shared entry) emit that window's entry.

    NOTE: which rows are done is decided on the host from the scheduler's ints (positions, frozen
    counts), so no device value decides a shape. Emitting for the done rows only (not for every row
    under a mask) keeps the results bit-identical to computing each entry alone: CPU softmax over
    a middle dimension is not invariant to the number of rows.
    """

    ring_rows: torch.Tensor  # [B] ring row of each row's new token (pos % ring_len)
    num_done: int
    """Rows that complete a window this step (host int; the tensors below have this many rows)."""
    done_rows: torch.Tensor  # [num_done] indices into the decode rows
    slots: torch.Tensor  # [num_done] their state slots
    windows: torch.Tensor  # [num_done] the window each completes ((pos + 1) // rate - 1)
    cur_rows: torch.Tensor  # [num_done, rate] ring rows of the window's tokens
    prev_rows: torch.Tensor  # [num_done, rate] ring rows of the previous window's tokens
    pool_rows: torch.Tensor  # [num_done] flat pool rows of the new entries
    entry_rope: RopeTable  # [num_done, rope_head_dim // 2] at positions windows * rate


@dataclass
class CompressedIndex:
    """The compressed entries each decode row's query sees, for one `(rate, entries_per_block)`."""

    pool_rows: torch.Tensor  # [B, C] flat pool rows (0 where not visible)
    visible: torch.Tensor  # [B, C] bool


@dataclass
class DecodeRows:
    """Requests of the step with exactly one new token, handled as one batch in every layer."""

    seq_ids: list[int]
    """Indices into `ForwardBatch.seqs`."""
    rows: torch.Tensor  # [B] flat token index of each decode row
    pos: torch.Tensor  # [B] its position
    slots: torch.Tensor  # [B]
    state_start: torch.Tensor  # [B]
    frozen: torch.Tensor  # [B] num_frozen_tokens
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    window_valid: dict[int, torch.Tensor]
    """Window W -> [B, W]: whether ring row j holds a key of the row's live window (after this step's write)."""
    window_rows: dict[int, torch.Tensor]
    """Window W -> [B]: ring row of the new token (pos % W)."""
    compressors: dict[tuple[int, bool], DecodeCompressorRows]
    """`(rate, is_overlap)` -> the compressor's per-row work."""
    compressed: dict[int, CompressedIndex | None]
    """Rate -> the entries each row sees; None while no row has one."""
    rope: dict[str, RopeTable]
    """Flavour -> the rows' cos/sin ([B, rope_head_dim // 2])."""
    entry_rope: dict[int, RopeTable] = field(default_factory=dict)
    """Static rows only: rate -> cos/sin ([B, rope_head_dim // 2], the 'compress' flavour) at the first
    position of the window each row's token would complete (`((pos + 1) // rate - 1) * rate`); read only
    where the row does complete it (decided on the device)."""
    is_static: bool = False
    """Static (CUDA-graph-safe) rows: `block_tables` is `[B, cache.max_blocks_per_seq]` padded with the
    cache's `dummy_block`; `compressors` and `compressed` are empty (the backend decides on the device
    which rows complete a window and which entries each row sees, from `pos`, `frozen` and the tables);
    `window_valid` / `window_rows` / `rope` / `entry_rope` are filled as usual. No host value depends on
    anything but B."""


@dataclass
class ChunkWindow:
    """One prefill chunk's sliding-window geometry for window W."""

    hist_rows: torch.Tensor  # [W - 1] ring rows of positions p0 - W + 1 .. p0 - 1
    num_dead_hist: int
    """Leading history rows before `state_start` (hold no key of this request; zeroed and masked)."""
    allowed: torch.Tensor  # [n, W] bool
    tail_rows: torch.Tensor  # [min(n, W)] ring rows the chunk's last keys go to


@dataclass
class ChunkCompressor:
    """One prefill chunk's work for one compressor geometry `(rate, is_overlap)`."""

    windows: torch.Tensor  # [nw] windows the chunk completes (and are not frozen)
    hist_rows: torch.Tensor | None  # [p0 - h0] ring rows of buffered tokens before the chunk, or None
    cur_rows: torch.Tensor  # [nw, rate] rows of the window's tokens in [buffered history | chunk]
    prev_rows: torch.Tensor  # [nw, rate] rows of the previous window's tokens
    write_rows: torch.Tensor  # [nw] flat pool rows of the new entries
    entry_rope: RopeTable  # [nw, rope_head_dim // 2] at position windows * rate
    tail_rows: torch.Tensor  # [min(n, ring_len)] ring rows the chunk's last tokens go to
    entry_rows: torch.Tensor | None  # [C1] flat pool rows of all entries up to the chunk's end, or None
    visible: torch.Tensor  # [n, C1] bool: entry w is visible to query t once (w + 1) * rate <= t + 1


@dataclass
class PrefillChunk:
    """One request with more than one new token: handled alone in every layer."""

    seq_id: int
    """Index into `ForwardBatch.seqs`."""
    start: int
    """Offset of its first token in the flat batch."""
    num_tokens: int
    num_computed_tokens: int
    slot: int
    state_start: int
    num_frozen_tokens: int
    windows: dict[int, ChunkWindow]
    compressors: dict[tuple[int, bool], ChunkCompressor]

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.num_tokens)


@dataclass
class AttentionMetadata:
    """What attention reads about one step, built once by the model runner, shared by every layer."""

    num_tokens: int
    positions: torch.Tensor  # [num_tokens] int64
    rope: dict[str, RopeTable]
    """Flavour ('main', 'compress') -> cos/sin of every token ([num_tokens, rope_head_dim // 2])."""
    block_size: int
    decode: DecodeRows | None
    prefill: list[PrefillChunk] = field(default_factory=list)
    is_pure_decode: bool = False
    """Every token is a decode row, in order (no gather / scatter of rows needed)."""
    verify: VerifyRows | None = None
    """Speculative decoding: verify chunks (`1 + L` new tokens per request) batched together instead of in
    `prefill` (`engine.spec_decode.verify_rows`); set only for a backend whose `supports_verify_rows` is True."""


def _window_chunk(pos: torch.Tensor, p0: int, n: int, state_start: int, W: int) -> ChunkWindow:
    device = pos.device
    h0 = max(state_start, p0 - W + 1)
    hist_pos = torch.arange(p0 - W + 1, p0, device=device)  # [W - 1] positions before the chunk
    allowed = (pos[:, None] - (W - 1) + torch.arange(W, device=device)[None, :]) >= h0  # [n, W]
    keep = min(n, W)
    return ChunkWindow(hist_pos % W, max(0, h0 - (p0 - W + 1)), allowed, pos[-keep:] % W)


def _compressor_chunk(pos: torch.Tensor, p0: int, n: int, num_frozen: int, rate: int, is_overlap: bool,
                      block_table: torch.Tensor, epb: int, rope_fn: RopeFn) -> ChunkCompressor:
    device = pos.device
    ring_len = (2 if is_overlap else 1) * rate
    C0, C1 = p0 // rate, (p0 + n) // rate
    windows = torch.arange(min(max(C0, num_frozen // rate), C1), C1, device=device)
    h0 = max(0, (p0 // rate - (1 if is_overlap else 0)) * rate)
    hist_rows = torch.arange(h0, p0, device=device) % ring_len if p0 > h0 else None
    cur = (windows * rate - h0)[:, None] + torch.arange(rate, device=device)[None, :]  # [nw, r]
    keep = min(n, ring_len)
    all_windows = torch.arange(C1, device=device)
    return ChunkCompressor(
        windows=windows,
        hist_rows=hist_rows,
        cur_rows=cur,
        prev_rows=(cur - rate).clamp(min=0),
        write_rows=block_table[windows // epb] * epb + windows % epb,
        entry_rope=rope_fn(windows * rate),
        tail_rows=torch.arange(p0 + n - keep, p0 + n, device=device) % ring_len,
        entry_rows=block_table[all_windows // epb] * epb + all_windows % epb if C1 else None,
        visible=all_windows[None, :] < ((pos + 1) // rate)[:, None],
    )


def _decode_rows(batch: ForwardBatch, seq_ids: list[int], specs: tuple[LayerSpec, ...],
                 rope: dict[str, RopeTable], rope_fns: dict[str, RopeFn], block_size: int,
                 static: tuple[int, int] | None = None) -> DecodeRows:
    """The decode rows' metadata; `static=(max_blocks_per_seq, dummy_block)` builds the static form."""
    device = batch.input_ids.device
    seqs = [batch.seqs[i] for i in seq_ids]
    max_blocks = max(len(s.block_table) for s in seqs) if static is None else static[0]
    pad = 0 if static is None else static[1]
    if static is not None and any(s.num_computed_tokens >= max_blocks * block_size for s in seqs):
        raise ValueError(f"a decode row's position is past max_blocks_per_seq ({max_blocks}) blocks of "
                         f"{block_size} tokens; build the cache with the engine's max_model_len")

    def t(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    rows = t([batch.starts[i] for i in seq_ids])
    pos_list = [s.num_computed_tokens for s in seqs]
    pos, slots, state_start = t(pos_list), t([s.slot for s in seqs]), t([s.state_start for s in seqs])
    frozen = t([s.num_frozen_tokens for s in seqs])
    # NOTE: a table may run past max_blocks (lookahead blocks); a row reads only blocks before its position
    block_tables = t([s.block_table[:max_blocks] + [pad] * (max_blocks - len(s.block_table)) for s in seqs])
    B = len(seqs)

    window_valid, window_rows = {}, {}
    for W in sorted({s.window for s in specs}):
        j = torch.arange(W, device=device)
        key_pos = pos[:, None] - ((pos[:, None] - j[None, :]) % W)  # position held by ring row j
        window_valid[W] = key_pos >= state_start[:, None]
        window_rows[W] = pos % W

    if static is not None:
        entry_rope = {}
        for rate in sorted({r for r, _ in _compressor_keys(specs)}):
            entry_rope[rate] = rope_fns["compress"](((pos + 1) // rate - 1) * rate)
        return DecodeRows(
            seq_ids=seq_ids, rows=rows, pos=pos, slots=slots, state_start=state_start, frozen=frozen,
            block_tables=block_tables, window_valid=window_valid, window_rows=window_rows, compressors={},
            compressed={}, rope={k: (cos[rows], sin[rows]) for k, (cos, sin) in rope.items()},
            entry_rope=entry_rope, is_static=True,
        )

    compressors = {}
    for rate, is_overlap in _compressor_keys(specs):
        epb = block_size // rate
        ring_len = (2 if is_overlap else 1) * rate
        done = [b for b, s in enumerate(seqs)
                if (s.num_computed_tokens + 1) % rate == 0
                and (s.num_computed_tokens + 1) // rate - 1 >= s.num_frozen_tokens // rate]
        w = t([(seqs[b].num_computed_tokens + 1) // rate - 1 for b in done])  # [num_done]
        done_rows = t(done)
        cur = w[:, None] * rate + torch.arange(rate, device=device)[None, :]  # [num_done, r] positions
        prev = (cur - rate).clamp(min=0)
        compressors[(rate, is_overlap)] = DecodeCompressorRows(
            ring_rows=pos % ring_len, num_done=len(done), done_rows=done_rows, slots=slots[done_rows], windows=w,
            cur_rows=cur % ring_len, prev_rows=prev % ring_len,
            pool_rows=block_tables[done_rows, w // epb] * epb + w % epb, entry_rope=rope_fns["compress"](w * rate),
        )

    compressed: dict[int, CompressedIndex | None] = {}
    for rate in sorted({r for r, _ in _compressor_keys(specs)}):
        epb = block_size // rate
        c_max = max((p + 1) // rate for p in pos_list)  # host ints: no device sync
        if c_max == 0:
            compressed[rate] = None
            continue
        num_entries = (pos + 1) // rate  # [B]
        c = torch.arange(c_max, device=device)
        visible = c[None, :] < num_entries[:, None]  # [B, C]
        cols = (c // epb).clamp(max=block_tables.shape[1] - 1)[None].expand(B, -1)
        blk = block_tables.gather(1, cols)
        compressed[rate] = CompressedIndex(torch.where(visible, blk * epb + c % epb, torch.zeros_like(blk)), visible)

    return DecodeRows(
        seq_ids=seq_ids, rows=rows, pos=pos, slots=slots, state_start=state_start, frozen=frozen,
        block_tables=block_tables, window_valid=window_valid, window_rows=window_rows, compressors=compressors,
        compressed=compressed, rope={k: (cos[rows], sin[rows]) for k, (cos, sin) in rope.items()},
    )


def build_attention_metadata(batch: ForwardBatch, specs: tuple[LayerSpec, ...], rope_fns: dict[str, RopeFn],
                             block_size: int, static_decode: tuple[int, int] | None = None) -> AttentionMetadata:
    """The step's `AttentionMetadata` (built once per step, before the forward).

    `rope_fns`: flavour ('main', 'compress') -> the model's rotary of that flavour; `block_size`: the
    cache's tokens per block (entry `w` lives in `block_table[w // (block_size // rate)]`);
    `static_decode`: `(cache.max_blocks_per_seq, cache.dummy_block)` for static decode rows
    (`DecodeRows.is_static`, what a CUDA-graph-safe backend reads), None for the host-decided form.
    """
    positions = batch.positions
    rope = {name: fn(positions) for name, fn in rope_fns.items()}
    decode_ids = [i for i, s in enumerate(batch.seqs) if s.num_new_tokens == 1]
    decode = (_decode_rows(batch, decode_ids, specs, rope, rope_fns, block_size, static_decode)
              if decode_ids else None)
    prefill = []
    windows = sorted({s.window for s in specs})
    geometries = _compressor_keys(specs)
    for i, s in enumerate(batch.seqs):
        if s.num_new_tokens == 1:
            continue
        a, n, p0 = batch.starts[i], s.num_new_tokens, s.num_computed_tokens
        pos = positions[a:a + n]
        block_table = torch.tensor(s.block_table, dtype=torch.long, device=positions.device)
        prefill.append(PrefillChunk(
            seq_id=i, start=a, num_tokens=n, num_computed_tokens=p0, slot=s.slot, state_start=s.state_start,
            num_frozen_tokens=s.num_frozen_tokens,
            windows={W: _window_chunk(pos, p0, n, s.state_start, W) for W in windows},
            compressors={
                (rate, ov): _compressor_chunk(pos, p0, n, s.num_frozen_tokens, rate, ov, block_table,
                                              block_size // rate, rope_fns["compress"])
                for rate, ov in geometries
            },
        ))
    return AttentionMetadata(
        num_tokens=batch.num_tokens, positions=positions, rope=rope, block_size=block_size, decode=decode,
        prefill=prefill, is_pure_decode=decode is not None and not prefill,
    )


# --------------------------------------------------------------------------- backend interface


@dataclass
class AttentionInputs:
    """What a layer hands its backend: the step's projections plus the modules that own weights.

    NOTE: modules are passed per call, not stored in the backend: loading and packing may replace
    parameters after construction.
    """

    q: torch.Tensor  # [num_tokens, num_heads, head_dim] (normed, rotated)
    kv: torch.Tensor  # [num_tokens, head_dim] the shared K=V head (normed, rotated)
    x: torch.Tensor  # [num_tokens, hidden] the layer's (normed) input
    q_res: torch.Tensor  # [num_tokens, q_lora_rank] the low-rank query (the indexer's query source)
    sink: torch.Tensor  # [num_heads] per-head sink logit
    compressor: object | None = None
    """The layer's `Compressor` (compressed layers)."""
    compressor_kv: torch.Tensor | None = None  # [num_tokens, width]
    compressor_gate: torch.Tensor | None = None  # [num_tokens, width]
    indexer: object | None = None
    """The layer's `Indexer` (CSA layers): scores, top-k and its own compressor."""
    index_kv: torch.Tensor | None = None  # [num_tokens, index width]
    index_gate: torch.Tensor | None = None  # [num_tokens, index width]


class AttentionBackend(ABC):
    """Cache I/O plus the attention core of one layer for one step.

    A backend is chosen once at model construction (`DeepseekV4ForCausalLM(config,
    attention_backend=name)`) and shared by every layer. It writes the step's keys into the
    layer's window ring, runs the compressors (writing finished entries into the paged pools),
    selects entries with the indexer, and attends.
    """

    name: str = ""
    cuda_graph_safe: bool = False
    """True when a pure-decode step of this backend can be captured in a CUDA graph and replayed with the
    next step's metadata copied into the captured tensors: its `build_metadata` gives pure-decode
    metadata whose tensor shapes depend only on the batch size and the cache geometry and whose host
    values do not change between steps of one batch size, its decode path performs no host
    synchronisation and decides everything else on the device, and it ignores padding rows
    (`V4KVCache.dummy_slot` / `dummy_block`, position 0)."""

    @classmethod
    def build_metadata(cls, batch: ForwardBatch, specs: tuple[LayerSpec, ...], rope_fns: dict[str, RopeFn],
                       cache: V4KVCache) -> AttentionMetadata:
        """The step's `AttentionMetadata` in the form this backend reads (the model's
        `build_attention_metadata` calls this once per step). Default: `build_attention_metadata`."""
        return build_attention_metadata(batch, specs, rope_fns, cache.block_size)

    @abstractmethod
    def forward(self, spec: LayerSpec, inputs: AttentionInputs, cache: V4KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attention output before the inverse rotation and the output projection:
        `[num_tokens, num_heads, head_dim]`, row t for token t of the flat batch."""


ATTENTION_BACKENDS: Registry[type[AttentionBackend]] = Registry("attention backend")
"""The attention backends by name."""


def register_attention_backend(name: str) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: make an `AttentionBackend` subclass available as `name`."""
    return ATTENTION_BACKENDS.register(name)


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; a ValueError listing the known names otherwise."""
    return ATTENTION_BACKENDS.get(name)


def attention_backend_names() -> list[str]:
    """Registered backend names, sorted (CLI choices)."""
    return ATTENTION_BACKENDS.names()
