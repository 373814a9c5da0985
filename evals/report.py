"""Scores, the confidence interval, and the two outputs of a run: the JSON results file and its
Markdown table.

Accuracy is pass@1 averaged over samples: each scored item's score is the fraction of its samples
graded right, and the accuracy is the mean of the item scores. The 95% confidence interval is
Wilson's score interval with n = the number of scored items (not items x samples: the samples of one
item are not independent draws of the benchmark), evaluated at that accuracy; it stays inside [0, 1]
and is not degenerate at 0% or 100%, which matters for benchmarks of 30 items (AIME).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

Z_95 = 1.959963984540054
"""The standard normal quantile of a two-sided 95% interval."""

CI_METHOD = "wilson"

TABLE_COLUMNS = ("task", "items", "accuracy (95% CI)", "mean output tokens", "thinking", "model", "commit", "date")
"""Columns of the Markdown score table, in order."""


def wilson_interval(p: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """Wilson's score interval of a proportion `p` observed over `n` trials; (0, 1) when n = 0."""
    if n <= 0:
        return 0.0, 1.0
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a proportion must lie in [0, 1], got {p}")
    denominator = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    # NOTE: the bounds at p = 0 and p = 1 are exactly 0 and 1; set them so that rounding cannot move them
    low = 0.0 if p == 0.0 else max(0.0, center - half)
    high = 1.0 if p == 1.0 else min(1.0, center + half)
    return low, high


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its per-item records (`run.py` writes their fields): accuracy, interval,
    counts of scored / judge / skipped items, mean output tokens over every generated sample."""
    scored = [r for r in records if r["status"] == "scored" and r["samples"]]
    scores = [sum(s["is_correct"] for s in r["samples"]) / len(r["samples"]) for r in scored]
    accuracy = sum(scores) / len(scores) if scores else 0.0
    low, high = wilson_interval(accuracy, len(scores))
    tokens = [s["num_output_tokens"] for r in records for s in r["samples"]]
    return {
        "accuracy": accuracy,
        "ci95": [low, high],
        "ci_method": CI_METHOD,
        "items": len(scored),
        "num_correct_samples": sum(s["is_correct"] for r in scored for s in r["samples"]),
        "num_scored_samples": sum(len(r["samples"]) for r in scored),
        "needs_judge": sum(r["status"] == "needs_judge" for r in records),
        "skipped": sum(r["status"] == "skipped" for r in records),
        "mean_output_tokens": sum(tokens) / len(tokens) if tokens else 0.0,
        "num_truncated_samples": sum(s["finish_reason"] == "length" for r in records for s in r["samples"]),
    }


def format_accuracy(accuracy: float, ci95: list[float] | tuple[float, float]) -> str:
    """`"85.0% [72.1, 93.0]"`: the accuracy and its interval, in percent."""
    return f"{100 * accuracy:.1f}% [{100 * ci95[0]:.1f}, {100 * ci95[1]:.1f}]"


def table_row(result: dict[str, Any]) -> str:
    """One Markdown table row of a results dict (the JSON file's top level)."""
    samples = result["samples"]
    cells = [
        result["title"],
        f"{result['items']}" + (f" x {samples}" if samples > 1 else ""),
        format_accuracy(result["accuracy"], result["ci95"]),
        f"{result['mean_output_tokens']:.0f}",
        result["thinking"],
        result["model"],
        result["commit"],
        result["date"][:10],
    ]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def markdown(result: dict[str, Any]) -> str:
    """The score table of one run (header, one row) and a line on what was not scored."""
    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS), table_row(result)]
    notes = []
    if result["samples"] > 1:
        notes.append(f"pass@1 averaged over {result['samples']} samples per item")
    notes.append(f"95% CI: Wilson score interval over {result['items']} items")
    if result["needs_judge"]:
        notes.append(f"{_count(result['needs_judge'], 'item')} need{'s' if result['needs_judge'] == 1 else ''} a "
                     "judge model (not scored)")
    if result["skipped"]:
        notes.append(f"{_count(result['skipped'], 'image item')} skipped (the model has no vision tower)")
    if result["num_truncated_samples"]:
        notes.append(f"{_count(result['num_truncated_samples'], 'sample')} hit max_tokens")
    notes.append(f"prompts: {result['prompt_style']}, temperature {result['sampling']['temperature']}, "
                 f"top_p {result['sampling']['top_p']}, seed {result['seed']}")
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + ".\n"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def write_json(path: Path, result: dict[str, Any]) -> None:
    """Writes `result` to `path` atomically (a temporary file renamed over it), so an interrupted run
    leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any]:
    """A results file written by `write_json`; raises ValueError naming the file if it is not one."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot resume from it: not a readable results file ({e})") from None
    if not isinstance(result, dict) or not isinstance(result.get("records"), list) or "config" not in result:
        raise ValueError(f"{path}: cannot resume from it: not a results file of `evals.run` (no config / records)")
    return result
