"""Offline generation throughput: our `LLM.generate` against transformers' batched `generate`.

    python -m deepinfer.benchmarks.offline_throughput [--num-requests 64] [--quick] [--threads 1,2]
        [--hf-batch-size 16] [--checkpoint DIR] [--json OUT]

Workload (fixed by `--seed`): `--num-requests` random-token prompts of length uniform in
[16, 512] with output lengths uniform in [64, 256], on the `small` random-weight checkpoint.
`--quick` runs 8 requests with outputs in [8, 32] (a smoke run).

- ours: one `LLM` (float32, CPU), all requests in one `generate` call, greedy (`temperature=0`),
  `ignore_eos=True`, each request's own `max_tokens`. Timed after a short warmup call.
- HF: requests sorted by prompt length and cut into batches of `--hf-batch-size`; each batch is
  left-padded (pad id 0) with an attention mask and run by `generate(do_sample=False,
  max_new_tokens=<that batch's longest output>)` with `eos_token_id=None`, so no row stops early.
  HF computes pad tokens and tokens past a request's own length; only requests' own tokens count.

Output tokens = sum of `max_tokens`; total tokens = that plus the prompt tokens. Both sides count
the same numbers, so the ratio of rates is the inverse ratio of wall times.

Prefix cache: after the main pass the same prompts run again with `max_tokens=1` on the same
(warm) engine, and on a freshly built (cold) engine; the speedup is cold time / warm time. The
engine recomputes `exact_replay_tokens` tokens before every hit, so short prompts gain little.
If that pass fails on the main engine, the error is reported and the pass is repeated on fresh
engines whose token budget holds every prompt at once (stated in the output).

Decode steps: every `Engine.step` is classified by the scheduler output it ran (decode-only means
every scheduled request computes exactly one token and none is new), and `engine.timings`
deltas plus the step's wall time are accumulated per class; "other" is the step's wall time
outside the three timed phases (building the model and sampling batches, stop checks,
detokenization, outputs). Our engine runs with its defaults (`async_scheduling` off).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling import SamplingParams
from deepinfer.engine.testing.make_checkpoint import make_checkpoint

PAD_ID = 0
PHASES = ("schedule", "model", "sample")


@dataclass(frozen=True)
class Workload:
    """The requests of one run: prompt token ids and each request's output length."""

    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


class LoadSampler:
    """Samples the 1-minute load average every `period_s` seconds in a daemon thread.

    NOTE: the load average counts this process too (about `threads` when it computes).
    """

    def __init__(self, period_s: float = 5.0) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)
        self._thread.start()

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        """Stop sampling; returns min / mean / max of the samples."""
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])
        return {"min": min(self.samples), "mean": sum(self.samples) / len(self.samples), "max": max(self.samples)}


def source_digest() -> str:
    """Short sha256 over the engine's Python sources, naming the code version measured."""
    import hashlib

    root = Path(__file__).resolve().parent.parent / "engine"
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def make_workload(num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> Workload:
    """`num_requests` random prompts (ids in [2, vocab): 0/1 are bos/eos) and output lengths."""
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_range) for _ in range(num_requests)]
    outs = [rng.randint(*output_range) for _ in range(num_requests)]
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in lens]
    return Workload(prompts, outs)


class StepRecorder:
    """Wraps one engine's `step` to split `engine.timings` into decode-only and other steps."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.totals = {kind: {**dict.fromkeys(PHASES, 0.0), "wall": 0.0, "steps": 0, "seqs": 0}
                       for kind in ("decode", "other")}
        self._last_out = None
        schedule, step = engine.scheduler.schedule, engine.step

        def recording_schedule(*a, **kw):
            self._last_out = schedule(*a, **kw)
            return self._last_out

        def recording_step():
            before = dict(engine.timings)
            t0 = time.perf_counter()
            outs = step()
            wall = time.perf_counter() - t0
            out = self._last_out
            n = len(out.num_scheduled_tokens)
            is_decode = n > 0 and not out.scheduled_new_reqs and out.total_num_scheduled_tokens == n
            acc = self.totals["decode" if is_decode else "other"]
            for k in PHASES:
                acc[k] += engine.timings[k] - before[k]
            acc["wall"] += wall
            acc["steps"] += 1
            acc["seqs"] += n
            return outs

        engine.scheduler.schedule = recording_schedule
        engine.step = recording_step

    def reset(self) -> None:
        for acc in self.totals.values():
            for k in acc:
                acc[k] = 0 if k in ("steps", "seqs") else 0.0

    def per_decode_step_ms(self) -> dict[str, float]:
        """Mean milliseconds per decode-only step by phase, plus its mean batch size."""
        acc = self.totals["decode"]
        steps = max(acc["steps"], 1)
        out = {k: 1e3 * acc[k] / steps for k in PHASES}
        out["other"] = 1e3 * (acc["wall"] - sum(acc[k] for k in PHASES)) / steps
        out["total"] = 1e3 * acc["wall"] / steps
        out["steps"] = acc["steps"]
        out["mean_batch"] = acc["seqs"] / steps
        return out


def _warmup(llm: LLM) -> None:
    """Blocks while running a few short requests (no prefix shared with any workload prompt)."""
    prompts = [[(7 * i + j) % 1000 + 2 for j in range(48)] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8), use_tqdm=False)


def _timed_prompts_pass(llm: LLM, prompts: list[list[int]]) -> tuple[float, int, list]:
    """Blocks while running `prompts` with max_tokens=1; returns (seconds, tokens computed, outputs)."""
    one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    computed0 = llm.engine.num_computed_tokens_total
    t0 = time.perf_counter()
    outs = llm.generate(prompts, one, use_tqdm=False)
    return time.perf_counter() - t0, llm.engine.num_computed_tokens_total - computed0, outs


def prefix_cache_pass(build, warm: LLM, prompts: list[list[int]]) -> dict:
    """Blocks while timing `prompts` (max_tokens=1) on the engine `warm`, which has seen them, and on
    a fresh engine from `build()`; returns times, tokens computed and the speedup."""
    warm_s, warm_computed, warm_outs = _timed_prompts_pass(warm, prompts)
    cold = build()
    _warmup(cold)
    cold_s, cold_computed, cold_outs = _timed_prompts_pass(cold, prompts)
    return {
        "warm_s": warm_s, "cold_s": cold_s, "speedup": cold_s / warm_s,
        "cached_prompt_tokens": sum(o.num_cached_tokens for o in warm_outs),
        "warm_computed_tokens": warm_computed, "cold_computed_tokens": cold_computed,
        "same_token_warm_vs_cold": sum(a.outputs[0].token_ids == b.outputs[0].token_ids
                                       for a, b in zip(warm_outs, cold_outs)),
    }


def run_ours(path: Path, work: Workload, args: argparse.Namespace) -> dict:
    """Blocks while running the workload (and the prefix-cache passes) through `LLM.generate`."""
    def build(max_num_batched_tokens: int = args.max_num_batched_tokens) -> LLM:
        return LLM(model=str(path), max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=args.max_model_len)

    llm = build()
    recorder = StepRecorder(llm.engine)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in work.max_tokens]
    _warmup(llm)
    recorder.reset()
    timings0 = dict(llm.engine.timings)

    t0 = time.perf_counter()
    outs = llm.generate(work.prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != work.max_tokens:
        raise RuntimeError(f"ours produced {sum(got)} tokens, expected {work.num_output_tokens}; ignore_eos failed?")
    timings = {k: llm.engine.timings[k] - timings0[k] for k in llm.engine.timings}
    per_step = recorder.per_decode_step_ms()

    try:
        prefix = prefix_cache_pass(build, llm, work.prompts)
        prefix["engine"] = "main-pass engine (warm) vs fresh engine, same config"
    except Exception as e:  # noqa: BLE001 - a failing engine path is a result to report, not a crash
        # NOTE: fallback: a token budget holding every prompt at once, so no prefill (and no replay
        # before a prefix hit) is split across steps; warm = a fresh engine that ran the prompts once.
        error = f"{type(e).__name__}: {e}"
        print(f"prefix-cache pass on the main engine failed ({error}); retrying with an unsplit token budget",
              flush=True)
        budget = max(args.max_num_batched_tokens, work.num_prompt_tokens)
        warm = build(budget)
        _warmup(warm)
        _timed_prompts_pass(warm, work.prompts)
        prefix = prefix_cache_pass(lambda: build(budget), warm, work.prompts)
        prefix["engine"] = (f"fallback: fresh engines with max_num_batched_tokens={budget} (main engine failed: "
                            f"{error}); warm engine ran the prompts once before")
        prefix["main_engine_error"] = error
    del llm
    return {
        "elapsed_s": elapsed,
        "output_token_ids": [o.outputs[0].token_ids for o in outs],
        "timings": timings,
        "decode_step_ms": per_step,
        "prefix_cache": prefix,
    }


def run_hf(path: Path, work: Workload, batch_size: int) -> dict:
    """Blocks while running the workload through transformers' `generate` in padded batches."""
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # NOTE: eos_token_id=None disables stopping (like ignore_eos), without touching the logits.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD_ID

    def generate(prompts: list[list[int]], max_new: int) -> torch.Tensor:
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), PAD_ID, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new)
        return out[:, L:]  # [batch, max_new]

    generate([[5] * 40, [6] * 48], 8)  # warmup

    order = sorted(range(len(work.prompts)), key=lambda i: len(work.prompts[i]))
    batches = [order[a:a + batch_size] for a in range(0, len(order), batch_size)]
    outputs: dict[int, list[int]] = {}
    computed_prompt = computed_output = 0
    t0 = time.perf_counter()
    for b in batches:
        max_new = max(work.max_tokens[i] for i in b)
        new = generate([work.prompts[i] for i in b], max_new)
        for row, i in enumerate(b):
            outputs[i] = new[row, : work.max_tokens[i]].tolist()
        computed_prompt += len(b) * max(len(work.prompts[i]) for i in b)
        computed_output += len(b) * max_new
    elapsed = time.perf_counter() - t0
    unpadded = {b[-1] for b in batches}  # the longest prompt of each batch has no padding
    return {
        "elapsed_s": elapsed,
        "num_batches": len(batches),
        "computed_prompt_tokens": computed_prompt,
        "computed_output_tokens": computed_output,
        "output_token_ids": [outputs[i] for i in range(len(work.prompts))],
        "unpadded_request_ids": sorted(unpadded),
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace, path: Path, threads: int) -> dict:
    """Blocks while running both sides at `threads` torch threads; returns the JSON-able results."""
    torch.set_num_threads(threads)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    output_range = (8, 32) if args.quick else (64, 256)
    work = make_workload(args.num_requests, (16, 512), output_range, vocab, args.seed)
    load_before = os.getloadavg()
    sampler = LoadSampler()
    ours = run_ours(path, work, args)
    load_ours = sampler.stop()
    hf, load_hf = None, None
    if not args.skip_hf:
        sampler = LoadSampler()
        hf = run_hf(path, work, args.hf_batch_size)
        load_hf = sampler.stop()
    load_after = os.getloadavg()
    out_tokens, total_tokens = work.num_output_tokens, work.num_output_tokens + work.num_prompt_tokens
    report = {
        "threads": threads,
        "num_requests": len(work.prompts),
        "prompt_tokens": work.num_prompt_tokens,
        "output_tokens": out_tokens,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "loadavg_during": {"ours": load_ours, "hf": load_hf},
        "ours": {
            "elapsed_s": ours["elapsed_s"],
            "output_tok_s": out_tokens / ours["elapsed_s"],
            "total_tok_s": total_tokens / ours["elapsed_s"],
            "timings": ours["timings"],
            "decode_step_ms": ours["decode_step_ms"],
            "prefix_cache": ours["prefix_cache"],
        },
    }
    if hf is not None:
        agree = [common_prefix(ours["output_token_ids"][i], hf["output_token_ids"][i])
                 for i in hf["unpadded_request_ids"]]
        report["hf"] = {
            "elapsed_s": hf["elapsed_s"],
            "output_tok_s": out_tokens / hf["elapsed_s"],
            "total_tok_s": total_tokens / hf["elapsed_s"],
            "batch_size": args.hf_batch_size,
            "num_batches": hf["num_batches"],
            "computed_prompt_tokens": hf["computed_prompt_tokens"],
            "computed_output_tokens": hf["computed_output_tokens"],
        }
        report["ratio"] = hf["elapsed_s"] / ours["elapsed_s"]
        report["greedy_agreement_unpadded"] = {
            "requests": len(agree),
            "identical": sum(a == work.max_tokens[i] for a, i in zip(agree, hf["unpadded_request_ids"])),
            "common_prefix_tokens": agree,
        }
    return report


def format_report(r: dict) -> str:
    """Markdown tables of one thread count's results."""
    o = r["ours"]
    during = "; ".join(f"{k} {v['min']:.2f}/{v['mean']:.2f}/{v['max']:.2f}"
                       for k, v in r["loadavg_during"].items() if v is not None)
    lines = [
        f"threads={r['threads']}: {r['num_requests']} requests, {r['prompt_tokens']} prompt + "
        f"{r['output_tokens']} output tokens; load avg (1m) {r['loadavg_before'][0]:.2f} before, "
        f"{r['loadavg_after'][0]:.2f} after; during (min/mean/max): {during}",
        "",
        "| engine | wall s | output tok/s | total tok/s |",
        "|---|---:|---:|---:|",
        f"| ours (LLM.generate) | {o['elapsed_s']:.1f} | {o['output_tok_s']:.1f} | {o['total_tok_s']:.1f} |",
    ]
    if "hf" in r:
        h = r["hf"]
        lines.append(f"| HF generate (batches of {h['batch_size']}, left-padded) | {h['elapsed_s']:.1f} | "
                     f"{h['output_tok_s']:.1f} | {h['total_tok_s']:.1f} |")
        lines.append(f"| ours/HF | | {r['ratio']:.2f} | {r['ratio']:.2f} |")
    p = o["prefix_cache"]
    s = o["decode_step_ms"]
    t = o["timings"]
    lines += [
        "",
        "| prefix cache (same prompts, max_tokens=1) | wall s | tokens computed |",
        "|---|---:|---:|",
        f"| cold engine | {p['cold_s']:.2f} | {p['cold_computed_tokens']} |",
        f"| warm engine ({p['cached_prompt_tokens']} prompt tokens hit) | {p['warm_s']:.2f} | "
        f"{p['warm_computed_tokens']} |",
        f"| speedup (cold/warm) | {p['speedup']:.2f}x | |",
        "",
        f"prefix-cache engines: {p['engine']}; first token equal warm vs cold: "
        f"{p['same_token_warm_vs_cold']}/{r['num_requests']}",
        "",
        f"| ours per decode-only step (ms; {s['steps']} steps, mean batch {s['mean_batch']:.1f}) | schedule | "
        "model | sample | other | total |",
        "|---|---:|---:|---:|---:|---:|",
        f"| | {s['schedule']:.2f} | {s['model']:.2f} | {s['sample']:.2f} | {s['other']:.2f} | {s['total']:.2f} |",
        "",
        f"engine.timings over the main pass: schedule {t['schedule']:.3f} s, model {t['model']:.2f} s, "
        f"sample {t['sample']:.3f} s, {t['steps']} steps",
    ]
    if "greedy_agreement_unpadded" in r:
        g = r["greedy_agreement_unpadded"]
        lines.append(f"greedy agreement with HF on the {g['requests']} unpadded requests: {g['identical']} identical; "
                     f"common-prefix tokens {g['common_prefix_tokens']}")
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
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.offline_throughput",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=None, help="requests (default 64; 8 with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 requests, outputs of 8-32 tokens")
    parser.add_argument("--threads", type=parse_threads, default=[1], help="torch threads, e.g. 1 or 1,2")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="requests per HF generate call")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="our engine's running-request cap")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="our engine's token budget per step")
    parser.add_argument("--max-model-len", type=int, default=1024, help="our engine's max prompt + output")
    parser.add_argument("--preset", default="small", help="architecture of the random checkpoint")
    parser.add_argument("--checkpoint", type=Path,
                        help="existing checkpoint directory (default: write --preset to a temp dir)")
    parser.add_argument("--skip-hf", action="store_true", help="measure ours only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the workload")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 8 if args.quick else 64
    if args.num_requests < 1 or args.hf_batch_size < 1:
        parser.error("--num-requests and --hf-batch-size must be >= 1")
    reports = []
    print(f"offline_throughput: preset={args.preset} engine sources {source_digest()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="deepinfer-bench-") as tmp:
        path = args.checkpoint or make_checkpoint(Path(tmp) / args.preset, preset=args.preset, seed=args.seed)
        for threads in args.threads:
            reports.append(run(args, path, threads))
            print(format_report(reports[-1]), flush=True)
            print()
    result = {
        "benchmark": "offline_throughput",
        "preset": args.preset,
        "quick": args.quick,
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_model_len": args.max_model_len},
        "torch": torch.__version__,
        "transformers": None if args.skip_hf else __import__("transformers").__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "engine_source_digest": source_digest(),
        "runs": reports,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
