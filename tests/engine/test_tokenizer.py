"""Tokenizer and chat encoding from the checkpoint (engine/tokenizer.py): the checkpoint's own files when it
ships them, DeepSeek-V4's tokenizer and recipe's V4 encoding otherwise."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.tokenizer import (
    TemplateChatEncoding,
    checkpoint_chat_template,
    default_tokenizer_path,
    load_chat_encoding,
    load_tokenizer,
)

recipe = pytest.importorskip("deepseek_recipe")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "hello", "there", "be", "brief", "[UNK]"]


def _v4_checkpoint(tmp_path, **config_changes):
    """A V4 checkpoint directory (config only) without tokenizer or chat template files."""
    d = tmp_path / "v4"
    d.mkdir()
    config = json.loads((builtin_model_path() / "config.json").read_text())
    config.pop("deepinfer", None)  # like V4-Flash: no deepinfer section
    config.update(config_changes)
    (d / "config.json").write_text(json.dumps(config))
    return d


def _own_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # the special tokens are split off before it
    tok.add_special_tokens(["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"])
    return tok


def _conversation():
    return recipe.Conversation([recipe.SystemMessage("be brief"), recipe.UserMessage("hello there")],
                               thinking_mode=False)


def test_v4_defaults_without_checkpoint_files(tmp_path):
    ckpt = _v4_checkpoint(tmp_path)
    assert checkpoint_chat_template(ckpt) is None
    tok = load_tokenizer(ckpt)
    assert tok.get_vocab_size() == Tokenizer.from_file(str(default_tokenizer_path())).get_vocab_size()
    encoding = load_chat_encoding(ckpt)
    assert not isinstance(encoding, TemplateChatEncoding)
    expected = recipe.DeepseekV4Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(default_tokenizer_path())))
    assert encoding.encode(_conversation()) == expected.encode(_conversation())
    # the built-in model names its encoding (v4) and ships no template: recipe's encoding too
    assert not isinstance(load_chat_encoding(builtin_model_path()), TemplateChatEncoding)


@pytest.mark.parametrize("where", ["jinja", "tokenizer_config", "chat_template_json"])
def test_checkpoint_tokenizer_and_chat_template(tmp_path, where):
    ckpt = _v4_checkpoint(tmp_path)
    _own_tokenizer().save(str(ckpt / "tokenizer.json"))
    special = {"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    if where == "jinja":
        (ckpt / "chat_template.jinja").write_text(TEMPLATE)
        (ckpt / "tokenizer_config.json").write_text(json.dumps(special))
    elif where == "tokenizer_config":
        (ckpt / "tokenizer_config.json").write_text(json.dumps({**special, "chat_template": TEMPLATE}))
    else:
        (ckpt / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
        (ckpt / "tokenizer_config.json").write_text(json.dumps(special))
    assert load_tokenizer(ckpt).get_vocab_size() == len(WORDS)
    encoding = load_chat_encoding(ckpt)
    assert isinstance(encoding, TemplateChatEncoding)
    text = encoding.render(_conversation())
    assert text == "<s><|system|>be brief\n<|user|>hello there\n<|assistant|>"
    ids = encoding.encode(_conversation())
    assert [WORDS[i] for i in ids] == ["<s>", "<|system|>", "be", "brief", "<|user|>", "hello", "there",
                                       "<|assistant|>"]
    assert encoding.encode([{"role": "user", "content": "hello"}]) == [0, 3, 5, 4]


def test_named_encoding_wins_over_a_template(tmp_path):
    ckpt = _v4_checkpoint(tmp_path, deepinfer={"chat_encoding": "v4"})
    shutil.copy(default_tokenizer_path(), ckpt / "tokenizer.json")
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    assert checkpoint_chat_template(ckpt) == TEMPLATE
    assert not isinstance(load_chat_encoding(ckpt), TemplateChatEncoding)


V41_RENAMED = {128799: "<｜System｜>", 129264: "<｜deepseek_image｜>", 129279: "<|place_holder_mm_span_0442|>"}
"""DeepSeek-V4.1-Flash's tokenizer.json against V4's (third-party listings of the published file, two agreeing:
the same 1,283 added tokens, `<｜System｜>` in placeholder 799's slot, 129264 spelled `<｜deepseek_image｜>`,
129279 an unused mm-span placeholder: no `<｜image｜>`)."""


def test_v41_tokenizer_renders_images_as_its_deepseek_image_token(tmp_path):
    """recipe renders `<｜image｜>` per image, which V4.1's tokenizer lacks: `RecipeChatEncoding` encodes it as
    `<｜deepseek_image｜>` (129264), a user's literal spellings stay plain text, and nothing else changes."""
    from deepinfer.engine.tokenizer import RecipeChatEncoding

    data = json.loads(default_tokenizer_path().read_text())
    for token in data["added_tokens"]:
        token["content"] = V41_RENAMED.get(token["id"], token["content"])
    ckpt = _v4_checkpoint(tmp_path, model_type="deepseek_v41")
    (ckpt / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    image = recipe.BytesImageSource(b"not decoded here")
    text = "look <｜image｜> <｜deepseek_image｜>"
    conv = recipe.Conversation([recipe.SystemMessage("be brief"), recipe.UserMessage(text + " <｜image｜>", [image])],
                               thinking_mode=False)
    plain = recipe.DeepseekV41Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(ckpt / "tokenizer.json")))
    with pytest.raises(RuntimeError, match="image"):  # why the alias: recipe refuses the tokenizer as it is
        plain.encode(conv)
    encoding = load_chat_encoding(ckpt)
    assert isinstance(encoding, RecipeChatEncoding) and encoding.image_placeholder_id == 129264
    ids = encoding.encode(conv)
    assert ids[:2] == [0, 128799] and ids.count(129264) == 1 and max(ids) < 129280
    assert ids[-2:] == [128804, 128822]  # <｜Assistant｜></think> (thinking off)
    # recipe's placeholder is the text's first <｜image｜> (UserMessage's rule); the later spellings are plain text
    rendered = encoding.render_conversation(conv)
    assert rendered.prompt.count("<｜image｜>") == 2 and len(rendered.image_sources) == 1
    assert ids[ids.index(129264) + 1:-2] == plain.encode(recipe.Conversation(
        [recipe.UserMessage(" <｜deepseek_image｜> <｜image｜>")], thinking_mode=False))[2:-2]
    assert encoding.tokenizer.encode("<｜image｜>") != [encoding._alias_id]  # the alias is the encoding's only
    # V4's tokenizer has <｜image｜> (129279): recipe's own ids, no alias
    v4 = RecipeChatEncoding("v4", default_tokenizer_path())
    assert v4.image_placeholder_id == 129279 and v4._alias_id is None
    v4_conv = recipe.Conversation([recipe.UserMessage("look <｜image｜>", [image])], thinking_mode=False)
    own = recipe.DeepseekV4Encoding().with_tokenizer(recipe.Tokenizer.from_file(str(default_tokenizer_path())))
    assert v4.encode(v4_conv) == own.encode(v4_conv) and 129279 in own.encode(v4_conv)
