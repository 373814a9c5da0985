"""The vision tower: image pixels -> LM input embeddings (the vision contract all stages build to).

Token layout (deepseek-recipe 0.2.0)
------------------------------------
recipe's chat encodings render ONE placeholder token per image, id 129279 (`<｜image｜>`). The
prompt ids the engine runs expand each placeholder into N copies of `IMAGE_TOKEN_ID` (129264,
recipe's `IMAGE_SPECIAL_TOKEN_ID`), with

    N = image_token_count(W, H) = 2 + rows * (cols + 1),  rows = ceil(H / 42), cols = ceil(W / 42)

where W x H is the size of recipe's preprocessed image (`OpenCvImagePreprocessor().preprocess(bytes,
PreprocessOptions(detail, 2048, 512))` -> `ImageInfo(data=WEBP bytes, width, height)`), and equal to
`MultiModalData([info]).image_token_adjustment() + 1`. The model's input embeddings at those N
positions are the tower's output rows, in order; everything else is unchanged (hash-routed MoE
layers see id 129264). `engine.multimodal` does the expansion and carries the spans.

Pixels (`preprocess_pixels`)
----------------------------
ImageInfo.data (WEBP) -> Pillow -> RGB uint8 [H, W, 3] -> float32 / 255 -> (x - mean) / std ->
zero-pad right and bottom to (rows * 42, cols * 42) -> [3, rows * 42, cols * 42]
(42 = patch_size * merge_size; mean/std from `VisionConfig`).

ViT (`VisionTransformer`)
-------------------------
The computation of transformers' `SiglipVisionModel(config)(pixel_values,
interpolate_pos_encoding=True).last_hidden_state` with vision_use_head=False: a patch convolution,
the learned position table (`image_size / patch_size` = 39 per side) bicubically interpolated
(align_corners=False) to the patch grid (3 rows, 3 cols) unless it already is 39 x 39, pre-norm
encoder layers (LayerNorm, multi-head attention with biases, LayerNorm, GELU MLP) and a final
LayerNorm. Output [(3 rows) * (3 cols), C], patches in row-major order. Our own implementation:
transformers is the test oracle only, never imported here.

Projector (`VisionProjector`)
-----------------------------
features [3r * 3c, C] -> view [3r, 3c, C] -> 3x3 blocks -> [r, c, 9C] (the 9 in (dy, dx) row-major
order) -> LayerNorm(9C) (`norm`, eps 1e-6) -> fc1 (9C -> projector_hidden_size) -> GELU (tanh
approximation) -> fc2 (-> LM hidden_size) -> `image_newline` appended after each row,
`image_begin` prepended and `image_end` appended => [2 + r * (c + 1), hidden].

Checkpoint names
----------------
- `vision_tower.` + the HF SiglipVisionModel key with its `vision_model.` prefix, e.g.
  `vision_tower.vision_model.embeddings.patch_embedding.weight`,
  `vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight`,
  `vision_tower.vision_model.post_layernorm.weight`. (transformers 5 drops the `vision_model.`
  level from `SiglipVisionModel.state_dict()`; the loader accepts `vision_tower.<that key>` too.)
- `vision_projector.norm.{weight,bias}`, `vision_projector.fc1.{weight,bias}`,
  `vision_projector.fc2.{weight,bias}`, `vision_projector.image_begin`,
  `vision_projector.image_newline`, `vision_projector.image_end` (each [hidden]).
`VisionTower.state_dict()` keys are exactly these names. The image content hash (prefix caching)
is the hex sha256 of recipe's preprocessed `ImageInfo.data`.
"""

from __future__ import annotations

import io
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import IMAGE_PIXELS_PER_TOKEN, IMAGE_TOKEN_ID, VisionConfig
from deepinfer.engine.errors import InvalidRequestError

__all__ = [
    "IMAGE_TOKEN_ID",
    "VisionConfig",
    "VisionProjector",
    "image_grid",
    "image_token_count",
    "preprocess_pixels",
]

PROJECTOR_NORM_EPS = 1e-6
"""Epsilon of the projector's LayerNorm (fixed by the contract)."""


# --------------------------------------------------------------------------- layout and pixels


def image_grid(width: int, height: int) -> tuple[int, int]:
    """`(rows, cols)` of LM image tokens (newlines and begin/end not counted) of a W x H image."""
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"image size must be positive; got {width}x{height}", field="image")
    return math.ceil(height / IMAGE_PIXELS_PER_TOKEN), math.ceil(width / IMAGE_PIXELS_PER_TOKEN)


def image_token_count(width: int, height: int) -> int:
    """LM positions of one preprocessed W x H image: `2 + rows * (cols + 1)` (begin, rows each
    followed by a newline, end); equals recipe's `MultiModalData([info]).image_token_adjustment() + 1`."""
    rows, cols = image_grid(width, height)
    return 2 + rows * (cols + 1)


def _image_fields(image: Any) -> tuple[bytes, int | None, int | None]:
    """(encoded bytes, width, height) of an `ImageInfo`-like object, a `(bytes, w, h)` tuple or bytes."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), None, None
    if isinstance(image, tuple) and len(image) == 3:
        data, width, height = image
        return bytes(data), int(width), int(height)
    if all(hasattr(image, a) for a in ("data", "width", "height")):
        return bytes(image.data), int(image.width), int(image.height)
    raise InvalidRequestError(
        f"an image must be a recipe ImageInfo, a (bytes, width, height) tuple or encoded bytes; got "
        f"{type(image).__name__}",
        field="image",
    )


def preprocess_pixels(image: Any, config: VisionConfig | None = None) -> torch.Tensor:
    """Decoded, normalised, zero-padded pixels of one preprocessed image -> float32 [3, rows*42, cols*42].

    `image` is recipe's `ImageInfo` (WEBP bytes + size), a `(bytes, width, height)` tuple, or bare
    encoded bytes (size taken from the decoded image). Raises `InvalidRequestError` (field
    "image") when the bytes do not decode or decode to another size than stated.
    """
    from PIL import Image, UnidentifiedImageError

    config = config or VisionConfig()
    data, width, height = _image_fields(image)
    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(f"the image cannot be decoded ({len(data)} bytes): {e}", field="image") from None
    if width is not None and (rgb.width, rgb.height) != (width, height):
        raise InvalidRequestError(
            f"the image decodes to {rgb.width}x{rgb.height} but its ImageInfo says {width}x{height}", field="image"
        )
    rows, cols = image_grid(rgb.width, rgb.height)
    raw = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(rgb.height, rgb.width, 3)
    x = raw.permute(2, 0, 1).to(torch.float32) / 255.0  # [3, H, W]
    mean = torch.tensor(config.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(config.image_std, dtype=torch.float32).view(3, 1, 1)
    x = (x - mean) / std
    unit = config.pixels_per_token
    return F.pad(x, (0, cols * unit - rgb.width, 0, rows * unit - rgb.height))  # [3, rows*42, cols*42]


# --------------------------------------------------------------------------- projector


class VisionProjector(nn.Module):
    """ViT patch features -> LM image embeddings (merge, LayerNorm, 2-layer GELU MLP, layout tokens).

    Parameters (checkpoint names `vision_projector.` + these): `norm` (LayerNorm over
    merge_size^2 * vision hidden, eps 1e-6), `fc1`, `fc2` (with biases), and the learned
    `image_begin`, `image_newline`, `image_end` rows [lm_hidden_size] (initialised N(0, 1) like
    embedding rows). See the module docstring for the exact layout.
    """

    def __init__(self, config: VisionConfig, lm_hidden_size: int) -> None:
        super().__init__()
        self.merge_size = config.merge_size
        merged = config.merge_size**2 * config.hidden_size
        self.norm = nn.LayerNorm(merged, eps=PROJECTOR_NORM_EPS)
        self.fc1 = nn.Linear(merged, config.projector_hidden_size)
        self.fc2 = nn.Linear(config.projector_hidden_size, lm_hidden_size)
        self.image_begin = nn.Parameter(torch.randn(lm_hidden_size))
        self.image_newline = nn.Parameter(torch.randn(lm_hidden_size))
        self.image_end = nn.Parameter(torch.randn(lm_hidden_size))

    def forward(self, features: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """features [B, (m*rows)*(m*cols), C] (or without B) -> [B, 2 + rows*(cols+1), lm_hidden] (same B-ness).

        `m` = merge_size; the patches are in row-major order over the (m*rows) x (m*cols) grid.
        """
        squeeze = features.dim() == 2
        if squeeze:
            features = features.unsqueeze(0)
        m = self.merge_size
        B, P, C = features.shape
        if P != m * rows * m * cols:
            raise ValueError(f"expected {m * rows}x{m * cols} = {m * rows * m * cols} patches, got {P}")
        x = features.view(B, rows, m, cols, m, C).permute(0, 1, 3, 2, 4, 5)  # [B, r, c, dy, dx, C]
        x = x.reshape(B, rows, cols, m * m * C)  # [B, r, c, 9C]
        x = self.fc2(F.gelu(self.fc1(self.norm(x)), approximate="tanh"))  # [B, r, c, H]
        H = x.shape[-1]
        newline = self.image_newline.to(x.dtype).view(1, 1, 1, H).expand(B, rows, 1, H)
        x = torch.cat([x, newline], dim=2).reshape(B, rows * (cols + 1), H)  # [B, r*(c+1), H]
        begin = self.image_begin.to(x.dtype).view(1, 1, H).expand(B, 1, H)
        end = self.image_end.to(x.dtype).view(1, 1, H).expand(B, 1, H)
        out = torch.cat([begin, x, end], dim=1)  # [B, 2 + r*(c+1), H]
        return out[0] if squeeze else out


# --------------------------------------------------------------------------- ViT (SiglipVisionModel layout)


class VisionEmbeddings(nn.Module):
    """Patch convolution plus the learned position table, interpolated to the patch grid."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.grid_size = config.position_grid_size
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size, config.patch_size)
        self.position_embedding = nn.Embedding(self.grid_size**2, config.hidden_size)

    def position_table(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """Position embeddings of a grid_h x grid_w patch grid -> [grid_h * grid_w, C].

        NOTE: like transformers, the table is used as is only at exactly its own square grid; any
        other grid gets a bicubic (align_corners=False) resize. The resize runs in float32.
        """
        table = self.position_embedding.weight  # [G*G, C]
        if (grid_h, grid_w) == (self.grid_size, self.grid_size):
            return table
        G, C = self.grid_size, table.shape[-1]
        grid = table.float().view(1, G, G, C).permute(0, 3, 1, 2)  # [1, C, G, G]
        grid = F.interpolate(grid, size=(grid_h, grid_w), mode="bicubic", align_corners=False)
        return grid.permute(0, 2, 3, 1).reshape(grid_h * grid_w, C).to(table.dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, Hpx, Wpx] -> patch embeddings [B, (Hpx/p) * (Wpx/p), C]."""
        w = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(w.dtype))  # [B, C, Hpx/p, Wpx/p]
        gh, gw = x.shape[-2:]
        return x.flatten(2).transpose(1, 2) + self.position_table(gh, gw)


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention with biased q/k/v/out projections."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        C = config.hidden_size
        self.num_heads, self.head_dim = config.num_attention_heads, C // config.num_attention_heads
        self.q_proj = nn.Linear(C, C)
        self.k_proj = nn.Linear(C, C)
        self.v_proj = nn.Linear(C, C)
        self.out_proj = nn.Linear(C, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, P, C] -> [B, P, C]."""
        B, P, C = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, P, self.num_heads, self.head_dim).transpose(1, 2)  # [B, heads, P, head_dim]

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(B, P, C))


class VisionMLP(nn.Module):
    """fc1 -> GELU -> fc2, with biases."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    """Pre-norm transformer layer: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    """The stack of encoder layers (`layers.{i}`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class VisionModel(nn.Module):
    """Embeddings, encoder and final LayerNorm (transformers' SiglipVisionModel without the head)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, Hpx, Wpx] -> last hidden state [B, (Hpx/p) * (Wpx/p), C]."""
        return self.post_layernorm(self.encoder(self.embeddings(pixels)))


class VisionTransformer(nn.Module):
    """The SigLIP ViT under its checkpoint prefix: `vision_model.*` (so `vision_tower.vision_model.*`)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.vision_model = VisionModel(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, Hpx, Wpx] (Hpx, Wpx multiples of patch_size) -> [B, (Hpx/p) * (Wpx/p), C]."""
        p = self.vision_model.embeddings.patch_size
        if pixels.dim() != 4 or pixels.shape[1] != 3 or pixels.shape[2] % p or pixels.shape[3] % p:
            raise ValueError(f"pixels must be [B, 3, H, W] with H, W multiples of {p}; got {tuple(pixels.shape)}")
        return self.vision_model(pixels)


# --------------------------------------------------------------------------- the tower


class VisionTower(nn.Module):
    """ViT + projector: preprocessed pixels -> LM input embeddings of each image.

    Children `vision_tower` (`VisionTransformer`) and `vision_projector` (`VisionProjector`), so
    `state_dict()` keys are the checkpoint names. The LM (`DeepseekV4ForCausalLM`) of a vision
    checkpoint registers the same two modules under the same names and exposes this object as
    `model.vision`; `engine.loader.load_vision_tower` loads the tower alone (the vision stage).
    """

    def __init__(self, config: VisionConfig, lm_hidden_size: int, max_batch_size: int = 8) -> None:
        super().__init__()
        self.config = config
        self.lm_hidden_size = lm_hidden_size
        self.max_batch_size = max_batch_size
        """Most images of one size encoded in one ViT forward (bounds activation memory)."""
        self.vision_tower = VisionTransformer(config)
        self.vision_projector = VisionProjector(config, lm_hidden_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.vision_projector.fc2.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.vision_projector.fc2.weight.device

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [B, 3, rows*42, cols*42] (equal sizes) -> embeddings [B, 2 + rows*(cols+1), lm_hidden]."""
        unit = self.config.pixels_per_token
        rows, cols = pixels.shape[-2] // unit, pixels.shape[-1] // unit
        if pixels.shape[-2] != rows * unit or pixels.shape[-1] != cols * unit or rows == 0 or cols == 0:
            raise ValueError(f"pixels must be padded to multiples of {unit} px; got {tuple(pixels.shape)}")
        return self.vision_projector(self.vision_tower(pixels), rows, cols)

    @torch.inference_mode()
    def encode(self, pixel_list: list[torch.Tensor]) -> list[torch.Tensor]:
        """Blocks while encoding: [3, rows_i*42, cols_i*42] per image -> [2 + rows_i*(cols_i+1), lm_hidden] each.

        Images of equal size run together (up to `max_batch_size` per forward); outputs keep the
        input order and are in the tower's dtype, on its device.
        """
        out: list[torch.Tensor | None] = [None] * len(pixel_list)
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixel_list):
            if px.dim() != 3 or px.shape[0] != 3:
                raise ValueError(f"image {i}: pixels must be [3, H, W]; got {tuple(px.shape)}")
            by_size.setdefault(tuple(px.shape), []).append(i)
        for idx in by_size.values():
            for a in range(0, len(idx), self.max_batch_size):
                chunk = idx[a:a + self.max_batch_size]
                batch = torch.stack([pixel_list[i] for i in chunk]).to(self.device, self.dtype)  # [b, 3, H, W]
                emb = self(batch)  # [b, N, lm_hidden]
                for j, i in enumerate(chunk):
                    out[i] = emb[j]
        return out  # type: ignore[return-value]
