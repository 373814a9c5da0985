"""`--model` as a local directory or a Hugging Face repo id: one resolver for every stage.

`resolve_model(model, revision)` turns what a user passes as `--model` (or `LLM(model=...)`) into a
checkpoint directory:

* None -> the built-in demo model;
* an existing directory -> itself (a `revision` is refused: it means nothing for a directory);
* otherwise a repo id (`org/name`) -> its snapshot in the standard Hugging Face cache
  (`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`), downloaded by `huggingface_hub` with a
  progress bar, resumable (partial files are kept and continued), and only the files the engine
  reads (`ENGINE_FILE_PATTERNS`). A snapshot already in the cache is used without any network
  call; with no network (or `HF_HUB_OFFLINE=1`) and nothing cached, `ModelNotAvailableError` names
  the cache path and the command that pre-downloads it.

NOTE: every stage that reads the checkpoint (engine workers, the vision worker, the entrypoint's
config check, the HTTP front's tokenizer and chat encoding, the deploy CLI) resolves through here,
so a repo id means the same files everywhere. Light to import (no torch).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ENGINE_FILE_PATTERNS: tuple[str, ...] = (
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)
"""The files of a hub repo the engine reads (weights, index, config, tokenizer, chat template)."""

_REPO_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUE = {"1", "on", "yes", "true"}


class ModelNotAvailableError(FileNotFoundError):
    """`--model` is neither a local checkpoint directory nor a hub repo we can get (not cached and
    no network, not found, or gated). The message says what to do."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache in effect: `HF_HUB_CACHE`, else `HF_HOME/hub`, else huggingface_hub's default.

    NOTE: read from the environment at call time (huggingface_hub reads it once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_offline() -> bool:
    """Whether the hub must not be contacted (`HF_HUB_OFFLINE`, read at call time)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def looks_like_repo_id(model: str) -> bool:
    """`org/name` (one slash, no leading `/`, `.` or `~`): what `resolve_model` sends to the hub."""
    return _REPO_ID_RE.fullmatch(model) is not None and not model.startswith((".", "~"))


def download_command(repo_id: str, revision: str | None) -> str:
    """The shell command that pre-downloads what `resolve_model` needs (into the default cache)."""
    rev = f" --revision {revision}" if revision else ""
    includes = " ".join(f"--include '{p}'" for p in ENGINE_FILE_PATTERNS)
    return f"hf download {repo_id}{rev} {includes}"


def resolve_model(model: str | os.PathLike | None, revision: str | None = None) -> Path:
    """Blocks while downloading: the checkpoint directory for `--model` (see the module docstring).

    Raises `ModelNotAvailableError` (naming the cache and the pre-download command) when a repo id
    is neither cached nor downloadable. A missing path that is no repo id comes back as it is (the
    loader's `CheckpointError` names it).
    """
    if model is None:
        if revision is not None:
            raise ValueError("`revision` needs `model` to be a Hugging Face repo id; the built-in model has none.")
        from deepinfer.engine.builtin_model import builtin_model_path

        return builtin_model_path()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"`revision` ({revision!r}) applies to a Hugging Face repo id, but --model {text} is a "
                             "local directory; drop --revision or pass the repo id.")
        return path
    if not looks_like_repo_id(text):
        return path  # NOTE: a path that does not exist: the loader refuses it, naming it, as for any bad directory
    return _snapshot(text, revision)


def _snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    cache = hub_cache_dir()
    kwargs = {"revision": revision, "cache_dir": str(cache), "allow_patterns": list(ENGINE_FILE_PATTERNS)}
    try:  # cached: no network at all
        folder = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
        if (folder / "config.json").is_file():
            return folder
    except Exception:  # noqa: BLE001  (not cached, or an incomplete snapshot: fall through to the download)
        pass
    rev = revision or "main"
    if is_offline():
        raise ModelNotAvailableError(
            f"{repo_id} (revision {rev}) is not in the Hugging Face cache at {cache}, and HF_HUB_OFFLINE is set. "
            f"Pre-download it where there is network: `{download_command(repo_id, revision)}` (with "
            f"HF_HUB_CACHE={cache}), or pass a local checkpoint directory as --model."
        )
    try:
        return Path(snapshot_download(repo_id, **kwargs))
    except GatedRepoError as e:
        raise ModelNotAvailableError(
            f"{repo_id} is gated on the Hugging Face hub: accept its terms on huggingface.co and log in "
            f"(`hf auth login`, or set HF_TOKEN). ({e})") from e
    except RevisionNotFoundError as e:
        raise ModelNotAvailableError(f"{repo_id} has no revision {rev!r} on the Hugging Face hub; check --revision.") from e
    except RepositoryNotFoundError as e:
        raise ModelNotAvailableError(
            f"{repo_id!r} is not a local directory and no such Hugging Face repo exists (or it is private: log in "
            "with `hf auth login`). Check --model.") from e
    except Exception as e:  # noqa: BLE001  (no network, timeouts, HTTP errors: one clear message)
        raise ModelNotAvailableError(
            f"{repo_id} (revision {rev}) is not in the Hugging Face cache at {cache} and could not be downloaded "
            f"({type(e).__name__}: {e}). Pre-download it where there is network: "
            f"`{download_command(repo_id, revision)}` (with HF_HUB_CACHE={cache}; `huggingface-cli download` takes "
            "the same arguments), or pass a local checkpoint directory as --model."
        ) from e
