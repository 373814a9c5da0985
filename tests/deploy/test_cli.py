"""The `deepinfer` command line as a user runs it (a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from deepinfer.engine.testing.make_checkpoint import make_checkpoint


def _cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.deploy.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_generate_prints_one_json_per_prompt(tmp_path):
    path = make_checkpoint(tmp_path / "ck", preset="tiny", seed=0)
    r = _cli("generate", "--model", str(path), "--prompt-ids", "5,6,7", "--prompt-ids", "9,10", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt_token_ids"] for x in lines] == [[5, 6, 7], [9, 10]]
    assert all(len(x["token_ids"]) == 4 and x["finish_reason"] == "length" for x in lines)
    assert lines[0]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "cached_prompt_tokens": 0}


def test_generate_refuses_bad_input_with_field(tmp_path):
    path = make_checkpoint(tmp_path / "ck", preset="tiny", seed=0)
    r = _cli("generate", "--model", str(path), "--prompt-ids", "5,999999", "--max-tokens", "4")
    assert r.returncode == 2
    assert json.loads(r.stderr.splitlines()[0])["field"] == "prompt_token_ids"


def test_generate_with_a_structured_output_constraint(tmp_path):
    path = make_checkpoint(tmp_path / "ck", preset="tiny", seed=0)
    r = _cli("generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-tokens", "8",
             "--structured-output", '{"regex": "(yes|no)"}')
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[0])
    assert out["text"] in ("yes", "no") and out["finish_reason"] == "stop"
    r = _cli("generate", "--model", str(path), "--prompt-ids", "5,6,7", "--structured-output", '{"regex": "(yes"}')
    assert r.returncode == 2
    error = json.loads(r.stderr.splitlines()[0])
    assert error["field"] == "structured_output" and "parenthesis" in error["error"] and ".cc" not in error["error"]


def test_demo_runs_on_the_embedded_default(tmp_path):
    """The README's main job: a local Ray cluster (1 vision + 1 prefill + 1 decode process, embeddings and
    KV over NIXL) with the built-in model answers chat requests (one about a picture) through the real
    chat format, then goes down."""
    r = _cli("demo", "--max-tokens", "16", env={"DEEPINFER_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "# starting a local cluster for " in r.stderr.split("# local cluster up")[0]  # said before the slow part
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [(x["question"], x["answer"], x["finish_reason"]) for x in lines] == [
        ("Reverse these words: red green blue", "blue green red", "stop"),
        ("Repeat these words: cat river song", "cat river song", "stop"),
        ("[picture of a blue circle] What colour is the shape?", "blue", "stop")]
    assert not list(tmp_path.iterdir())  # the packaged demo checkpoint: nothing is written on first use


def test_demo_offline(tmp_path):
    r = _cli("demo", "--offline", "--max-tokens", "3", env={"DEEPINFER_HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 2 and all(1 <= len(x["token_ids"]) <= 3 for x in lines)  # the demo model may stop early
