"""The vision tower (engine/models/vision.py) against the vision contract: transformers'
SiglipVisionModel as the ViT oracle, recipe's image token counts, the projector's layout, the
checkpoint format and loading."""

from __future__ import annotations

import io
import json
import random

import pytest
import torch

from deepinfer.engine.config import ModelConfig, VisionConfig
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.loader import CheckpointError, load_checkpoint, load_vision_tower
from deepinfer.engine.models.deepseek_v4_weights import checkpoint_spec, vision_checkpoint_spec
from deepinfer.engine.models.vision import VisionProjector, VisionTower, image_token_count, preprocess_pixels
from deepinfer.engine.testing.make_checkpoint import TINY_VISION_CONFIG, make_checkpoint

recipe = pytest.importorskip("deepseek_recipe")
Image = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny-vision"), preset="tiny", seed=3, vision=True)


@pytest.fixture(scope="module")
def tower(vision_ckpt):
    return load_vision_tower(str(vision_ckpt))


def _png(width: int, height: int, seed: int = 0) -> bytes:
    """A flat-colour PNG (fast to encode and preprocess at any size)."""
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (seed * 37 % 256, 90, 200)).save(buf, "PNG")
    return buf.getvalue()


def _webp_info(width: int, height: int, seed: int = 0):
    """A recipe-like ImageInfo of exactly width x height (lossless WEBP)."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buf, "WEBP", lossless=True)
    return recipe.ImageInfo(buf.getvalue(), width, height)


def _hf_siglip(tower: VisionTower):
    transformers = pytest.importorskip("transformers")
    vc = tower.config
    cfg = transformers.SiglipVisionConfig(
        hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size, num_hidden_layers=vc.num_hidden_layers,
        num_attention_heads=vc.num_attention_heads, num_channels=3, image_size=vc.image_size,
        patch_size=vc.patch_size, hidden_act=vc.hidden_act, layer_norm_eps=vc.layer_norm_eps,
        attention_dropout=0.0, vision_use_head=False, attn_implementation="eager",
    )
    hf = transformers.SiglipVisionModel(cfg).eval()
    prefix = "vision_tower.vision_model."
    state = {k.removeprefix(prefix): v for k, v in tower.state_dict().items()
             if k.startswith(prefix)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "embeddings.position_ids" for k in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("size", [(546, 546), (672, 448)])
def test_vit_equals_transformers_siglip(tower, size):
    info = _webp_info(*size, seed=size[0])
    pixels = preprocess_pixels(info, tower.config)  # [3, rows*42, cols*42]
    rows, cols = -(-size[1] // 42), -(-size[0] // 42)
    assert pixels.shape == (3, rows * 42, cols * 42)
    if size == (672, 448):
        assert pixels.shape == (3, 462, 672) and bool((pixels[:, 448:] == 0).all())  # zero-padded at the bottom
    hf = _hf_siglip(tower)
    with torch.no_grad():
        want = hf(pixel_values=pixels[None], interpolate_pos_encoding=True).last_hidden_state[0]
        got = tower.vision_tower(pixels[None])[0]
    assert got.shape == want.shape == (9 * rows * cols, tower.config.hidden_size)
    assert (got - want).abs().max().item() <= 1e-4


def test_pixels_follow_the_contract():
    info = _webp_info(50, 30, seed=1)
    cfg = VisionConfig(image_mean=(0.4, 0.5, 0.6), image_std=(0.2, 0.25, 0.5))
    px = preprocess_pixels(info, cfg)
    assert px.shape == (3, 42, 84)
    raw = torch.tensor(__import__("numpy").array(Image.open(io.BytesIO(info.data)).convert("RGB")))
    want = (raw.permute(2, 0, 1).float() / 255 - torch.tensor([0.4, 0.5, 0.6])[:, None, None]) \
        / torch.tensor([0.2, 0.25, 0.5])[:, None, None]
    assert torch.equal(px[:, :30, :50], want)
    assert bool((px[:, 30:] == 0).all()) and bool((px[:, :, 50:] == 0).all())
    assert torch.equal(preprocess_pixels((info.data, 50, 30), cfg), px)
    with pytest.raises(InvalidRequestError, match="cannot be decoded"):
        preprocess_pixels(recipe.ImageInfo(b"not an image", 50, 30))
    with pytest.raises(InvalidRequestError, match="decodes to 50x30"):
        preprocess_pixels(recipe.ImageInfo(info.data, 60, 30))


def test_image_token_count_equals_recipe():
    rng = random.Random(0)
    pre = recipe.OpenCvImagePreprocessor()
    sizes = [(1, 1), (546, 546), (547, 546), (2000, 1000), (1000, 2000), (84, 42), (43, 1999)]
    sizes += [(rng.randint(1, 2000), rng.randint(1, 2000)) for _ in range(20)]
    checked = 0
    for i, (w, h) in enumerate(sizes):
        for detail in ("high", "low"):
            info = pre.preprocess(_png(w, h, seed=i), recipe.PreprocessOptions(detail, 2048, 512))
            want = recipe.MultiModalData([info]).image_token_adjustment() + 1
            assert image_token_count(info.width, info.height) == want, (w, h, detail, info.width, info.height)
            checked += 1
    assert checked == 2 * len(sizes)
    assert image_token_count(546, 546) == 184 and image_token_count(672, 448) == 2 + 11 * 17


def test_projector_layout_and_names():
    torch.manual_seed(0)
    cfg = VisionConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, projector_hidden_size=12)
    proj = VisionProjector(cfg, 10).eval()
    assert sorted(proj.state_dict()) == sorted(
        ["norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
         "image_begin", "image_newline", "image_end"])
    rows, cols, C = 2, 3, 8
    feats = torch.randn(2, 3 * rows * 3 * cols, C)  # [B, (3r)*(3c), C]
    out = proj(feats, rows, cols)
    assert out.shape == (2, 2 + rows * (cols + 1), 10)
    # one image alone = the same image in a batch (to rounding: the two run GEMMs of different shapes)
    assert torch.allclose(proj(feats[1], rows, cols), out[1], atol=1e-6, rtol=1e-5)
    # reference: token (r, c) = MLP(LN(concat of patches (3r+dy, 3c+dx), (dy, dx) row-major))
    grid = feats[0].view(3 * rows, 3 * cols, C)
    for r in range(rows):
        for c in range(cols):
            merged = torch.cat([grid[3 * r + dy, 3 * c + dx] for dy in range(3) for dx in range(3)])
            want = proj.fc2(torch.nn.functional.gelu(proj.fc1(proj.norm(merged)), approximate="tanh"))
            assert torch.allclose(out[0, 1 + r * (cols + 1) + c], want, atol=1e-6)
        assert torch.equal(out[0, 1 + r * (cols + 1) + cols], proj.image_newline.detach())
    assert torch.equal(out[0, 0], proj.image_begin.detach())
    assert torch.equal(out[0, -1], proj.image_end.detach())


def test_tower_encode_batches_by_size_and_keeps_order(tower):
    infos = [_webp_info(546, 546, 1), _webp_info(100, 60, 2), _webp_info(546, 546, 3)]
    pixels = [preprocess_pixels(i, tower.config) for i in infos]
    outs = tower.encode(pixels)
    assert [o.shape[0] for o in outs] == [image_token_count(i.width, i.height) for i in infos]
    assert all(o.shape[1] == 64 for o in outs)
    for px, o in zip(pixels, outs):
        assert torch.allclose(tower.encode([px])[0], o, atol=1e-5)


def test_vision_checkpoint_format_and_loading(vision_ckpt, tower):
    config = ModelConfig.from_json_file(vision_ckpt)
    assert config.vision == VisionConfig(**TINY_VISION_CONFIG) and config.image_token_id == 129264
    spec = checkpoint_spec(config)
    vspec = vision_checkpoint_spec(config)
    assert set(vspec) <= set(spec)
    assert set(tower.state_dict()) == set(vspec)
    assert "vision_tower.vision_model.embeddings.patch_embedding.weight" in vspec
    assert "vision_tower.vision_model.encoder.layers.1.self_attn.q_proj.weight" in vspec
    assert vspec["vision_projector.image_newline"].shape == (config.hidden_size,)
    model, _ = load_checkpoint(vision_ckpt)
    assert model.vision is not None
    assert set(model.state_dict()) == set(spec)
    for name, t in tower.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert model.vision.vision_projector is model.vision_projector


def test_vision_checkpoint_missing_tensors_fails_clearly(vision_ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(vision_ckpt / "model.safetensors")
    del state["vision_projector.image_end"]
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((vision_ckpt / "config.json").read_text())
    with pytest.raises(CheckpointError, match="vision_projector.image_end"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="vision_projector.image_end"):
        load_vision_tower(str(tmp_path))
    # transformers-5 SiglipVisionModel keys (no `vision_model.` level) are accepted too
    state = load_file(vision_ckpt / "model.safetensors")
    renamed = {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in state.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    assert load_vision_tower(str(tmp_path)).state_dict().keys() == vision_checkpoint_spec(
        ModelConfig.from_json_file(vision_ckpt)).keys()


def test_vision_config_validation():
    raw = json.loads(json.dumps(TINY_VISION_CONFIG))
    with pytest.raises(ValueError, match="42 px per token"):
        VisionConfig.from_hf_dict({**raw, "patch_size": 7})
    with pytest.raises(ValueError, match="vision_use_head"):
        VisionConfig.from_hf_dict({**raw, "vision_use_head": True})
    with pytest.raises(ValueError, match="does not implement"):
        VisionConfig.from_hf_dict({**raw, "spatial_merge": 2})
    ok = VisionConfig.from_hf_dict({**raw, "model_type": "siglip_vision_model", "transformers_version": "5.24.0"})
    assert ok.pixels_per_token == 42 and ok.position_grid_size == 39
