"""Test-only reference of DeepSeek-V4.1's image path, written by us from reading DeepSeek's official
`inference/vision.py` (ViT, Aligner, 2D RoPE) and `inference/image_processor.py` (resize plan, `load_image`, the
span's token types) and the image merge of `inference/model.py` (`Transformer.merge_image_embeddings`) —
huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, revision dba1be0a40aa45a94ad051997016db3960a90277 (read through
vendored copies in the code index; docs/V4_1.md §14). It follows their structure step by step: one image at a time
without a batch dimension, the RoPE table built by stacking (row, column) positions against the inverse frequencies,
the aligner as zero padding plus `F.unfold`, the span assembled by token type (START, IMAGE, NEW_LINE, END).

It reads a tower's weights by their checkpoint names (`vision.*`, `aligner.*`, `image_start`, ...), so it can be
compared with `engine.models.vision_v41` on the same random parameters. Nothing here imports engine code.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F

TEXT = -1
IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)


# ------------------------------------------------------------------ image_processor.py


def num_image_tokens(n_llm_h, n_llm_w):
    return n_llm_h * (n_llm_w + 1) + 2


def llm_grid(best_height, best_width, patch_size, downsample_ratio):
    return (math.ceil((best_height // patch_size) / downsample_ratio),
            math.ceil((best_width // patch_size) / downsample_ratio))


def solve_resize_ratio(height, width, patch_size, downsample_ratio, max_n_token):
    r = height / width
    max_w = math.sqrt((max_n_token - 2) / r + 0.25) - 0.5
    max_h = max_w * r
    cell = patch_size * downsample_ratio
    if max_w < 1.0:
        return (max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / patch_size) * patch_size, math.floor(width * beta / patch_size) * patch_size


def plan_image_grid(width, height, vc):
    """vc: the `vision_config` dict. -> (n_llm_h, n_llm_w, best_height, best_width)."""
    p, r, max_tokens = vc["patch_size"], vc["downsample_ratio"], vc["max_image_tokens"]
    if vc.get("max_wh_ratio") is not None and width > height * vc["max_wh_ratio"]:
        width = height * vc["max_wh_ratio"]
    if 0 < width * height < vc["min_pixels"]:
        ratio = (vc["min_pixels"] / (width * height)) ** 0.5
        width, height = int(width * ratio), int(height * ratio)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    n_h, n_w = llm_grid(best_h, best_w, p, r)
    if num_image_tokens(n_h, n_w) > max_tokens:
        best_h, best_w = solve_resize_ratio(height, width, p, r, max_tokens)
        n_h, n_w = llm_grid(best_h, best_w, p, r)
        assert num_image_tokens(n_h, n_w) <= max_tokens
    return n_h, n_w, best_h, best_w


def load_image(data: bytes, vc):
    """Encoded image bytes -> (patches [N, 3, p, p] bfloat16, n_vit_h, n_vit_w, n_llm_h, n_llm_w)."""
    from PIL import Image, ImageOps

    p = vc["patch_size"]
    with Image.open(io.BytesIO(data)) as source:
        image = source.convert("RGB")
    n_llm_h, n_llm_w, best_h, best_w = plan_image_grid(image.width, image.height, vc)
    n_vit_h, n_vit_w = best_h // p, best_w // p
    if vc.get("max_wh_ratio") is not None and image.width >= vc["max_wh_ratio"] * image.height:
        image = image.resize((best_w, best_h))
    else:
        image = ImageOps.pad(image, (best_w, best_h), color=(127, 127, 127))
    x = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1) / 255
    x = ((x - 0.5) / 0.5).to(torch.bfloat16)
    patches = x.reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(n_vit_h * n_vit_w, 3, p, p)
    return patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w


def image_token_types(n_llm_h, n_llm_w):
    types = [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]
    return torch.tensor(types, dtype=torch.int64)


# ------------------------------------------------------------------ vision.py


def vision_cos_sin(n_h, n_w, dim, theta):
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    hpos = torch.arange(n_h).unsqueeze(1).expand(n_h, n_w)
    wpos = torch.arange(n_w).unsqueeze(0).expand(n_h, n_w)
    freqs = torch.stack([hpos, wpos], dim=-1).reshape(-1, 2, 1).float() * inv_freq
    freqs = freqs.flatten(1)
    return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)


def apply_rotary(x, cos, sin):
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def rmsnorm(x, weight, eps=1e-6):
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * x).to(dtype)


class Reference:
    """The official ViT + Aligner + span merge over a state dict of checkpoint names (float32)."""

    def __init__(self, vc, state_dict):
        self.vc = vc
        self.w = {k: v.float() for k, v in state_dict.items()}
        self.n_heads = vc["num_attention_heads"]
        self.dim = vc["hidden_size"]

    def linear(self, x, name, bias=True):
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias") if bias else None)

    def vit(self, patches, n_h, n_w):
        w, dim, heads = self.w, self.dim, self.n_heads
        hd = dim // heads
        x = self.linear(patches.float().flatten(1), "vision.patch_embed.proj")
        cos, sin = vision_cos_sin(n_h, n_w, dim // heads // 2, self.vc["rope_theta"])
        for i in range(self.vc["num_hidden_layers"]):
            p = f"vision.blocks.{i}."
            h = rmsnorm(x, w[p + "norm1.weight"])
            n = h.size(0)
            q, k, v = (t.view(n, heads, hd) for t in self.linear(h, p + "attn.wqkv").chunk(3, dim=-1))
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            x = x + self.linear(o.transpose(0, 1).reshape(n, -1), p + "attn.wo")
            h = rmsnorm(x, w[p + "norm2.weight"])
            gate, up = self.linear(h, p + "mlp.w1", bias=False).chunk(2, dim=-1)
            x = x + self.linear(F.silu(gate) * up, p + "mlp.w2", bias=False)
        return rmsnorm(x, w["vision.norm.weight"])

    def aligner(self, x, n_h, n_w):
        r = self.vc["downsample_ratio"]
        x = x.view(n_h, n_w, -1).permute(2, 0, 1)
        x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
        x = F.unfold(x.unsqueeze(0), r, stride=r).squeeze(0).transpose(0, 1)
        return self.linear(F.gelu(self.linear(x, "aligner.w1")), "aligner.w2")

    def span(self, data: bytes):
        """Encoded image bytes -> (the span's input rows [N, lm_hidden], the patches, token types [N])."""
        patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = load_image(data, self.vc)
        types = image_token_types(n_llm_h, n_llm_w)
        out = torch.zeros(types.numel(), self.w["image_start"].numel())
        out[types == IMAGE_START] = self.w["image_start"]
        out[types == IMAGE_END] = self.w["image_end"]
        out[types == IMAGE_NEW_LINE] = self.w["image_newline"]
        out[types == IMAGE] = self.aligner(self.vit(patches, n_vit_h, n_vit_w), n_vit_h, n_vit_w)
        return out, patches, types
