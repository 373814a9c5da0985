"""Runs one evaluation: `python -m deepinfer.evals.run --task aime|gpqa|hle --data FILE [options]`.

From a source checkout `python -m evals.run ...` works the same from the repository root.

```bash
python -m deepinfer.evals.run --task aime --data aime_2026.jsonl --model CKPT --device cuda --dtype bfloat16 \
    --thinking high --samples 16 --seed 0 --output results/aime.json      # + results/aime.md
python -m deepinfer.evals.run --task gpqa --data gpqa_diamond.csv --cluster 10.0.0.5:50051 --model CKPT
python -m deepinfer.evals.run --task aime --data aime_2026.jsonl --model CKPT --output results/aime.json --resume
```

A run reads and checks the whole data file first (a bad file is refused before the model loads), renders
every (item, sample) prompt with recipe (`backends.Renderer`), generates them offline or on a cluster,
grades each answer (`tasks`, `grading`) and writes the results JSON (atomically, every few seconds and at
the end) and a Markdown table beside it (`report`). Sample `s` of item `i` samples with its own seed,
derived from `--seed`, the task, the item id and `s` (`sample_seed`), so a run is reproducible whatever
its batches, and `--resume` regenerates exactly the samples the output file lacks.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer.evals import report
from deepinfer.evals.backends import (
    THINKING_MODES,
    ClusterBackend,
    Completion,
    GenerationError,
    OfflineBackend,
    Request,
    renderer_for,
)
from deepinfer.evals.data import DataError
from deepinfer.evals.tasks import PROMPT_STYLES, SCORED, SKIPPED, TASKS, Item

SAVE_INTERVAL_S = 10.0
"""Longest time between two writes of the results file while samples come in."""

REASONING_TAIL_CHARS = 2000
"""Characters of each sample's reasoning kept in the results (all of it with --keep-reasoning)."""

RESUME_KEYS = ("task", "data_sha256", "model", "thinking", "prompt_style", "samples", "seed", "sampling", "limit")
"""Config entries that must match for --resume to continue a results file."""


def sample_seed(seed: int, task: str, item_id: str, sample: int) -> int:
    """The sampling seed of sample `sample` of item `item_id`: a 62-bit hash of (seed, task, item, sample),
    so it does not depend on the item's position, the batch or the other samples."""
    digest = hashlib.sha256(f"{seed}/{task}/{item_id}/{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 2


@functools.lru_cache(maxsize=1)
def source_commit() -> str:
    """The short git commit of this source checkout (`+dirty` with local changes), else the installed
    package version, else "unknown"."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10)
        if commit.returncode == 0 and commit.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                   capture_output=True, text=True, timeout=10)
            return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from importlib.metadata import version

        return f"v{version('deepinfer')}"
    except Exception:
        return "unknown"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_label(model: str | None) -> str:
    """The model's name in the table: the built-in demo model, a directory's name, or a repo id."""
    if model is None:
        return "builtin"
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deepinfer.evals.run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=sorted(TASKS), help="which evaluation")
    p.add_argument("--data", required=True, help="local data file (.jsonl, .json, .csv, .parquet; evals/README.md)")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or Hugging Face repo id (default: the built-in demo model); with "
                        "--cluster, the checkpoint the cluster serves (its tokenizer and chat encoding render prompts)")
    p.add_argument("--revision", default=None, help="hub revision of a repo id --model")
    p.add_argument("--cluster", default=None, metavar="ADDRESS",
                   help="generate on a running cluster: its entrypoint's HOST:PORT (gRPC), or `auto` for the one "
                        "`deepinfer up` recorded ($DEEPINFER_CLUSTER or the only one); default: the offline engine "
                        "in this process")
    p.add_argument("--samples", type=int, default=1, help="samples per item; accuracy is pass@1 averaged over them")
    p.add_argument("--thinking", default="high", choices=THINKING_MODES,
                   help="off: non-thinking mode; high / max: thinking mode with that reasoning effort")
    p.add_argument("--seed", type=int, default=0, help="base seed of every sample's sampling seed and GPQA's shuffles")
    p.add_argument("--output", default=None,
                   help="results JSON (default: evals-TASK-THINKING.json); the Markdown table goes beside it (.md)")
    p.add_argument("--resume", action="store_true", help="continue the run recorded in --output")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output instead of refusing")
    p.add_argument("--prompt-style", default="official", choices=PROMPT_STYLES,
                   help="official: the benchmark's usual instructions; bare: the question alone")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (model card: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (model card: 1.0)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per sample (default: recipe's: 8192 without thinking, 65536 high, 131072 "
                        "max), lowered to the context left after the prompt")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (offline: the engine's; default min(model, 8192)); on a cluster, caps "
                        "max_tokens")
    p.add_argument("--limit", type=int, default=None, help="only the first N items of the data file")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="offline engine dtype")
    p.add_argument("--device", default="cpu", help="offline engine device (cpu, cuda)")
    p.add_argument("--batch-size", type=int, default=256,
                   help="offline: samples handed to the engine at once (results are saved between batches)")
    p.add_argument("--concurrency", type=int, default=64, help="cluster: requests in flight")
    p.add_argument("--keep-reasoning", action="store_true",
                   help=f"keep each sample's whole reasoning in the results (default: its last "
                        f"{REASONING_TAIL_CHARS} characters)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


class Run:
    """One evaluation run's state: the items, their records (loaded on --resume), and the file to keep."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.task = TASKS[args.task]
        self.data = Path(args.data)
        self.items: list[Item] = self.task.load(self.data)
        if args.limit is not None:
            self.items = self.items[:args.limit]
        self.output = Path(args.output or f"evals-{args.task}-{args.thinking}.json")
        self.config = {
            "task": args.task, "data": str(self.data.resolve()), "data_sha256": file_sha256(self.data),
            "model": model_label(args.model), "thinking": args.thinking, "prompt_style": args.prompt_style,
            "samples": args.samples, "seed": args.seed, "limit": args.limit,
            "sampling": {"temperature": args.temperature, "top_p": args.top_p, "max_tokens": args.max_tokens},
        }
        self.records: dict[str, dict[str, Any]] = {}
        self.started = _now()
        if self.output.exists():
            if args.resume:
                self._load_previous()
            elif not args.overwrite:
                raise ValueError(f"{self.output} exists; pass --resume to continue that run or --overwrite to "
                                 "replace it")
        elif args.resume:
            print(f"# --resume: {self.output} does not exist yet; starting the run", file=sys.stderr)
        self.last_save = 0.0

    def _load_previous(self) -> None:
        previous = report.read_json(self.output)
        old = previous["config"]
        changed = [k for k in RESUME_KEYS if old.get(k) != self.config[k]]
        if changed:
            diffs = "; ".join(f"{k}: {old.get(k)!r} there, {self.config[k]!r} now" for k in changed)
            raise ValueError(f"{self.output}: cannot resume: the run differs ({diffs}); use the same options, or "
                             "another --output")
        self.started = previous.get("started", self.started)
        ids = {item.id for item in self.items}
        for record in previous["records"]:
            if record.get("id") in ids:
                self.records[record["id"]] = record

    def record(self, item: Item, status: str) -> dict[str, Any]:
        record = self.records.get(item.id)
        if record is None or record["status"] != status:
            record = {"id": item.id, "where": item.where, "status": status, "kind": item.kind,
                      "reference": item.reference, "why_not_scored": item.why_not_scored, "score": None,
                      "samples": []}
            if status == SKIPPED:
                record["why_not_scored"] = "image item: the model has no vision tower"
            self.records[item.id] = record
        return record

    def result(self, final: bool, backend_name: str) -> dict[str, Any]:
        records = [self.records[item.id] for item in self.items if item.id in self.records]
        for r in records:
            r["samples"].sort(key=lambda s: s["sample"])
            if r["status"] == SCORED and r["samples"]:
                r["score"] = sum(s["is_correct"] for s in r["samples"]) / len(r["samples"])
        return {
            "title": self.task.title, **self.config, "backend": backend_name, "commit": source_commit(),
            "started": self.started, "date": _now(), "is_complete": final,
            **report.summarize(records), "config": self.config, "records": records,
        }

    def save(self, final: bool, backend_name: str) -> dict[str, Any]:
        result = self.result(final, backend_name)
        report.write_json(self.output, result)
        self.last_save = time.monotonic()
        return result


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _make_backend(args):
    if args.cluster is None:
        return OfflineBackend(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                              revision=args.revision, batch_size=args.batch_size)
    from deepinfer.engine.hub import resolve_model
    from deepinfer.evals.backends import recorded_cluster

    address, secret = recorded_cluster() if args.cluster == "auto" else (args.cluster, None)
    return ClusterBackend(address, resolve_model(args.model, args.revision), max_model_len=args.max_model_len,
                          concurrency=args.concurrency, secret=secret)


def evaluate(args: argparse.Namespace, backend=None) -> dict[str, Any]:
    """Blocks for the whole run; returns the results dict (also written to --output and its .md).
    `backend` replaces the one the arguments name (tests; it is left open)."""
    for name in ("samples", "batch_size", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    run = Run(args)  # reads and checks the data before any model loads
    owns_backend = backend is None
    backend = backend or _make_backend(args)
    try:
        renderer = renderer_for(Path(backend.model_path).resolve())
        renderer.check_thinking(args.thinking)
        requests, prompts = [], {}
        for item in run.items:
            status = SKIPPED if item.images and not renderer.has_vision else item.status
            record = run.record(item, status)
            if status == SKIPPED:
                continue
            done = {s["sample"] for s in record["samples"]}
            for sample in range(args.samples):
                if sample in done:
                    continue
                seed = sample_seed(args.seed, args.task, item.id, sample)
                prompt = run.task.render(item, seed, args.prompt_style)
                try:
                    ids, max_tokens = renderer.render(prompt, args.thinking, args.max_tokens, backend.max_model_len)
                except ValueError as e:
                    raise ValueError(f"{item.where} (item {item.id}): {e}") from None
                key = (item.id, sample)
                prompts[key] = (item, prompt)
                requests.append(Request(key, ids, prompt.images, max_tokens, args.temperature, args.top_p, seed))
        by_id = {item.id: item for item in run.items}
        bar = _progress(len(requests), f"{args.task} ({backend.name})", disabled=args.no_progress)

        def on_done(request: Request, completion: Completion) -> None:
            item, prompt = prompts[request.key]
            reasoning, answer, is_finished = renderer.split(completion.token_ids, args.thinking)
            grade = run.task.grade(by_id[item.id], prompt, answer)
            why_none = grade.why_none
            if not is_finished:
                why_none = "the reasoning did not finish (no </think> before max_tokens)"
            record = run.records[item.id]
            sample = {
                "sample": request.key[1], "seed": request.seed, "reference": prompt.reference,
                "extracted": grade.extracted,
                "is_correct": grade.is_correct if record["status"] == SCORED else None,
                "why_none": why_none, "answer": answer,
                "reasoning": reasoning if args.keep_reasoning else reasoning[-REASONING_TAIL_CHARS:],
                "num_reasoning_chars": len(reasoning), "is_reasoning_finished": is_finished,
                "num_output_tokens": len(completion.token_ids), "finish_reason": completion.finish_reason,
            }
            if prompt.order:
                sample["order"] = list(prompt.order)
            record["samples"].append(sample)
            bar.update(1)
            if time.monotonic() - run.last_save > SAVE_INTERVAL_S:
                run.save(False, backend.name)

        try:
            backend.generate(requests, on_done)
        except BaseException:
            run.save(False, backend.name)  # keep what finished: --resume continues from it
            raise
        finally:
            bar.close()
        result = run.save(True, backend.name)
    finally:
        if owns_backend:
            backend.close()
    table = report.markdown(result)
    run.output.with_suffix(".md").write_text(table, encoding="utf-8")
    return result


def _progress(total: int, desc: str, disabled: bool):
    """A tqdm progress bar over the samples (tqdm comes with huggingface_hub, a core dependency)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", disable=disabled)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate(args)
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except GenerationError as e:
        print(f"error: {e}\nthe samples that finished are in the results file; --resume continues the run",
              file=sys.stderr)
        return 1
    print(report.markdown(result))
    print(f"# results: {args.output or f'evals-{args.task}-{args.thinking}.json'} (+ .md)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
