"""DeepSeek-V4.1's quantized parts kept as published: the passes its loader (`engine.models.deepseek_v41`) applies.

  * `keep_fp4_experts(model)`: every routed expert's `w1` / `w2` / `w3` (`*.ffn.experts.{e}.w{1,2,3}`, MXFP4 in the
    checkpoint: E2M1 codes two a byte + one UE8M0 scale per 1 x 32) becomes an `Fp4Linear`, so the experts run
    through the same quantized MoE paths as V4's ("torch" / "torch_loop" call the modules, "fp4" and "triton" run
    them grouped).
  * `keep_engram_tables(model)`: every Engram table (`*.engram.embed`) becomes an `Fp8EngramTable` (FP8 rows +
    1 x 32 UE8M0 scales, gathered then dequantized; `engine.quant.engram`).
  * `mapped_tensors(files, names)`: those tables' tensors as lazy memory maps of the shards (no data read).

They work on module names and types only (no import of the model: see the package NOTE). The replacement modules
start with meta tensors of the right shapes and dtypes (no memory) until the loader installs the checkpoint's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from deepinfer.engine.quant.engram import Fp8EngramTable, map_safetensors_tensor, read_safetensors_header
from deepinfer.engine.quant.formats import FP4_BLOCK
from deepinfer.engine.quant.linear import Fp4Linear

_EXPERT_LINEAR_RE = re.compile(r"(^|\.)ffn\.experts\.\d+\.w[123]$")
_ENGRAM_TABLE_RE = re.compile(r"(^|\.)engram\.embed$")


def is_engram_table_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` is an Engram table's weight or scale (`layers.{L}.engram.embed.{weight,scale}`)."""
    module, _, leaf = name.rpartition(".")
    return leaf in ("weight", "scale") and bool(_ENGRAM_TABLE_RE.search(module))


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def keep_fp4_experts(model: nn.Module, block: int = FP4_BLOCK) -> list[str]:
    """Replace each routed expert's `nn.Linear` w1 / w2 / w3 by an empty `Fp4Linear` (packed int8 weight
    [out, in/2], UE8M0 scale [out, in/block], on the meta device until loaded). Returns the replaced names."""
    done = []
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or not _EXPERT_LINEAR_RE.search(name):
            continue
        with torch.device("meta"):
            _replace(model, name, Fp4Linear(mod.in_features, mod.out_features, block))
        done.append(name)
    return done


def keep_engram_tables(model: nn.Module) -> list[str]:
    """Replace each Engram table module (`*.engram.embed`, a float `[rows, dim]` table) by an empty
    `Fp8EngramTable` of the same shape (meta tensors until the loader installs the mapped ones). Returns the names."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, Fp8EngramTable) or not _ENGRAM_TABLE_RE.search(name):
            continue
        rows, dim = mod.weight.shape
        _replace(model, name, Fp8EngramTable(rows, dim))
        done.append(name)
    return done


def mapped_tensors(files: Iterable[str | Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Tensors `names` from the safetensors `files` that hold them, each a lazy private memory map of its shard
    (`map_safetensors_tensor`: only the headers are read). A name no file holds is left out."""
    wanted, out = set(names), {}
    for file in files:
        header, _ = read_safetensors_header(file)
        for name in wanted.intersection(header):
            out[name] = map_safetensors_tensor(file, name)
    return out
