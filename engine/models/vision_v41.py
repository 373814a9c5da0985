"""DeepSeek-V4.1's vision tower: a preprocessed image -> the LM input embeddings of its image span.

Written from reading DeepSeek's official `inference/vision.py` and `inference/image_processor.py`
(huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, revision dba1be0a40aa45a94ad051997016db3960a90277; docs/V4_1.md
§14 describes them), not copied. Module paths are the published checkpoint's tensor names, so a tower's
`state_dict()` keys are exactly `vision.*`, `aligner.*`, `image_start`, `image_end`, `image_newline`.

Pixels (`preprocess`)
---------------------
recipe's `OpenCvImagePreprocessor` has already fetched, decoded and resized the image (`engine.images`:
`ImageInfo` = WEBP bytes, width, height) and counted its tokens by its V4.1 image-token specification. Here, as
the official `load_image` does with any image: decode to RGB, plan the patch grid from the size (`plan_grid`:
scale tiny images up to about `min_pixels`, round each side up to a multiple of `patch_size`, shrink until the
span fits `max_image_tokens`), fit the image into that size keeping its aspect and pad the rest grey (127)
centred (Pillow's `ImageOps.pad`; with `max_wh_ratio`, a too-wide image is stretched instead), scale to
[-1, 1] (`(x / 255 - 0.5) / 0.5`), round to bfloat16 (the official code hands the tower bfloat16 pixels) and cut
into `n_vit_h x n_vit_w` patches of `[3, p, p]` in reading order.

The tower (`V41VisionTower`)
----------------------------
* `vision` (ViT): `patch_embed.proj` (a biased linear over the flattened `[3, p, p]` patch) -> blocks of pre-norm
  attention and SwiGLU MLP -> `norm`. RMSNorm (eps 1e-6) in float32. Attention: one biased `wqkv`, full
  bidirectional softmax over the image's patches, biased `wo`. 2D RoPE on every head: the head's two halves are
  the rotation pairs (rotate-half); a half's first quarter of frequencies turns with the patch's row, the second
  with its column (`theta ** (-2i / (head_dim / 2))`), computed in float32. MLP: `w1` (no bias) gives gate and
  up, `silu(gate) * up`, `w2` (no bias).
* `aligner`: the `[n_vit_h, n_vit_w, C]` features, zero-padded right and bottom to multiples of r
  (`downsample_ratio`), each r x r block flattened channel-major (`c * r * r + dy * r + dx`, torch's `unfold`
  order) -> `w1` -> exact GELU -> `w2` (both biased): one row per LM token, blocks in reading order.
* the span: `image_start`, then each of the `n_llm_h` rows of `n_llm_w` aligner rows followed by `image_newline`,
  then `image_end`: `2 + n_llm_h * (n_llm_w + 1)` rows, every position holding `image_token_id` in the prompt ids.
  The LM (`engine.models.deepseek_v41`) routes those positions with `bias_vl` and gives them no Engram n-gram.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import V41VisionConfig
from deepinfer.engine.errors import InvalidRequestError

__all__ = ["V41VisionConfig", "V41Patches", "V41VisionTower", "num_image_tokens", "plan_grid"]

VISION_NORM_EPS = 1e-6
"""Epsilon of the ViT's RMSNorms (fixed in the official code, not in config.json)."""
PAD_GREY = (127, 127, 127)
"""Colour of the padding around a fitted image."""
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")
"""Checkpoint names of the tower (the vision stage reads only these)."""


# --------------------------------------------------------------------------- the resize plan


def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """LM positions of an image whose aligner grid is n_llm_h x n_llm_w: start, rows each with a newline, end."""
    return n_llm_h * (n_llm_w + 1) + 2


def _llm_grid(height_px: int, width_px: int, cfg: V41VisionConfig) -> tuple[int, int]:
    r, p = cfg.downsample_ratio, cfg.patch_size
    return math.ceil((height_px // p) / r), math.ceil((width_px // p) / r)


def _shrunk_size(height: float, width: float, cfg: V41VisionConfig) -> tuple[int, int]:
    """The largest aspect-keeping (height, width) in pixels whose span fits `max_image_tokens`."""
    p, cell, budget = cfg.patch_size, cfg.patch_size * cfg.downsample_ratio, cfg.max_image_tokens
    aspect = height / width
    # NOTE: a grid of w columns and h = aspect * w rows costs h * (w + 1) + 2 tokens: solve for w
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    rows = cols * aspect
    if cols < 1.0:  # far taller than wide: one column
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:  # far wider than tall: one row
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, cfg: V41VisionConfig) -> tuple[int, int, int, int]:
    """(n_llm_h, n_llm_w, height_px, width_px) of an image of `width` x `height` pixels: the size it is fitted into
    (multiples of `patch_size`) and its aligner grid. A pure function of its arguments."""
    p = cfg.patch_size
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = height * cfg.max_wh_ratio
    if 0 < width * height < cfg.min_pixels:
        up = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * up), int(height * up)
    h_px, w_px = math.ceil(height / p) * p, math.ceil(width / p) * p
    n_h, n_w = _llm_grid(h_px, w_px, cfg)
    if num_image_tokens(n_h, n_w) > cfg.max_image_tokens:
        h_px, w_px = _shrunk_size(height, width, cfg)
        n_h, n_w = _llm_grid(h_px, w_px, cfg)
    return n_h, n_w, h_px, w_px


# --------------------------------------------------------------------------- pixels


@dataclass(frozen=True)
class V41Patches:
    """One preprocessed image as the tower takes it."""

    patches: torch.Tensor  # [n_vit_h * n_vit_w, 3, p, p] float32 (bfloat16-exact values)
    """The patches in reading order."""
    n_vit_h: int
    """Patch rows."""
    n_vit_w: int
    """Patch columns."""

    @property
    def grid(self) -> tuple[int, int]:
        return self.n_vit_h, self.n_vit_w


def _image_bytes(image: Any) -> tuple[bytes, int | None, int | None]:
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), None, None
    if all(hasattr(image, a) for a in ("data", "width", "height")):
        return bytes(image.data), int(image.width), int(image.height)
    raise InvalidRequestError(f"an image must be a recipe ImageInfo or encoded bytes; got {type(image).__name__}",
                              field="image")


def preprocess(image: Any, cfg: V41VisionConfig) -> V41Patches:
    """recipe's `ImageInfo` (or encoded bytes) -> the tower's patches (module docstring, "Pixels").

    Raises `InvalidRequestError` (field "image") when the bytes do not decode or decode to another size than the
    `ImageInfo` states."""
    import numpy as np
    from PIL import Image, ImageOps, UnidentifiedImageError

    data, width, height = _image_bytes(image)
    try:
        with Image.open(io.BytesIO(data)) as img:
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InvalidRequestError(f"the image cannot be decoded ({len(data)} bytes): {e}", field="image") from None
    if width is not None and (rgb.width, rgb.height) != (width, height):
        raise InvalidRequestError(f"the image decodes to {rgb.width}x{rgb.height} but its ImageInfo says "
                                  f"{width}x{height}", field="image")
    p = cfg.patch_size
    _, _, h_px, w_px = plan_grid(rgb.width, rgb.height, cfg)
    if cfg.max_wh_ratio is not None and rgb.width >= cfg.max_wh_ratio * rgb.height:
        rgb = rgb.resize((w_px, h_px))
    else:
        rgb = ImageOps.pad(rgb, (w_px, h_px), color=PAD_GREY)
    x = torch.from_numpy(np.asarray(rgb, dtype=np.float32)).permute(2, 0, 1) / 255  # [3, H, W]
    x = ((x - 0.5) / 0.5).to(torch.bfloat16).float()  # NOTE: the official tower input is bfloat16
    n_h, n_w = h_px // p, w_px // p
    patches = x.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, p, p)
    return V41Patches(patches.contiguous(), n_h, n_w)


# --------------------------------------------------------------------------- the ViT


class VisionRMSNorm(nn.Module):
    """RMSNorm computed in float32 (weight held in float32 by the loader's choice of dtype)."""

    def __init__(self, dim: int, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


@lru_cache(maxsize=16)
def _rope_table(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, head_dim // 2] (float32, CPU) of the patch grid in reading order."""
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)  # [half / 2]
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    angles = torch.cat([rows[:, None] * inv, cols[:, None] * inv], dim=-1)  # [N, half]
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, N, heads, head_dim]; cos/sin [N, head_dim / 2] -> rotate-half RoPE in float32, cast back."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: V41VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [B, N, 3, p, p] -> [B, N, C]."""
        return self.proj(patches.flatten(2).to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image's patches with 2D RoPE on q and k."""

    def __init__(self, cfg: V41VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]."""
        B, N, C = x.shape
        q, k, v = (t.view(B, N, self.num_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B, h, N, d]
        return self.wo(o.transpose(1, 2).reshape(B, N, C))


class VisionMLP(nn.Module):
    """SwiGLU without biases: `w1` -> (gate, up) -> silu(gate) * up -> `w2`."""

    def __init__(self, cfg: V41VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: V41VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.norm2 = VisionRMSNorm(cfg.hidden_size)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patch embedding, `num_hidden_layers` blocks and a final RMSNorm (checkpoint prefix `vision.`)."""

    def __init__(self, cfg: V41VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = VisionRMSNorm(cfg.hidden_size)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [B, n_h * n_w, 3, p, p] (equal grids) -> features [B, n_h * n_w, C]."""
        if patches.dim() != 5 or patches.shape[1] != n_h * n_w:
            raise ValueError(f"patches must be [B, {n_h * n_w}, 3, p, p] for a {n_h}x{n_w} grid; got "
                             f"{tuple(patches.shape)}")
        x = self.patch_embed(patches)
        cos, sin = (t.to(x.device) for t in _rope_table(n_h, n_w, self.cfg.head_dim, float(self.cfg.rope_theta)))
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """r x r patch blocks -> one LM row each: unfold, `w1`, exact GELU, `w2` (checkpoint prefix `aligner.`)."""

    def __init__(self, cfg: V41VisionConfig, lm_hidden_size: int) -> None:
        super().__init__()
        self.r = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.r**2, lm_hidden_size)
        self.w2 = nn.Linear(lm_hidden_size, lm_hidden_size)

    def forward(self, x: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """x [B, n_h * n_w, C] -> [B, ceil(n_h / r) * ceil(n_w / r), lm_hidden] (blocks in reading order)."""
        B, _, C = x.shape
        r = self.r
        grid = x.view(B, n_h, n_w, C)
        grid = F.pad(grid, (0, 0, 0, -n_w % r, 0, -n_h % r))  # zero features right and bottom
        gh, gw = grid.shape[1] // r, grid.shape[2] // r
        blocks = grid.view(B, gh, r, gw, r, C).permute(0, 1, 3, 5, 2, 4)  # [B, gh, gw, C, dy, dx]
        return self.w2(F.gelu(self.w1(blocks.reshape(B, gh * gw, C * r * r))))


# --------------------------------------------------------------------------- the tower


class V41VisionTower(nn.Module):
    """ViT + aligner + the span's learned rows: preprocessed images -> LM input embeddings of each image span.

    The engine-facing interface (`engine.engine.Engine`, the vision stage's `vision_worker.core.tower_encoder`):
    `preprocess(image)`, `image_token_count(width, height)`, `encode([V41Patches])`, `dtype`, `device`,
    `lm_hidden_size`, `config`. `DeepseekV41ForCausalLM` of a checkpoint with a `vision_config` registers these
    same modules and rows at its top level (their checkpoint names) and holds this object as `image_encoder`;
    `load_tower` loads it alone for the vision stage.
    """

    def __init__(self, config: V41VisionConfig, lm_hidden_size: int, max_batch_size: int = 8) -> None:
        super().__init__()
        self.config = config
        self.lm_hidden_size = lm_hidden_size
        self.max_batch_size = max_batch_size
        """Most images of one grid encoded in one ViT forward (bounds activation memory)."""
        self.vision = ViT(config)
        self.aligner = Aligner(config, lm_hidden_size)
        self.image_start = nn.Parameter(torch.zeros(lm_hidden_size))
        self.image_end = nn.Parameter(torch.zeros(lm_hidden_size))
        self.image_newline = nn.Parameter(torch.zeros(lm_hidden_size))

    @property
    def dtype(self) -> torch.dtype:
        return self.aligner.w2.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.aligner.w2.weight.device

    def image_token_count(self, width: int, height: int) -> int:
        """LM positions of a preprocessed `width` x `height` image (`plan_grid`)."""
        n_h, n_w, _, _ = plan_grid(int(width), int(height), self.config)
        return num_image_tokens(n_h, n_w)

    def preprocess(self, image: Any) -> V41Patches:
        """recipe's `ImageInfo` -> patches (`preprocess`)."""
        return preprocess(image, self.config)

    def forward(self, patches: torch.Tensor, n_vit_h: int, n_vit_w: int) -> torch.Tensor:
        """patches [B, n_vit_h * n_vit_w, 3, p, p] -> span embeddings [B, 2 + n_llm_h * (n_llm_w + 1), lm_hidden]."""
        r = self.config.downsample_ratio
        rows = self.aligner(self.vision(patches.to(self.device), n_vit_h, n_vit_w), n_vit_h, n_vit_w)
        B, H = rows.shape[0], self.lm_hidden_size
        n_h, n_w = -(-n_vit_h // r), -(-n_vit_w // r)
        newline = self.image_newline.to(rows.dtype).view(1, 1, 1, H).expand(B, n_h, 1, H)
        body = torch.cat([rows.view(B, n_h, n_w, H), newline], dim=2).reshape(B, n_h * (n_w + 1), H)
        start = self.image_start.to(rows.dtype).view(1, 1, H).expand(B, 1, H)
        end = self.image_end.to(rows.dtype).view(1, 1, H).expand(B, 1, H)
        return torch.cat([start, body, end], dim=1)

    @torch.inference_mode()
    def encode(self, images: list[V41Patches]) -> list[torch.Tensor]:
        """Blocks while encoding: one `[num_tokens, lm_hidden]` span per image (tower dtype and device), in order;
        images of one grid share a forward (up to `max_batch_size`)."""
        out: list[torch.Tensor | None] = [None] * len(images)
        by_grid: dict[tuple[int, int], list[int]] = {}
        for i, im in enumerate(images):
            if not isinstance(im, V41Patches):
                raise TypeError(f"image {i}: V4.1's tower takes V41Patches (`preprocess`), got {type(im).__name__}")
            by_grid.setdefault(im.grid, []).append(i)
        for (n_h, n_w), idx in by_grid.items():
            for a in range(0, len(idx), self.max_batch_size):
                chunk = idx[a:a + self.max_batch_size]
                batch = torch.stack([images[i].patches for i in chunk]).to(self.device, self.dtype)
                emb = self(batch, n_h, n_w)
                for j, i in enumerate(chunk):
                    out[i] = emb[j]
        return out  # type: ignore[return-value]


def load_tower(path, config, dtype: torch.dtype, device) -> V41VisionTower:
    """Blocks while reading: the tower alone from V4.1 checkpoint `path` (only its tensors are read; BF16 as
    published, cast to `dtype`, the RMSNorm weights kept float32). `config`: the checkpoint's `V41Config`.
    Raises ValueError naming a missing, unexpected or misshapen tensor."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    path = Path(path)
    if config.vision is None:
        raise ValueError(f"checkpoint {path} has no vision tower (no `vision_config` in config.json).")
    tower = V41VisionTower(config.vision, config.hidden_size)
    index = path / "model.safetensors.index.json"
    weight_map = (json.loads(index.read_text())["weight_map"] if index.is_file()
                  else dict.fromkeys(_keys(path / "model.safetensors"), "model.safetensors"))
    names = sorted(n for n in weight_map if n.startswith(VISION_PREFIXES))
    state = tower.state_dict()
    missing, unexpected = sorted(set(state) - set(names)), sorted(set(names) - set(state))
    if missing or unexpected:
        raise ValueError(f"{path}: the vision tensors do not match `vision_config`: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    loaded = {}
    for file in sorted({weight_map[n] for n in names}):
        with safe_open(str(path / file), framework="pt") as f:
            for n in names:
                if weight_map[n] == file:
                    loaded[n] = f.get_tensor(n)
    for n, t in loaded.items():
        if tuple(t.shape) != tuple(state[n].shape):
            raise ValueError(f"{path}: {n} has shape {list(t.shape)}, `vision_config` gives {list(state[n].shape)}")
        loaded[n] = t.to(torch.float32 if n.endswith("norm.weight") or ".norm" in n else dtype)
    tower.load_state_dict(loaded, strict=True, assign=True)
    return tower.to(device).eval().requires_grad_(False)


def _keys(file) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())
