"""DeepSeek-V4.1's Engram tables kept FP8 in memory, mapped from the checkpoint without a full read.

A published Engram table (`layers.{L}.engram.embed.weight`: float8_e4m3fn [rows, 256] with `embed.scale`:
float8_e8m0fnu [rows, 8], one UE8M0 scale per 32 values of a row) is ~94 GiB per layer in Flash (384M rows;
docs/V4_1.md §6). A token reads 24 of those rows per layer, so the engine never holds the table as floats and
never reads it through Python objects:

  * `map_safetensors_tensor(file, name)`: the tensor as a view of a private (copy-on-write) memory map of the
    shard, at its offset from the safetensors header: pages are read only when touched.
  * `Fp8EngramTable`: holds `weight` / `scale` under the checkpoint's names (so `state_dict()` round trips), and
    its `forward(ids)` gathers only the rows the hashes hit, then dequantizes them (the `"engram_gather"` op,
    `kernels/engram_gather.py`: torch reference, host gather, Triton).
  * Placement (`place`): "device" (the table in the engine device's memory; on a CPU engine the mapping itself,
    which is host memory) or "pinned_host" (page-locked host memory, read from CUDA either by the host gather or
    by the Triton kernel zero-copy). Model moves (`model.to(...)`) and dtype casts never touch the table: only
    `place` moves it. `engine.fit` decides the placement (`decide_engram_placement`, `EngineConfig.engram_placement`
    overrides it).

NOTE: this module imports only torch and the standard library (see the package NOTE).
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

ENGRAM_PLACEMENTS = ("auto", "device", "pinned_host")
"""`EngineConfig.engram_placement` values: "auto" (the fit check decides), "device", "pinned_host"."""

_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "I8": torch.int8,
              "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}
_COPY_CHUNK_BYTES = 256 << 20
"""Bytes per chunk when a mapped table is copied into device or pinned memory (bounded host scratch)."""


def read_safetensors_header(file: str | Path) -> tuple[dict, int]:
    """A safetensors file's JSON header and the byte offset where its data section starts (reads the header only)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def map_safetensors_tensor(file: str | Path, name: str) -> torch.Tensor:
    """Tensor `name` of safetensors `file` as a view of a private memory map of the file: no data is read until
    rows are touched (then the OS pages them in), and writes would stay private. The tensor keeps the map alive
    (and names it as `tensor._mapping`, for `Fp8EngramTable.place`).

    NOTE: the map is advised MADV_RANDOM: a gather touches scattered 256-byte rows of a table that is mostly not
    in the page cache, and the kernel's default read-around would read from disk a window around each row."""
    header, start = read_safetensors_header(file)
    if name not in header:
        raise KeyError(f"{file}: no tensor {name!r} in its safetensors header")
    info = header[name]
    dtype = _ST_DTYPES.get(info["dtype"])
    if dtype is None:
        raise ValueError(f"{file}: {name} has safetensors dtype {info['dtype']}, which map_safetensors_tensor does "
                         f"not map (known: {sorted(_ST_DTYPES)})")
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    itemsize = torch.tensor([], dtype=dtype).element_size()
    if end - begin != itemsize * int(torch.Size(shape).numel()):
        raise ValueError(f"{file}: {name}'s data_offsets [{begin}, {end}) do not hold {dtype} {list(shape)}")
    if end == begin:
        return torch.empty(shape, dtype=dtype)
    with open(file, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE: lazy, writable, never written back
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
    tensor = flat.view(dtype).view(shape)
    tensor._mapping = mapped
    return tensor


def _advise(maps, advice_name: str) -> None:
    advice = getattr(mmap, advice_name, None)
    for m in maps:
        if advice is not None and hasattr(m, "madvise"):
            m.madvise(advice)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Copy `src` into `dst` a chunk of rows at a time (a mapped table is never materialised whole on the host)."""
    rows = max(1, _COPY_CHUNK_BYTES // max(1, src[0].numel() * src.element_size())) if src.shape[0] else 1
    for r in range(0, src.shape[0], rows):
        dst[r:r + rows].copy_(src[r:r + rows])
    return dst


class Fp8EngramTable(nn.Module):
    """One Engram layer's table kept FP8: `weight` float8_e4m3fn [rows, dim], `scale` float8_e8m0fnu [rows, dim/32]
    (the checkpoint's tensors under its names); `forward(ids)` -> the dequantized rows in `out_dtype`.

    `placement` says where the table lives ("loaded": as loaded, e.g. the file mapping; "device"; "pinned_host"); the
    gather implementation follows from it and the ids' device (`kernels.engram_gather.table_gather_impl`), or
    `gather_impl` when set ("triton" on a pinned table: the zero-copy read)."""

    def __init__(self, rows: int, dim: int, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if dim % 32:
            raise ValueError(f"Fp8EngramTable: the row width must be a multiple of 32 (one scale per 32), got {dim}")
        self.rows, self.dim, self.out_dtype = rows, dim, out_dtype
        # NOTE: meta tensors of the right shapes and dtypes (no memory) until the loader installs the table's
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device="meta"), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device="meta"),
                                  requires_grad=False)
        self._maps: list = []
        self._gather_key: tuple | None = None
        self._gather = None
        self.placement = "unloaded"
        self.gather_impl: str | None = None
        """An `"engram_gather"` implementation name forcing the pick (None: `table_gather_impl`)."""

    def set_tables(self, weight: torch.Tensor, scale: torch.Tensor, placement: str = "loaded") -> None:
        """Install the table's tensors as they are (a mapping, or tensors already placed); checks dtypes and shapes."""
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (self.rows, self.dim):
            raise ValueError(f"Fp8EngramTable: weight must be float8_e4m3fn [{self.rows}, {self.dim}], got "
                             f"{weight.dtype} {list(weight.shape)}")
        if scale.dtype != torch.float8_e8m0fnu or tuple(scale.shape) != (self.rows, self.dim // 32):
            raise ValueError(f"Fp8EngramTable: scale must be float8_e8m0fnu [{self.rows}, {self.dim // 32}] (UE8M0, "
                             f"one per 32 values), got {scale.dtype} {list(scale.shape)}")
        # the file maps the tensors view (none once placed elsewhere)
        self._maps = [m for m in (getattr(weight, "_mapping", None), getattr(scale, "_mapping", None)) if m is not None]
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.placement = placement
        self._gather_key = None  # new tensors (e.g. now pinned): `forward` picks the gather again

    def place(self, placement: str, device: torch.device | str) -> None:
        """Move the table to `placement` for an engine on `device`: "device" (copied into `device` memory a chunk at a
        time; on a CPU device the host tensors stay as they are, the mapping included) or "pinned_host" (copied into
        page-locked host memory when CUDA is present; otherwise host memory as it is: there is nothing to pin)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        _advise(self._maps, "MADV_SEQUENTIAL")  # a whole-table copy reads in order: read ahead (random after)
        try:
            self._place(placement, device)
        finally:
            _advise(self._maps, "MADV_RANDOM")

    def _place(self, placement: str, device: torch.device) -> None:
        if placement == "device":
            if self.weight.device != device:
                self.set_tables(_copy_rows(self.weight, torch.empty_like(self.weight, device=device)),
                                _copy_rows(self.scale, torch.empty_like(self.scale, device=device)), placement)
            self.placement = placement
        elif placement == "pinned_host":
            w, s = self.weight, self.scale
            if w.device.type != "cpu":
                w, s = w.cpu(), s.cpu()
            if torch.cuda.is_available() and not w.is_pinned():
                w = _copy_rows(w, torch.empty(w.shape, dtype=w.dtype, pin_memory=True))
                s = _copy_rows(s, torch.empty(s.shape, dtype=s.dtype, pin_memory=True))
            self.set_tables(w, s, placement)
        else:
            raise ValueError(f"Fp8EngramTable.place: placement must be 'device' or 'pinned_host', got {placement!r}")

    def _apply(self, fn, recurse=True):
        # NOTE: the table stays where `place` put it and in its stored dtypes: a model-wide `.to(device)` would copy
        # ~94 GiB per layer (and a dtype cast would drop the scales), so the base class never sees these tensors.
        saved = {k: self._parameters.pop(k) for k in ("weight", "scale")}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._parameters.update(saved)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # NOTE: installs the given tensors as they are (`set_tables`: a file mapping stays a mapping) instead of
        # copying them into the current ones, which would read the whole table.
        names = [prefix + "weight", prefix + "scale"]
        found = [n for n in names if n in state_dict]
        missing_keys.extend(n for n in names if n not in state_dict)
        if len(found) == 2:
            try:
                self.set_tables(state_dict[names[0]], state_dict[names[1]])
            except ValueError as exc:
                error_msgs.append(f"{prefix[:-1]}: {exc}")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 (row ids on the engine's device) -> rows [..., dim] in `out_dtype` on the ids' device."""
        key = (self.weight.device, ids.device, self.gather_impl)
        if key != self._gather_key:  # picked once per (table device, ids device, override)
            from deepinfer.kernels import engram_gather as _ops  # registers the op
            from deepinfer.kernels.registry import get_op

            impl = self.gather_impl or _ops.table_gather_impl(key[0], key[1], pinned=self.weight.is_pinned())
            self._gather = get_op("engram_gather", impl)
            self._gather_key = key
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        return self._gather(flat, self.weight, self.scale, self.out_dtype).view(*ids.shape, self.dim)

    def resident_nbytes(self) -> int:
        """Bytes of the table (weight + scale) wherever it lives (a mapping counts whole: it may all be paged in)."""
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantized(self) -> torch.Tensor:
        """The whole float32 table [rows, dim] (tests and references only: reads every row)."""
        from deepinfer.engine.quant.formats import dequant_fp8_block

        return dequant_fp8_block(self.weight.cpu(), self.scale.cpu(), (1, 32))

    def extra_repr(self) -> str:
        return (f"rows={self.rows}, dim={self.dim}, placement={self.placement}, device={self.weight.device}, "
                f"out_dtype={self.out_dtype}")


def decide_engram_placement(requested: str, device: torch.device | str, *, num_seqs_fit_with_tables: int,
                            max_num_seqs: int, table_bytes: int) -> str:
    """Where the Engram tables go ("device" or "pinned_host") for an engine on `device`.

    `requested` "device" / "pinned_host" is honoured. "auto": no tables, or a CPU engine (host memory is its
    device memory: pinning buys nothing) -> "device"; on an accelerator the tables go to the device only when,
    with them there, the cache still holds `max_num_seqs` sequences of max_model_len (the configured
    concurrency is not cut) — else they live in pinned host memory and are gathered from there (a token reads
    ~6 KiB per Engram layer, over PCIe)."""
    if requested not in ENGRAM_PLACEMENTS:
        raise ValueError(f"engram_placement must be one of {list(ENGRAM_PLACEMENTS)}, got {requested!r}")
    if requested != "auto":
        return requested
    if table_bytes == 0 or torch.device(device).type == "cpu":
        return "device"
    return "device" if num_seqs_fit_with_tables >= max_num_seqs else "pinned_host"
