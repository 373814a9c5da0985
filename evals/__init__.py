"""Evaluation scripts: AIME, GPQA Diamond and Humanity's Last Exam on the offline batch API (`LLM`) or
on a running cluster, graded here, with a JSON results file and a Markdown score table per run.

`python -m deepinfer.evals.run --task aime|gpqa|hle --data FILE ...` (see `run.py`; data layouts and
where to get each data set: README.md in this folder). Modules: `data` (reading JSONL / JSON / CSV /
Parquet with file-and-line errors), `tasks` (each benchmark's fields, prompts and grading), `grading`
(answer extraction, pure), `backends` (recipe prompt rendering; offline or cluster generation),
`report` (accuracy, Wilson interval, JSON and Markdown).
"""
