"""Forward-pass speed of our model against transformers' `DeepseekV4ForCausalLM` on the CPU.

    python -m deepinfer.benchmarks.model_forward [--preset small] [--prompt-len 512] [--decode-steps 32]
        [--batch 8] [--reps 9] [--threads 1,2] [--checkpoint DIR] [--json OUT]

Both models load the same random-weight checkpoint (written by `make_checkpoint` into a temporary
directory unless `--checkpoint` names one) in float32. Three cases, each in tokens/s:

- `prefill`: one sequence of `--prompt-len` tokens in one forward. Ours:
  `ModelRunnerForTests.run` (last-token logits); HF: `model(ids, use_cache=True,
  logits_to_keep=1)`, so neither computes the LM head over the whole prompt and both fill a cache.
- `decode_b1`: single-token steps of one sequence after a `--prompt-len` prompt. Ours: `run` of one
  token; HF: `model(ids[:, -1:], cache=cache, use_cache=True)` on the `DynamicCache` its prefill
  returned (`cache` is V4's keyword; `past_key_values` is its deprecated alias).
- `decode_bN`: the same with `--batch` sequences of equal prompt length in every step (ours: one
  flat `run` over all of them; HF: a `[batch, 1]` input, no padding).

Ours and HF run alternately, repetition by repetition, so load from other processes falls on
both alike. Every repetition of a prefill starts from an empty cache. Decode cases prefill once
(not timed), then time one warmup block and `--reps` blocks of `--decode-steps` steps back to
back, so the context grows from `prompt_len` to `prompt_len + (reps + 1) * decode_steps` across
the blocks; both models see the same token ids. Decode tokens are fixed random ids (no sampling),
so only the forward is timed. Figures are medians over repetitions; the table also gives the range
of the per-repetition ratio (ours and HF of one repetition run back to back), a measure of noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import PRESETS


def paired_medians(ours_fn: Callable[[], None], hf_fn: Callable[[], None], reps: int, warmup: int = 1) -> dict:
    """Blocks while running both `warmup + reps` times, interleaved; returns median seconds of each
    (`ours_s`, `hf_s`) and the range of the per-repetition ratio HF time / our time (`ratio_range`).

    NOTE: ours and HF alternate rep by rep, so a load change on a shared machine hits both alike.
    """
    times: dict[str, list[float]] = {"ours": [], "hf": []}
    for i in range(warmup + reps):
        for name, fn in (("ours", ours_fn), ("hf", hf_fn)):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    ratios = [h / o for o, h in zip(times["ours"], times["hf"])]
    return {"ours_s": statistics.median(times["ours"]), "hf_s": statistics.median(times["hf"]),
            "ratio_range": (min(ratios), max(ratios))}


def source_digest() -> str:
    """Short sha256 over the engine's Python sources, naming the code version measured."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "engine"
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def load_hf(path: Path):
    """transformers' model of checkpoint `path`, float32, eval mode, quiet."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    return transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g)  # [batch, length]; 0/1 are bos/eos


def bench_prefill(ours, hf, ids: torch.Tensor, reps: int) -> dict[str, float]:
    """Median seconds of one prefill of `ids` [1, L] from an empty cache, ours and HF."""
    L = ids.shape[1]
    prompt = ids[0].tolist()
    runners: list[ModelRunnerForTests] = []

    def ours_once() -> None:
        runner = runners.pop()  # NOTE: cache allocation stays outside the timed call
        runner.run([(0, prompt)])

    def fresh_runners(n: int) -> None:
        runners.extend(ModelRunnerForTests(ours, max_seqs=1, max_len=L + 1) for _ in range(n))

    fresh_runners(reps + 1)

    def hf_once() -> None:
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)

    return {**paired_medians(ours_once, hf_once, reps), "tokens": L}


def bench_decode(ours, hf, ids: torch.Tensor, steps: int, reps: int, vocab: int, seed: int) -> dict[str, float]:
    """Median seconds of `steps` single-token decode steps of all `ids.shape[0]` sequences at once."""
    B, L = ids.shape
    g = torch.Generator().manual_seed(seed + 1)
    new = torch.randint(2, vocab, (B, steps * (reps + 1)), generator=g)  # [B, all decode tokens]
    new_list = new.tolist()

    runner = ModelRunnerForTests(ours, max_seqs=B, max_len=L + new.shape[1] + 1)
    runner.run([(i, ids[i].tolist()) for i in range(B)])
    cursor = [0]

    def ours_block() -> None:
        c = cursor[0]
        for k in range(c, c + steps):
            runner.run([(i, [new_list[i][k]]) for i in range(B)])
        cursor[0] = c + steps

    with torch.inference_mode():
        cache = hf(ids, use_cache=True, logits_to_keep=1).cache
    hf_cursor = [0]

    def hf_block() -> None:
        c = hf_cursor[0]
        with torch.inference_mode():
            for k in range(c, c + steps):
                hf(new[:, k:k + 1], cache=cache, use_cache=True)
        hf_cursor[0] = c + steps

    return {**paired_medians(ours_block, hf_block, reps), "tokens": B * steps}


def run(args: argparse.Namespace, path: Path) -> dict:
    """Blocks while measuring every case at every thread count; returns the JSON-able results."""
    ours, config = load_checkpoint(path, dtype="float32", progress=False)
    hf = load_hf(path)
    vocab = config.vocab_size
    results = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        load_before = os.getloadavg()
        one = _prompts(1, args.prompt_len, vocab, args.seed)
        batch = _prompts(args.batch, args.prompt_len, vocab, args.seed + 7)
        cases = [
            ("prefill", bench_prefill(ours, hf, one, args.reps)),
            ("decode_b1", bench_decode(ours, hf, one, args.decode_steps, args.reps, vocab, args.seed)),
            (f"decode_b{args.batch}",
             bench_decode(ours, hf, batch, args.decode_steps, args.reps, vocab, args.seed)),
        ]
        load_after = os.getloadavg()
        for name, r in cases:
            results.append({
                "case": name, "threads": threads, "tokens": r["tokens"],
                "ours_s": r["ours_s"], "hf_s": r["hf_s"],
                "ours_tok_s": r["tokens"] / r["ours_s"], "hf_tok_s": r["tokens"] / r["hf_s"],
                "ratio": r["hf_s"] / r["ours_s"], "ratio_range": r["ratio_range"],
                "loadavg_before": load_before, "loadavg_after": load_after,
            })
    return {
        "benchmark": "model_forward",
        "preset": args.preset,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "batch": args.batch,
        "reps": args.reps,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "engine_source_digest": source_digest(),
        "results": results,
    }


def format_table(report: dict) -> str:
    """Markdown table of `report["results"]` (ratio = ours tok/s / HF tok/s)."""
    lines = [
        "| case | threads | tokens timed | ours tok/s | HF tok/s | ours/HF | per-rep ours/HF min-max "
        "| load avg (1m) before/after |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['case']} | {r['threads']} | {r['tokens']} | {r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | "
            f"{r['ratio']:.2f} | {r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f} | "
            f"{r['loadavg_before'][0]:.2f} / {r['loadavg_after'][0]:.2f} |"
        )
    return "\n".join(lines)


def parse_threads(value: str) -> list[int]:
    """`"1,2"` -> [1, 2]."""
    try:
        threads = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--threads takes integers separated by commas, e.g. 1,2; got {value!r}") from None
    if not threads or min(threads) < 1:
        raise argparse.ArgumentTypeError(f"--threads needs at least one count >= 1; got {value!r}")
    return threads


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.model_forward", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS),
                        help="architecture of the random checkpoint")
    parser.add_argument("--checkpoint", type=Path,
                        help="existing checkpoint directory (default: write --preset to a temp dir)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps per timed block")
    parser.add_argument("--batch", type=int, default=8, help="sequences of the batched decode case")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions (after one warmup)")
    parser.add_argument("--threads", type=parse_threads, default=[1], help="torch threads, e.g. 1 or 1,2")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the token ids")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("prompt_len", "decode_steps", "batch", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / args.preset, preset=args.preset, seed=args.seed)
        report = run(args, path)
    print(f"model_forward: preset={args.preset} prompt_len={args.prompt_len} decode_steps={args.decode_steps} "
          f"batch={args.batch} reps={args.reps} engine sources {report['engine_source_digest']} "
          "(median; ours/HF > 1 means ours is faster)")
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
