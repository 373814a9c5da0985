"""`--model` as a Hugging Face repo id (engine/hub.py), against a pre-filled cache; nothing reaches the network."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.engine.hub import ModelNotAvailableError, looks_like_repo_id, resolve_model

REPO = "deepseek-ai/DeepSeek-V4-Tiny"
SHA_MAIN = "a" * 40
SHA_OLD = "b" * 40


def _fill_cache(cache: Path, repo: str, snapshots: dict[str, Path | None], refs: dict[str, str]) -> Path:
    """The hub cache layout: `models--org--name/{refs/<name>, snapshots/<sha>/...}` (files copied, not linked)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    for sha, source in snapshots.items():
        snap = root / "snapshots" / sha
        snap.mkdir(parents=True)
        if source is not None:
            for f in source.iterdir():
                if f.is_file():
                    shutil.copy(f, snap / f.name)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for name, sha in refs.items():
        (root / "refs" / name).write_text(sha)
    return root


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def small_checkpoint(tmp_path):
    """A copy of the built-in model's small files (config, no weights) to tell snapshots apart."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(builtin_model_path() / "config.json", d / "config.json")
    return d


def test_local_directory_and_default_unchanged(tmp_path):
    assert resolve_model(None) == builtin_model_path()
    assert resolve_model(str(tmp_path)) == tmp_path
    missing = tmp_path / "nope"
    assert resolve_model(str(missing)) == missing  # the loader names it
    with pytest.raises(ValueError, match="local directory"):
        resolve_model(str(tmp_path), revision="main")
    assert looks_like_repo_id(REPO) and not looks_like_repo_id("/abs/path") and not looks_like_repo_id("./a/b")


def test_cached_repo_id_resolves_offline(offline_cache, small_checkpoint):
    _fill_cache(offline_cache, REPO, {SHA_MAIN: small_checkpoint}, {"main": SHA_MAIN})
    path = resolve_model(REPO)
    assert path == offline_cache / "models--deepseek-ai--DeepSeek-V4-Tiny" / "snapshots" / SHA_MAIN
    assert (path / "config.json").is_file()


def test_revision_selects_the_snapshot(offline_cache, small_checkpoint):
    _fill_cache(offline_cache, REPO, {SHA_MAIN: small_checkpoint, SHA_OLD: small_checkpoint},
                {"main": SHA_MAIN, "v1": SHA_OLD})
    root = offline_cache / "models--deepseek-ai--DeepSeek-V4-Tiny" / "snapshots"
    assert resolve_model(REPO) == root / SHA_MAIN
    assert resolve_model(REPO, revision="main") == root / SHA_MAIN
    assert resolve_model(REPO, revision="v1") == root / SHA_OLD  # a branch / tag ref
    assert resolve_model(REPO, revision=SHA_OLD) == root / SHA_OLD  # a commit hash


def test_not_cached_gives_a_clear_error(offline_cache):
    with pytest.raises(ModelNotAvailableError) as e:
        resolve_model(REPO, revision="v2")
    msg = str(e.value)
    assert str(offline_cache) in msg and f"hf download {REPO} --revision v2" in msg and "revision v2" in msg


def test_engine_loads_a_cached_repo_id_offline(offline_cache):
    from deepinfer.engine.engine import Engine

    _fill_cache(offline_cache, "deepinfer/builtin", {SHA_MAIN: builtin_model_path()}, {"main": SHA_MAIN})
    engine = Engine(model="deepinfer/builtin", revision="main", max_num_seqs=2, max_model_len=256)
    assert engine.model_path.name == SHA_MAIN
    assert engine.model_config.hidden_size == 128
