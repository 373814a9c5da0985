"""Load a DeepSeek-V4 safetensors checkpoint into a model: validated first, then streamed.

A checkpoint is a directory with `config.json` and either `model.safetensors` or shards
`model-0000i-of-0000n.safetensors` listed by `model.safetensors.index.json` (the layout of
transformers' `save_pretrained`). Loading goes in two phases:

1. **Plan** (headers only, no tensor data read): read `config.json` into `ModelConfig`, derive the
   expected tensors from `engine.models.deepseek_v4_weights.checkpoint_spec`, scan the index and
   every shard's safetensors header, and refuse the checkpoint with one `CheckpointError` that
   names every culprit: missing or unexpected tensors, wrong shapes or dtypes, a broken index, a
   missing shard, or a quantization we cannot load.
2. **Stream**: the model is built with its parameters on the `meta` device (no memory), then each
   shard is memory-mapped with `safetensors.safe_open` and its tensors are read one at a time,
   converted (dtype, device) and assigned. At most one raw tensor is alive besides the model, so
   peak memory is about the model's size, never twice it.

Extending to quantized checkpoints
----------------------------------
How a stored tensor becomes a model tensor is decided by a `WeightTransform`, chosen by the
`quantization_config.quant_method` of config.json (`"none"` when absent) from a registry filled
with `@register_weight_transform(method)`. A transform (a) names the companion tensors it consumes
(e.g. the `*.scale` block scales of FP8 weights) so they are not reported as unexpected, (b)
checks one stored tensor against its `TensorSpec` (a packed FP4 expert has another shape than the
model tensor), and (c) converts it, reading companions on demand. FP8 block-scaled attention or FP4
experts therefore arrive as one new transform (plus, if the model keeps them quantized, a
quantization-aware spec), without touching the model or this loader. Registered: `"none"` (dense
float/int tensors, cast to the requested dtype; FP8 tensors or scales are refused) and `"fp8"`
(DeepSeek's published checkpoints, below).

The published DeepSeek-V4 checkpoints (`quant_method: fp8`)
-----------------------------------------------------------
Names follow `deepseek_v4_weights.PUBLISHED_NAME_MAP` (`embed.weight`, `layers.{i}.attn.kv_norm.weight`,
`mtp.0.*`, ...). A weight `X.weight` stored float8_e4m3fn with a companion `X.scale` (UE8M0, or float32
in the `*-Base` checkpoints) over `weight_block_size` [128, 128] blocks is held as an
`engine.quant.linear.Fp8Linear`; one stored int8 [out, in/2] (two E2M1 codes a byte) with a UE8M0
`X.scale` [out, in/32] as an `Fp4Linear` (the routed experts when `expert_dtype` is "fp4", at the top
level of config.json in V4, inside `quantization_config` in V4.1). NOTE: which modules are quantized
is decided here, from the headers: `FP8Transform.quantize_spec` turns the spec's `X.weight` entries into
the stored (quantized) shapes and dtypes and adds `X.scale`; `_load_into` then replaces those
`nn.Linear` modules of the built model (still on `meta`) before the state is loaded, so the tensors
stay as published (resident bytes = checkpoint bytes). Everything else (BF16 norms, FP32 `hc_*`, ...)
is cast as in a dense checkpoint. Refused with the tensor or field and the fix: an unknown
`quant_method` or quantization field, a scale grid that does not match its weight, a quantized
tensor without its scale, an expert storage that contradicts `expert_dtype`, and V4.1's 32x32 blocks
and Engram tables in a V4 config. A V4.1 checkpoint (`model_type` deepseek_v41, `text_config`) is read by
its own model's reader (`engine.models.deepseek_v41.load_for_engine`: FP8 linears, FP4 experts and FP8 Engram
tables kept as stored, the tables mapped from the shards and placed on the device or in pinned host memory).

The loader imports the models (their tensor specs, the classes it builds: `load_checkpoint`, and
`load_vision_tower` for the vision stage); no model imports the loader.

Multi-token-prediction weights
------------------------------
`load_checkpoint` builds the model's MTP layers (`engine.models.mtp`) when the checkpoint ships
`mtp.*` tensors and loads them with the rest (spec: `mtp_checkpoint_spec`); a checkpoint without
them (transformers' `save_pretrained` writes none) gives a model without MTP. `load_weights` into a
model loads `mtp.*` exactly when the model has an MTP layer. Skipped keys are recorded in
`WeightLoader.skipped_names`.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from deepinfer.engine.config import ModelConfig, V41Config, config_json_path, is_v41_config, read_config_json
from deepinfer.engine.models.deepseek_v4_weights import (
    VISION_PREFIXES,
    TensorSpec,
    checkpoint_spec,
    mtp_checkpoint_spec,
    official_to_spec_name,
    parse_dtype,
    spec_to_published_name,
    vision_checkpoint_spec,
)

if TYPE_CHECKING:
    from deepinfer.engine.models.vision import VisionTower

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MTP_PREFIXES = ("mtp.", "model.mtp.")
"""Key prefixes of multi-token-prediction layers, skipped by default (see module docstring)."""

PROGRESS_MIN_BYTES = 1 << 30
PROGRESS_MIN_TENSORS = 200
_MAX_LISTED = 10

_FLOAT_STORAGE = frozenset({"F64", "F32", "F16", "BF16"})  # safetensors dtype tags cast to any float dtype
_INT_STORAGE = frozenset({"I64", "I32", "I16", "I8", "U8"})
_FP8_STORAGE_RE = re.compile(r"^(F8_.*|F4.*|F6.*)$")
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
# Companion tensors of block-scaled quantization (DeepSeek: `<w>.scale`; HF FP8: `weight_scale_inv`).
# NOTE: hyper-connection scales (`hc_attn_scale`, `hc_head.hc_scale`) do not match: no dot before.
_QUANT_SCALE_RE = re.compile(r"(\.scale|_scale_inv|\.weight_scale|\.input_scale)$")


class CheckpointError(ValueError):
    """A checkpoint (or a model) does not match what deepinfer can load.

    The message names the culprit tensor, field or file and says how to fix it.
    """


class QuantizedLinearSpec(NamedTuple):
    """One `nn.Linear` of the model that the checkpoint stores quantized (decided from the headers)."""

    kind: str
    """`"fp8"` (`Fp8Linear`) or `"fp4"` (`Fp4Linear`)."""
    in_features: int
    """Input width of the linear."""
    out_features: int
    """Output width of the linear."""
    block: tuple[int, int]
    """Scale block (rows, columns): `weight_block_size` for FP8, (1, 32) for FP4."""
    scale_dtype: torch.dtype
    """float8_e8m0fnu, or float32 (FP8 of the `*-Base` checkpoints)."""


class StoredTensor(NamedTuple):
    """One tensor as a safetensors header describes it (no data read)."""

    file: Path
    """Shard that holds it."""
    dtype: str
    """safetensors dtype tag: `F32`, `BF16`, `I64`, `F8_E4M3`, ..."""
    shape: tuple[int, ...]
    """Stored shape."""

    @property
    def num_bytes(self) -> int:
        """Bytes on disk (1 byte per element for tags we do not size)."""
        return math.prod(self.shape) * _ITEMSIZE.get(self.dtype, 1)


# ---------------------------------------------------------------------------------- transforms


class WeightTransform:
    """How stored tensors become model tensors, for one quantization method.

    Subclass it, set `method`, and register it with `@register_weight_transform`; the loader picks
    it by `quantization_config.quant_method` of config.json. Contract, in call order:

    - `companion_names(stored)`: once, before anything is read; returns checkpoint names consumed
      alongside other tensors (never reported as unexpected). It may refuse storage it cannot load.
    - `check(name, stored, spec)`: per expected tensor, header only; returns a problem description
      or None.
    - `convert(name, tensor, spec, read_companion)`: per tensor, returns the tensor the model holds
      (dtype `spec.dtype`, on the CPU); `read_companion(name)` reads another checkpoint tensor.

    Before `companion_names`, `quantize_spec(spec, stored)` may rewrite the spec for tensors the
    model keeps quantized (and name the linears that must become quantized modules).
    """

    method: ClassVar[str] = "none"

    def __init__(self, quantization_config: Mapping[str, Any] | None = None) -> None:
        self.quantization_config = dict(quantization_config or {})

    def quantize_spec(
        self, spec: Mapping[str, TensorSpec], stored: Mapping[str, StoredTensor]
    ) -> tuple[dict[str, TensorSpec], dict[str, QuantizedLinearSpec]]:
        """The spec as the model will hold this checkpoint, and the linears (module name -> what) that
        are kept quantized; `stored` is keyed by spec name. Unquantized methods change nothing."""
        return dict(spec), {}

    def companion_names(self, stored: Mapping[str, StoredTensor]) -> set[str]:
        """Names of checkpoint tensors this method consumes alongside others (e.g. FP8 scales)."""
        return set()

    def check(self, name: str, stored: StoredTensor, spec: TensorSpec) -> str | None:
        """Why stored tensor `name` cannot become `spec`, or None if it can."""
        raise NotImplementedError

    def convert(
        self, name: str, tensor: torch.Tensor, spec: TensorSpec, read_companion: Callable[[str], torch.Tensor]
    ) -> torch.Tensor:
        """The model's tensor for `name` from its stored `tensor`."""
        raise NotImplementedError


_WEIGHT_TRANSFORMS: dict[str, type[WeightTransform]] = {}


def register_weight_transform(method: str) -> Callable[[type[WeightTransform]], type[WeightTransform]]:
    """Class decorator: make `cls` the transform for `quantization_config.quant_method == method`."""

    def register(cls: type[WeightTransform]) -> type[WeightTransform]:
        if method in _WEIGHT_TRANSFORMS:
            raise ValueError(f"a weight transform for quant_method {method!r} is already registered")
        cls.method = method
        _WEIGHT_TRANSFORMS[method] = cls
        return cls

    return register


def supported_quant_methods() -> list[str]:
    """Quantization methods the loader can read (`"none"` = unquantized)."""
    return sorted(_WEIGHT_TRANSFORMS)


def make_weight_transform(quantization_config: Mapping[str, Any] | None, source: str = "config.json") -> WeightTransform:
    """The registered transform for a config.json `quantization_config` (None: unquantized)."""
    if not quantization_config:
        return _WEIGHT_TRANSFORMS["none"]()
    if not isinstance(quantization_config, Mapping):
        raise CheckpointError(f"{source}: quantization_config must be an object, got {quantization_config!r}.")
    method = quantization_config.get("quant_method")
    cls = _WEIGHT_TRANSFORMS.get(str(method))
    if cls is None:
        raise CheckpointError(
            f"quant_method {method!r} is not supported: {source} has quantization_config with quant_method={method!r}. "
            f"deepinfer loads {supported_quant_methods()} checkpoints ('fp8': DeepSeek's published FP8 block-scaled "
            "layout); dequantize the weights to bfloat16 first and drop quantization_config from config.json."
        )
    try:
        return cls(quantization_config)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from None


@register_weight_transform("none")
class DenseTransform(WeightTransform):
    """Unquantized checkpoints: any float dtype is cast to the spec's dtype, integers to int64."""

    def companion_names(self, stored: Mapping[str, StoredTensor]) -> set[str]:
        quantized = [n for n, s in stored.items() if _QUANT_SCALE_RE.search(n) or _FP8_STORAGE_RE.match(s.dtype)]
        if quantized:
            examples = ", ".join(f"{n} ({stored[n].dtype} in {stored[n].file.name})" for n in quantized[:3])
            raise CheckpointError(
                f"quantized tensors without a quantization_config: the checkpoint has {len(quantized)} quantized "
                f"or scale tensor(s), e.g. {examples}, but config.json declares no quantization. Add DeepSeek's "
                "quantization_config (quant_method 'fp8', weight_block_size [128, 128]) if these are its published "
                "FP8/FP4 tensors, or dequantize the checkpoint to bfloat16."
            )
        return set()

    def check(self, name: str, stored: StoredTensor, spec: TensorSpec) -> str | None:
        if stored.shape != tuple(spec.shape):
            return f"{name}: shape {list(stored.shape)} in {stored.file.name}, expected {list(spec.shape)}"
        if spec.dtype.is_floating_point and stored.dtype not in _FLOAT_STORAGE:
            return f"{name}: dtype {stored.dtype} in {stored.file.name}, expected a float tensor (loaded as {spec.dtype})"
        if not spec.dtype.is_floating_point and stored.dtype not in _INT_STORAGE:
            return f"{name}: dtype {stored.dtype} in {stored.file.name}, expected an integer tensor (loaded as {spec.dtype})"
        return None

    def convert(
        self, name: str, tensor: torch.Tensor, spec: TensorSpec, read_companion: Callable[[str], torch.Tensor]
    ) -> torch.Tensor:
        return tensor.to(spec.dtype)


_QUANT_FIELDS = frozenset({"quant_method", "fmt", "scale_fmt", "weight_block_size", "activation_scheme", "expert_dtype"})
_EXPERT_WEIGHT_RE = re.compile(r"(?:model\.layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_QUANT_STORAGE = {"F8_E4M3": torch.float8_e4m3fn, "I8": torch.int8, "U8": torch.int8}
_SCALE_STORAGE = {"F8_E8M0": torch.float8_e8m0fnu, "F32": torch.float32}
_TORCH_TAG = {torch.float8_e4m3fn: "F8_E4M3", torch.int8: "I8", torch.float8_e8m0fnu: "F8_E8M0", torch.float32: "F32"}
V41_HINT = ("V4.1 checkpoints are served only in their own layout (config.json `model_type` 'deepseek_v41' with a "
            "`text_config`: engine.config.V41Config, engine.models.deepseek_v41; docs/V4_1.md), not as a V4 config")


@register_weight_transform("fp8")
class FP8Transform(WeightTransform):
    """DeepSeek's published checkpoints: FP8 block-scaled linears and FP4 (or FP8) routed experts kept
    quantized (see the module docstring), every other tensor dense as in `"none"`.

    `quantization_config`: `quant_method` "fp8", `fmt` "e4m3", `scale_fmt` "ue8m0" (the stored scale
    dtype decides: UE8M0 or float32), `weight_block_size` [128, 128], `activation_scheme` "dynamic",
    optionally `expert_dtype` ("fp4" or "fp8"; config.json's top-level value is folded in by
    `read_checkpoint_config`). Anything else is refused.
    """

    def __init__(self, quantization_config: Mapping[str, Any] | None = None) -> None:
        super().__init__(quantization_config)
        q = self.quantization_config
        unknown = sorted(set(q) - _QUANT_FIELDS)
        if unknown:
            raise CheckpointError(
                f"quantization_config has field(s) deepinfer does not understand: {unknown}; it reads "
                f"{sorted(_QUANT_FIELDS)}. Remove them if they describe nothing stored, or add support in engine/loader.py."
            )
        for key, allowed in (("fmt", ("e4m3",)), ("scale_fmt", ("ue8m0",)), ("activation_scheme", ("dynamic",)),
                             ("expert_dtype", ("fp4", "fp8"))):
            if q.get(key) is not None and q[key] not in allowed:
                raise CheckpointError(
                    f"quantization_config.{key}={q[key]!r} is not supported; deepinfer loads {key} in {list(allowed)}."
                )
        block = q.get("weight_block_size", [128, 128])
        if list(block) == [32, 32]:
            raise CheckpointError(
                f"quantization_config.weight_block_size=[32, 32] is V4.1's FP8 block size; {V41_HINT} "
                "(use a V4 checkpoint, block [128, 128])."
            )
        if list(block) != [128, 128]:
            raise CheckpointError(
                f"quantization_config.weight_block_size={list(block)} is not supported; DeepSeek-V4 FP8 weights use "
                "[128, 128] blocks. Re-quantize with 128x128 blocks or dequantize to bfloat16."
            )
        self.block = (int(block[0]), int(block[1]))
        self.expert_dtype: str | None = q.get("expert_dtype")
        self._quantized: set[str] = set()

    def quantize_spec(
        self, spec: Mapping[str, TensorSpec], stored: Mapping[str, StoredTensor]
    ) -> tuple[dict[str, TensorSpec], dict[str, QuantizedLinearSpec]]:
        from deepinfer.engine.quant.formats import fp4_scale_shape, fp8_scale_shape

        out, plan, problems = dict(spec), {}, []
        pub = spec_to_published_name  # NOTE: messages name tensors as the published checkpoint spells them
        for name, st in stored.items():
            if not name.endswith(".scale"):
                continue  # NOTE: hyper-connection scales (`hc_attn_scale`, `hc_head.hc_scale`) have no dot before
            module, wname = name.removesuffix(".scale"), name.removesuffix(".scale") + ".weight"
            ws = stored.get(wname)
            if wname not in spec or ws is None or len(spec[wname].shape) != 2:
                continue  # reported as unexpected (or the weight as missing) by the loader
            out_f, in_f = spec[wname].shape
            where = f"in {ws.file.name}"
            if ws.dtype == "F8_E4M3":
                kind, block, want_w, grid = "fp8", self.block, (out_f, in_f), fp8_scale_shape(out_f, in_f, self.block)
            elif ws.dtype in ("I8", "U8"):
                kind, block, want_w, grid = "fp4", (1, 32), (out_f, in_f // 2), fp4_scale_shape(out_f, in_f)
            else:
                problems.append(f"{pub(name)} is a block scale but {pub(wname)} is stored {ws.dtype} {where}; a block-scaled "
                                "weight is F8_E4M3 (FP8) or I8 (two FP4 codes a byte)")
                continue
            if _EXPERT_WEIGHT_RE.fullmatch(wname) and kind != (self.expert_dtype or "fp8"):
                problems.append(f"{pub(wname)} is stored {kind.upper()} ({ws.dtype}) but config.json says expert_dtype="
                                f"{self.expert_dtype!r}; set expert_dtype to {kind!r} (top level, or in "
                                "quantization_config) or re-export the experts")
                continue
            if st.dtype not in _SCALE_STORAGE or (kind == "fp4" and st.dtype != "F8_E8M0"):
                problems.append(f"{pub(name)}: scale dtype {st.dtype} {where}; {kind.upper()} scales are F8_E8M0"
                                + (" or F32 (*-Base)" if kind == "fp8" else ""))
                continue
            if tuple(ws.shape) != want_w:
                problems.append(f"{pub(wname)}: {kind.upper()} shape {list(ws.shape)} {where}, expected {list(want_w)} for "
                                f"the model's [{out_f}, {in_f}] linear")
                continue
            if tuple(st.shape) != grid:
                problems.append(f"{pub(name)}: scale grid {list(st.shape)} {where} does not match weight {pub(wname)} "
                                f"[{out_f}, {in_f}] with {list(block)} blocks (expected {list(grid)}); re-export the "
                                "scales or fix quantization_config.weight_block_size")
                continue
            out[wname] = TensorSpec(tuple(ws.shape), _QUANT_STORAGE[ws.dtype])
            out[name] = TensorSpec(grid, _SCALE_STORAGE[st.dtype])
            plan[module] = QuantizedLinearSpec(kind, in_f, out_f, block, _SCALE_STORAGE[st.dtype])
            self._quantized.update((wname, name))
        for name, st in stored.items():
            if _FP8_STORAGE_RE.match(st.dtype) and name not in self._quantized and name in spec:
                problems.append(f"{pub(name)} is stored {st.dtype} in {st.file.name} without a usable "
                                f"{pub(name).removesuffix('.weight')}.scale; ship its block scales or dequantize it")
        if problems:
            raise CheckpointError(f"{len(problems)} quantized tensor(s) deepinfer cannot hold: {_listing(problems)}.")
        return out, plan

    def check(self, name: str, stored: StoredTensor, spec: TensorSpec) -> str | None:
        if name in self._quantized:
            if stored.shape != tuple(spec.shape) or _TORCH_TAG.get(spec.dtype) not in (stored.dtype, "I8"):
                return f"{name}: {stored.dtype} {list(stored.shape)} in {stored.file.name}, expected {spec.dtype} {list(spec.shape)}"
            return None
        return DenseTransform.check(self, name, stored, spec)

    def convert(
        self, name: str, tensor: torch.Tensor, spec: TensorSpec, read_companion: Callable[[str], torch.Tensor]
    ) -> torch.Tensor:
        if name in self._quantized:
            # NOTE: kept as published; U8-stored FP4 bytes are reinterpreted, never converted
            return tensor.view(torch.int8) if tensor.dtype == torch.uint8 else tensor
        return tensor.to(spec.dtype)


# ---------------------------------------------------------------------------------- files


def scan_checkpoint(path: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint at `path` (a directory), from the index and headers only."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist (or is not a directory).")
    index_path = root / INDEX_FILE
    if index_path.exists():
        files = _read_index(index_path)
    elif (root / SINGLE_FILE).exists():
        files = None
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if found:
            raise CheckpointError(
                f"{root} has {len(found)} safetensors file(s) ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}) "
                f"but no {INDEX_FILE} and no {SINGLE_FILE}; restore the index file that maps tensors to shards."
            )
        raise CheckpointError(f"no safetensors files in {root}; expected {SINGLE_FILE} or shards listed by {INDEX_FILE}.")

    stored: dict[str, StoredTensor] = {}
    shard_names = sorted(set(files.values())) if files is not None else [SINGLE_FILE]
    for shard in shard_names:
        file = root / shard
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if files is not None and files.get(name) != shard:
                        continue  # only the index decides which shard holds a tensor
                    sl = f.get_slice(name)
                    stored[name] = StoredTensor(file, sl.get_dtype(), tuple(sl.get_shape()))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read safetensors file {file}: {e}. The file is damaged; re-download or re-save it.") from None
    if files is not None:
        absent = [n for n in files if n not in stored]
        if absent:
            raise CheckpointError(
                f"{index_path} lists {len(absent)} tensor(s) that are not in their shard: "
                + ", ".join(f"{n} (-> {files[n]})" for n in absent[:_MAX_LISTED])
                + (f" and {len(absent) - _MAX_LISTED} more" if len(absent) > _MAX_LISTED else "")
                + ". The index and the shards disagree; re-save the checkpoint."
            )
    return stored


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        raw = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index_path} is not valid JSON ({e}); restore it or re-save the checkpoint.") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{index_path} has no valid `weight_map` (an object mapping tensor names to shard file names); "
            "restore it or re-save the checkpoint."
        )
    missing: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not (index_path.parent / shard).is_file():
            missing.setdefault(shard, []).append(name)
    if missing:
        shard, names = next(iter(missing.items()))
        raise CheckpointError(
            f"{index_path} points to shard(s) that do not exist in {index_path.parent}: {sorted(missing)}; e.g. "
            f"tensor {names[0]} is mapped to missing shard {shard}. Copy the missing shard(s) or re-save the checkpoint."
        )
    return weight_map


def read_checkpoint_config(path: str | Path) -> tuple[ModelConfig | V41Config, dict[str, Any] | None]:
    """The checkpoint's `ModelConfig` (a `V41Config` for DeepSeek-V4.1, whose published layout
    `engine.models.deepseek_v41.load_published` reads) and its raw `quantization_config` (None when unquantized).

    NOTE: the one place that decides whether a checkpoint's quantization can be loaded: it refuses
    (CheckpointError) exactly what `WeightLoader` cannot load, so a stage that checks a checkpoint
    without loading it (the entrypoint) accepts every checkpoint the workers accept.
    """
    file = config_json_path(path)
    if not file.parent.is_dir():
        raise CheckpointError(f"checkpoint directory {file.parent} does not exist (or is not a directory).")
    try:
        raw = read_config_json(file)
    except FileNotFoundError:
        raise CheckpointError(f"no config.json at {file}; a checkpoint directory needs one.") from None
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if is_v41_config(raw):  # V4.1's own layout (text_config): say what exactly is missing
        try:
            v41 = V41Config.from_hf_dict(raw)
        except ValueError as e:
            raise CheckpointError(f"{file}: {e}") from None
        if v41.unsupported():
            raise CheckpointError(f"{file}: DeepSeek-V4.1; the engine serves its text backbone only. Not served yet: "
                                  + "; ".join(v41.unsupported()) + ".")
        return v41, v41.quantization_config
    quant = raw.pop("quantization_config", None) or None
    engram = sorted(k for k in raw if "engram" in k.lower())
    if engram:
        raise CheckpointError(f"{file}: fields {engram} describe V4.1's Engram tables; {V41_HINT}.")
    if isinstance(quant, Mapping) and raw.get("expert_dtype") is not None and "expert_dtype" not in quant:
        quant = {**quant, "expert_dtype": raw["expert_dtype"]}  # V4's top-level spelling; V4.1 nests it
    make_weight_transform(quant, source=str(file))  # refuse unsupported quantization before anything else
    try:
        config = ModelConfig.from_hf_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return config, quant


# ---------------------------------------------------------------------------------- loader


class WeightLoader:
    """Validates a checkpoint directory against a spec, then streams its tensors one at a time.

    Construction reads headers only and raises `CheckpointError` for any mismatch; `tensors()`
    then yields `(name, tensor)` pairs, each converted by the quantization method's
    `WeightTransform` and placed on `device`, reading shards through `safe_open` (memory-mapped).
    """

    def __init__(
        self,
        path: str | Path,
        spec: Mapping[str, TensorSpec],
        *,
        quantization_config: Mapping[str, Any] | None = None,
        device: str | torch.device = "cpu",
        progress: bool | None = None,
        skip_prefixes: tuple[str, ...] = MTP_PREFIXES,
        skip_spec_name: Callable[[str], bool] | None = None,
    ) -> None:
        self.path = Path(path)
        self.spec = dict(spec)
        self.device = torch.device(device)
        self.transform = make_weight_transform(quantization_config)
        self.stored = scan_checkpoint(self.path)
        self.skipped_names: list[str] = sorted(
            n for n in self.stored
            if n.startswith(skip_prefixes) or (skip_spec_name is not None and skip_spec_name(official_to_spec_name(n))))
        """Checkpoint tensors left out on purpose (MTP layers; with `skip_spec_name`, e.g. the routed experts
        another rank of an expert-parallel instance holds): never read, not reported as unexpected."""
        skipped = set(self.skipped_names)
        by_spec_name = {official_to_spec_name(n): s for n, s in self.stored.items() if n not in skipped}
        self.spec, self.quantized_linears = self.transform.quantize_spec(self.spec, by_spec_name)
        """`quantized_linears`: module name -> `QuantizedLinearSpec` for each linear kept quantized."""
        self.checkpoint_names: dict[str, str] = {}
        """Spec name -> checkpoint name (they differ for DeepSeek's own top-level names)."""
        self._validate()
        total = sum(self.stored[n].num_bytes for n in self.checkpoint_names.values())
        self.num_bytes = total
        """Bytes of the tensors to be read."""
        self.show_progress = progress if progress is not None else (
            total > PROGRESS_MIN_BYTES or len(self.checkpoint_names) > PROGRESS_MIN_TENSORS
        )

    def _validate(self) -> None:
        candidates = {n: s for n, s in self.stored.items() if n not in self.skipped_names}
        companions = self.transform.companion_names(candidates)
        by_spec_name: dict[str, str] = {}
        unexpected: list[str] = []
        for name in candidates:
            if name in companions:
                continue
            spec_name = official_to_spec_name(name)
            if spec_name in by_spec_name:
                raise CheckpointError(
                    f"tensors {by_spec_name[spec_name]} and {name} in {self.path} are the same weight under two "
                    "names; keep one."
                )
            if spec_name in self.spec:
                by_spec_name[spec_name] = name
            else:
                unexpected.append(name)
        missing = [n for n in self.spec if n not in by_spec_name]
        problems = [
            p for n, c in by_spec_name.items() if (p := self.transform.check(n, candidates[c], self.spec[n])) is not None
        ]
        lines = []
        if missing:
            lines.append(f"missing {len(missing)} tensor(s) the model needs: {_listing(missing)}")
        if unexpected:
            lines.append(
                f"{len(unexpected)} unexpected tensor(s) the model does not have: "
                + _listing([f"{n} (in {candidates[n].file.name})" for n in unexpected])
            )
        if problems:
            lines.append(f"{len(problems)} tensor(s) with the wrong shape or dtype: {_listing(problems)}")
        if lines:
            raise CheckpointError(
                f"checkpoint {self.path} does not match its config.json:\n  - " + "\n  - ".join(lines)
                + "\nCheck that config.json belongs to these weights (layer count, sizes, layer_types, "
                "mlp_layer_types, tie_word_embeddings) or re-save the checkpoint."
            )
        self.checkpoint_names = by_spec_name

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(spec name, model tensor)`, reading one tensor at a time, shard by shard."""
        by_file: dict[Path, list[str]] = {}
        for spec_name, name in self.checkpoint_names.items():
            by_file.setdefault(self.stored[name].file, []).append(spec_name)
        with contextlib.ExitStack() as companions:
            companion_handles: dict[Path, Any] = {}

            def read_companion(name: str) -> torch.Tensor:
                file = self.stored[name].file
                if file not in companion_handles:
                    companion_handles[file] = companions.enter_context(safe_open(file, framework="pt", device="cpu"))
                return companion_handles[file].get_tensor(name)

            with tqdm(total=self.num_bytes, unit="B", unit_scale=True, desc=f"loading {self.path.name}",
                      disable=not self.show_progress) as bar:
                for file in sorted(by_file):
                    with safe_open(file, framework="pt", device="cpu") as f:
                        for spec_name in by_file[file]:
                            stored, spec = self.stored[self.checkpoint_names[spec_name]], self.spec[spec_name]
                            raw = f.get_tensor(self.checkpoint_names[spec_name])
                            tensor = self.transform.convert(spec_name, raw, spec, read_companion)
                            del raw  # NOTE: the raw tensor must die before the next read (peak memory)
                            if spec.max_value is not None:
                                _check_range(spec_name, tensor, spec.max_value, stored.file)
                            bar.update(stored.num_bytes)
                            yield spec_name, tensor.to(self.device)
                            del tensor

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All tensors at once, as a state dict (still read one by one)."""
        return dict(self.tensors())


def _check_range(name: str, tensor: torch.Tensor, max_value: int, file: Path) -> None:
    lo, hi = int(tensor.min()), int(tensor.max())
    if lo < 0 or hi > max_value:
        bad = lo if lo < 0 else hi
        raise CheckpointError(
            f"{name} in {file.name} holds value {bad}, outside [0, {max_value}] (expert ids must be below "
            f"n_routed_experts={max_value + 1}); check n_routed_experts in config.json."
        )


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f" ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else "")


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Build modules inside this context to get their parameters on the `meta` device (no memory).

    Buffers are created normally, so non-persistent ones (RoPE tables) keep their computed values.
    NOTE: patches `nn.Module.register_parameter` process-wide for the duration; not thread-safe.
    """
    original = nn.Module.register_parameter

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_weights(
    model_or_spec: nn.Module | Mapping[str, TensorSpec],
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
) -> Any:
    """Load checkpoint `path` into a model, or into a state dict for a spec.

    - `model_or_spec` an `nn.Module` (parameters may be on `meta`): its state_dict keys and shapes
      must equal `checkpoint_spec(config.json, dtype)`; the tensors are assigned in place and the
      module is returned. `dtype` defaults to float32.
    - `model_or_spec` a spec (name -> `TensorSpec`, dtypes already resolved): returns the state dict;
      `dtype` must be left None.
    """
    root = Path(path)
    if isinstance(model_or_spec, nn.Module):
        config, quant = read_checkpoint_config(root)
        return _load_into(model_or_spec, root, config, quant, parse_dtype(dtype or "float32"), device, progress)
    if dtype is not None:
        raise ValueError("load_weights(spec, ...) takes its dtypes from the spec; leave `dtype` unset.")
    quant = read_checkpoint_config(root)[1] if (root / "config.json").exists() else None
    return WeightLoader(root, model_or_spec, quantization_config=quant, device=device, progress=progress).state_dict()


_ROUTED_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.ffn\.experts\.(\d+)\.")


class AbsentExpert(nn.Module):
    """Stands in for a routed expert this process does not hold (an expert-parallel rank's other experts).

    It has no state-dict tensors and no memory beyond an empty marker; `w1.weight` etc. exist (empty, on
    the model's device) only because `MoE` reads `experts[0].w1.weight` for its device and re-prepare
    check. Calling it is a bug: the expert-parallel backend computes only held experts.
    """

    is_absent = True

    def __init__(self, limit: float, device: str | torch.device) -> None:
        super().__init__()
        self.limit = limit
        for name in ("w1", "w2", "w3"):
            marker = nn.Module()
            marker.register_buffer("weight", torch.empty(0, device=device), persistent=False)
            setattr(self, name, marker)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this routed expert is held by another rank (expert parallelism); it cannot run here")


def _drop_routed_experts(model: nn.Module, spec: dict[str, TensorSpec], routed_experts: Mapping[int, Any],
                         device: str | torch.device) -> Callable[[str], bool]:
    """Replace the routed experts not in `routed_experts[layer]` by `AbsentExpert`s and drop their spec entries;
    returns the predicate on spec names of the tensors to skip."""
    keep = {int(layer): {int(e) for e in experts} for layer, experts in routed_experts.items()}
    for i, layer in enumerate(model.model.layers):
        if i not in keep:
            continue
        experts = layer.ffn.experts
        for e in range(len(experts)):
            if e not in keep[i]:
                experts[e] = AbsentExpert(experts[e].limit, device)
    for name in [n for n in spec if (m := _ROUTED_EXPERT_RE.match(n)) and int(m[1]) in keep
                 and int(m[2]) not in keep[int(m[1])]]:
        del spec[name]

    def skip(spec_name: str) -> bool:
        m = _ROUTED_EXPERT_RE.match(spec_name)
        return m is not None and int(m[1]) in keep and int(m[2]) not in keep[int(m[1])]

    return skip


def _load_into(
    model: nn.Module,
    root: Path,
    config: ModelConfig,
    quant: Mapping[str, Any] | None,
    dtype: torch.dtype,
    device: str | torch.device,
    progress: bool | None,
    routed_experts: Mapping[int, Any] | None = None,
) -> nn.Module:
    spec = checkpoint_spec(config, dtype)
    # NOTE: a model with an MTP layer (`mtp.*` keys) loads it from the checkpoint; one without skips them
    has_mtp = any(n.startswith(MTP_PREFIXES) for n in model.state_dict(keep_vars=True))
    if has_mtp:
        spec.update(mtp_checkpoint_spec(config, dtype))
    skip = _drop_routed_experts(model, spec, routed_experts, device) if routed_experts is not None else None
    _check_model_matches_spec(model, spec)
    loader = WeightLoader(root, spec, quantization_config=quant, device=device, progress=progress,
                          skip_prefixes=() if has_mtp else MTP_PREFIXES, skip_spec_name=skip)
    quantize_linears(model, loader.quantized_linears)
    model.load_state_dict(loader.state_dict(), strict=True, assign=True)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise CheckpointError(
            f"{type(model).__name__} still has tensors on the meta device after loading: {_listing(still_meta)}. "
            "Build the model with `engine.loader.meta_parameters()` (buffers real) rather than on the meta device."
        )
    return model.to(device)


def quantize_linears(model: nn.Module, plan: Mapping[str, QuantizedLinearSpec]) -> None:
    """Replace each `nn.Linear` named in `plan` by an empty (meta) `Fp8Linear` / `Fp4Linear` of the
    same shape, so `load_state_dict(..., assign=True)` then installs the published tensors as they are.

    NOTE: the model's `state_dict` names stay the same (`X.weight`, plus `X.scale`); model code calls
    these modules (or `dequantized()` where it needs a weight matrix), never reads a quantized `.weight`.
    """
    if not plan:
        return
    from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear

    for name, q in plan.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr, None)
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (q.in_features, q.out_features):
            raise CheckpointError(
                f"{name}.weight is stored {q.kind.upper()}-quantized, but {type(model).__name__}.{name} is "
                f"{type(old).__name__}, not an nn.Linear({q.in_features}, {q.out_features}); deepinfer keeps only linear "
                "layers quantized. Dequantize this tensor to bfloat16 in the checkpoint."
            )
        with torch.device("meta"):
            if q.kind == "fp8":
                new = Fp8Linear(q.in_features, q.out_features, block=q.block, scale_dtype=q.scale_dtype)
            else:
                new = Fp4Linear(q.in_features, q.out_features, block=q.block[1])
        setattr(parent, attr, new)


def _check_model_matches_spec(model: nn.Module, spec: Mapping[str, TensorSpec]) -> None:
    state = model.state_dict(keep_vars=True)
    missing = [n for n in spec if n not in state]
    extra = [n for n in state if n not in spec]
    shapes = [f"{n}: model {list(t.shape)}, spec {list(spec[n].shape)}" for n, t in state.items()
              if n in spec and tuple(t.shape) != tuple(spec[n].shape)]
    if missing or extra or shapes:
        parts = []
        if missing:
            parts.append(f"lacks {len(missing)} spec tensor(s): {_listing(missing)}")
        if extra:
            parts.append(f"has {len(extra)} tensor(s) outside the spec: {_listing(extra)}")
        if shapes:
            parts.append(f"shape mismatches: {_listing(shapes)}")
        raise CheckpointError(
            f"{type(model).__name__}.state_dict() does not match checkpoint_spec(config): " + "; ".join(parts)
            + ". Fix the model (engine/models/deepseek_v4.py) or the spec (engine/models/deepseek_v4_weights.py)."
        )


def load_checkpoint(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = None,
    attention_backend: str = "torch",
    moe_backend: str = "torch",
    fp8_activations: str = "bf16",
    indexer_numerics: str = "transformers",
    routed_experts: Mapping[int, Any] | None = None,
    before_prepare: Callable[[nn.Module], None] | None = None,
    load_mtp: bool = True,
    engram_placement: str = "device",
) -> tuple[nn.Module, ModelConfig]:
    """Blocks while reading: build `DeepseekV4ForCausalLM` from checkpoint `path` and load its weights.
    (`attention_backend`: an `engine.attention` backend name; `moe_backend`: an `engine.moe` backend name;
    `fp8_activations`: "bf16" or "fp8", the activations of the FP8 linears, `engine.quant.linear.set_fp8_activations`;
    `indexer_numerics`: "transformers" or "reference", `engine.attention.indexer_quant.set_indexer_numerics`.)

    Expert parallelism: `routed_experts` (decoder layer index -> the routed expert ids to read) makes the
    model hold only those experts of the listed layers (the others are `AbsentExpert`s, never read from the
    shards; quantized ones stay quantized); `before_prepare(model)` runs before the MoE backends are prepared
    (so an expert-parallel backend, which hands its inner backend only the held experts, can be installed:
    `engine.distributed.expert_parallel`). MTP layers always load all their experts; `load_mtp=False` leaves
    the MTP layers out (an expert-parallel rank without speculative decoding; with it every rank holds them whole,
    `engine.distributed.spec`).

    `engram_placement` ("device" or "pinned_host"; DeepSeek-V4.1 only, `engine.fit` decides it): where the FP8
    Engram tables are placed (`engine.quant.engram.Fp8EngramTable.place`).

    Returns `(model, config)` with the model in eval mode, without gradients, on `device`, floats in
    `dtype` except the fp32-kept set. Raises `CheckpointError` (naming the culprit) before reading any tensor data if
    the checkpoint does not match its config.json.
    """
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM  # lazy: the model is heavy to import

    root = Path(path)
    torch_dtype = parse_dtype(dtype)
    config, quant = read_checkpoint_config(root)
    if isinstance(config, V41Config):  # V4.1: its own model and reader (docs/V4_1.md §12)
        from deepinfer.engine.models.deepseek_v41 import load_for_engine

        if attention_backend != "torch" or fp8_activations != "bf16" or indexer_numerics != "transformers" \
                or routed_experts is not None:
            raise CheckpointError(f"{root}: DeepSeek-V4.1 runs its own torch attention path; "
                                  "attention_backend='torch', fp8_activations='bf16', indexer_numerics='transformers' "
                                  "and no expert parallelism are what it supports.")
        model = load_for_engine(root, config, torch_dtype, device, moe_backend, engram_placement)
        if before_prepare is not None:
            before_prepare(model)
        return model, config
    # the MTP layer is built when the checkpoint ships it (transformers' save_pretrained writes none)
    num_mtp = config.num_nextn_predict_layers if load_mtp and any(n.startswith(MTP_PREFIXES)
                                                                  for n in scan_checkpoint(root)) else 0
    with torch.device(device), meta_parameters():
        model = DeepseekV4ForCausalLM(config, attention_backend=attention_backend, moe_backend=moe_backend,
                                      num_mtp_layers=num_mtp)
    _load_into(model, root, config, quant, torch_dtype, device, progress, routed_experts)
    from deepinfer.engine.quant.linear import set_fp8_activations

    set_fp8_activations(model, fp8_activations)
    from deepinfer.engine.attention.indexer_quant import set_indexer_numerics

    set_indexer_numerics(model, indexer_numerics)
    model.eval().requires_grad_(False)
    if before_prepare is not None:
        before_prepare(model)
    model.prepare_for_inference()  # once, on the loaded weights: small-op picks, MoE backend packing
    return model, config


def load_vision_tower(
    path: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> VisionTower:
    """Blocks while reading: the vision tower alone from checkpoint `path` (the LM's tensors are not read).

    Raises `CheckpointError` when config.json has no `vision_config` or a vision tensor is missing
    or misshapen.
    """
    from deepinfer.engine.models.vision import VisionTower

    config, quant = read_checkpoint_config(path)
    if config.vision is None:
        raise CheckpointError(f"checkpoint {path} has no vision tower (no `vision_config` in config.json).")
    if isinstance(config, V41Config):  # V4.1's own tower and names (`vision.*`, `aligner.*`, `image_*`)
        from deepinfer.engine.models.vision_v41 import load_tower

        try:
            return load_tower(path, config, parse_dtype(dtype), device)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
    spec = vision_checkpoint_spec(config, parse_dtype(dtype))
    # skip the LM's tensors by their top-level name component (a handful of prefixes)
    others = tuple({n.split(".", 1)[0] + ("." if "." in n else "") for n in scan_checkpoint(path)
                    if not n.startswith(VISION_PREFIXES)})
    loader = WeightLoader(path, spec, quantization_config=quant, device=device, skip_prefixes=others)
    with torch.device(device), meta_parameters():
        tower = VisionTower(config.vision, config.hidden_size)
    tower.load_state_dict(loader.state_dict(), strict=True, assign=True)
    return tower.to(device).eval().requires_grad_(False)
