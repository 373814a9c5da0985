"""Write random-weight DeepSeek-V4 checkpoints for tests and benchmarks.

    python -m deepinfer.engine.testing.make_checkpoint DIR --preset tiny [--seed 0] [--dtype float32|bfloat16]
        [--writer ours|hf] [--max-shard-size 5MB] [--overwrite] [--vision]
        [--format transformers|published] [--expert-dtype fp4|fp8] [--expert-dtype-in top|quantization_config]
        [--base] [--mtp-layers 1]

or `make_checkpoint(dir, preset="tiny", seed=0, dtype="float32", writer="ours", vision=False)` from Python.

`vision=True` (`--vision`) adds a random vision tower and projector (`TINY_VISION_CONFIG`: a 2-layer,
64-wide ViT, the demo model's vision numbers) and `image_token_id` 129264; the vocabulary grows to
the real V4 one (129280) when smaller, so recipe's image ids and the real tokenizer fit. Only the
`ours` writer writes vision checkpoints (transformers' `DeepseekV4ForCausalLM` has no vision tower).

Every tensor of `checkpoint_spec` is drawn, in spec order, from one `torch.Generator` seeded with
`seed`, in float32 and then cast (so a bf16 checkpoint is the rounded fp32 one). All values are
random and non-trivial, scaled to keep activations O(1) (see `_INIT_RULES`).

Writers (both give the same tensor names, shapes, dtypes and values):
- `ours`: safetensors written directly, split into `model-0000i-of-0000n.safetensors` shards plus
  `model.safetensors.index.json` when larger than `max_shard_size`, and a transformers-style
  config.json.
- `hf`: the `ours` checkpoint loaded by transformers' `DeepseekV4ForCausalLM.from_pretrained` and
  written back with `save_pretrained` (needs transformers; a test-only dependency).

`format="published"` (`--format published`, writer `ours` only) writes instead exactly the layout and
dtypes of DeepSeek's published checkpoints (`write_published`): published names
(`deepseek_v4_weights.PUBLISHED_NAME_MAP`), FP8 e4m3 weights with UE8M0 128x128 block scales for the
FP8 linears, FP4 routed experts (int8 [out, in/2] + UE8M0 [out, in/32]) when `expert_dtype` is "fp4",
BF16 and FP32 parts as `published_storage` lists, shards plus `model.safetensors.index.json`, an MTP
layer (`mtp.0.*`, `mtp_layers`), and config.json in the official spelling (`compress_ratios` with the
MTP entry, `num_hash_layers`, `qk_rope_head_dim`, `topk_method`, `rope_scaling` with `type`,
`torch_dtype`, `quantization_config`, `expert_dtype` at the top level or inside quantization_config).
`base=True` (`--base`) is the `*-Base` variant: FP8 everywhere (experts too) with float32 block scales.
`write_dequantized` turns such a checkpoint into the float one it stands for (the exact dequantization,
in the transformers layout) for reference models.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.models.deepseek_v4_weights import (
    TensorSpec,
    checkpoint_spec,
    mtp_checkpoint_spec,
    official_to_spec_name,
    parse_dtype,
    published_storage,
    spec_to_published_name,
)
from deepinfer.engine.testing.presets import PRESETS, get_preset

WRITERS = ("ours", "hf")
FORMATS = ("transformers", "published", "published-v41")
EXPERT_DTYPE_PLACES = ("top", "quantization_config")
DEFAULT_MAX_SHARD_SIZE = 4 << 30
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}

Init = Callable[[TensorSpec, torch.Generator], torch.Tensor]


def _normal(std: Callable[[tuple[int, ...]], float], mean: float = 0.0) -> Init:
    return lambda s, g: torch.randn(s.shape, generator=g) * std(s.shape) + mean


def _uniform(lo: float, hi: float) -> Init:
    return lambda s, g: torch.rand(s.shape, generator=g) * (hi - lo) + lo


def _distinct_expert_ids(s: TensorSpec, g: torch.Generator) -> torch.Tensor:
    # [vocab, top_k]: each row a random set of distinct experts
    assert s.max_value is not None
    return torch.rand(s.shape[0], s.max_value + 1, generator=g).argsort(dim=1)[:, : s.shape[1]].contiguous()


_FAN_IN = _normal(lambda shape: shape[-1] ** -0.5)  # y = W x keeps x's scale
_INIT_RULES: tuple[tuple[str, Init], ...] = (
    # vision tower and projector (names in engine/models/vision.py)
    (r"vision_tower\..*patch_embedding\.weight", _normal(lambda shape: (shape[1] * shape[2] * shape[3]) ** -0.5)),
    (r"vision_tower\..*position_embedding\.weight", _normal(lambda _: 0.5)),
    (r"vision_.*layer_?norm\d?\.weight|vision_projector\.norm\.weight", _normal(lambda _: 0.1, mean=1.0)),
    (r"vision_.*\.bias", _normal(lambda _: 0.1)),
    (r"vision_projector\.image_(begin|newline|end)", _normal(lambda _: 1.0)),  # like embedding rows
    (r".*\.tid2eid", _distinct_expert_ids),
    (r".*norm\.weight", _normal(lambda _: 0.1, mean=1.0)),  # RMSNorm gains: 1 +- 0.1
    (r"model\.embed_tokens\.weight", _normal(lambda _: 1.0)),  # unit-RMS residual stream
    (r".*\.attn_sink", _normal(lambda _: 1.0)),  # comparable to q.k / sqrt(d)
    (r".*\.ape", _normal(lambda _: 0.5)),  # compressor gate position bias
    (r".*\.gate\.bias", _normal(lambda _: 0.1)),  # score correction: changes some top-k picks
    (r".*(hc_attn|hc_ffn)_base|.*hc_head\.hc_base", _normal(lambda _: 0.5)),
    (r".*(hc_attn|hc_ffn)_scale|.*hc_head\.hc_scale", _uniform(0.5, 1.5)),
    (r"mtp\.\d+\.hc_head_base", _normal(lambda _: 0.5)),
    (r"mtp\.\d+\.hc_head_scale", _uniform(0.5, 1.5)),
    (r".*", _FAN_IN),  # every other matrix, hyper-connection `fn`s included
)
"""(regex over the full tensor name, initializer): the first match draws the tensor."""
_INIT_RES = [(re.compile(p), init) for p, init in _INIT_RULES]


def random_weights(
    config: ModelConfig, dtype: str | torch.dtype = "float32", seed: int = 0, *, mtp: bool = False
) -> dict[str, torch.Tensor]:
    """A random state dict for `config`, keyed and typed like `checkpoint_spec(config, dtype)` (then,
    with `mtp`, `mtp_checkpoint_spec`: drawn after the main tensors, so those do not change)."""
    spec = checkpoint_spec(config, dtype)
    if mtp:
        spec.update(mtp_checkpoint_spec(config, dtype))
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, s in spec.items():
        init = next(init for pattern, init in _INIT_RES if pattern.fullmatch(name))
        out[name] = init(s, g).to(s.dtype).contiguous()
    return out


TINY_VISION_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_channels": 3,
    "image_size": 546,
    "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0,
    "merge_size": 3,
    "projector_hidden_size": 256,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
"""The `vision_config` that `vision=True` adds (the numbers of the vision contract's demo model)."""
_VISION_VOCAB = 129280


def with_vision(hf_config: Mapping[str, Any], vision_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of a transformers-style config dict with a vision tower (`vision_config` +
    `image_token_id` 129264), its vocabulary raised to 129280 when smaller."""
    out = dict(hf_config)
    out["vision_config"] = dict(vision_config or TINY_VISION_CONFIG)
    out["image_token_id"] = 129264
    out["vocab_size"] = max(int(out.get("vocab_size", _VISION_VOCAB)), _VISION_VOCAB)
    return out


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like `"5MB"`, `"200KiB"`, `"1GB"`."""
    if isinstance(size, int):
        value = size
    else:
        m = _SIZE_RE.match(size)
        if not m:
            raise ValueError(f"max shard size {size!r} is not a size; write e.g. 5MB, 200KiB or 1GB.")
        value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"max shard size must be positive; got {size!r}.")
    return value


def make_checkpoint(
    directory: str | Path,
    preset: str | Mapping[str, Any] = "tiny",
    seed: int = 0,
    dtype: str | torch.dtype = "float32",
    writer: str = "ours",
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    vision: bool = False,
    format: str = "transformers",
    expert_dtype: str = "fp4",
    expert_dtype_in: str = "top",
    base: bool = False,
    mtp_layers: int = 1,
    dspark: bool = False,
) -> Path:
    """Write a random-weight checkpoint of `preset` (a preset name or a transformers-style config
    dict) to `directory` and return its path; `vision=True` adds a vision tower (`with_vision`).

    `format="published"`: DeepSeek's published layout (module docstring; `dtype` is ignored: the
    formats are the published ones), with `expert_dtype` ("fp4" or "fp8") stated at `expert_dtype_in`
    ("top" as V4 does, or "quantization_config" as V4.1 does), `mtp_layers` MTP layers, and `base`
    for the `*-Base` variant (FP8 experts, float32 scales). `format="published-v41"` with `dspark`: DSpark draft
    stages too (`TINY_V41_DSPARK`, `mtp.*` tensors).
    """
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; choose one of {WRITERS}.")
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose one of {FORMATS}.")
    if format == "published-v41":  # V4.1's own tiny model; `preset`, `dtype` and the V4 options do not apply
        out = Path(directory)
        if out.exists() and any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) or pick another directory.")
            shutil.rmtree(out)
        return write_published_v41(out, seed=seed, max_shard_size=parse_size(max_shard_size), vision=vision,
                                   text_config=with_tiny_dspark(TINY_V41_TEXT_CONFIG) if dspark else None)
    if format == "published":
        if writer != "ours" or vision:
            raise ValueError("format 'published' is written by writer 'ours' alone, without a vision tower.")
        hf_config = get_preset(preset).hf_config() if isinstance(preset, str) else dict(preset)
        out = Path(directory)
        if out.exists() and any(out.iterdir()):
            if not overwrite:
                raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) or pick another directory.")
            shutil.rmtree(out)
        write_published(out, hf_config, seed=seed, expert_dtype="fp8" if base else expert_dtype,
                        expert_dtype_in=expert_dtype_in, base=base, mtp_layers=mtp_layers,
                        max_shard_size=parse_size(max_shard_size))
        return out
    hf_config = get_preset(preset).hf_config() if isinstance(preset, str) else dict(preset)
    if vision:
        hf_config = with_vision(hf_config)
    if writer == "hf" and "vision_config" in hf_config:
        raise ValueError("writer 'hf' cannot write a vision tower (transformers' DeepseekV4ForCausalLM has none); "
                         "use writer 'ours'.")
    torch_dtype = parse_dtype(dtype)
    shard_bytes = parse_size(max_shard_size)
    out = Path(directory)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{out} is not empty; pass overwrite=True (--overwrite) or pick another directory.")
        shutil.rmtree(out)
    config = ModelConfig.from_hf_dict(hf_config)  # validate before writing anything
    tensors = random_weights(config, torch_dtype, seed)
    if writer == "ours":
        _write_ours(out, hf_config, tensors, torch_dtype, shard_bytes)
    else:
        _write_hf(out, hf_config, tensors, torch_dtype, shard_bytes)
    return out


def _write_ours(
    out: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype, shard_bytes: int
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _save_sharded(out, tensors, shard_bytes, single_file=True)
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **hf_config}
    config["dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def official_config(hf_config: Mapping[str, Any], mtp_layers: int = 1) -> dict[str, Any]:
    """A transformers-style config dict respelled as DeepSeek's published config.json spells it:
    `compress_ratios` (0 sliding, 4 CSA, 128 HCA per layer, then 0 per MTP layer; `compress_rates` kept
    only when a preset's rates are not V4's 4 and 128), `num_hash_layers` (when the hash layers come
    first), `qk_rope_head_dim`, `topk_method`, `rope_scaling` with `type`, `n_shared_experts`, ..."""
    c = copy.deepcopy(dict(hf_config))
    codes = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    c["compress_ratios"] = [codes[t] for t in c.pop("layer_types")] + [0] * mtp_layers
    rates = c.pop("compress_rates", None)
    if rates and rates != {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}:
        c["compress_rates"] = rates  # NOTE: tiny presets' rates; the real checkpoints need no override
    mlp = c.pop("mlp_layer_types")
    n_hash = mlp.count("hash_moe")
    if mlp == ["hash_moe"] * n_hash + ["moe"] * (len(mlp) - n_hash):
        c["num_hash_layers"] = n_hash
    else:
        c["mlp_layer_types"] = mlp
    c["qk_rope_head_dim"] = int(c["head_dim"] * c.pop("partial_rotary_factor"))
    rp = c.pop("rope_parameters", None)
    if rp:
        rp = dict(rp)
        rp["type"] = rp.pop("rope_type")
        c["rope_scaling"] = rp
    c.update(topk_method="noaux_tc", n_shared_experts=1, norm_topk_prob=True, hidden_act="silu",
             num_key_value_heads=1, num_nextn_predict_layers=mtp_layers, torch_dtype="bfloat16")
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **c}


def write_published(
    out: str | Path,
    hf_config: Mapping[str, Any],
    *,
    seed: int = 0,
    expert_dtype: str = "fp4",
    expert_dtype_in: str = "top",
    base: bool = False,
    mtp_layers: int = 1,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write random weights for `hf_config` in DeepSeek's published layout (module docstring) to `out`.

    The values are `random_weights(config, float32, seed, mtp=...)` quantized with
    `engine.quant.formats` (so the main tensors are those of the float checkpoint of the same seed,
    up to quantization). Returns `out`.
    """
    from deepinfer.engine.quant.formats import quantize_fp4, quantize_fp8_block

    if expert_dtype not in ("fp4", "fp8") or expert_dtype_in not in EXPERT_DTYPE_PLACES:
        raise ValueError(f"expert_dtype must be 'fp4' or 'fp8' and expert_dtype_in one of {EXPERT_DTYPE_PLACES}.")
    out = Path(out)
    config_json = official_config(hf_config, mtp_layers)
    quant: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    if expert_dtype_in == "top":
        config_json["expert_dtype"] = expert_dtype
    else:
        quant["expert_dtype"] = expert_dtype
    config_json["quantization_config"] = quant
    config = ModelConfig.from_hf_dict({**config_json, "quantization_config": None})  # validate first
    scale_dtype = torch.float32 if base else torch.float8_e8m0fnu
    tensors: dict[str, torch.Tensor] = {}
    for name, w in random_weights(config, torch.float32, seed, mtp=mtp_layers > 0).items():
        if name.startswith("mtp.") and int(name.split(".")[1]) >= mtp_layers:
            continue
        kind = published_storage(name, expert_dtype)
        published = spec_to_published_name(name)
        module = published.removesuffix(".weight")
        if kind == "fp8":
            tensors[published], tensors[module + ".scale"] = quantize_fp8_block(w, (128, 128), scale_dtype=scale_dtype)
        elif kind == "fp4":
            tensors[published], tensors[module + ".scale"] = quantize_fp4(w, 32)
        elif kind == "fp32":
            tensors[published] = w.float()
        elif kind == "int":
            tensors[published] = w.to(torch.int64)
        else:
            tensors[published] = w.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    _save_sharded(out, tensors, max_shard_size)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out


TINY_V41_TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 8,
    "num_attention_heads": 4, "head_dim": 32, "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_lora_rank": 16,
    "o_groups": 2, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 4096, "rope_theta": 10000,
    "compress_rope_theta": 160000, "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                                                    "original_max_position_embeddings": 16},
    "n_routed_experts": 4, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "sliding_window": 4, "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1],
    "kv_source_layer_ids": [2, 5], "index_source_layer_ids": [2, 4, 5, 7], "index_n_heads": 2,
    "index_head_dim": 32, "index_topk": 3, "candidate_source_layer_id": 5, "candidate_topk_blocks": 2,
    "candidate_block_size": 2, "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [72, 138], "engram_max_ngram_size": 3, "engram_vocab_size": 13, "engram_n_heads": 2,
    "engram_head_dim": 32, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 20,
    "num_nextn_predict_layers": 0,
}
"""`--format published-v41`'s model (docs/V4_1.md): 8 layers with every V4.1 layer kind (window-only, ratio-2
and ratio-1 KV sources and their consumers, an index source without index keys, the candidate source and a
user of its candidates) and two Engram layers with tiny tables; widths multiples of 32 (the FP8 blocks)."""


TINY_V41_DSPARK: dict[str, Any] = {
    "num_nextn_predict_layers": 3, "dspark_block_size": 4, "dspark_noise_token_id": 63,
    "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 16, "dspark_n_routed_experts": 3,
    "dspark_num_experts_per_tok": 2,
}
"""`--format published-v41 --dspark`'s draft stages (`engine.models.dspark`): three, as Flash has, fed by layers 5 (the
last KV source) to 7, a block of 4, a smaller MoE than the backbone's."""


def with_tiny_dspark(text_config: Mapping[str, Any]) -> dict[str, Any]:
    """`text_config` plus `TINY_V41_DSPARK` (and a 0 `compress_ratios` entry per stage)."""
    out = dict(text_config, **TINY_V41_DSPARK)
    out["compress_ratios"] = list(text_config["compress_ratios"])[: out["num_hidden_layers"]] + [0] * 3
    return out


TINY_V41_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜System｜>", "<｜User｜>",
                           "<｜Assistant｜>", "<think>", "</think>", "<｜latest_reminder｜>")
"""The tiny V4.1 tokenizer's special tokens, ids 0.. in this order (bos 0, eos 1, pad 2 as config.json states):
the ones recipe's `DeepseekV41Encoding` writes for system / user / assistant turns and thinking."""
TINY_V41_WORDS = ("[UNK]", ".", ",", ":", "?", "!", "(", ")", "-", "be", "brief", "hello", "there", "you", "are", "a",
                  "helpful", "assistant", "the", "Reasoning", "Effort", "range", "higher", "value", "more", "thorough",
                  "reasoning", "is", "of", "to", "and", "in", "it", "what", "I", "weather", "city", "today", "yes",
                  "no", "ok", "answer", "question", "hi", "1", "75", "100", "think", "please", "thanks", "name",
                  "my", "your", "how", "so")
"""Its plain words (a word-level model; anything else is `[UNK]`)."""


TINY_V41_IMAGE_TOKEN = "<｜deepseek_image｜>"
"""V4.1's image token as its tokenizer spells it (the real one has no `<｜image｜>`, V4's spelling); a vision
checkpoint's tiny tokenizer has it at the checkpoint's `image_token_id` (129264), as the real one."""


def write_tiny_v41_tokenizer(out: str | Path, vocab_size: int, image_token_id: int | None = None) -> Path:
    """`tokenizer.json` of a tiny V4.1 checkpoint: a word-level tokenizer whose ids all fit `vocab_size` (so the
    tiny model can serve chat prompts end to end) with V4.1's special tokens, `<｜System｜>` included (recipe's
    V4.1 encoding refuses a tokenizer without it, e.g. V4's). `image_token_id` (a vision checkpoint's): also
    `<｜deepseek_image｜>` at that id, so chat prompts with images render as with V4.1's own tokenizer (one
    `<｜deepseek_image｜>` per image, no `<｜image｜>`: `engine.tokenizer.RecipeChatEncoding`). Returns the file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = TINY_V41_SPECIAL_TOKENS + TINY_V41_WORDS
    if len(tokens) > vocab_size:
        raise ValueError(f"the tiny V4.1 tokenizer has {len(tokens)} tokens, more than vocab_size {vocab_size}")
    vocab = {t: i for i, t in enumerate(tokens)}
    special = list(TINY_V41_SPECIAL_TOKENS)
    if image_token_id is not None:
        if not len(tokens) <= image_token_id < vocab_size:
            raise ValueError(f"image_token_id {image_token_id} must lie in [{len(tokens)}, vocab_size {vocab_size})")
        vocab[TINY_V41_IMAGE_TOKEN] = image_token_id
        special.append(TINY_V41_IMAGE_TOKEN)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok.add_special_tokens(special)
    file = Path(out) / "tokenizer.json"
    tok.save(str(file))
    return file


def random_v41_model(config, seed: int = 0, device: torch.device | str | None = None):
    """A `DeepseekV41ForCausalLM` of `config` with every parameter random from `seed` (norm weights and mHC
    scales near 1, linears ~ 1/sqrt(fan-in)) and a random Engram token map.

    `device`: build and draw it there (a generator of that device: a V4.1-Flash-width stack of GBs is drawn on
    the GPU in seconds, not on the host); None: the CPU. The values depend on the device's generator."""
    from deepinfer.engine.models.deepseek_v41 import DeepseekV41ForCausalLM

    dev = torch.device(device or "cpu")
    with dev:
        model = DeepseekV41ForCausalLM(config)
    g = torch.Generator(device=dev).manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, device=dev)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "_scale", "norm1.weight", "norm2.weight")):
                p.copy_(1 + 0.1 * randn(p.shape))
            elif name.endswith(("q_weight", "k_weight")):
                p.copy_(1 + 0.5 * randn(p.shape))
            elif p.dim() == 2 and not name.endswith(("embed.weight", "_fn")):
                p.copy_(randn(p.shape) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.5 * randn(p.shape))
    if config.engram_layer_ids:
        model.set_engram_token_map(torch.randint(0, config.engram_compressed_vocab_size, (config.vocab_size,),
                                                 generator=g, device=dev))
    return model


TINY_V41_VISION_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
    "intermediate_size": 48, "patch_size": 14, "rope_theta": 10000, "downsample_ratio": 3, "max_image_tokens": 1024,
    "min_pixels": 295936, "max_wh_ratio": None,
}
"""`--format published-v41 --vision`'s tower: Flash's image geometry (patch 14, 3 x 3 merge, at most 1024 tokens,
about 544 x 544 px at least: recipe's V4.1 image-token count holds) with a 2-block, 32-wide ViT."""


def write_published_v41(out: str | Path, *, seed: int = 0, text_config: Mapping[str, Any] | None = None,
                        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE, vision: bool = False) -> Path:
    """A random V4.1 checkpoint in the published layout (`deepseek_v41.published_storage`: FP8 e4m3 with UE8M0
    32x32 block scales, FP4 experts, FP8 Engram tables with 1x32 row scales) and config.json with
    `text_config` and `quantization_config`, from `random_v41_model(seed)` (`TINY_V41_TEXT_CONFIG` by default).
    The Engram token map is not a tensor of the checkpoint (it derives from the tokenizer): the random one is
    written beside config.json (`deepseek_v41.ENGRAM_TOKEN_MAP_FILE`), which the engine's loader reads. A tiny
    word-level `tokenizer.json` with V4.1's special tokens comes with it (`write_tiny_v41_tokenizer`), so the chat
    front renders prompts with recipe's V4.1 encoding and the model can serve them. `vision`: a vision tower too
    (`TINY_V41_VISION_CONFIG`, BF16 `vision.*` / `aligner.*` / `image_*` tensors, the routers' `bias_vl`), with
    `image_token_id` 129264, the vocabulary raised to 129280 to hold it and the tokenizer's `<｜deepseek_image｜>`
    there (image chat through the front and `LLM.chat`). Returns `out`."""
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.models.deepseek_v41 import published_tensors

    config_json = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
                   "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
                   "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
                   "text_config": {"model_type": "deepseek_v41_text", **(text_config or TINY_V41_TEXT_CONFIG)}}
    if vision:
        config_json["image_token_id"] = 129264
        config_json["vision_config"] = dict(TINY_V41_VISION_CONFIG)
        vocab = config_json["text_config"]["vocab_size"]
        config_json["text_config"]["vocab_size"] = max(vocab, _VISION_VOCAB)
    model = random_v41_model(V41Config.from_hf_dict(config_json), seed)  # validates before writing anything
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _save_sharded(out, published_tensors(model), max_shard_size)
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    write_tiny_v41_tokenizer(out, model.config.vocab_size, config_json.get("image_token_id"))
    if model.engram_hash is not None:  # the random map (a real checkpoint's derives from its tokenizer)
        from deepinfer.engine.models.deepseek_v41 import ENGRAM_TOKEN_MAP_FILE

        (out / ENGRAM_TOKEN_MAP_FILE).write_text(json.dumps(model.engram_hash.token_map.tolist()) + "\n")
    return out


def _save_sharded(out: Path, tensors: Mapping[str, torch.Tensor], shard_bytes: int, *,
                  single_file: bool = False) -> None:
    """`model-0000i-of-0000n.safetensors` shards of at most `shard_bytes` (one tensor may exceed it)
    plus `model.safetensors.index.json`: always by default (the published layout has an index even for
    one shard); with `single_file`, what fits in one shard is written as `model.safetensors`, no index
    (as transformers' `save_pretrained` does)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if single_file and len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )


def write_dequantized(src: str | Path, out: str | Path, dtype: str | torch.dtype = "float32") -> Path:
    """The float checkpoint a published-format checkpoint `src` stands for, written to `out` in the
    transformers layout (spec names, one file, no quantization_config): every FP8/FP4 weight is
    dequantized exactly (`engine.quant.formats`), then cast to `dtype` with the rest (fp32-kept
    tensors stay float32). A reference for parity tests."""
    from safetensors import safe_open

    from deepinfer.engine.models.deepseek_v4_weights import is_fp32_kept
    from deepinfer.engine.quant.formats import dequant_fp4, dequant_fp8_block

    src, out, torch_dtype = Path(src), Path(out), parse_dtype(dtype)
    raw_config = json.loads((src / "config.json").read_text())
    block = tuple(raw_config["quantization_config"]["weight_block_size"])
    stored: dict[str, torch.Tensor] = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            stored.update({n: f.get_tensor(n) for n in f.keys()})
    tensors: dict[str, torch.Tensor] = {}
    for name, t in stored.items():
        if name.endswith(".scale"):
            continue
        scale = stored.get(name.removesuffix(".weight") + ".scale") if name.endswith(".weight") else None
        if scale is not None:
            t = dequant_fp8_block(t, scale, block) if t.dtype == torch.float8_e4m3fn else dequant_fp4(t, scale, 32)
        spec_name = official_to_spec_name(name)
        if t.is_floating_point():
            t = t.float() if is_fp32_kept(spec_name) else t.to(torch_dtype)
        tensors[spec_name] = t.contiguous()
    config_json = {k: v for k, v in raw_config.items() if k not in ("quantization_config", "expert_dtype")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out


def _write_hf(
    out: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype, shard_bytes: int
) -> None:
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
        from transformers.activations import ACT2FN
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise RuntimeError(f"writer 'hf' needs transformers with DeepSeek-V4 (pip install transformers); {e}") from e
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # NOTE: transformers 5.24 has no `softmax` router activation (ACT2FN lacks it), so it cannot build
    # such a model. The router function changes no tensor, so build with a stand-in and write the real
    # value back into config.json (transformers then cannot load that checkpoint; we can).
    scoring_func = hf_config.get("scoring_func", "sqrtsoftplus")
    build_config = {**hf_config, "scoring_func": scoring_func if scoring_func in ACT2FN else "sigmoid"}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _write_ours(Path(tmp), build_config, tensors, dtype, DEFAULT_MAX_SHARD_SIZE)
            model, info = DeepseekV4ForCausalLM.from_pretrained(
                tmp, config=DeepseekV4Config(**build_config), dtype=dtype, output_loading_info=True
            )
        model.config.scoring_func = scoring_func
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise RuntimeError(f"transformers did not load our random checkpoint cleanly: {bad}; checkpoint_spec is stale.")
        model.save_pretrained(out, max_shard_size=shard_bytes)
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars_were_off:
            hf_logging.enable_progress_bar()


def num_parameters(preset: str, vision: bool = False) -> int:
    """Number of elements in a preset's checkpoint (with a vision tower when `vision`)."""
    hf_config = get_preset(preset).hf_config()
    spec = checkpoint_spec(ModelConfig.from_hf_dict(with_vision(hf_config) if vision else hf_config))
    return sum(math.prod(s.shape) for s in spec.values())


def main(argv: list[str] | None = None) -> Path:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m deepinfer.engine.testing.make_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="output directory (created)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="architecture (engine/testing/presets.py)")
    parser.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same weights")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    parser.add_argument("--writer", default="ours", choices=WRITERS, help="ours: direct; hf: via transformers")
    parser.add_argument("--max-shard-size", default=str(DEFAULT_MAX_SHARD_SIZE), help="shard above this size, e.g. 5MB")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    parser.add_argument("--vision", action="store_true", help="add a random vision tower (TINY_VISION_CONFIG; "
                        "with --format published-v41: TINY_V41_VISION_CONFIG)")
    parser.add_argument("--format", default="transformers", choices=FORMATS,
                        help="transformers: save_pretrained layout; published: DeepSeek's FP8/FP4 layout; "
                             "published-v41: a tiny DeepSeek-V4.1 (TINY_V41_TEXT_CONFIG) in its published layout")
    parser.add_argument("--expert-dtype", default="fp4", choices=["fp4", "fp8"], help="published: routed experts")
    parser.add_argument("--expert-dtype-in", default="top", choices=EXPERT_DTYPE_PLACES,
                        help="published: where config.json states expert_dtype (V4: top, V4.1: quantization_config)")
    parser.add_argument("--base", action="store_true", help="published: the *-Base variant (FP8 experts, fp32 scales)")
    parser.add_argument("--mtp-layers", type=int, default=1, help="published: MTP layers to write")
    parser.add_argument("--dspark", action="store_true", help="published-v41: DSpark draft stages (TINY_V41_DSPARK)")
    args = parser.parse_args(argv)
    try:
        out = make_checkpoint(
            args.directory, args.preset, seed=args.seed, dtype=args.dtype, writer=args.writer,
            max_shard_size=args.max_shard_size, overwrite=args.overwrite, vision=args.vision,
            format=args.format, expert_dtype=args.expert_dtype, expert_dtype_in=args.expert_dtype_in,
            base=args.base, mtp_layers=args.mtp_layers, dspark=args.dspark,
        )
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))
    if args.format == "published-v41":
        print(f"wrote a tiny DeepSeek-V4.1{' + vision' if args.vision else ''} checkpoint (published layout, seed "
              f"{args.seed}) to {out}")
        return out
    num = num_parameters(args.preset, args.vision)
    what = f"published, experts {'fp8, Base' if args.base else args.expert_dtype}" if args.format == "published" else args.dtype
    print(f"wrote {args.preset}{' + vision' if args.vision else ''} checkpoint ({num:,} parameters, {what}) to {out}")
    return out


if __name__ == "__main__":
    main()
