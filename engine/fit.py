"""Will the model fit? Checked at start-up, before any weight is read.

From config.json and the checkpoint's safetensors headers (the index and each shard's header; no
tensor data), `plan_fit` works out:

* the resident weight bytes: float tensors at the engine dtype (the fp32-kept set at float32),
  quantized tensors (FP8, packed FP4, their scales) as stored; split into the routed experts and the
  rest, so an expert-parallel layout can be sized;
* the KV cost (`engine.cache.layout`): compressed bytes per token, bytes per cache block, the
  bounded state of one sequence, hence the bytes of one sequence of `max_model_len`;
* the budget: the device's memory (CUDA: free bytes from `torch.cuda.mem_get_info`; CPU:
  `MemAvailable` of /proc/meminfo) times `MEMORY_UTILIZATION`, minus the weights;
* how many sequences of `max_model_len` fit, the most cache blocks the engine may allocate, and
  for a model too big for one device, how many devices an expert-parallel layout needs (routed
  experts split evenly, everything else replicated), with the per-device weight bytes and the
  sequences that then fit per device for that count and for 8 devices (one node);
* DeepSeek-V4.1's Engram tables (FP8, ~94 GiB a layer in Flash; `WeightBytes.engram_bytes`): on the device or in
  pinned host memory (`FitReport.engram_placement`): `engine.quant.engram.decide_engram_placement` picks the device
  only when the tables there still leave room for `max_num_seqs` sequences of `max_model_len` (always on a CPU
  engine), `EngineConfig.engram_placement` overrides it; tables in host memory are checked against the host's.

Expert-parallel instances (`expert_parallel_size` N > 1) are checked per rank: a rank holds the
replicated part plus its `(n_routed_experts + num_redundant_experts) / N` routed-expert slots, and its own KV pool
(`num_blocks` is per rank). The MTP layers (V4's MTP, V4.1's DSpark stages: checkpoint `mtp.*`) follow the
loader: one device holds them whenever the checkpoint ships them; an expert-parallel rank loads them whole (their
routed experts too, `engine.distributed.spec`) with speculative decoding on and leaves them out otherwise
(`FitReport.with_mtp`). CPU ranks share the host, so there the available memory is split N ways; CUDA ranks have
one device each (rank 0's device is measured for all).

Speculative decoding (`speculative`): the drafter keeps per-request state of its own beside the cache's, allocated
for every slot at start-up and counted here per slot (`drafter_slot_bytes`): V4's MTP drafter its one-layer window
cache (`MTPLayer.make_cache`: `sliding_window` rows of `head_dim` per slot), V4.1's DSpark drafter its window rings
(`dspark_keys`, stages x (slots + 1) x sliding_window x head_dim, the extra slot the cache's dummy slot id).

`check_fit` raises `ModelDoesNotFitError` with those numbers when not even one sequence of
`max_model_len` fits (or a requested `num_blocks` exceeds the budget). `Engine` calls it before
`load_checkpoint`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.cache.layout import cache_layout
from deepinfer.engine.config import ModelConfig

MEMORY_UTILIZATION = 0.9
"""Fraction of the device's available memory the weights plus the cache may use (the rest: activations,
allocator slack, the CUDA context)."""

_EXPERT_RE = re.compile(r"(^|\.)ffn\.experts\.\d+\.")
_MTP_NAME_RE = re.compile(r"(?:model\.)?mtp\.\d+\.(.+)")
_MTP_FP32 = ("enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale")
_ENGRAM_TABLE_RE = re.compile(r"(^|\.)engram\.embed\.(weight|scale)$")
_FLOAT_TAGS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_GIB = 1 << 30


def _size(num_bytes: int) -> str:
    """A byte count in the largest binary unit it reaches (KiB at least)."""
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes / 1024:.2f} KiB"


class ModelDoesNotFitError(MemoryError):
    """The model (or the requested cache) does not fit the device; the message gives the numbers."""


@dataclass(frozen=True)
class WeightBytes:
    """Resident bytes of a checkpoint's weights, routed experts apart (they are what expert parallelism splits)."""

    expert_bytes: int
    """The routed experts (`*.ffn.experts.{e}.*`, MTP layers included), scales included."""
    other_bytes: int
    """Everything else (attention, shared experts, router, norms, embedding, head, vision tower)."""
    mtp_expert_bytes: int = 0
    """Of `expert_bytes`: the MTP layers' routed experts."""
    mtp_other_bytes: int = 0
    """Of `other_bytes`: the rest of the MTP layers."""
    engram_bytes: int = 0
    """Of `other_bytes`: DeepSeek-V4.1's Engram tables (FP8 rows + scales), which may live in pinned host memory
    instead of the device (`FitReport.engram_placement`)."""

    @property
    def total(self) -> int:
        return self.expert_bytes + self.other_bytes

    @property
    def main_expert_bytes(self) -> int:
        """The decoder layers' routed experts (what expert parallelism splits; the MTP layers' left out)."""
        return self.expert_bytes - self.mtp_expert_bytes

    @property
    def mtp_bytes(self) -> int:
        """The MTP layers (V4's MTP, V4.1's DSpark stages), their routed experts included."""
        return self.mtp_expert_bytes + self.mtp_other_bytes

    def replicated_bytes(self, with_mtp: bool = False) -> int:
        """What every rank of an expert-parallel instance holds whole: everything but the routed experts, the MTP
        layers left out, or with `with_mtp` (speculative decoding on) loaded whole, their routed experts too."""
        return self.other_bytes - self.mtp_other_bytes + (self.mtp_bytes if with_mtp else 0)

    def per_device(self, num_devices: int, with_mtp: bool = False) -> int:
        """Bytes on each of `num_devices` devices of an expert-parallel layout with the decoder layers' routed
        experts split evenly and the rest replicated (`replicated_bytes(with_mtp)`)."""
        return self.replicated_bytes(with_mtp) + -(-self.main_expert_bytes // num_devices)

    def per_rank(self, world_size: int, num_experts: int, num_redundant_experts: int = 0,
                 with_mtp: bool = False) -> int:
        """Bytes one rank of an expert-parallel instance loads: the replicated part (`replicated_bytes(with_mtp)`:
        the MTP layers whole with speculative decoding, left out without) plus its
        `(num_experts + num_redundant_experts) / world_size` expert slots of every decoder MoE layer (worst case:
        all distinct experts)."""
        slots = -(-(num_experts + num_redundant_experts) // world_size)
        experts = -(-self.main_expert_bytes * min(slots, num_experts) // num_experts)
        return self.replicated_bytes(with_mtp) + experts


def _v4_fp32_kept(name: str) -> bool:
    """V4's float32-kept rule for a checkpoint name, the MTP layers' included (as `mtp_checkpoint_spec` keeps them:
    their decoder block's tensors as a decoder layer's, and their own norms and `hc_head_*`)."""
    from deepinfer.engine.models.deepseek_v4_weights import is_fp32_kept, official_to_spec_name

    m = _MTP_NAME_RE.fullmatch(name)
    if m is None:
        return is_fp32_kept(official_to_spec_name(name))
    # NOTE: the MTP's own names first: mapped as top-level names they would read as the main model's
    return m[1] in _MTP_FP32 or is_fp32_kept(official_to_spec_name("layers.0." + m[1]))


def checkpoint_weight_bytes(path: str | Path, dtype: torch.dtype,
                            dequantized: bool | Callable[[str], bool] = False,
                            fp32_kept: Callable[[str], bool] | None = None) -> WeightBytes:
    """Resident bytes of the checkpoint at `path` once loaded at `dtype`, from its headers only.
    `dequantized`: FP8 / packed FP4 weights are held dequantized at `dtype` and their scales dropped; a callable
    decides per tensor name (V4.1's loader: `deepseek_v41.dequantized_at_load`: nothing, all kept as stored).
    `fp32_kept`: which float tensors (checkpoint names) stay float32 (None: V4's rule, `is_fp32_kept`, with the MTP
    layers' own)."""
    from deepinfer.engine.loader import MTP_PREFIXES, scan_checkpoint

    itemsize = torch.tensor([], dtype=dtype).element_size()
    expert = other = mtp_expert = mtp_other = engram = 0
    for name, stored in scan_checkpoint(path).items():
        numel = math.prod(stored.shape)
        if stored.dtype in _FLOAT_TAGS:  # cast at load: the engine dtype, or float32 for the kept set
            kept = (fp32_kept or _v4_fp32_kept)(name)
            nbytes = numel * (4 if kept else itemsize)
        elif dequantized(name) if callable(dequantized) else dequantized:
            # FP8 one value a byte, packed FP4 two; scales (`.scale`) are folded in
            nbytes = 0 if name.endswith(".scale") else numel * (2 if stored.dtype in ("I8", "U8") else 1) * itemsize
        else:  # integers, FP8 / packed FP4 weights and their scales stay as stored
            nbytes = stored.num_bytes
        is_mtp = name.startswith(MTP_PREFIXES)
        if _EXPERT_RE.search(name):
            expert += nbytes
            mtp_expert += nbytes if is_mtp else 0
        else:
            other += nbytes
            mtp_other += nbytes if is_mtp else 0
            engram += nbytes if _ENGRAM_TABLE_RE.search(name) else 0
    return WeightBytes(expert, other, mtp_expert, mtp_other, engram)


def drafter_slot_bytes(config: ModelConfig, speculative: str | None, itemsize: int) -> tuple[int, int]:
    """`(bytes per slot, fixed bytes)` of the speculative drafter's own state at element size `itemsize` (the
    engine dtype's; both drafters allocate in the embedding's dtype): what it allocates for `n` slots is
    `n * per_slot + fixed`. `(0, 0)` without speculative decoding, or for a checkpoint without draft layers (the
    drafter refuses to start there).

    * "mtp" (V4): `MTPLayer.make_cache`, a one-layer sliding-window `V4KVCache` with one block at the layer's
      default block size (its paged pools are empty: the MTP layer has no compressor) and one window ring per slot;
    * "dspark" (V4.1): `DSparkDrafter.rings`, `[stages, num_slots + 1, sliding_window, head_dim]` (the extra
      slot is the cache's dummy slot id), registered as the cache state `dspark_keys`."""
    if speculative is None or not config.num_nextn_predict_layers:
        return 0, 0
    if speculative == "dspark":
        if not getattr(config, "dspark_block_size", 0):
            return 0, 0
        per_slot = config.num_nextn_predict_layers * config.sliding_window * config.head_dim * itemsize
        return per_slot, per_slot  # NOTE: the dummy slot's ring is allocated too
    if speculative == "mtp":
        from deepinfer.engine.cache.layout import default_block_size
        from deepinfer.engine.models.mtp import mtp_layer_config

        mc = mtp_layer_config(config)
        pools = cache_layout(mc).pools(1, default_block_size(mc.compress_rates.values()), 1, itemsize)
        return (sum(p.nbytes for p in pools.values() if p.is_state),
                sum(p.nbytes for p in pools.values() if not p.is_state))
    raise ValueError(f"unknown speculative method {speculative!r}; known: mtp, dspark")


def available_device_bytes(device: str | torch.device) -> int:
    """Memory the engine may take on `device`: free CUDA memory, or the host's MemAvailable on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass(frozen=True)
class FitReport:
    """The start-up memory plan of one engine (all byte counts per device)."""

    weights: WeightBytes
    device: str
    device_bytes: int
    """Available memory of the device (before the utilization fraction)."""
    usable_bytes: int
    """`device_bytes * MEMORY_UTILIZATION`."""
    kv_bytes_per_token: float
    """Compressed KV bytes one token adds (all layers)."""
    block_bytes: int
    """Bytes of one cache block (every paged pool, every layer)."""
    state_bytes_per_seq: int
    """Bounded state of one sequence slot (window ring and compressor rings, every layer)."""
    max_model_len: int
    block_size: int
    max_num_seqs: int
    expert_parallel_size: int = 1
    """Ranks of the instance: with more than one, the byte counts and budgets are per rank."""
    num_routed_experts: int = 0
    num_redundant_experts: int = 0
    engram_placement: str = "device"
    """Where DeepSeek-V4.1's Engram tables live: "device" (counted in the device's weights) or "pinned_host" (host
    memory, not counted here; `decide_engram_placement`)."""
    speculative: str | None = None
    """The speculative drafter ("mtp", "dspark") whose state is counted, or None (off)."""
    with_mtp: bool = False
    """An expert-parallel rank loads the MTP layers whole, their routed experts included (speculative decoding on,
    `engine.distributed.spec`); False: it leaves them out. One device (no expert parallelism) holds whatever the
    checkpoint ships, MTP layers included, either way (the loader's rule)."""
    drafter_state_bytes_per_seq: int = 0
    """The drafter's own state of one slot (`drafter_slot_bytes`): the MTP drafter's window ring, or DSpark's
    `dspark_keys` rings; 0 without speculative decoding."""
    drafter_fixed_bytes: int = 0
    """The drafter's state that no slot owns (DSpark: the dummy slot's rings; MTP: its cache's one, empty, block)."""

    @property
    def engram_host_bytes(self) -> int:
        """Engram table bytes held in pinned host memory rather than on the device."""
        return self.weights.engram_bytes if self.engram_placement == "pinned_host" else 0

    @property
    def num_slots(self) -> int:
        """State slots on one device: `max_num_seqs`, split over the ranks of an expert-parallel instance."""
        return -(-self.max_num_seqs // self.expert_parallel_size)

    @property
    def drafter_state_bytes(self) -> int:
        """What the drafter allocates on one device: its state for `num_slots` slots plus its fixed part."""
        return self.num_slots * self.drafter_state_bytes_per_seq + self.drafter_fixed_bytes

    @property
    def rank_weight_bytes(self) -> int:
        """Weight bytes one rank (one device) holds: all of them, or its expert-parallel share (the MTP layers whole
        with `with_mtp`, else left out; Engram tables in pinned host memory left out)."""
        if self.expert_parallel_size == 1:
            return self.weights.total - self.engram_host_bytes
        return (self.weights.per_rank(self.expert_parallel_size, self.num_routed_experts, self.num_redundant_experts,
                                      self.with_mtp)
                - self.engram_host_bytes)

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def bytes_per_seq(self) -> int:
        """Cache bytes of one sequence of `max_model_len` (its blocks plus its state slot, the drafter's included)."""
        return self.blocks_per_seq * self.block_bytes + self.state_bytes_per_seq + self.drafter_state_bytes_per_seq

    @property
    def kv_budget_bytes(self) -> int:
        """What is left for the cache after the (rank's) weights and the drafter's fixed bytes (negative: the weights
        alone do not fit)."""
        return self.usable_bytes - self.rank_weight_bytes - self.drafter_fixed_bytes

    @property
    def num_seqs_fit(self) -> int:
        """Sequences of `max_model_len` the cache budget holds."""
        return max(0, self.kv_budget_bytes // self.bytes_per_seq) if self.bytes_per_seq else 0

    @property
    def max_num_blocks(self) -> int:
        """Most cache blocks the budget holds beside the state slots (`num_slots`, the drafter's state included)."""
        left = self.kv_budget_bytes - self.num_slots * (self.state_bytes_per_seq + self.drafter_state_bytes_per_seq)
        return max(0, left // self.block_bytes) if self.block_bytes else 1 << 62

    @property
    def fits(self) -> bool:
        """At least one sequence of `max_model_len` fits beside the weights."""
        return self.num_seqs_fit >= 1 and self.max_num_blocks >= self.blocks_per_seq

    def expert_parallel_devices(self) -> int | None:
        """Fewest devices like this one on which an expert-parallel layout (routed experts split, the rest
        replicated, the MTP layers as `with_mtp` says) holds the weights plus one sequence; None when the
        replicated part alone is too big."""
        room = (self.usable_bytes - self.weights.replicated_bytes(self.with_mtp) - self.bytes_per_seq
                - self.drafter_fixed_bytes)
        if room <= 0:
            return None
        return max(1, -(-self.weights.main_expert_bytes // room))

    def expert_parallel_bytes(self, num_devices: int) -> int:
        """Weight bytes on each of `num_devices` devices like this one with the routed experts split evenly and
        everything else replicated (the MTP layers whole with `with_mtp`, else left out)."""
        return self.weights.per_device(num_devices, self.with_mtp)

    def expert_parallel_num_seqs(self, num_devices: int) -> int:
        """Sequences of `max_model_len` each device's cache budget holds with the weights expert-parallel over
        `num_devices` devices (0 when even the weights do not fit)."""
        budget = self.usable_bytes - self.expert_parallel_bytes(num_devices) - self.drafter_fixed_bytes
        return max(0, budget // self.bytes_per_seq) if self.bytes_per_seq else 0

    def expert_parallel_text(self, num_devices: int) -> str:
        """One expert-parallel layout in words: per-device weight bytes and the sequences that then fit."""
        return (f"EP over {num_devices}: {self.expert_parallel_bytes(num_devices) / _GIB:.2f} GiB weights per device, "
                f"{self.expert_parallel_num_seqs(num_devices)} sequences of max_model_len per device")

    def summary(self) -> str:
        """The numbers, in one paragraph."""
        w = self.weights
        mtp = ""
        if self.expert_parallel_size > 1 and w.mtp_bytes:
            mtp = (f", MTP layers {_size(w.mtp_bytes)} whole on each rank (speculative={self.speculative!r})"
                   if self.with_mtp else ", MTP layers left out (no speculative decoding)")
        ep = (f" ({self.rank_weight_bytes / _GIB:.2f} GiB per rank of expert_parallel_size "
              f"{self.expert_parallel_size} with {self.num_redundant_experts} redundant experts{mtp})"
              if self.expert_parallel_size > 1 else "")
        drafter = (f" + {_size(self.drafter_state_bytes_per_seq)} {self.speculative} drafter state"
                   if self.drafter_state_bytes_per_seq else "")
        text = (f"weights {w.total / _GIB:.2f} GiB ({w.expert_bytes / _GIB:.2f} GiB routed experts, "
                f"{w.other_bytes / _GIB:.2f} GiB the rest){ep}; {self.device} has {self.device_bytes / _GIB:.2f} GiB "
                f"available, {MEMORY_UTILIZATION:.0%} usable = {self.usable_bytes / _GIB:.2f} GiB; KV "
                f"{self.kv_bytes_per_token:.0f} B/token + {self.state_bytes_per_seq / 2**20:.2f} MiB state{drafter} "
                f"per sequence = {self.bytes_per_seq / 2**20:.2f} MiB per sequence of max_model_len "
                f"{self.max_model_len}; KV budget {self.kv_budget_bytes / _GIB:.2f} GiB holds {self.num_seqs_fit} "
                "such sequences")
        if self.drafter_state_bytes:
            text += (f"; the {self.speculative} drafter's state takes {_size(self.drafter_state_bytes)} for "
                     f"{self.num_slots} slots")
        if w.engram_bytes:
            text += (f"; Engram tables {w.engram_bytes / _GIB:.2f} GiB in "
                     + ("pinned host memory" if self.engram_placement == "pinned_host" else "device memory"))
        if self.rank_weight_bytes + self.bytes_per_seq > self.usable_bytes:
            n = self.expert_parallel_devices()
            text += (f"; an expert-parallel layout needs {n} such devices (routed experts split "
                     f"{w.expert_bytes / _GIB:.2f} GiB / {n}, {w.other_bytes / _GIB:.2f} GiB replicated)" if n else
                     "; even the non-expert weights do not fit one device, so expert parallelism alone cannot place it")
            # NOTE: per-device figures for the smallest layout that fits and for one 8-device node.
            text += "; on " + self.device + ": " + "; ".join(
                self.expert_parallel_text(k) for k in sorted({n, 8} if n else {8}))
        return text


def plan_fit(config: ModelConfig, weights: WeightBytes, *, dtype: torch.dtype, device: str, device_bytes: int,
             max_model_len: int, block_size: int, max_num_seqs: int, expert_parallel_size: int = 1,
             num_redundant_experts: int = 0, engram_placement: str = "auto",
             speculative: str | None = None) -> FitReport:
    """The memory plan from known numbers (no I/O): what `check_fit` evaluates (per rank with
    `expert_parallel_size` > 1; `device_bytes` is then one rank's). `engram_placement` ("auto", "device",
    "pinned_host"): where V4.1's Engram tables go; "auto" is resolved by `engram.decide_engram_placement` from the
    plan with the tables on the device (the report states the choice). `speculative` (`EngineConfig.speculative`:
    None, "mtp", "dspark"): the drafter's state is counted per slot, and expert-parallel ranks hold the MTP layers
    whole (NOTE: as `Engine` loads them: `rank_load_kwargs(..., load_mtp=speculative is not None)`)."""
    from dataclasses import replace

    from deepinfer.engine.quant.engram import decide_engram_placement

    itemsize = torch.tensor([], dtype=dtype).element_size()
    layout = cache_layout(config)  # V4's or V4.1's anatomy
    pools = layout.pools(1, block_size, 1, itemsize)  # one block, one slot
    block_bytes = sum(p.nbytes for p in pools.values() if not p.is_state)
    state_bytes = sum(p.nbytes for p in pools.values() if p.is_state)
    drafter_per_slot, drafter_fixed = drafter_slot_bytes(config, speculative, itemsize)
    report = FitReport(
        weights=weights, device=str(device), device_bytes=device_bytes,
        usable_bytes=int(device_bytes * MEMORY_UTILIZATION),
        kv_bytes_per_token=layout.compressed_bytes_per_token(itemsize), block_bytes=block_bytes,
        state_bytes_per_seq=state_bytes, max_model_len=max_model_len, block_size=block_size,
        max_num_seqs=max_num_seqs, expert_parallel_size=expert_parallel_size,
        num_routed_experts=config.n_routed_experts, num_redundant_experts=num_redundant_experts,
        speculative=speculative, with_mtp=speculative is not None, drafter_state_bytes_per_seq=drafter_per_slot,
        drafter_fixed_bytes=drafter_fixed,
    )
    placement = decide_engram_placement(engram_placement, device, num_seqs_fit_with_tables=report.num_seqs_fit,
                                        max_num_seqs=max_num_seqs, table_bytes=weights.engram_bytes)
    return replace(report, engram_placement=placement)


def check_fit(path: str | Path, config: ModelConfig, *, dtype: torch.dtype, device: str, max_model_len: int,
              block_size: int, max_num_seqs: int, num_blocks: int | None = None,
              device_bytes: int | None = None, expert_parallel_size: int = 1,
              num_redundant_experts: int = 0, engram_placement: str = "auto",
              host_bytes: int | None = None, speculative: str | None = None) -> FitReport:
    """The memory plan for serving checkpoint `path` on `device`; raises `ModelDoesNotFitError` (with the
    numbers, and the expert-parallel device count when the weights are the problem) when not one
    sequence of `max_model_len` fits, or a requested `num_blocks` exceeds the budget.
    `device_bytes`: the available memory (None: measured). `expert_parallel_size` > 1: the plan of one rank
    (its weight share, its own KV pool; `num_blocks` per rank; CPU ranks split the host's memory).
    `engram_placement`: where V4.1's Engram tables go ("auto": `plan_fit` decides; the report's `engram_placement`
    is what the loader is told); tables in pinned host memory must fit `host_bytes` (None: the host's
    MemAvailable) times `MEMORY_UTILIZATION`, else `ModelDoesNotFitError`. `speculative` (`EngineConfig.speculative`):
    the drafter's state per slot, and the MTP layers on every expert-parallel rank (`plan_fit`)."""
    if device_bytes is None:
        device_bytes = available_device_bytes(device)
        if torch.device(device).type != "cuda":
            device_bytes //= expert_parallel_size  # CPU ranks share the host's memory
    dequantized, fp32_kept = False, None
    if hasattr(config, "kv_source_layer_ids"):  # a V41Config: its loader's own rules (what stays quantized, fp32)
        from deepinfer.engine.models.deepseek_v41 import dequantized_at_load as dequantized
        from deepinfer.engine.models.deepseek_v41 import kept_float32 as fp32_kept
    report = plan_fit(config, checkpoint_weight_bytes(path, dtype, dequantized, fp32_kept), dtype=dtype, device=device,
                      device_bytes=device_bytes, max_model_len=max_model_len, block_size=block_size,
                      max_num_seqs=max_num_seqs, expert_parallel_size=expert_parallel_size,
                      num_redundant_experts=num_redundant_experts, engram_placement=engram_placement,
                      speculative=speculative)
    if report.engram_host_bytes and torch.device(device).type != "cpu":
        host = available_device_bytes("cpu") if host_bytes is None else host_bytes
        if report.engram_host_bytes > host * MEMORY_UTILIZATION:
            raise ModelDoesNotFitError(
                f"{path}: the Engram tables ({report.engram_host_bytes / _GIB:.2f} GiB) go to pinned host memory "
                f"(engram_placement={engram_placement!r}), but the host has {host / _GIB:.2f} GiB available "
                f"({MEMORY_UTILIZATION:.0%} usable). Free host memory, or set engram_placement='device' with room on "
                f"the device ({report.summary()}).")
    spec_hint = (f" (speculative={speculative!r} adds the drafter's state and, per expert-parallel rank, the whole "
                 "MTP layers: speculative=None frees them)" if speculative is not None else "")
    if not report.fits:
        raise ModelDoesNotFitError(
            f"{path} does not fit on {device}: {report.summary()}. Use more devices, a smaller max_model_len or "
            f"max_num_seqs, or a bfloat16 / quantized checkpoint{spec_hint}."
        )
    if num_blocks is not None and num_blocks > report.max_num_blocks:
        raise ModelDoesNotFitError(
            f"num_blocks={num_blocks} does not fit on {device}: the budget holds {report.max_num_blocks} blocks of "
            f"{report.block_bytes / 2**20:.2f} MiB beside {report.num_slots} state slots ({report.summary()}). "
            f"Lower num_blocks or leave it unset{spec_hint}."
        )
    return report
