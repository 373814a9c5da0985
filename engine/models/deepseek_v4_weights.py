"""The DeepSeek-V4 checkpoint format: the name, shape and dtype of every tensor.

`checkpoint_spec(config, dtype)` is the single source of truth for what a DeepSeek-V4 checkpoint
holds and what `engine.models.deepseek_v4.DeepseekV4ForCausalLM.state_dict()` must contain, key for
key. The names are the official DeepSeek ones, exactly as Hugging Face transformers'
`DeepseekV4ForCausalLM.save_pretrained` writes them (transformers renames them to its own module
names on load and back on save; we never use its internal names). DeepSeek's published checkpoints
spell a few of them differently (`embed.weight`, `layers.{i}.attn.kv_norm.weight`, ...: see
`PUBLISHED_NAME_MAP`) and store some linears FP8/FP4 (`published_storage`); the loader reads both.

```
head.weight                       [V, H]            absent when tie_word_embeddings
model.embed_tokens.weight         [V, H]
model.norm.weight                 [H]
model.hc_head.hc_{fn,base,scale}  [M, M*H] [M] [1]
model.layers.{i}.
  attn_norm.weight ffn_norm.weight                    [H]
  hc_{attn,ffn}_{fn,base,scale}                       [(2+M)*M, M*H] [(2+M)*M] [3]
  attn.wq_a.weight [Q, H]   attn.q_norm.weight [Q]    attn.wq_b.weight [NH*D, Q]
  attn.wkv.weight  [D, H]   attn.norm.weight   [D]    attn.attn_sink   [NH]
  attn.wo_a.weight [G*R, NH*D/G]                      attn.wo_b.weight [H, G*R]
  CSA (rate m):  attn.compressor.{wkv,wgate}.weight [2D, H]  .ape [m, 2D]  .norm.weight [D]
                 attn.indexer.compressor.{wkv,wgate}.weight [2*ID, H]  .ape [m, 2*ID]  .norm.weight [ID]
                 attn.indexer.wq_b.weight [IH*ID, Q]  attn.indexer.weights_proj.weight [IH, H]
  HCA (rate m'): attn.compressor.{wkv,wgate}.weight [D, H]  .ape [m', D]  .norm.weight [D]
  ffn.gate.weight [E, H]    hash_moe: ffn.gate.tid2eid [V, K] int64    moe: ffn.gate.bias [E] fp32
  ffn.experts.{e}.w1.weight [I, H]  .w2.weight [H, I]  .w3.weight [I, H]    e in 0..E-1
  ffn.shared_experts.w1.weight [I, H]  .w2.weight [H, I]  .w3.weight [I, H]
```

A checkpoint whose config.json has a `vision_config` also holds the vision tower and projector,
listed by `vision_checkpoint_spec` (appended to `checkpoint_spec`; names in engine/models/vision.py):

```
vision_tower.vision_model.embeddings.patch_embedding.{weight [C, 3, p, p], bias [C]}
vision_tower.vision_model.embeddings.position_embedding.weight  [(S/p)^2, C]
vision_tower.vision_model.encoder.layers.{i}.
  layer_norm1.{weight,bias} layer_norm2.{weight,bias}                       [C]
  self_attn.{q,k,v,out}_proj.{weight [C, C], bias [C]}
  mlp.fc1.{weight [I, C], bias [I]}  mlp.fc2.{weight [C, I], bias [C]}
vision_tower.vision_model.post_layernorm.{weight,bias}                      [C]
vision_projector.norm.{weight,bias} [m*m*C]   fc1.{weight [P, m*m*C], bias [P]}   fc2.{weight [H, P], bias [H]}
vision_projector.image_begin / image_newline / image_end                     [H]
```

Multi-token-prediction layers (`mtp.*`) are not part of this spec (transformers' model has none);
`mtp_checkpoint_spec(config, dtype)` describes them (official V4 layout), and the main model's
loader skips them.

NOTE: a bf16 checkpoint is not all bf16. The tensors matched by `FP32_KEPT_PATTERNS` stay float32
in any checkpoint and in the model (mirroring transformers' `_keep_in_fp32_modules_strict`, as
measured on a bf16 `save_pretrained`), and `tid2eid` is always int64.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

from deepinfer.engine.config import ModelConfig

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""Model dtypes deepinfer runs, by name (the fp32-kept tensors stay float32 under either)."""
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16"}

FP32_KEPT_PATTERNS: tuple[str, ...] = (
    "model.norm.weight",
    "model.hc_head.hc_fn",
    "model.hc_head.hc_base",
    "model.hc_head.hc_scale",
    "model.layers.*.attn_norm.weight",
    "model.layers.*.ffn_norm.weight",
    "model.layers.*.hc_attn_fn",
    "model.layers.*.hc_attn_base",
    "model.layers.*.hc_attn_scale",
    "model.layers.*.hc_ffn_fn",
    "model.layers.*.hc_ffn_base",
    "model.layers.*.hc_ffn_scale",
    "model.layers.*.attn.attn_sink",
    "model.layers.*.attn.q_norm.weight",
    "model.layers.*.attn.norm.weight",
    "model.layers.*.attn.compressor.ape",
    "model.layers.*.attn.compressor.norm.weight",
    "model.layers.*.attn.indexer.compressor.ape",
    "model.layers.*.attn.indexer.compressor.norm.weight",
    "model.layers.*.ffn.gate.bias",
)
"""Tensors that stay float32 whatever the model dtype (`*` = a layer index): RMSNorm weights,
hyper-connection weights, attention sinks, compressor position biases (`ape`) and the router's
score-correction bias. Everything else that is floating point takes the requested dtype."""

_FP32_KEPT_RE = re.compile(
    "|".join("(?:" + re.escape(p).replace(r"\*", r"\d+") + ")" for p in FP32_KEPT_PATTERNS)
)

# Top-level names of DeepSeek's own (non-HF) checkpoints -> the names of this spec. Layer keys
# only gain the `model.` prefix. transformers accepts both spellings; so does our loader.
_OFFICIAL_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


_PUBLISHED_KV_NORM, _SPEC_KV_NORM = ".attn.kv_norm.weight", ".attn.norm.weight"

PUBLISHED_NAME_MAP: tuple[tuple[str, str], ...] = (
    ("embed.weight", "model.embed_tokens.weight"),
    ("head.weight", "head.weight"),
    ("norm.weight", "model.norm.weight"),
    ("hc_head_{fn,base,scale}", "model.hc_head.hc_{fn,base,scale}"),
    ("layers.{i}.attn.kv_norm.weight", "model.layers.{i}.attn.norm.weight"),
    ("layers.{i}.<rest>", "model.layers.{i}.<rest>"),
    ("mtp.{k}.attn.kv_norm.weight", "mtp.{k}.attn.norm.weight"),
    ("mtp.{k}.<rest>", "mtp.{k}.<rest>"),
    ("<name>.scale", "<name>.scale  (FP8/FP4 block scales of <name>.weight, same rule as <name>)"),
)
"""The one name map between DeepSeek's published checkpoints (left) and this spec / the model's
`state_dict` (right), as `(published, spec)` patterns. It agrees with transformers' rename table for
`deepseek_v4` (conversion_mapping.py), which maps both `attn.kv_norm` and our `attn.norm` to its
`self_attn.kv_norm`. Everything else (the `attn.*`, `ffn.*`, `hc_{attn,ffn}_*` leaves, routed experts
`ffn.experts.{e}.w{1,2,3}` with w1 gate, w3 up, w2 down) is spelled the same on both sides.
`official_to_spec_name` applies it left to right, `spec_to_published_name` right to left; loading
also accepts transformers' `save_pretrained` spelling (the right column itself)."""


class TensorSpec(NamedTuple):
    """Shape and dtype of one tensor as the model holds it after loading."""

    shape: tuple[int, ...]
    """Exact shape; the checkpoint must store this shape."""
    dtype: torch.dtype
    """dtype in the model (the checkpoint may store any float dtype for a float tensor)."""
    max_value: int | None = None
    """Inclusive upper bound on the values of an integer tensor (`tid2eid`: n_routed_experts - 1)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Resolve `"float32"`/`"bfloat16"` (or `fp32`/`bf16`, or the torch dtype) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(SUPPORTED_DTYPES)}.")
    name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower())
    if name not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(SUPPORTED_DTYPES)}.")
    return SUPPORTED_DTYPES[name]


def is_fp32_kept(name: str) -> bool:
    """Whether tensor `name` stays float32 whatever the model dtype (see `FP32_KEPT_PATTERNS`)."""
    return _FP32_KEPT_RE.fullmatch(name) is not None


def official_to_spec_name(name: str) -> str:
    """Map a key of DeepSeek's own checkpoint layout (`embed.weight`, `layers.0...`, `hc_head_fn`,
    `layers.{i}.attn.kv_norm.weight`) to this spec's name; names already in the spec's layout come
    back unchanged. The inverse is `spec_to_published_name` (see `PUBLISHED_NAME_MAP`).

    Vision keys written as `vision_tower.` + a transformers-5 `SiglipVisionModel.state_dict()` key
    (which lacks the `vision_model.` level) gain it: `vision_tower.embeddings...` ->
    `vision_tower.vision_model.embeddings...`.
    """
    if name in _OFFICIAL_TOP_LEVEL:
        return _OFFICIAL_TOP_LEVEL[name]
    if name.endswith(_PUBLISHED_KV_NORM):  # the attention's kv norm (the compressors' `norm` keeps its name)
        name = name.removesuffix(_PUBLISHED_KV_NORM) + _SPEC_KV_NORM
    if name.startswith("layers."):
        return "model." + name
    if name.startswith("vision_tower.") and not name.startswith(_VIT_PREFIX):
        return _VIT_PREFIX + name.removeprefix("vision_tower.")
    return name


_SPEC_TOP_LEVEL = {v: k for k, v in _OFFICIAL_TOP_LEVEL.items()}


def spec_to_published_name(name: str) -> str:
    """This spec's name (or a model `state_dict` key, `.scale` companions included) -> the name in
    DeepSeek's published checkpoints (`PUBLISHED_NAME_MAP`, right to left)."""
    if name in _SPEC_TOP_LEVEL:
        return _SPEC_TOP_LEVEL[name]
    if name.endswith(_SPEC_KV_NORM) and (name.startswith(("model.layers.", "mtp."))):
        name = name.removesuffix(_SPEC_KV_NORM) + _PUBLISHED_KV_NORM
    return name.removeprefix("model.") if name.startswith("model.layers.") else name


def checkpoint_spec(config: ModelConfig, dtype: str | torch.dtype = torch.float32) -> dict[str, TensorSpec]:
    """Every tensor of a DeepSeek-V4 checkpoint for `config`, in a fixed order, as the model holds it
    in `dtype` (the fp32-kept set stays float32, `tid2eid` is int64)."""
    dtype = parse_dtype(dtype)
    c = config
    h, v, m, e = c.hidden_size, c.vocab_size, c.hc_mult, c.n_routed_experts
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(c.num_hidden_layers):
        shapes.update(_layer_shapes(c, f"model.layers.{i}.", c.layer_types[i], c.compress_rate(i), c.mlp_layer_types[i]))
    shapes["model.norm.weight"] = (h,)
    shapes["model.hc_head.hc_fn"] = (m, m * h)
    shapes["model.hc_head.hc_base"] = (m,)
    shapes["model.hc_head.hc_scale"] = (1,)
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (v, h)

    spec: dict[str, TensorSpec] = {}
    for name, shape in shapes.items():
        if name.endswith(".tid2eid"):
            spec[name] = TensorSpec(shape, torch.int64, max_value=e - 1)
        else:
            spec[name] = TensorSpec(shape, torch.float32 if is_fp32_kept(name) else dtype)
    spec.update(vision_checkpoint_spec(config, dtype))
    return spec


VISION_PREFIXES = ("vision_tower.", "vision_projector.")
"""Top-level name prefixes of the vision tower's and projector's tensors."""
_VIT_PREFIX = "vision_tower.vision_model."


def vision_checkpoint_spec(config: ModelConfig, dtype: str | torch.dtype = torch.float32) -> dict[str, TensorSpec]:
    """Every tensor of the vision tower and projector (empty when `config.vision` is None), all in
    `dtype`, in the order of `engine.models.vision.VisionTower.state_dict()`."""
    vc = config.vision
    if vc is None:
        return {}
    dtype = parse_dtype(dtype)
    C, inter, p = vc.hidden_size, vc.intermediate_size, vc.patch_size
    merged, P, H = vc.merge_size**2 * C, vc.projector_hidden_size, config.hidden_size
    e = _VIT_PREFIX + "embeddings."
    shapes: dict[str, tuple[int, ...]] = {
        e + "patch_embedding.weight": (C, vc.num_channels, p, p),
        e + "patch_embedding.bias": (C,),
        e + "position_embedding.weight": (vc.position_grid_size**2, C),
    }
    for i in range(vc.num_hidden_layers):
        lp = f"{_VIT_PREFIX}encoder.layers.{i}."
        shapes[lp + "layer_norm1.weight"] = shapes[lp + "layer_norm1.bias"] = (C,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{lp}self_attn.{proj}.weight"] = (C, C)
            shapes[f"{lp}self_attn.{proj}.bias"] = (C,)
        shapes[lp + "layer_norm2.weight"] = shapes[lp + "layer_norm2.bias"] = (C,)
        shapes[lp + "mlp.fc1.weight"], shapes[lp + "mlp.fc1.bias"] = (inter, C), (inter,)
        shapes[lp + "mlp.fc2.weight"], shapes[lp + "mlp.fc2.bias"] = (C, inter), (C,)
    shapes[_VIT_PREFIX + "post_layernorm.weight"] = shapes[_VIT_PREFIX + "post_layernorm.bias"] = (C,)
    for name in ("image_begin", "image_newline", "image_end"):
        shapes["vision_projector." + name] = (H,)
    shapes["vision_projector.norm.weight"] = shapes["vision_projector.norm.bias"] = (merged,)
    shapes["vision_projector.fc1.weight"], shapes["vision_projector.fc1.bias"] = (P, merged), (P,)
    shapes["vision_projector.fc2.weight"], shapes["vision_projector.fc2.bias"] = (H, P), (H,)
    return {name: TensorSpec(shape, dtype) for name, shape in shapes.items()}


def _layer_shapes(c: ModelConfig, p: str, layer_type: str, rate: int, mlp_type: str) -> dict[str, tuple[int, ...]]:
    """Shapes of one decoder layer's tensors under name prefix `p`."""
    h, v, m = c.hidden_size, c.vocab_size, c.hc_mult
    d, q, nh = c.head_dim, c.q_lora_rank, c.num_attention_heads
    idim, ih = c.index_head_dim, c.index_n_heads
    inter, e = c.moe_intermediate_size, c.n_routed_experts
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "attn_norm.weight"] = (h,)
    shapes[p + "ffn_norm.weight"] = (h,)
    for branch in ("attn", "ffn"):
        shapes[f"{p}hc_{branch}_fn"] = ((2 + m) * m, m * h)
        shapes[f"{p}hc_{branch}_base"] = ((2 + m) * m,)
        shapes[f"{p}hc_{branch}_scale"] = (3,)
    a = p + "attn."
    shapes[a + "wq_a.weight"] = (q, h)
    shapes[a + "q_norm.weight"] = (q,)
    shapes[a + "wq_b.weight"] = (nh * d, q)
    shapes[a + "wkv.weight"] = (d, h)
    shapes[a + "norm.weight"] = (d,)
    shapes[a + "attn_sink"] = (nh,)
    shapes[a + "wo_a.weight"] = (c.o_groups * c.o_lora_rank, nh * d // c.o_groups)
    shapes[a + "wo_b.weight"] = (h, c.o_groups * c.o_lora_rank)
    if layer_type == "compressed_sparse_attention":
        # overlapping windows: each token feeds two compressed entries, hence 2x widths
        shapes.update(_compressor(a + "compressor.", h, 2 * d, d, rate))
        shapes.update(_compressor(a + "indexer.compressor.", h, 2 * idim, idim, rate))
        shapes[a + "indexer.wq_b.weight"] = (ih * idim, q)
        shapes[a + "indexer.weights_proj.weight"] = (ih, h)
    elif layer_type == "heavily_compressed_attention":
        shapes.update(_compressor(a + "compressor.", h, d, d, rate))
    f = p + "ffn."
    shapes[f + "gate.weight"] = (e, h)
    if mlp_type == "hash_moe":
        shapes[f + "gate.tid2eid"] = (v, c.num_experts_per_tok)
    else:
        shapes[f + "gate.bias"] = (e,)
    for expert in [f"experts.{j}." for j in range(e)] + ["shared_experts."]:
        shapes[f + expert + "w1.weight"] = (inter, h)
        shapes[f + expert + "w2.weight"] = (h, inter)
        shapes[f + expert + "w3.weight"] = (inter, h)
    return shapes


def mtp_checkpoint_spec(config: ModelConfig, dtype: str | torch.dtype = torch.float32) -> dict[str, TensorSpec]:
    """Every tensor of the checkpoint's multi-token-prediction layers (`mtp.{k}.*`, k <
    num_nextn_predict_layers), in the official DeepSeek-V4 layout:

    ```
    mtp.{k}.<decoder layer tensors>            as model.layers.{i}.*, a sliding-window layer
                                               (no compressor) with a learned router (gate.bias)
    mtp.{k}.e_proj.weight  mtp.{k}.h_proj.weight   [H, H]   embedding / hidden-stream projections
    mtp.{k}.enorm.weight   mtp.{k}.hnorm.weight    [H]      RMSNorms before them
    mtp.{k}.norm.weight                            [H]      final RMSNorm (then the shared head)
    mtp.{k}.hc_head_fn [M, M*H]  mtp.{k}.hc_head_base [M]  mtp.{k}.hc_head_scale [1]
    ```

    Semantics (as deepinfer's demo model is trained): at position i, with the main model's final
    hyper-connection streams `s_i` [M, H] and the next token t_{i+1},
    `x = e_proj(enorm(embed(t_{i+1})))[None] + h_proj(hnorm(s_i))` (per stream), the decoder layer
    runs at position i, `hc_head` collapses the streams, `norm` then the main output head give the
    logits of t_{i+2}. The embedding and output head are the main model's.
    """
    dtype = parse_dtype(dtype)
    c, h, m = config, config.hidden_size, config.hc_mult
    spec: dict[str, TensorSpec] = {}
    for k in range(c.num_nextn_predict_layers):
        p = f"mtp.{k}."
        for name, shape in _layer_shapes(c, p, "sliding_attention", 0, "moe").items():
            kept = is_fp32_kept("model.layers.0." + name.removeprefix(p))
            spec[name] = TensorSpec(shape, torch.float32 if kept else dtype)
        for name in ("e_proj.weight", "h_proj.weight"):
            spec[p + name] = TensorSpec((h, h), dtype)
        for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
            spec[p + name] = TensorSpec((h,), torch.float32)
        spec[p + "hc_head_fn"] = TensorSpec((m, m * h), torch.float32)
        spec[p + "hc_head_base"] = TensorSpec((m,), torch.float32)
        spec[p + "hc_head_scale"] = TensorSpec((1,), torch.float32)
    return spec


_LAYER = r"(?:model\.layers|mtp)\.\d+\."
_PUBLISHED_FP8_RE = re.compile(
    _LAYER + r"(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight"
    r"|mtp\.\d+\.[eh]_proj\.weight"
)
_PUBLISHED_EXPERT_RE = re.compile(_LAYER + r"ffn\.experts\.\d+\.w[123]\.weight")
_PUBLISHED_FP32_RE = re.compile(
    r"model\.hc_head\.hc_\w+|mtp\.\d+\.hc_head_\w+|" + _LAYER
    + r"(?:hc_(?:attn|ffn)_\w+|attn\.attn_sink|attn\.(?:indexer\.)?compressor\.ape|ffn\.gate\.bias)"
)
PUBLISHED_STORAGE_KINDS = ("fp8", "fp4", "bf16", "fp32", "int")


def published_storage(name: str, expert_dtype: str = "fp4") -> str:
    """How DeepSeek's published checkpoints store spec tensor `name` (one of `PUBLISHED_STORAGE_KINDS`):

    - `fp8`: float8_e4m3fn weight + `.scale` over 128x128 blocks: the attention projections
      (`wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, `indexer.wq_b`), the shared experts, MTP `e_proj`/`h_proj`,
      and the routed experts when `expert_dtype` is `"fp8"` (the `*-Base` checkpoints);
    - `fp4`: the routed experts when `expert_dtype` is `"fp4"`: int8 [out, in/2] (two E2M1 codes a
      byte) + `.scale` UE8M0 [out, in/32];
    - `fp32`: hyper-connection weights, attention sinks, compressor `ape`, router `gate.bias`;
    - `int`: `gate.tid2eid`; `bf16`: everything else (embedding, head, norms, router weight,
      compressor `wkv`/`wgate`, indexer `weights_proj`).
    """
    if _PUBLISHED_EXPERT_RE.fullmatch(name):
        return expert_dtype
    if _PUBLISHED_FP8_RE.fullmatch(name):
        return "fp8"
    if _PUBLISHED_FP32_RE.fullmatch(name):
        return "fp32"
    if name.endswith(".tid2eid"):
        return "int"
    return "bf16"


def _compressor(prefix: str, hidden: int, width: int, norm_dim: int, rate: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "wkv.weight": (width, hidden),
        prefix + "wgate.weight": (width, hidden),
        prefix + "ape": (rate, width),
        prefix + "norm.weight": (norm_dim,),
    }
