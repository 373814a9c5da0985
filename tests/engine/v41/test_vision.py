"""DeepSeek-V4.1's vision tower (`engine.models.vision_v41`) against the test-only reference written from the
official `inference/vision.py` / `image_processor.py` (tests/engine/v41/vision_reference.py), on random weights,
with recipe's `OpenCvImagePreprocessor` in front; the published layout of the tower's tensors; the paged engine
with image spans (`LLM.generate` with `multi_modal_data`) against `forward_full` with the tower's embeddings.
Tiny random models, float32, CPU."""

from __future__ import annotations

import io
import json

import deepseek_recipe as recipe
import pytest
import torch

from deepinfer.engine.config import V41VisionConfig
from deepinfer.engine.images import image_token_count as recipe_token_count
from deepinfer.engine.models.vision_v41 import V41Patches, V41VisionTower, num_image_tokens, plan_grid
from deepinfer.engine.testing.make_checkpoint import TINY_V41_VISION_CONFIG, make_checkpoint
from tests.engine.v41.vision_reference import Reference, load_image, plan_image_grid

pytest.importorskip("PIL")

PLACEHOLDER = 129279
IMAGE_TOKEN = 129264


def png(color, size=(64, 64), shape="circle") -> bytes:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(im)
    if shape == "circle":
        draw.ellipse((4, 4, size[0] - 4, size[1] - 4), fill=color)
    else:
        draw.rectangle((2, 2, size[0] // 2, size[1] - 2), fill=color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def recipe_info(data: bytes) -> recipe.ImageInfo:
    """recipe's preprocessing, as the vision stage runs it (`engine.images.ImageResolver`)."""
    return recipe.OpenCvImagePreprocessor().preprocess(data, recipe.PreprocessOptions("high", 2048, 512))


def raw_info(data: bytes) -> recipe.ImageInfo:
    """An `ImageInfo` of the bytes as they are (no recipe resize): grids recipe's sizes never give."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return recipe.ImageInfo(data, im.width, im.height)


def random_tower(vc: dict, lm_hidden: int = 64, seed: int = 0) -> V41VisionTower:
    tower = V41VisionTower(V41VisionConfig.from_hf_dict(vc), lm_hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return tower.eval()


VC = dict(TINY_V41_VISION_CONFIG)
IMAGES = {
    "small square (upscaled by recipe)": (recipe_info, png((255, 0, 0))),
    "wide": (recipe_info, png((0, 0, 255), (300, 90), "rect")),
    "tall": (recipe_info, png((0, 160, 0), (70, 260))),
    "grid not a multiple of 3": (raw_info, png((200, 100, 0), (600, 560), "rect")),
    "over max_image_tokens": (raw_info, png((20, 20, 220), (1400, 900))),
}


@pytest.fixture(scope="module")
def tower():
    return random_tower(VC)


@pytest.mark.parametrize("name", list(IMAGES))
def test_tower_equals_the_reference(tower, name):
    """Preprocessing (patches bit-exact), the token count (= recipe's V4.1 specification) and the span's rows."""
    make_info, data = IMAGES[name]
    info = make_info(data)
    ref_patches, _, _, n_llm_h, n_llm_w = load_image(info.data, VC)
    got = tower.preprocess(info)
    assert isinstance(got, V41Patches)
    assert torch.equal(got.patches, ref_patches.float())
    n = tower.image_token_count(info.width, info.height)
    assert n == num_image_tokens(n_llm_h, n_llm_w)
    if make_info is recipe_info:
        assert n == recipe_token_count(info)
    if n > 400:  # NOTE: the shrunk image's pixels are compared above; its ~9000-patch ViT pass is too slow for CI
        return
    want, _, types = Reference(VC, tower.state_dict()).span(info.data)
    emb = tower.encode([got])[0]
    assert emb.shape == want.shape == (types.numel(), 64)
    torch.testing.assert_close(emb, want, rtol=1e-5, atol=1e-5)


def test_grids_and_batching(tower):
    """Non-multiple-of-3 grids pad the aligner's input; equal grids share a forward and give the same rows."""
    a, b = tower.preprocess(raw_info(png((200, 100, 0), (600, 560)))), tower.preprocess(raw_info(png((0, 9, 9), (600, 560))))
    assert (a.n_vit_h % 3, a.n_vit_w % 3) != (0, 0)
    together = tower.encode([a, b, a])
    alone = [tower.encode([x])[0] for x in (a, b)]
    torch.testing.assert_close(together[0], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[1], alone[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[0], together[1])


def test_resize_plan_matches_the_reference_and_recipe():
    cfg = V41VisionConfig.from_hf_dict(VC)
    g = torch.Generator().manual_seed(1)
    sizes = [(1, 1), (544, 544), (546, 546), (2048, 1536), (640, 480), (100, 2000)]
    sizes += [tuple(int(v) for v in torch.randint(1, 2049, (2,), generator=g)) for _ in range(300)]
    for w, h in sizes:
        n_h, n_w, h_px, w_px = plan_grid(w, h, cfg)
        assert (n_h, n_w, h_px, w_px) == plan_image_grid(w, h, VC), (w, h)
        assert num_image_tokens(n_h, n_w) <= cfg.max_image_tokens
    # recipe's own count (what the entrypoint expands placeholders to) agrees on what its preprocessor emits
    for size in [(64, 64), (300, 90), (70, 260), (1000, 700), (2000, 600), (1800, 1800), (1296, 14), (6, 968)]:
        info = recipe_info(png((1, 2, 3), size, "rect"))
        assert num_image_tokens(*plan_grid(info.width, info.height, cfg)[:2]) == recipe_token_count(info), size


def test_config_checks():
    assert V41VisionConfig.from_hf_dict({"model_type": "deepseek_v41_vision"}).hidden_size == 1024  # Flash defaults
    with pytest.raises(ValueError, match="multiple of 4"):
        V41VisionConfig.from_hf_dict({**VC, "hidden_size": 36, "num_attention_heads": 6})
    with pytest.raises(ValueError, match="does not implement"):
        V41VisionConfig.from_hf_dict({**VC, "vision_use_head": True})
    with pytest.raises(ValueError, match="deepseek_v41_vision"):
        V41VisionConfig.from_hf_dict({**VC, "model_type": "siglip_vision_model"})


# ------------------------------------------------------------------ the published checkpoint and the engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41_vision"), format="published-v41", seed=7, vision=True)


def test_published_layout_of_the_tower(ckpt):
    from safetensors import safe_open

    from deepinfer.engine.loader import load_vision_tower
    from deepinfer.engine.models.deepseek_v41 import load_published

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for file in set(index.values()):
        with safe_open(str(ckpt / file), framework="pt") as f:
            dtypes.update({k: f.get_slice(k).get_dtype() for k in f.keys()})
    vision = {n for n in dtypes if n.startswith(("vision.", "aligner.", "image_"))}
    per_block = {"norm1.weight", "attn.wqkv.weight", "attn.wqkv.bias", "attn.wo.weight", "attn.wo.bias",
                 "norm2.weight", "mlp.w1.weight", "mlp.w2.weight"}
    expected = {f"vision.blocks.{i}.{n}" for i in range(VC["num_hidden_layers"]) for n in per_block}
    expected |= {"vision.patch_embed.proj.weight", "vision.patch_embed.proj.bias", "vision.norm.weight",
                 "aligner.w1.weight", "aligner.w1.bias", "aligner.w2.weight", "aligner.w2.bias", "image_start",
                 "image_end", "image_newline"}
    assert vision == expected
    assert {dtypes[n] for n in vision} == {"BF16"}
    assert all(dtypes[f"layers.{i}.ffn.gate.bias_vl"] == "F32" for i in range(8))
    model = load_published(ckpt)
    tower = load_vision_tower(ckpt)
    assert model.image_encoder is not None and model.vision is model.image_encoder.vision
    lm_state, encoder_state = model.state_dict(), model.image_encoder.state_dict()
    for name, t in tower.state_dict().items():
        assert torch.equal(t.float(), lm_state[name].float()), name
        assert torch.equal(t.float(), encoder_state[name].float()), name  # the LM's tower shares its weights
    with pytest.raises(ValueError, match="missing"):
        raw = json.loads((ckpt / "config.json").read_text())
        raw["vision_config"]["num_hidden_layers"] = 3
        bad = ckpt.parent / "bad"
        bad.mkdir(exist_ok=True)
        for f in ckpt.iterdir():
            (bad / f.name).write_bytes(f.read_bytes()) if f.name != "config.json" else None
        (bad / "config.json").write_text(json.dumps(raw))
        load_vision_tower(bad)


def _reference_model(ckpt):
    from deepinfer.engine.models.deepseek_v41 import engram_token_map_for, load_published

    model = load_published(ckpt).eval()
    model.set_engram_token_map(engram_token_map_for(ckpt, model.config))
    return model


def _greedy_consistent(model, ids: list[int], out: list[int], embeds: torch.Tensor, mask: torch.Tensor,
                       replay_from: int | None = None) -> list[int]:
    """The full forward's argmax at each generated position, teacher-forced with the engine's tokens `out` (one
    causal pass: equal to `out` exactly when `out` is the full forward's greedy continuation)."""
    T = len(ids) + len(out) - 1
    e = torch.zeros(T, embeds.shape[-1])
    e[:len(embeds)] = embeds
    m = torch.zeros(T, dtype=torch.bool)
    m[:len(mask)] = mask
    with torch.no_grad():
        logits = model.forward_full(torch.tensor(ids + out[:-1]), m, image_embeds=e, replay_from=replay_from)
    return logits[-len(out):].argmax(-1).tolist()


def test_llm_generate_with_images_equals_forward_full(ckpt):
    """Image prompts through the paged engine (chunked prefill cutting the spans, decode rows), decoder replay off:
    greedy tokens equal the full forward's over each prefix with the tower's rows at the image positions (bias_vl
    routing and dead Engram tokens on both paths); swapping the images changes the output."""
    from deepinfer.engine import LLM, SamplingParams

    red, blue = png((255, 0, 0)), png((0, 0, 255), (90, 120), "rect")
    llm = LLM(str(ckpt), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, v41_decoder_replay=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [([5, 6, PLACEHOLDER, 7], [red]), ([9, PLACEHOLDER, 10, PLACEHOLDER, 12], [blue, red]),
               ([9, PLACEHOLDER, 10, PLACEHOLDER, 12], [red, blue]), ([13, 14, 15], [])]
    outs = llm.generate([{"prompt_token_ids": ids, **({"multi_modal_data": {"image": ims}} if ims else {})}
                         for ids, ims in prompts], params, use_tqdm=False)
    model = _reference_model(ckpt)
    tower = model.image_encoder
    for (ids, ims), out in zip(prompts, outs):
        infos = iter(recipe_info(d) for d in ims)
        full, rows, mask = [], [], []
        for t in ids:
            if t != PLACEHOLDER:
                full.append(t)
                rows.append(torch.zeros(1, 64))
                mask.append(False)
                continue
            span = tower.encode([tower.preprocess(next(infos))])[0]
            full += [IMAGE_TOKEN] * len(span)
            rows.append(span)
            mask += [True] * len(span)
        assert out.prompt_token_ids == full
        got = list(out.outputs[0].token_ids)
        assert _greedy_consistent(model, full, got, torch.cat(rows), torch.tensor(mask)) == got, ids
    assert outs[1].outputs[0].token_ids != outs[2].outputs[0].token_ids


def test_llm_generate_with_images_and_decoder_replay(ckpt):
    """Decoder-side bounded replay (on by default) with an image prompt: the image span lies before the tail, and
    the generated tokens equal the full forward's with the same replay (`replay_from = P - sliding_window`)."""
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(str(ckpt), max_model_len=512, max_num_seqs=2, max_num_batched_tokens=96)
    out = llm.generate([{"prompt_token_ids": [5, PLACEHOLDER, 6, 7, 8, 9, 10],
                         "multi_modal_data": {"image": [png((0, 200, 200))]}}],
                       SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    model = _reference_model(ckpt)
    tower = model.image_encoder
    span = tower.encode([tower.preprocess(recipe_info(png((0, 200, 200))))])[0]
    ids, got = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
    mask = torch.tensor([t == IMAGE_TOKEN for t in ids])
    embeds = torch.zeros(len(ids), 64)
    embeds[mask] = span
    P, W = len(ids), model.config.sliding_window
    assert _greedy_consistent(model, ids, got, embeds, mask, replay_from=P - W) == got


def test_bfloat16_engine_with_images_and_its_memory_plan(ckpt):
    """A bfloat16 engine encodes and serves an image prompt (the ViT's norms and RoPE in float32); the memory plan
    (`checkpoint_weight_bytes`) counts the tower as the loader holds it (BF16 weights, float32 RMSNorm weights)."""
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.fit import checkpoint_weight_bytes
    from deepinfer.engine.models.deepseek_v41 import dequantized_at_load, kept_float32

    llm = LLM(str(ckpt), max_model_len=512, max_num_seqs=2, dtype="bfloat16")
    tower = llm.engine.vision
    assert tower.dtype == torch.bfloat16 and tower.vision.blocks[0].norm1.weight.dtype == torch.float32
    held = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    wb = checkpoint_weight_bytes(ckpt, torch.bfloat16, dequantized_at_load, kept_float32)
    assert wb.expert_bytes + wb.other_bytes == held
    (o,) = llm.generate([{"prompt_token_ids": [5, PLACEHOLDER, 6], "multi_modal_data": {"image": [png((9, 9, 250))]}}],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(o.prompt_token_ids) == 186 and len(o.outputs[0].token_ids) == 2
    llm.shutdown()


@pytest.mark.gpu
def test_tower_on_cuda_matches_the_cpu(tower):
    """The tower on the GPU (float32: SDPA's CUDA kernels) equals the CPU's; bfloat16 stays close."""
    import copy

    images = [tower.preprocess(recipe_info(png((255, 0, 0)))), tower.preprocess(raw_info(png((1, 99, 0), (600, 560))))]
    want = tower.encode(images)
    gpu = copy.deepcopy(tower).to("cuda")
    for got, w in zip(gpu.encode(images), want):
        torch.testing.assert_close(got.cpu(), w, rtol=1e-4, atol=1e-4)
    half = copy.deepcopy(tower).to("cuda", torch.bfloat16)
    for n, p in half.named_parameters():
        if "norm" in n:
            p.data = p.data.float()
    for got, w in zip(half.encode(images), want):
        assert ((got.float().cpu() - w).abs().max() / w.abs().max()).item() < 0.05
