"""V4.1's config.json: the published layout parses into `V41Config` with its layer roles; anything the
reference would compute wrongly is refused naming the field; V4's `ModelConfig` and the loader refuse V4.1
saying what is not served yet."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.config import ModelConfig, V41Config
from deepinfer.engine.loader import CheckpointError, read_checkpoint_config
from tests.engine.v41.configs import flash_config, tiny_config


def test_flash_config_parses():
    c = V41Config.from_hf_dict(flash_config())
    assert (c.num_hidden_layers, c.hidden_size, c.head_dim, c.rope_head_dim) == (40, 5120, 512, 64)
    assert len(c.compress_ratios) == 43 and c.compress_ratios[2] == 2 and c.compress_ratios[20] == 1
    assert c.rms_norm_eps == 1e-20 and c.image_token_id == 129264 and c.eos_token_ids == (1,)
    assert c.rope_main.rope_type == "default" and c.rope_main.rope_theta == 10000
    rc = c.rope_compress
    assert (rc.rope_type, rc.rope_theta, rc.factor, rc.original_max_position_embeddings, rc.attention_factor) == (
        "yarn", 160000, 16, 65536, 1.0)
    assert c.quantization_config["weight_block_size"] == [32, 32]
    # layer roles (docs/V4_1.md §2)
    assert [c.kv_source_of(i) for i in (0, 1, 2, 7, 8, 19, 20, 39)] == [None, None, 2, 2, 8, 14, 20, 20]
    assert [c.index_source_of(i) for i in (3, 21, 24, 27, 39)] == [2, 20, 24, 24, 36]
    assert [c.uses_candidates(i) for i in (14, 20, 21, 24, 36)] == [False, False, False, True, True]
    assert c.unsupported() == []  # everything is served now, DSpark stages included (docs/V4_1.md §12, §13)


def test_flat_layout_and_reference_spellings():
    raw = tiny_config()
    flat = {**raw.pop("text_config"), **raw}
    flat["engram_pad_id"] = flat.pop("engram_pad_token_id")
    assert V41Config.from_hf_dict(flat) == V41Config.from_hf_dict(tiny_config())


def _mutated(path: str, value):
    raw = flash_config()
    target = raw["text_config"]
    keys = path.split(".")
    for k in keys[:-1]:
        target = target[k]
    if value is _DELETE:
        del target[keys[-1]]
    else:
        target[keys[-1]] = value
    return raw


_DELETE = object()


@pytest.mark.parametrize(
    "path,value,match",
    [
        ("kv_source_layer_ids", [1, 8, 14, 20], "compress_ratio is 0"),
        ("index_source_layer_ids", [8, 14, 20, 24], "KV source 2 is not in `index_source_layer_ids`"),
        ("kv_source_layer_ids", [8, 14, 20], "layer 2 reads compressed KV at ratio 2"),
        ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20, None),  # no DSpark entries: accepted
        ("compress_ratios", [0, 0] + [2] * 19 + [1] * 19 + [0, 0, 0], "layer 21 reads compressed KV at ratio 1"),
        ("compress_ratios", [0] * 41, "`compress_ratios` has 41 entries"),
        ("compress_ratios", [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 1], "DSpark stages must be 0"),
        ("candidate_source_layer_id", 21, "is not an index source"),
        ("candidate_topk_blocks", 10, "may keep fewer than index_topk"),
        ("engram_num_embeddings", [384006168, 384016681], "`engram_num_embeddings` for layer 14"),
        ("engram_num_embeddings", [384006168], "one per Engram layer"),
        ("engram_layer_ids", [1, 1], "`engram_layer_ids` must be distinct"),
        ("num_key_value_heads", 8, "`num_key_value_heads`"),
        ("model_type", "deepseek_v4", "text_config.model_type"),
        ("yarn_magic", 1, r"fields deepinfer does not implement: \['yarn_magic'\]"),
        ("qk_rope_head_dim", 65, "`qk_rope_head_dim`"),
    ],
)
def test_refusals_name_the_field(path, value, match):
    raw = _mutated(path, value)
    if match is None:
        V41Config.from_hf_dict(raw)
        return
    with pytest.raises(ValueError, match=match):
        V41Config.from_hf_dict(raw)


def test_candidate_source_after_a_kv_source_is_refused():
    raw = flash_config()
    raw["text_config"]["candidate_source_layer_id"] = 14
    with pytest.raises(ValueError, match="a KV source follows `candidate_source_layer_id`"):
        V41Config.from_hf_dict(raw)


def test_v4_parser_and_loader_refuse_v41(tmp_path):
    with pytest.raises(ValueError, match=r"DeepSeek-V4.1.*V41Config"):
        ModelConfig.from_hf_dict(flash_config())
    (tmp_path / "config.json").write_text(json.dumps(flash_config()))
    assert isinstance(read_checkpoint_config(tmp_path)[0], V41Config)  # Flash's config is served as a whole now
    bad = flash_config()
    bad["text_config"]["kv_source_layer_ids"] = [1]
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="kv_source_layer_ids"):
        read_checkpoint_config(tmp_path)


def test_flash_compressed_kv_bytes_per_token():
    from deepinfer.engine.models.deepseek_v41 import compressed_kv_bytes_per_token

    assert compressed_kv_bytes_per_token(V41Config.from_hf_dict(flash_config())) == 890
