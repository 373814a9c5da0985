"""Model configuration for DeepSeek-V4-family checkpoints.

`ModelConfig` reads the `config.json` that Hugging Face transformers' `DeepseekV4Config` writes
and the one DeepSeek's published checkpoints ship (the official spelling: `compress_ratios` with one
extra entry per MTP layer, `num_hash_layers`, `qk_rope_head_dim`, `topk_method: noaux_tc`,
`rope_scaling` with `type: yarn`, `torch_dtype`, `expert_dtype`), normalises the legacy keys exactly
as transformers does, and validates every field that changes the math. A field we do not implement is rejected with an
error that names it and says what value we accept; nothing is silently ignored, except
`quantization_config`: how the weights are stored is the loader's decision alone
(`engine.loader.read_checkpoint_config`). `read_config_json` parses a file once per process.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_LAYER_TYPES = ("hash_moe", "moe")
_RATIO_TO_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}

IMAGE_TOKEN_ID = 129264
"""deepseek-recipe's `IMAGE_SPECIAL_TOKEN_ID`: the id each image position of the engine's prompt ids holds."""
IMAGE_PIXELS_PER_TOKEN = 42
"""Pixels per image token side in recipe's image token layout (`patch_size * merge_size`)."""

# Keys of a `vision_config` that carry no math (what transformers' `SiglipVisionConfig.to_dict()` adds).
_VISION_IGNORED_KEYS = frozenset(
    {
        "model_type", "transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path",
        "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward",
        "is_encoder_decoder", "id2label", "label2id", "problem_type", "initializer_range", "initializer_factor",
        "tie_word_embeddings", "use_bfloat16", "torchscript", "pruned_heads",
    }
)



def config_json_path(path: str | Path) -> Path:
    """The `config.json` of a checkpoint directory (or `path` itself when it names a .json file)."""
    path = Path(path)
    return path if path.suffix == ".json" else path / "config.json"


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A checkpoint's `config.json` as a dict (a fresh copy), parsed once per process and file version.

    `path` is the checkpoint directory or the file. Raises FileNotFoundError (no file) or ValueError
    (not a JSON object), naming the file. NOTE: the parse is cached by (path, mtime, size), so the
    entrypoint, the workers' engines, the loader and the tokenizer share one parse of an unchanged file.
    """
    file = config_json_path(path)
    try:
        st = file.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"no config.json at {file}; a checkpoint directory needs one") from None
    return copy.deepcopy(_parse_config_json(str(file.resolve()), st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=32)
def _parse_config_json(file: str, mtime_ns: int, size: int) -> dict[str, Any]:
    try:
        raw = json.loads(Path(file).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}.")
    return raw

class VisionConfig(BaseModel):
    """The vision tower of a checkpoint: config.json's `vision_config` (see `engine.models.vision`).

    A SigLIP ViT in transformers' `SiglipVisionModel` layout (no pooling head) followed by
    deepinfer's projector, which merges `merge_size x merge_size` patches into one LM token. The
    defaults are the built-in demo model's numbers; checkpoints state every value.
    """

    model_config = ConfigDict(frozen=True)

    hidden_size: int = Field(64, gt=0)
    """ViT width."""
    intermediate_size: int = Field(256, gt=0)
    """ViT MLP width."""
    num_hidden_layers: int = Field(2, gt=0)
    """ViT encoder layers."""
    num_attention_heads: int = Field(4, gt=0)
    """ViT attention heads."""
    num_channels: Literal[3] = 3
    """Input channels (RGB)."""
    image_size: int = Field(546, gt=0)
    """Side of the square image the position table was trained for (table side = image_size / patch_size)."""
    patch_size: int = Field(14, gt=0)
    """Side of one ViT patch in pixels."""
    hidden_act: Literal["gelu_pytorch_tanh", "gelu"] = "gelu_pytorch_tanh"
    """ViT MLP activation (tanh-approximated or exact GELU)."""
    layer_norm_eps: float = Field(1e-6, gt=0)
    """Epsilon of the ViT's LayerNorms."""
    attention_dropout: float = Field(0.0, ge=0.0, le=1.0)
    """Training-only; inference never drops."""
    merge_size: int = Field(3, gt=0)
    """Patches per LM token side: the projector merges merge_size x merge_size patches."""
    projector_hidden_size: int = Field(256, gt=0)
    """Hidden width of the projector MLP (fc1 output)."""
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel mean subtracted from pixels in [0, 1]."""
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    """Per-channel std dividing the centred pixels."""

    @property
    def pixels_per_token(self) -> int:
        """Side in pixels of the square an LM image token covers (`patch_size * merge_size`, 42)."""
        return self.patch_size * self.merge_size

    @property
    def position_grid_size(self) -> int:
        """Side of the ViT's learned position table (`image_size // patch_size`, 39)."""
        return self.image_size // self.patch_size

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`vision_config.hidden_size` ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if self.image_size % self.patch_size:
            raise ValueError(
                f"`vision_config.image_size` ({self.image_size}) must be a multiple of patch_size ({self.patch_size})."
            )
        if self.pixels_per_token != IMAGE_PIXELS_PER_TOKEN:
            raise ValueError(
                f"`vision_config.patch_size * merge_size` is {self.pixels_per_token}, but recipe's image token layout "
                f"covers {IMAGE_PIXELS_PER_TOKEN} px per token; use e.g. patch_size=14, merge_size=3."
            )
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"`vision_config.image_std` must be positive; got {list(self.image_std)}.")
        return self

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        """Validate a `vision_config` dict (transformers' bookkeeping keys are dropped)."""
        if not isinstance(raw, dict):
            raise ValueError(f"`vision_config` must be an object; got {type(raw).__name__}.")
        d = {k: v for k, v in raw.items() if k not in _VISION_IGNORED_KEYS}
        if d.pop("vision_use_head", False):
            raise ValueError("`vision_config.vision_use_head`=true is not supported: the tower has no pooling head.")
        unknown = sorted(k for k in d if k not in cls.model_fields)
        if unknown:
            raise ValueError(
                f"`vision_config` has fields deepinfer does not implement: {unknown}. Remove them if they carry no "
                "math, or add support for them in engine/config.py."
            )
        return cls(**d)


# Keys of config.json that carry no math (bookkeeping written by transformers or the hub).
_IGNORED_KEYS = frozenset(
    {
        "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "auto_map",
        "_name_or_path", "use_cache", "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
        "initializer_range", "attention_dropout", "output_hidden_states", "output_attentions",
        "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
        "tokenizer_class", "add_cross_attention", "tie_encoder_decoder", "pruned_heads", "torchscript",
        "cross_attention_hidden_size", "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id",
        "task_specific_params", "is_decoder", "tf_legacy_loss", "use_bfloat16",
        # deepinfer's own blocks, read by other components (tokenizer / chat encoding / vision)
        "deepinfer",
    }
)


class RopeConfig(BaseModel):
    """One RoPE flavour (`main` for sliding layers, `compress` for CSA/HCA layers and compressors)."""

    model_config = ConfigDict(frozen=True)

    rope_type: Literal["default", "yarn"] = "default"
    """`default` (plain RoPE) or `yarn` (NTK-by-parts scaling); other types are not implemented."""
    rope_theta: float
    """RoPE base."""
    factor: float = 1.0
    """YaRN scaling factor (yarn only)."""
    original_max_position_embeddings: int = 0
    """Context length the rotary was trained on before YaRN (yarn only)."""
    beta_fast: float = 32.0
    """YaRN extrapolation boundary, in rotations."""
    beta_slow: float = 1.0
    """YaRN interpolation boundary, in rotations."""
    attention_factor: float = 1.0
    """Multiplier on cos/sin; V4 forces 1.0 on its compressed branches."""


class ModelConfig(BaseModel):
    """A validated DeepSeek-V4 architecture description (the math-relevant part of config.json)."""

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(129280, gt=0)
    """Number of token ids."""
    hidden_size: int = Field(4096, gt=0)
    """Residual stream width."""
    moe_intermediate_size: int = Field(2048, gt=0)
    """Width of each routed expert and of the shared expert."""
    num_hidden_layers: int = Field(43, gt=0)
    """Number of decoder layers (MTP layers not counted)."""
    num_attention_heads: int = Field(64, gt=0)
    """Query heads; all share one K=V head."""
    head_dim: int = Field(512, gt=0)
    """Per-head width of q and of the shared K=V head."""
    q_lora_rank: int = Field(1024, gt=0)
    """Rank of the low-rank query projection."""
    num_experts_per_tok: int = Field(6, gt=0)
    """Routed experts per token."""
    n_routed_experts: int = Field(256, gt=0)
    """Routed experts per MoE layer."""
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    """Router score activation."""
    routed_scaling_factor: float = 1.5
    """Multiplier on the normalised routed weights."""
    max_position_embeddings: int = Field(1048576, gt=0)
    """Longest supported context."""
    layer_types: tuple[str, ...]
    """Attention type per layer."""
    compress_rates: dict[str, int]
    """Tokens per compressed entry, per compressed layer type."""
    hc_mult: int = Field(4, gt=0)
    """Number of hyper-connection residual streams."""
    hc_sinkhorn_iters: int = Field(20, gt=0)
    """Sinkhorn-Knopp iterations for the residual mixing matrix."""
    hc_eps: float = 1e-6
    """Numerical floor of the hyper-connection weights."""
    mlp_layer_types: tuple[str, ...]
    """MoE routing per layer: `hash_moe` (token-id table) or `moe` (learned top-k)."""
    swiglu_limit: float = 10.0
    """Clamp of the SwiGLU pre-activations: gate to at most this, up to [-limit, limit]."""
    sliding_window: int = Field(128, gt=0)
    """Tokens (including the query itself) each query sees in the sliding branch."""
    o_groups: int = Field(8, gt=0)
    """Groups of the grouped low-rank output projection."""
    o_lora_rank: int = Field(1024, gt=0)
    """Per-group rank of the grouped output projection."""
    index_n_heads: int = Field(64, gt=0)
    """Lightning indexer query heads."""
    index_head_dim: int = Field(128, gt=0)
    """Lightning indexer head width."""
    index_topk: int = Field(512, gt=0)
    """Compressed entries each query keeps in a CSA layer."""
    num_nextn_predict_layers: int = Field(1, ge=0)
    """MTP layers stored in the checkpoint (used by speculative decoding)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    bos_token_id: int | None = 0
    """Beginning-of-sequence id."""
    eos_token_id: int | tuple[int, ...] | None = 1
    """End-of-sequence id(s)."""
    pad_token_id: int | None = None
    """Padding id (unused by the math)."""
    tie_word_embeddings: bool = False
    """Whether `head.weight` is the embedding matrix."""
    partial_rotary_factor: float
    """Fraction of head_dim (the trailing part) that gets RoPE."""
    rope_main: RopeConfig
    """RoPE for sliding-only layers."""
    rope_compress: RopeConfig
    """RoPE for CSA/HCA layers, their compressors and the indexer."""
    vision: VisionConfig | None = None
    """The vision tower (config.json's `vision_config`); None for a text-only checkpoint."""
    image_token_id: int | None = None
    """Id of the image positions in the engine's prompt ids (config.json's `image_token_id`; 129264
    by default when the checkpoint has a vision tower)."""

    @property
    def rope_head_dim(self) -> int:
        """Number of trailing channels per head that carry RoPE."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple."""
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    def compress_rate(self, layer_idx: int) -> int:
        """Tokens per compressed entry of layer `layer_idx` (0 for sliding-only layers)."""
        return self.compress_rates.get(self.layer_types[layer_idx], 0)

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        n = self.num_hidden_layers
        for name, types, allowed in (
            ("layer_types", self.layer_types, LAYER_TYPES),
            ("mlp_layer_types", self.mlp_layer_types, MLP_LAYER_TYPES),
        ):
            if len(types) != n:
                raise ValueError(f"`{name}` has {len(types)} entries but num_hidden_layers is {n}; give one per layer.")
            bad = sorted({t for t in types if t not in allowed})
            if bad:
                raise ValueError(f"`{name}` entries must be one of {allowed}; got {bad}.")
        for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
            rate = self.compress_rates.get(kind)
            if rate is None or rate <= 0:
                raise ValueError(f"`compress_rates[{kind!r}]` must be a positive integer; got {rate!r}.")
        if self.head_dim * self.num_attention_heads % self.o_groups:
            raise ValueError(
                f"`o_groups` ({self.o_groups}) must divide num_attention_heads*head_dim "
                f"({self.num_attention_heads * self.head_dim})."
            )
        rd = self.rope_head_dim
        if rd <= 0 or rd % 2 or rd > self.head_dim or rd > self.index_head_dim:
            raise ValueError(
                f"`partial_rotary_factor` gives a rope width of {rd}; it must be even, positive and at most "
                f"head_dim ({self.head_dim}) and index_head_dim ({self.index_head_dim})."
            )
        if self.image_token_id is not None and not 0 <= self.image_token_id < self.vocab_size:
            raise ValueError(f"`image_token_id` ({self.image_token_id}) must be in [0, vocab_size={self.vocab_size}).")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds n_routed_experts ({self.n_routed_experts})."
            )
        return self

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Read and validate a checkpoint's `config.json` (parsed once per process: `read_config_json`).

        NOTE: this does not decide whether the checkpoint's quantization can be loaded; the loader
        does (`engine.loader.read_checkpoint_config`), and every stage that must accept exactly what
        the workers load asks it.
        """
        return cls.from_hf_dict(read_config_json(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a transformers-style config dict (legacy keys included) and validate it."""
        d = dict(raw)
        model_type = d.pop("model_type", "deepseek_v4")
        if model_type not in ("deepseek_v4", "deepseek_v41"):
            raise ValueError(f"`model_type` {model_type!r} is not a DeepSeek-V4 model; expected 'deepseek_v4'.")
        d.pop("quantization_config", None)  # NOTE: how weights are stored is the loader's decision alone
        # V4 states `expert_dtype` at the top level (V4.1 inside quantization_config): storage, so the
        # loader checks it against the tensors; other values fall to the unknown-field error.
        if d.get("expert_dtype") in (None, "bf16", "bfloat16", "fp4", "fp8"):
            d.pop("expert_dtype", None)
        topk_method = d.pop("topk_method", "noaux_tc")
        if topk_method != "noaux_tc":
            raise ValueError(
                f"`topk_method`={topk_method!r} is not supported: DeepSeek-V4 routes with 'noaux_tc' (top-k of "
                "bias-corrected scores; hash layers by tid2eid); set topk_method to 'noaux_tc' or remove it."
            )
        for key, must in (
            ("num_key_value_heads", 1),
            ("n_shared_experts", 1),
            ("norm_topk_prob", True),
            ("attention_bias", False),
            ("mlp_bias", False),
            ("hidden_act", "silu"),
        ):
            if key in d:
                value = d.pop(key)
                if value != must:
                    raise ValueError(f"`{key}`={value!r} is not supported: DeepSeek-V4 math here needs {key}={must!r}.")
        n = int(d.get("num_hidden_layers", 43))
        # legacy -> modern keys, as transformers' DeepseekV4Config.__post_init__ does
        rates = dict(d.pop("compress_rates", None) or _DEFAULT_COMPRESS_RATES)
        if (v := d.pop("compress_rate_csa", None)) is not None:
            rates["compressed_sparse_attention"] = v
        if (v := d.pop("compress_rate_hca", None)) is not None:
            rates["heavily_compressed_attention"] = v
        layer_types = d.pop("layer_types", None)
        ratios = d.pop("compress_ratios", None)
        if ratios is not None:
            n_mtp = int(d.get("num_nextn_predict_layers", 1))
            if len(ratios) not in (n, n + n_mtp):
                raise ValueError(
                    f"`compress_ratios` has {len(ratios)} entries; give one per layer ({n}), optionally followed by "
                    f"one per MTP layer ({n + n_mtp} in all)."
                )
        if layer_types is None and ratios is not None:
            try:
                layer_types = [_RATIO_TO_LAYER_TYPE[r] for r in ratios]
            except KeyError as e:
                raise ValueError(f"`compress_ratios` entries must be 0, 4 or 128; got {e.args[0]!r}.") from None
        if layer_types is None:
            inter = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))]
            layer_types = ["heavily_compressed_attention"] * min(n, 2) + inter
        mlp_types = d.pop("mlp_layer_types", None)
        n_hash = d.pop("num_hash_layers", None)
        if mlp_types is None:
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = int(d.get("head_dim", 512))
        prf = d.pop("partial_rotary_factor", None)
        qk_rope = d.pop("qk_rope_head_dim", None)
        if prf is None:
            prf = qk_rope / head_dim if qk_rope is not None else 64 / 512
        rope_theta = float(d.pop("rope_theta", 10000.0))
        compress_theta = float(d.pop("compress_rope_theta", 160000.0))
        rp = d.pop("rope_parameters", None) or d.pop("rope_scaling", None) or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main_raw, comp_raw = dict(rp["main"]), dict(rp["compress"])
        else:
            main_raw = {"rope_type": "default", "rope_theta": rope_theta}
            comp_raw = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            comp_raw["rope_theta"] = compress_theta
            comp_raw.setdefault("rope_type", comp_raw.pop("type", "default"))
            if comp_raw["rope_type"] == "yarn":
                comp_raw.setdefault("attention_factor", 1.0)
        rope_main = _parse_rope(main_raw, "main", d.get("max_position_embeddings", 1048576))
        rope_compress = _parse_rope(comp_raw, "compress", d.get("max_position_embeddings", 1048576))
        vision_raw = d.pop("vision_config", None)
        vision = VisionConfig.from_hf_dict(vision_raw) if vision_raw is not None else None
        image_token_id = d.pop("image_token_id", None)
        if vision is not None and image_token_id is None:
            image_token_id = IMAGE_TOKEN_ID
        for key in list(d):
            if key in _IGNORED_KEYS:
                d.pop(key)
        fields = set(cls.model_fields) - {"rope_main", "rope_compress", "layer_types", "mlp_layer_types", "vision"}
        unknown = sorted(k for k in d if k not in fields)
        if unknown:
            raise ValueError(
                f"config.json has fields deepinfer does not implement: {unknown}. Remove them if they carry no "
                "math, or add support for them in engine/config.py."
            )
        eos = d.pop("eos_token_id", 1)
        if isinstance(eos, list):
            eos = tuple(eos)
        return cls(
            **d,
            eos_token_id=eos,
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            compress_rates=rates,
            partial_rotary_factor=float(prf),
            rope_main=rope_main,
            rope_compress=rope_compress,
            vision=vision,
            image_token_id=image_token_id,
        )


def _parse_rope(raw: dict[str, Any], label: str, max_pos: int) -> RopeConfig:
    raw = dict(raw)
    rope_type = raw.pop("rope_type", raw.pop("type", "default"))
    raw.pop("partial_rotary_factor", None)  # the model-level factor governs (transformers mirrors it here)
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"`rope_parameters[{label!r}].rope_type`={rope_type!r} is not supported; use 'default' or 'yarn'.")
    out: dict[str, Any] = {"rope_type": rope_type, "rope_theta": float(raw.pop("rope_theta"))}
    if rope_type == "yarn":
        if raw.pop("truncate", True) is not True:
            raise ValueError(f"`rope_parameters[{label!r}].truncate`=false is not supported; remove it.")
        for k in ("mscale", "mscale_all_dim"):
            if raw.get(k) not in (None, 0, 1, 1.0):
                if "attention_factor" not in raw:
                    raise ValueError(f"`rope_parameters[{label!r}].{k}` without attention_factor is not supported.")
            raw.pop(k, None)
        factor = raw.pop("factor", None)
        orig = raw.pop("original_max_position_embeddings")
        if factor is None:
            factor = max_pos / orig
        af = raw.pop("attention_factor", None)
        if af is None:
            af = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        out.update(
            factor=float(factor),
            original_max_position_embeddings=int(orig),
            beta_fast=float(raw.pop("beta_fast", None) or 32.0),
            beta_slow=float(raw.pop("beta_slow", None) or 1.0),
            attention_factor=float(af),
        )
    else:
        if raw.get("attention_factor") in (None, 1, 1.0):  # other values fall to the unknown-field error
            raw.pop("attention_factor", None)
    if raw:
        raise ValueError(f"`rope_parameters[{label!r}]` has fields deepinfer does not implement: {sorted(raw)}.")
    return RopeConfig(**out)
