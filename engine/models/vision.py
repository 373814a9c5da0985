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

from engine.config import IMAGE_PIXELS_PER_TOKEN, IMAGE_TOKEN_ID, VisionConfig
from engine.errors import InvalidRequestError

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
