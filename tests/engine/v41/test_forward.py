"""The V4.1 full-sequence forward (engine/models/deepseek_v41.py) against the test-only reference written
from the official inference code (tests/engine/v41/reference.py), float32, on a tiny random model that has
every layer kind (tests/engine/v41/configs.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.config import V41Config
from deepinfer.engine.models import model_class
from deepinfer.engine.models.deepseek_v41 import DeepseekV41ForCausalLM
from deepinfer.engine.testing.make_checkpoint import TINY_V41_VISION_CONFIG, random_v41_model
from tests.engine.v41.configs import tiny_config
from tests.engine.v41.reference import Reference

T = 24


def random_model(cfg: V41Config, seed: int = 0) -> DeepseekV41ForCausalLM:
    """Every parameter random (engine.testing's `random_v41_model`), with a random Engram token map."""
    return random_v41_model(cfg, seed)


@pytest.fixture(scope="module")
def setup():
    cfg = V41Config.from_hf_dict(tiny_config())
    model = random_model(cfg)
    ref = Reference(cfg, model.state_dict(), model.engram_hash.token_map)
    ids = torch.randint(3, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    return cfg, model, ref, ids


def test_registered_beside_v4():
    assert model_class("deepseek_v41") is DeepseekV41ForCausalLM
    assert model_class("deepseek_v4").__name__ == "DeepseekV4ForCausalLM"


def test_built_under_a_device_context_every_tensor_is_there():
    """`random_v41_model(device="cuda")` builds under `with torch.device(...)`: a buffer made from numpy (the Engram
    multipliers) stayed on the host and the first CUDA prefill failed on a device mismatch."""
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(V41Config.from_hf_dict(tiny_config()))
    elsewhere = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
    assert not elsewhere


def test_state_dict_uses_published_names(setup):
    cfg, model, _, _ = setup
    names = set(model.state_dict())
    assert {"embed.weight", "norm.weight", "head.weight", "layers.0.hc_attn_fn", "layers.0.attn.attn_sink",
            "layers.0.ffn.gate.bias", "layers.0.ffn.experts.3.w2.weight", "layers.0.ffn.shared_experts.w1.weight",
            "layers.1.engram.embed.weight", "layers.1.engram.wkv.weight", "layers.1.engram.q_weight",
            "layers.2.attn.compressor.wgate.weight", "layers.2.attn.indexer.wk.weight",
            "layers.5.attn.compressor.wkv.weight", "layers.4.attn.indexer.weights_proj.weight"} <= names
    # only KV sources own compressors, only the ratio>1 ones a gate; only KV sources own index keys
    assert sorted(n for n in names if n.endswith("compressor.wkv.weight")) == [
        "layers.2.attn.compressor.wkv.weight", "layers.5.attn.compressor.wkv.weight"]
    assert [n for n in names if n.endswith("compressor.wgate.weight")] == ["layers.2.attn.compressor.wgate.weight"]
    assert sorted(n.split(".")[1] for n in names if n.endswith("indexer.wq_b.weight")) == ["2", "4", "5", "7"]
    assert sorted(n.split(".")[1] for n in names if n.endswith("indexer.wk.weight")) == ["2", "5"]
    assert not any("hc_head" in n or "tid2eid" in n or "bias_vl" in n for n in names)
    assert model.state_dict()["layers.4.engram.embed.weight"].shape == (138, 8)


def test_logits_match_reference(setup):
    cfg, model, ref, ids = setup
    with torch.no_grad():
        got = model.forward_full(ids)
        want = ref.forward(ids[None])[0]
    assert got.shape == (T, cfg.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_prefix_logits_are_causal(setup):
    """A prefix's logits equal the full sequence's at those positions (no position sees later tokens)."""
    _, model, _, ids = setup
    with torch.no_grad():
        full = model.forward_full(ids)
        part = model.forward_full(ids[:15])
    torch.testing.assert_close(part, full[:15], rtol=1e-5, atol=1e-5)


def test_image_mask_matches_reference():
    """Image-span tokens: the router's bias_vl (a checkpoint with a vision tower) and no Engram n-grams."""
    # NOTE: a tiny tower (a bare `vision_config` means Flash's 32-layer ViT, which the model would build)
    cfg = V41Config.from_hf_dict({**tiny_config(), "vision_config": TINY_V41_VISION_CONFIG})
    model = random_model(cfg, seed=3)
    assert "layers.0.ffn.gate.bias_vl" in model.state_dict()
    ref = Reference(cfg, model.state_dict(), model.engram_hash.token_map)
    ids = torch.randint(3, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(4))
    image = torch.zeros(T, dtype=torch.bool)
    image[6:11] = True
    with torch.no_grad():
        got = model.forward_full(ids, image_mask=image)
        want = ref.forward(ids[None], image_mask=image[None])[0]
        plain = model.forward_full(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got[6:], plain[6:])


def test_sources_are_reused_not_recomputed(setup):
    """Zeroing a consumer's would-be compressor changes nothing: layer 3 reads layer 2's entries, 6 reads 5's."""
    cfg, model, _, ids = setup
    assert model.layers[3].attn.compressor is None and model.layers[6].attn.indexer is None
    assert model.layers[4].attn.indexer is not None and not model.layers[4].attn.indexer.owns_k
    assert model.layers[7].attn.indexer.uses_candidates and model.layers[5].attn.indexer.is_candidate_source


def test_bounded_replay():
    """Decoder-side bounded replay: the layers after the last KV source (5) run over the last `sliding_window`
    tokens only. Exact while the prompt fits the window; beyond it the tail's logits differ (measured, not
    bounded: the first tail tokens lose part of their window in layers 6 and 7)."""
    cfg = V41Config.from_hf_dict(tiny_config())
    model = random_model(cfg)
    ids = torch.randint(3, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    W = cfg.sliding_window
    with torch.no_grad():
        short = ids[:W]
        torch.testing.assert_close(model.forward_full(short, bounded_replay=True), model.forward_full(short),
                                   rtol=0, atol=0)
        full = model.forward_full(ids)
        tail = model.forward_full(ids, bounded_replay=True)
    assert tail.shape == (W, cfg.vocab_size) and bool(tail.isfinite().all())
    assert not torch.equal(tail, full[-W:])  # layers 6 and 7 really ran on the tail alone
