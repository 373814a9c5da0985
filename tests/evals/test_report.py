"""Scores, the Wilson interval and the Markdown table format."""

from __future__ import annotations

import pytest

from deepinfer.evals import report


def test_wilson_interval_known_values():
    low, high = report.wilson_interval(0.5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    low, high = report.wilson_interval(1.0, 30)  # not degenerate at 100%
    assert round(low, 4) == 0.8865 and high == 1.0
    assert report.wilson_interval(0.0, 5)[0] == 0.0
    assert report.wilson_interval(0.3, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        report.wilson_interval(1.5, 3)


def _sample(is_correct, tokens=10, finish="stop"):
    return {"is_correct": is_correct, "num_output_tokens": tokens, "finish_reason": finish}


def test_summarize_averages_pass_at_1_over_samples_per_item():
    records = [
        {"status": "scored", "samples": [_sample(True), _sample(False)]},     # 0.5
        {"status": "scored", "samples": [_sample(True), _sample(True, 30)]},  # 1.0
        {"status": "needs_judge", "samples": [_sample(None, 20, "length")]},
        {"status": "skipped", "samples": []},
    ]
    s = report.summarize(records)
    assert s["accuracy"] == 0.75 and s["items"] == 2
    assert s["ci95"] == list(report.wilson_interval(0.75, 2))  # n counts items, not samples
    assert (s["needs_judge"], s["skipped"], s["num_truncated_samples"]) == (1, 1, 1)
    assert s["mean_output_tokens"] == 16.0 and s["num_correct_samples"] == 3


def test_markdown_table_format():
    result = {"title": "AIME", "items": 30, "samples": 4, "accuracy": 0.85, "ci95": [0.7, 0.93],
              "mean_output_tokens": 12345.4, "thinking": "high", "model": "DeepSeek-V4.1-Flash", "commit": "abc1234",
              "date": "2026-12-04T21:00:00+00:00", "needs_judge": 2, "skipped": 1, "num_truncated_samples": 0,
              "prompt_style": "official", "sampling": {"temperature": 1.0, "top_p": 1.0}, "seed": 0}
    assert report.markdown(result) == (
        "| task | items | accuracy (95% CI) | mean output tokens | thinking | model | commit | date |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| AIME | 30 x 4 | 85.0% [70.0, 93.0] | 12345 | high | DeepSeek-V4.1-Flash | abc1234 | 2026-12-04 |\n"
        "\n"
        "pass@1 averaged over 4 samples per item; 95% CI: Wilson score interval over 30 items; 2 items need a judge "
        "model (not scored); 1 image item skipped (the model has no vision tower); prompts: official, temperature "
        "1.0, top_p 1.0, seed 0.\n")
