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
        if is_v41_config(d):
            # NOTE: V4.1's layout and math differ (docs/V4_1.md): `V41Config` is its config, not this class
            v41 = V41Config.from_hf_dict(d)
            missing = v41.unsupported()
            raise ValueError(
                "this is a DeepSeek-V4.1 config (`model_type` 'deepseek_v41'): it is a V41Config (engine.config."
                "V41Config, what engine.loader.read_checkpoint_config returns for it), not a V4 ModelConfig"
                + ("; the engine cannot serve yet: " + "; ".join(missing) if missing else "") + "."
            )
        model_type = d.pop("model_type", "deepseek_v4")
        if model_type != "deepseek_v4":
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


# ============================================================================ DeepSeek-V4.1

V41_MODEL_TYPE = "deepseek_v41"
"""`model_type` of DeepSeek-V4.1 checkpoints (top level; the nested `text_config` says `deepseek_v41_text`)."""

# Keys of V4.1's config.json (top level or `text_config`) that carry no math.
_V41_IGNORED_KEYS = frozenset(
    {"architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "use_cache",
     "initializer_range", "attention_dropout", "deepinfer", "auto_map"}
)
# Keys whose only accepted value is the one V4.1's math has (the reference has no other code path).
_V41_FIXED = {"num_key_value_heads": 1, "n_shared_experts": 1, "hidden_act": "silu", "attention_bias": False,
              "topk_method": "noaux_tc", "tie_word_embeddings": False}


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def engram_primes(layer_ids: tuple[int, ...], max_ngram_size: int, n_heads: int,
                  vocab_size: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Bucket sizes of V4.1's Engram tables, [layer][n-gram order - 2][head] (docs/V4_1.md §6).

    For each Engram layer, order and head in that order: the smallest prime above the running value
    (which restarts at `vocab_size - 1` for every order) that no earlier bucket took, across all layers.
    A layer's table has exactly the sum of its primes as rows (`engram_num_embeddings`).
    """
    seen: set[int] = set()
    out = []
    for _ in layer_ids:
        per_order = []
        for _ in range(max_ngram_size - 1):
            current, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                current += 1
                while current in seen or not _is_prime(current):
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_order.append(tuple(sizes))
        out.append(tuple(per_order))
    return tuple(out)


class V41VisionConfig(BaseModel):
    """DeepSeek-V4.1's vision tower: config.json's `vision_config` (`model_type` deepseek_v41_vision), field names
    the published file's. A ViT with 2D RoPE over a patch grid, then an aligner that merges `downsample_ratio` x
    `downsample_ratio` patches into one LM token (`engine.models.vision_v41`; docs/V4_1.md §14). Defaults: Flash."""

    model_config = ConfigDict(frozen=True)

    num_hidden_layers: int = Field(32, gt=0)
    """ViT blocks."""
    hidden_size: int = Field(1024, gt=0)
    """ViT width."""
    num_attention_heads: int = Field(16, gt=0)
    """ViT attention heads."""
    intermediate_size: int = Field(2816, gt=0)
    """ViT SwiGLU width (`mlp.w1` projects to twice this: gate and up)."""
    patch_size: int = Field(14, gt=0)
    """Side of one ViT patch in pixels."""
    rope_theta: float = Field(10000.0, gt=0)
    """Base of the ViT's 2D RoPE."""
    downsample_ratio: int = Field(3, gt=0)
    """Patches per LM token side (the aligner's unfold)."""
    max_image_tokens: int = Field(1024, gt=3)
    """Most LM positions one image may take (start, rows with their newline, end): the resize plan shrinks to fit."""
    min_pixels: int = Field(295936, ge=0)
    """Images with fewer pixels are scaled up to about this area before planning (544 x 544)."""
    max_wh_ratio: int | None = Field(None, gt=0)
    """Widest width / height kept; a wider image is planned at height x this and resized (None: no cap)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @model_validator(mode="after")
    def _check(self) -> V41VisionConfig:
        if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
            raise ValueError(f"`vision_config.hidden_size` ({self.hidden_size}) over num_attention_heads "
                             f"({self.num_attention_heads}) must give a head width that is a multiple of 4 (the 2D RoPE "
                             "rotates half of each head, split between rows and columns).")
        return self

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> V41VisionConfig:
        """Validate a V4.1 `vision_config` dict, naming fields deepinfer does not implement."""
        if not isinstance(raw, dict):
            raise ValueError(f"`vision_config` must be an object; got {type(raw).__name__}.")
        d = dict(raw)
        if d.pop("model_type", "deepseek_v41_vision") != "deepseek_v41_vision":
            raise ValueError(f"`vision_config.model_type` {raw['model_type']!r} is not 'deepseek_v41_vision'.")
        unknown = sorted(k for k in d if k not in cls.model_fields and k not in _V41_IGNORED_KEYS)
        if unknown:
            raise ValueError(f"`vision_config` has fields deepinfer does not implement: {unknown}.")
        return cls(**{k: v for k, v in d.items() if k in cls.model_fields})


class V41Config(BaseModel):
    """A validated DeepSeek-V4.1 language model (config.json's `text_config` plus the top-level ids).

    Field names are the published config.json's. docs/V4_1.md explains each one and the layer roles
    they define (KV sources, index sources, the candidate source, Engram layers, DSpark stages); the
    checks here refuse, naming the field, any combination the reference code would compute wrongly or
    not at all. `unsupported()` lists what the engine cannot serve yet (the loader refuses with it).
    """

    model_config = ConfigDict(frozen=True)

    vocab_size: int = Field(gt=0)
    """Number of token ids."""
    hidden_size: int = Field(gt=0)
    """Residual stream width (the reference's `dim`)."""
    moe_intermediate_size: int = Field(gt=0)
    """Width of each routed expert and of the shared expert."""
    num_hidden_layers: int = Field(gt=0)
    """Backbone layers (DSpark stages not counted)."""
    num_attention_heads: int = Field(gt=0)
    """Query heads; all share one K=V head."""
    head_dim: int = Field(gt=0)
    """Width of each query head and of the shared K=V head."""
    qk_rope_head_dim: int = Field(gt=0)
    """Trailing channels of each head (and of the index heads) that carry RoPE."""
    q_lora_rank: int = Field(gt=0)
    """Rank of the low-rank query projection."""
    o_lora_rank: int = Field(gt=0)
    """Per-group rank of the grouped output projection."""
    o_groups: int = Field(gt=0)
    """Groups of the grouped output projection."""
    swiglu_limit: float = Field(10.0, ge=0)
    """Clamp of the SwiGLU pre-activations (0: none)."""
    rms_norm_eps: float = Field(1e-20, gt=0)
    """Epsilon of every RMSNorm and of the mHC normalisation (1e-20 in V4.1-Flash)."""
    max_position_embeddings: int = Field(1048576, gt=0)
    """Longest supported context."""
    rope_main: RopeConfig
    """RoPE of window-only layers (`rope_theta`, no YaRN)."""
    rope_compress: RopeConfig
    """RoPE of layers with compress_ratio > 0 (`compress_rope_theta` with `rope_scaling`'s YaRN, no mscale)."""
    n_routed_experts: int = Field(gt=0)
    """Routed experts per backbone MoE."""
    num_experts_per_tok: int = Field(gt=0)
    """Routed experts per token in the backbone."""
    scoring_func: Literal["sqrtsoftplus", "sigmoid", "softmax"] = "sqrtsoftplus"
    """Router score activation."""
    norm_topk_prob: bool = True
    """Normalise the chosen experts' scores to sum to one (when more than one is chosen)."""
    routed_scaling_factor: float = 1.5
    """Multiplier on the routed weights."""
    sliding_window: int = Field(gt=0)
    """Tokens (the query included) each query sees in its window."""
    compress_ratios: tuple[int, ...]
    """Per backbone layer, then per DSpark stage: tokens per compressed entry the layer reads (0: window only)."""
    kv_source_layer_ids: tuple[int, ...]
    """Layers that compute the compressed KV (and index keys) later layers of the same ratio reuse."""
    index_source_layer_ids: tuple[int, ...]
    """Layers that run an indexer; compressed layers in between reuse the latest one's selection."""
    index_n_heads: int = Field(gt=0)
    """Indexer query heads."""
    index_head_dim: int = Field(gt=0)
    """Indexer head width."""
    index_topk: int = Field(gt=0)
    """Compressed entries each query keeps."""
    candidate_source_layer_id: int = -1
    """Index source whose block mask restricts every later index source (-1: no candidate filter)."""
    candidate_topk_blocks: int = Field(0, ge=0)
    """Blocks of entries the candidate source keeps per query."""
    candidate_block_size: int = Field(0, ge=0)
    """Entries per candidate block."""
    hc_mult: int = Field(4, gt=0)
    """Hyper-connection residual streams."""
    hc_sinkhorn_iters: int = Field(20, gt=0)
    """Sinkhorn iterations of the mHC mixing matrix."""
    hc_eps: float = 1e-6
    """Numerical floor of the mHC weights."""
    engram_layer_ids: tuple[int, ...] = ()
    """Layers whose input streams get an Engram lookup added."""
    engram_num_embeddings: tuple[int, ...] = ()
    """Table rows per Engram layer (the sum of that layer's bucket primes)."""
    engram_max_ngram_size: int = Field(1, ge=1)
    """Largest n-gram hashed (2-grams .. this)."""
    engram_vocab_size: int = Field(0, ge=0)
    """Where each bucket's prime search starts (+1)."""
    engram_n_heads: int = Field(0, ge=0)
    """Hash heads per n-gram order."""
    engram_head_dim: int = Field(0, ge=0)
    """Width of one table row."""
    engram_pad_token_id: int = Field(2, ge=0)
    """Token (raw id) whose compressed id fills n-gram slots with no history."""
    engram_compressed_vocab_size: int = Field(0, ge=0)
    """Size of the normalised compressed vocabulary every hash multiplier derives from."""
    num_nextn_predict_layers: int = Field(0, ge=0)
    """DSpark draft stages (`mtp.*`)."""
    dspark_block_size: int = Field(0, ge=0)
    """Tokens a DSpark pass drafts."""
    dspark_noise_token_id: int = Field(0, ge=0)
    """Filler id of the draft block's inputs."""
    dspark_target_layer_ids: tuple[int, ...] = ()
    """Backbone layers whose input streams feed the drafter."""
    dspark_markov_rank: int = Field(256, ge=0)
    """Width of the DSpark Markov head."""
    dspark_n_routed_experts: int = Field(0, ge=0)
    """Routed experts of the DSpark stages' MoE (0: the backbone's)."""
    dspark_num_experts_per_tok: int = Field(0, ge=0)
    """Routed experts per token in the DSpark stages (0: the backbone's)."""
    bos_token_id: int | None = 0
    """Beginning-of-sequence id."""
    eos_token_id: int | tuple[int, ...] | None = 1
    """End-of-sequence id(s)."""
    pad_token_id: int | None = None
    """Padding id."""
    image_token_id: int | None = None
    """Id of every image-span position (selects the router's `bias_vl`, kills Engram n-grams)."""
    vision_config: dict[str, Any] | None = None
    """The vision tower's config as config.json states it (parsed and checked by `vision`)."""
    quantization_config: dict[str, Any] | None = None
    """How the weights are stored (the loader's business; kept to report what it cannot load)."""

    # ------------------------------------------------------------------ derived layer roles

    @property
    def vision(self) -> V41VisionConfig | None:
        """The vision tower the engine builds (`engine.models.vision_v41`), None for a text-only checkpoint: the
        serving stages ask it (an LM stage with a tower reads image embeddings; the vision stage loads it)."""
        return None if self.vision_config is None else V41VisionConfig.from_hf_dict(self.vision_config)

    @property
    def rope_head_dim(self) -> int:
        """Trailing RoPE channels per head."""
        return self.qk_rope_head_dim

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry layer `layer` reads (0: window only)."""
        return self.compress_ratios[layer]

    def _latest(self, ids: tuple[int, ...], layer: int) -> int | None:
        found = [i for i in ids if i <= layer]
        return max(found) if found else None

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed entries `layer` reads (None for window-only layers)."""
        return self._latest(self.kv_source_layer_ids, layer) if self.compress_ratios[layer] else None

    def index_source_of(self, layer: int) -> int | None:
        """The index source whose selection `layer` uses (None for window-only layers)."""
        return self._latest(self.index_source_layer_ids, layer) if self.compress_ratios[layer] else None

    def uses_candidates(self, layer: int) -> bool:
        """Whether index source `layer` restricts its scores to the candidate source's blocks."""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids

    @property
    def engram_primes(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Bucket sizes [layer][order - 2][head] (`engram_primes`)."""
        return engram_primes(self.engram_layer_ids, self.engram_max_ngram_size, self.engram_n_heads,
                             self.engram_vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All end-of-sequence ids as a tuple."""
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def compress_rates(self) -> dict[str, int]:
        """The KV sources' distinct ratios by a name (`ratio_{r}`): what sizes blocks and bounded replay
        (`engine.cache.layout.default_block_size`, `exact_replay_tokens`), as V4's `compress_rates`."""
        return {f"ratio_{r}": r for r in sorted({self.compress_ratios[s] for s in self.kv_source_layer_ids})}

    @property
    def engram_history_tokens(self) -> int:
        """Tokens of history each new token's Engram hashes read (`engram_max_ngram_size - 1`; 0 without Engram):
        bounded state of the paged engine, rebuilt by replay like the window rings."""
        return self.engram_max_ngram_size - 1 if self.engram_layer_ids else 0

    def unsupported(self) -> list[str]:
        """What the serving engine cannot do with this checkpoint yet, each naming its config field.

        NOTE: keep in step with what exists: the paged engine serves V4.1's text backbone (cache anatomy
        `engine.cache.v41`, the paged forward of `engine.models.deepseek_v41`, the published layout read by
        `deepseek_v41.load_published`, weights dequantized to float) and the vision tower
        (`engine.models.vision_v41`) and the DSpark draft stages (`engine.models.dspark`), when they are complete.
        """
        out = []
        if self.num_nextn_predict_layers and self.dspark_block_size and not self.dspark_target_layer_ids:
            out.append(f"DSpark draft stages (`num_nextn_predict_layers`={self.num_nextn_predict_layers}) without "
                       "`dspark_target_layer_ids` (the backbone layers that feed them)")
        return out

    # ------------------------------------------------------------------ validation

    @model_validator(mode="after")
    def _check(self) -> V41Config:
        n, ratios = self.num_hidden_layers, self.compress_ratios
        if len(ratios) not in (n, n + self.num_nextn_predict_layers):
            raise ValueError(
                f"`compress_ratios` has {len(ratios)} entries; give one per layer ({n}), optionally followed by one per "
                f"DSpark stage ({n + self.num_nextn_predict_layers} in all)."
            )
        if any(r < 0 for r in ratios):
            raise ValueError(f"`compress_ratios` entries must be >= 0; got {list(ratios)}.")
        if any(ratios[n:]):
            raise ValueError("`compress_ratios` of the DSpark stages must be 0: their attention is window-only.")
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
            ids = getattr(self, name)
            if len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
                raise ValueError(f"`{name}` must be distinct layer ids in [0, {n}); got {list(ids)}.")
        for layer in self.kv_source_layer_ids:
            if not ratios[layer]:
                raise ValueError(f"`kv_source_layer_ids` has layer {layer}, whose compress_ratio is 0: it has nothing to "
                                 "compress; give it a ratio or remove it.")
            if layer not in self.index_source_layer_ids:
                raise ValueError(f"KV source {layer} is not in `index_source_layer_ids`: its index keys would never be "
                                 "computed; add it.")
        for layer in self.index_source_layer_ids:
            if not ratios[layer]:
                raise ValueError(f"`index_source_layer_ids` has layer {layer}, whose compress_ratio is 0.")
        for layer in range(n):
            if not ratios[layer]:
                continue
            src = self.kv_source_of(layer)
            if src is None or ratios[src] != ratios[layer]:
                raise ValueError(
                    f"layer {layer} reads compressed KV at ratio {ratios[layer]} (`compress_ratios`), but the latest KV "
                    f"source at or before it ({src}) " + ("does not exist" if src is None else f"has ratio {ratios[src]}")
                    + "; fix `kv_source_layer_ids` or `compress_ratios`."
                )
        cand = self.candidate_source_layer_id
        if cand != -1:
            if cand not in self.index_source_layer_ids:
                raise ValueError(f"`candidate_source_layer_id` ({cand}) is not an index source.")
            if self.candidate_topk_blocks <= 0 or self.candidate_block_size <= 0:
                raise ValueError("`candidate_topk_blocks` and `candidate_block_size` must be positive with a candidate "
                                 "source.")
            if (self.candidate_topk_blocks - 1) * self.candidate_block_size + 1 < self.index_topk:
                raise ValueError(
                    f"`candidate_topk_blocks` ({self.candidate_topk_blocks}) x `candidate_block_size` "
                    f"({self.candidate_block_size}) may keep fewer than index_topk ({self.index_topk}) entries; the "
                    "reference would then pick masked entries arbitrarily. Need (blocks - 1) * size + 1 >= index_topk."
                )
            if any(s > cand for s in self.kv_source_layer_ids):
                raise ValueError(f"a KV source follows `candidate_source_layer_id` ({cand}): its candidate mask would "
                                 "index another source's entries.")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds n_routed_experts "
                             f"({self.n_routed_experts}).")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"`o_groups` ({self.o_groups}) must divide num_attention_heads ({self.num_attention_heads}).")
        rd = self.qk_rope_head_dim
        if rd % 2 or rd > self.head_dim or rd > self.index_head_dim:
            raise ValueError(f"`qk_rope_head_dim` ({rd}) must be even and at most head_dim ({self.head_dim}) and "
                             f"index_head_dim ({self.index_head_dim}).")
        self._check_engram()
        if self.vision_config is not None:
            V41VisionConfig.from_hf_dict(self.vision_config)  # refuse a malformed tower at parse time
        return self

    def _check_engram(self) -> None:
        ids = self.engram_layer_ids
        if not ids:
            return
        if len(self.engram_num_embeddings) != len(ids):
            raise ValueError(f"`engram_num_embeddings` has {len(self.engram_num_embeddings)} entries for "
                             f"{len(ids)} `engram_layer_ids`; give one per Engram layer.")
        for key in ("engram_max_ngram_size", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
                    "engram_compressed_vocab_size"):
            if getattr(self, key) < (2 if key == "engram_max_ngram_size" else 1):
                raise ValueError(f"`{key}` ({getattr(self, key)}) is too small for Engram layers.")
        if self.engram_pad_token_id >= self.vocab_size:
            raise ValueError(f"`engram_pad_token_id` ({self.engram_pad_token_id}) must be < vocab_size.")
        for layer, rows, primes in zip(ids, self.engram_num_embeddings, self.engram_primes):
            if rows != sum(sum(p) for p in primes):
                raise ValueError(
                    f"`engram_num_embeddings` for layer {layer} is {rows}, but its buckets (primes from engram_vocab_size="
                    f"{self.engram_vocab_size}) sum to {sum(sum(p) for p in primes)} rows."
                )

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_json_file(cls, path: str | Path) -> V41Config:
        """Read and validate a V4.1 checkpoint's config.json (parsed once per process)."""
        return cls.from_hf_dict(read_config_json(path))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> V41Config:
        """Validate the published layout: top-level ids, `text_config`, `vision_config`, `quantization_config`
        (a flat dict with the text fields at the top level is accepted too)."""
        top = dict(raw)
        model_type = top.get("model_type", V41_MODEL_TYPE)
        if model_type != V41_MODEL_TYPE:
            raise ValueError(f"`model_type` {model_type!r} is not DeepSeek-V4.1; expected {V41_MODEL_TYPE!r}.")
        text = top.pop("text_config", None)
        d: dict[str, Any] = {}
        if text is not None:
            if not isinstance(text, dict):
                raise ValueError("`text_config` must be an object.")
            d.update(text)
            if d.get("model_type", "deepseek_v41_text") != "deepseek_v41_text":
                raise ValueError(f"`text_config.model_type` {d['model_type']!r} is not 'deepseek_v41_text'.")
        for key, value in top.items():  # top-level ids and blocks; a text field stated twice must agree
            if key in d and d[key] != value and key not in _V41_IGNORED_KEYS:
                raise ValueError(f"`{key}` is {value!r} at the top level but {d[key]!r} in text_config.")
            d.setdefault(key, value)
        for key in list(d):
            if key in _V41_IGNORED_KEYS:
                d.pop(key)
        for key, must in _V41_FIXED.items():
            if key in d and d.pop(key) != must:
                raise ValueError(f"`{key}` is not supported unless {must!r}: DeepSeek-V4.1's math has no other path.")
        theta = float(d.pop("rope_theta", 10000.0))
        compress_theta = float(d.pop("compress_rope_theta", 160000.0))
        scaling = dict(d.pop("rope_scaling", None) or d.pop("rope_parameters", None) or {})
        scaling.setdefault("rope_type", scaling.pop("type", "default"))
        if scaling["rope_type"] == "yarn":
            scaling.setdefault("attention_factor", 1.0)  # NOTE: the reference applies no mscale to cos/sin
        rope_compress = _parse_rope({**scaling, "rope_theta": compress_theta}, "compress",
                                    d.get("max_position_embeddings", 1048576))
        rope_main = RopeConfig(rope_theta=theta)
        if "engram_pad_id" in d:  # the reference's ModelArgs spelling
            d.setdefault("engram_pad_token_id", d.pop("engram_pad_id"))
        eos = d.pop("eos_token_id", 1)
        unknown = sorted(k for k in d if k not in cls.model_fields)
        if unknown:
            raise ValueError(f"config.json has V4.1 fields deepinfer does not implement: {unknown}. Remove them if they "
                             "carry no math, or add support for them in engine/config.py.")
        return cls(**d, eos_token_id=tuple(eos) if isinstance(eos, list) else eos, rope_main=rope_main,
                   rope_compress=rope_compress)


def is_v41_config(raw: dict[str, Any]) -> bool:
    """Whether a config.json dict describes DeepSeek-V4.1 (its `model_type`, or the nested `text_config`)."""
    return raw.get("model_type") == V41_MODEL_TYPE or isinstance(raw.get("text_config"), dict)
