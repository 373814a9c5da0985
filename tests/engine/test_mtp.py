"""The MTP layer (engine/models/mtp.py): its names, its forward against a plain reference, its window cache.

The reference spells out the MTP-specific math from its description (enorm/e_proj of the next token's
embedding, hnorm/h_proj of the main streams, summed, the block, hc_head, norm, the shared head) and
runs the block through transformers' `DeepseekV4DecoderLayer` (the oracle of the main model's layers),
loaded with the `mtp.0` block tensors by transformers' own loader.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.cache.layout import default_block_size
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.loader import load_checkpoint, scan_checkpoint
from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.engine.models.deepseek_v4_weights import checkpoint_spec, mtp_checkpoint_spec
from deepinfer.engine.models.mtp import mtp_layer_config
from deepinfer.engine.testing.make_checkpoint import random_weights
from deepinfer.engine.testing.presets import PRESETS

SLIDING = "sliding_attention"


def _tiny_config() -> tuple[dict, ModelConfig]:
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    return hf, ModelConfig.from_hf_dict(hf)


def _mtp_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.0.*` tensors: the one-layer block drawn like a checkpoint's layer, plus its own pieces."""
    one = random_weights(mtp_layer_config(config), seed=seed)
    out = {"mtp.0." + k.removeprefix("model.layers.0."): v for k, v in one.items() if k.startswith("model.layers.0.")}
    g = torch.Generator().manual_seed(seed + 1)
    H, hc = config.hidden_size, config.hc_mult
    for name in ("e_proj", "h_proj"):
        out[f"mtp.0.{name}.weight"] = torch.randn(H, H, generator=g) * H**-0.5
    for name in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{name}.weight"] = 1 + 0.1 * torch.randn(H, generator=g)
    out["mtp.0.hc_head_fn"] = torch.randn(hc, hc * H, generator=g) * (hc * H) ** -0.5
    out["mtp.0.hc_head_base"] = 0.5 * torch.randn(hc, generator=g)
    out["mtp.0.hc_head_scale"] = torch.rand(1, generator=g) + 0.5
    return out


@pytest.fixture(scope="module")
def tiny_model():
    hf, config = _tiny_config()
    model = DeepseekV4ForCausalLM(config)
    state = {**random_weights(config, seed=3), **_mtp_weights(config, seed=4)}
    assert set(model.state_dict()) == set(state)
    model.load_state_dict(state, strict=True)
    model.eval().requires_grad_(False).prepare_for_inference()
    return hf, config, model, state


def _main_streams(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, H], pre-hc_head streams [T, hc, H]) of the main model over `ids` from position 0."""
    config = model.config
    block_size = default_block_size(config.compress_rates.values())
    num_blocks = -(-len(ids) // block_size)
    cache = V4KVCache(config, num_blocks, block_size, 1)
    batch = ForwardBatch.build([ids], [SeqChunk(slot=0, block_table=list(range(num_blocks)), num_computed_tokens=0,
                                                num_new_tokens=len(ids))], logits="all")
    with torch.inference_mode():
        return model(batch, cache, return_streams=True)


def _mtp_batch(next_ids: list[int], start: int) -> ForwardBatch:
    return ForwardBatch.build([next_ids], [SeqChunk(slot=0, block_table=[], num_computed_tokens=start,
                                                    num_new_tokens=len(next_ids))], logits="all")


def test_state_dict_has_exactly_the_published_mtp_names(tiny_model):
    _, config, model, _ = tiny_model
    keys = set(model.state_dict())
    mtp = {k for k in keys if k.startswith("mtp.")}
    assert mtp == set(mtp_checkpoint_spec(config))
    assert keys - mtp == set(checkpoint_spec(config))
    no_mtp = DeepseekV4ForCausalLM(config, num_mtp_layers=0)
    assert no_mtp.mtp is None and set(no_mtp.state_dict()) == keys - mtp


def test_return_streams_costs_nothing_and_matches(tiny_model):
    _, _, model, _ = tiny_model
    ids = torch.randint(2, 512, (13,), generator=torch.Generator().manual_seed(0)).tolist()
    hidden, streams = _main_streams(model, ids)
    assert streams.shape == (13, model.config.hc_mult, model.config.hidden_size)
    m = model.model
    torch.testing.assert_close(m.norm(m.hc_head(streams)), hidden, rtol=0, atol=0)


def _hf_block(hf_config: dict, state: dict[str, torch.Tensor], tmp_path):
    """transformers' one-layer model holding the `mtp.0` block as its layer 0 (its loader maps the names)."""
    transformers = pytest.importorskip("transformers")
    one = {**hf_config, "num_hidden_layers": 1, "layer_types": [SLIDING], "mlp_layer_types": ["moe"],
           "num_nextn_predict_layers": 0, "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}
    extra = {"e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
             "hc_head_fn", "hc_head_base", "hc_head_scale"}
    tensors = {"model.layers.0." + k.removeprefix("mtp.0."): v for k, v in state.items()
               if k.startswith("mtp.0.") and k.removeprefix("mtp.0.") not in extra}
    tensors.update({k: v for k, v in state.items() if not k.startswith(("mtp.", "model.layers."))})
    (tmp_path / "config.json").write_text(json.dumps(one))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()


def _reference_mtp_logits(hf, state, streams, next_ids, eps) -> torch.Tensor:
    """Plain MTP forward from the description; the block is transformers' decoder layer."""
    from transformers.masking_utils import create_sliding_window_causal_mask

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    p = "mtp.0."
    ids = torch.tensor([next_ids])
    emb = state["model.embed_tokens.weight"][ids]  # [1, T, H]
    e = rms(emb, state[p + "enorm.weight"]) @ state[p + "e_proj.weight"].T
    h = rms(streams[None], state[p + "hnorm.weight"]) @ state[p + "h_proj.weight"].T  # [1, T, hc, H]
    x = e.unsqueeze(2) + h
    m = hf.model
    pos = torch.arange(len(next_ids))[None]
    mask = create_sliding_window_causal_mask(config=hf.config, inputs_embeds=emb, attention_mask=None, cache=None,
                                             position_ids=pos)
    pe = {k: m.rotary_emb(emb, position_ids=pos, layer_type=k) for k in ("main", "compress")}
    with torch.no_grad():
        x = m.layers[0](x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids, cache=None)
    x = x[0]  # [T, hc, H]
    flat = x.flatten(1)
    pre = torch.sigmoid((flat @ state[p + "hc_head_fn"].T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + eps)
                        * state[p + "hc_head_scale"] + state[p + "hc_head_base"]) + hf.config.hc_eps
    y = (pre.unsqueeze(-1) * x).sum(1)  # [T, H]
    return rms(y, state[p + "norm.weight"]) @ state["head.weight"].T


def test_mtp_forward_matches_plain_reference(tiny_model, tmp_path):
    hf_config, config, model, state = tiny_model
    T = 21  # beyond the sliding window (8): the block's window is exercised
    ids = torch.randint(2, 512, (T + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    _, streams = _main_streams(model, ids[:T])
    next_ids = ids[1:T + 1]
    layer = model.mtp[0]
    cache = layer.make_cache(num_slots=1)
    got = model.mtp_step(streams, _mtp_batch(next_ids, 0), cache)  # [T, vocab]
    hf = _hf_block(hf_config, state, tmp_path)
    ref = _reference_mtp_logits(hf, state, streams, next_ids, config.rms_norm_eps)
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * max(scale, 1.0)


def test_mtp_window_cache_chunked_equals_full(tiny_model):
    _, _, model, _ = tiny_model
    T = 24
    ids = torch.randint(2, 512, (T + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    _, streams = _main_streams(model, ids[:T])
    next_ids = ids[1:]
    layer = model.mtp[0]
    full = model.mtp_step(streams, _mtp_batch(next_ids, 0), layer.make_cache(1))
    cache = layer.make_cache(1)
    rows = [model.mtp_step(streams[:10], _mtp_batch(next_ids[:10], 0), cache)]
    for t in range(10, T):  # then one position at a time (decode rows)
        rows.append(model.mtp_step(streams[t:t + 1], _mtp_batch(next_ids[t:t + 1], t), cache))
    torch.testing.assert_close(torch.cat(rows), full, rtol=1e-5, atol=1e-5)


def test_builtin_model_mtp_loads_under_its_published_names():
    path = builtin_model_path()
    stored = {n for n in scan_checkpoint(path) if n.startswith("mtp.")}
    model, config = load_checkpoint(path)
    assert model.mtp is not None and len(model.mtp) == config.num_nextn_predict_layers == 1
    assert {k for k in model.state_dict() if k.startswith("mtp.")} == stored
    # the loaded MTP layer drafts: its greedy guess for the token after next is a real token id
    ids = [0, 100, 200, 300]
    _, streams = _main_streams(model, ids[:3])
    logits = model.mtp_step(streams, _mtp_batch(ids[1:4], 0), model.mtp[0].make_cache(1))
    assert logits.shape == (3, config.vocab_size) and torch.isfinite(logits).all()
    assert F.softmax(logits, -1).sum(-1).sub(1).abs().max() < 1e-4
