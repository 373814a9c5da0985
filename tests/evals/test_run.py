"""Whole runs: the fixtures graded through the built-in model (offline, and through the cluster backend
with a stand-in client), seeded sampling, --resume, refusals, and the outputs."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from deepinfer.evals import run as evals_run
from deepinfer.evals.backends import ClusterBackend, Completion, OfflineBackend
from deepinfer.evals.tasks import TASKS

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def offline():
    backend = OfflineBackend(None, dtype="float32", device="cpu", max_model_len=None)
    yield backend
    backend.close()


def _args(tmp_path: Path, task: str, data: str, *extra: str, output: str = "out.json"):
    return evals_run.build_parser().parse_args(
        ["--task", task, "--data", str(FIXTURES / data), "--output", str(tmp_path / output), "--no-progress", *extra])


BARE_GREEDY = ("--prompt-style", "bare", "--thinking", "off", "--temperature", "0", "--max-tokens", "8")


def test_aime_graded_through_the_builtin_model(tmp_path, offline):
    result = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY), backend=offline)
    graded = {r["id"]: (r["samples"][0]["extracted"], r["samples"][0]["is_correct"]) for r in result["records"]}
    # the demo model adds two-digit numbers (its model card) and fails one-digit ones
    assert graded["1"] == ("85", True) and graded["2"] == ("42", True) and graded["3"][1] is False
    assert result["accuracy"] == pytest.approx(2 / 3) and result["items"] == 3 and result["is_complete"]
    on_disk = json.loads((tmp_path / "out.json").read_text())
    assert on_disk["accuracy"] == result["accuracy"] and len(on_disk["records"]) == 3
    table = (tmp_path / "out.md").read_text()
    assert table.splitlines()[2].startswith("| AIME | 3 | 66.7% [20.8, 93.9] | ")
    assert "| off | builtin |" in table


def test_refusals_before_any_generation(tmp_path, offline):
    evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, "--limit", "1"), backend=offline)
    with pytest.raises(ValueError, match="out.json exists; pass --resume"):
        evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, "--limit", "1"), backend=offline)
    with pytest.raises(ValueError, match=r"cannot resume: the run differs \(seed: 0 there, 1 now\)"):
        evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, "--limit", "1", "--seed", "1",
                                 "--resume"), backend=offline)
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="bad.json: cannot resume from it"):
        evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, "--resume", output="bad.json"),
                           backend=offline)


class Counting:
    """A backend that counts the requests it passes on."""

    def __init__(self, inner) -> None:
        self.inner, self.keys = inner, []
        self.model_path, self.max_model_len, self.name = inner.model_path, inner.max_model_len, inner.name

    def generate(self, requests, on_done):
        self.keys += [r.key for r in requests]
        self.inner.generate(requests, on_done)

    def close(self):
        pass


def test_thinking_samples_are_seeded_and_resume_regenerates_only_what_is_missing(tmp_path, offline):
    options = ("--prompt-style", "bare", "--thinking", "high", "--samples", "2", "--seed", "7", "--max-tokens", "32",
               "--limit", "2")
    first = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *options), backend=offline)
    assert first["thinking"] == "high" and first["items"] == 2
    for record in first["records"]:
        for s in record["samples"]:
            assert s["is_reasoning_finished"] and s["reasoning"].startswith("The user asks for the sum")
            assert s["answer"] == s["extracted"]  # the answer part alone: after </think>
    # an interrupted run: item 1 lost sample 1, item 2 lost both samples
    partial = json.loads((tmp_path / "out.json").read_text())
    partial["records"][0]["samples"] = partial["records"][0]["samples"][:1]
    partial["records"][1]["samples"] = []
    (tmp_path / "out.json").write_text(json.dumps(partial))
    counting = Counting(offline)
    resumed = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *options, "--resume"), backend=counting)
    assert sorted(counting.keys) == [("1", 1), ("2", 0), ("2", 1)]
    # each sample's own seed: the regenerated samples equal the first run's, in another batch
    assert resumed["records"] == first["records"]
    assert resumed["started"] == first["started"]


def test_gpqa_and_hle_graded_through_the_builtin_model(tmp_path, offline):
    gpqa = evals_run.evaluate(_args(tmp_path, "gpqa", "gpqa_diamond.csv", *BARE_GREEDY, output="g.json"),
                              backend=offline)
    assert gpqa["items"] == 3
    for record in gpqa["records"]:
        s = record["samples"][0]
        assert "ABCD"[s["order"].index(0)] == s["reference"]  # the correct answer's letter after the shuffle
        assert s["is_correct"] is (s["extracted"] == s["reference"])
    hle = evals_run.evaluate(_args(tmp_path, "hle", "hle.jsonl", *BARE_GREEDY, output="h.json"), backend=offline)
    by_id = {r["id"][-2:]: r for r in hle["records"]}
    assert by_id["a1"]["samples"][0]["is_correct"] is True  # "What is 37 + 48?" -> 85, exactMatch
    assert by_id["a3"]["status"] == "needs_judge" and by_id["a3"]["samples"][0]["is_correct"] is None
    assert by_id["a4"]["status"] == "scored" and by_id["a4"]["samples"]  # the image item: the model has a vision tower
    assert (hle["items"], hle["needs_judge"], hle["skipped"]) == (3, 1, 0)
    assert "; 1 item needs a judge model (not scored);" in (tmp_path / "h.md").read_text()


class OfflineClient:
    """Stands in for `entrypoint.client.Client`: answers `generate` with the offline engine, as a cluster
    answers the token API (token ids in, token ids out)."""

    def __init__(self, llm) -> None:
        self.llm, self.calls = llm, []
        self.lock = threading.Lock()  # NOTE: the backend calls from several threads; one LLM is not thread-safe

    def generate(self, prompt_token_ids, **sampling):
        from deepinfer.engine import SamplingParams

        self.calls.append(dict(sampling))
        assert sampling.pop("images") is None
        with self.lock:
            out = self.llm.generate([{"prompt_token_ids": prompt_token_ids}], SamplingParams(**sampling),
                                    use_tqdm=False)[0]
        c = out.outputs[0]
        return {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason}

    def close(self):
        pass


def test_cluster_backend_sends_the_same_prompts_and_grades_the_same(tmp_path, offline):
    client = OfflineClient(offline.llm)
    cluster = ClusterBackend("127.0.0.1:1", offline.model_path, max_model_len=None, concurrency=2, client=client)
    on_cluster = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, output="c.json"),
                                    backend=cluster)
    offline_run = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *BARE_GREEDY, output="o.json"),
                                     backend=offline)
    assert on_cluster["records"] == offline_run["records"]
    assert on_cluster["backend"] == "cluster 127.0.0.1:1"
    assert {c["max_tokens"] for c in client.calls} == {8} and all(c["temperature"] == 0 for c in client.calls)


class Canned:
    """A backend without a model: every request gets the same completion."""

    def __init__(self, model_path: Path, renderer_text: str) -> None:
        from deepinfer.engine.tokenizer import load_tokenizer

        self.model_path, self.max_model_len, self.name = model_path, 4096, "canned"
        self.token_ids = load_tokenizer(model_path).encode(renderer_text, add_special_tokens=False).ids

    def generate(self, requests, on_done):
        for r in requests:
            on_done(r, Completion(self.token_ids, "stop"))

    def close(self):
        pass


def test_image_items_are_skipped_on_a_model_without_a_vision_tower(tmp_path):
    from deepinfer.engine.builtin_model import builtin_model_path

    ckpt = tmp_path / "text_only"
    ckpt.mkdir()
    config = json.loads((builtin_model_path() / "config.json").read_text())
    config.pop("vision_config")
    (ckpt / "config.json").write_text(json.dumps(config))
    backend = Canned(ckpt, "Explanation: easy\nAnswer: B\nConfidence: 90%")
    result = evals_run.evaluate(_args(tmp_path, "hle", "hle.jsonl", "--thinking", "off"), backend=backend)
    by_id = {r["id"][-2:]: r for r in result["records"]}
    assert by_id["a4"]["status"] == "skipped" and by_id["a4"]["samples"] == []
    assert by_id["a2"]["samples"][0]["is_correct"] is True  # "Answer: B" is the multiple-choice item's answer
    assert by_id["a1"]["samples"][0]["extracted"] == "B" and by_id["a1"]["samples"][0]["is_correct"] is False
    assert (result["items"], result["needs_judge"], result["skipped"]) == (2, 1, 1)
    assert "1 image item skipped (the model has no vision tower)" in (tmp_path / "out.md").read_text()


def test_gpqa_shuffles_are_seeded_per_sample():
    gpqa = TASKS["gpqa"]
    item = gpqa.load(FIXTURES / "gpqa_diamond.csv")[0]
    seeds = [evals_run.sample_seed(0, "gpqa", item.id, s) for s in range(8)]
    orders = [gpqa.render(item, seed, "official").order for seed in seeds]
    assert orders == [gpqa.render(item, seed, "official").order for seed in seeds]  # reproducible
    assert len(set(orders)) > 1  # and not the same permutation for every sample
    prompt = gpqa.render(item, seeds[0], "official")
    shown = dict(line.split(") ", 1) for line in prompt.user.splitlines() if line[:2] in ("A)", "B)", "C)", "D)"))
    assert shown[prompt.reference] == "85" and prompt.user.endswith("one of A, B, C or D.")


def test_cli_refuses_a_bad_file_before_loading_a_model(tmp_path, capsys):
    bad = tmp_path / "aime.jsonl"
    bad.write_text('{"problem": "What is 1 + 1?", "answer": 2}\n{"problem": "What is 2 + 2?"}\n')
    code = evals_run.main(["--task", "aime", "--data", str(bad), "--output", str(tmp_path / "o.json")])
    assert code == 2
    err = capsys.readouterr().err
    assert f"error: {bad}:2: field 'answer': missing" in err
    assert not (tmp_path / "o.json").exists()


def test_source_checkout_module_path_runs(tmp_path):
    # `python -m evals.run` from the repository root is the same module as `python -m deepinfer.evals.run`
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "evals.run", "--help"], cwd=root, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--thinking {off,high,max}" in out.stdout


class ScriptedClient:
    """A cluster client without a model: answers "85" to every prompt, and fails the prompts in `failing`."""

    def __init__(self, failing=()) -> None:
        from deepinfer.engine.builtin_model import builtin_model_path
        from deepinfer.evals.backends import renderer_for

        self.failing, self.num_calls = set(failing), 0
        self.answer = renderer_for(builtin_model_path()).tokenizer.encode("85", add_special_tokens=False).ids

    def generate(self, prompt_token_ids, **sampling):
        import grpc

        from deepinfer.entrypoint.client import GenerateError

        self.num_calls += 1
        if tuple(prompt_token_ids) in self.failing:
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "no healthy decode instance")
        return {"token_ids": self.answer, "finish_reason": "stop"}

    def close(self):
        pass


def test_a_failure_on_the_cluster_keeps_what_finished_and_resume_completes_it(tmp_path):
    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.evals.backends import GenerationError, renderer_for

    args = ("--prompt-style", "bare", "--thinking", "off", "--max-tokens", "8")
    failing = tuple(renderer_for(builtin_model_path()).render(TASKS["aime"].render(
        TASKS["aime"].load(FIXTURES / "aime_2026.jsonl")[2], 0, "bare"), "off", 8, None)[0])
    broken = ClusterBackend("10.0.0.5:50051", builtin_model_path(), max_model_len=None, concurrency=1,
                            client=ScriptedClient([failing]))
    with pytest.raises(GenerationError, match="item 3 sample 0 failed on the cluster: UNAVAILABLE"):
        evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *args, output="r.json"), backend=broken)
    kept = json.loads((tmp_path / "r.json").read_text())
    assert not kept["is_complete"] and [len(r["samples"]) for r in kept["records"]] == [1, 1, 0]
    healthy = ScriptedClient()
    backend = ClusterBackend("10.0.0.5:50051", builtin_model_path(), max_model_len=None, client=healthy)
    result = evals_run.evaluate(_args(tmp_path, "aime", "aime_2026.jsonl", *args, "--resume", output="r.json"),
                                backend=backend)
    assert healthy.num_calls == 1 and result["is_complete"] and result["accuracy"] == pytest.approx(1 / 3)
