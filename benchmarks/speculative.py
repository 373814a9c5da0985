"""Speculative decoding (MTP drafts) on the built-in model: accepted length and decode throughput.

    python -m deepinfer.benchmarks.speculative [--batch-sizes 1,4,16] [--ks 0,1,2,3,3c] [--repeats 3]
        [--max-tokens 64] [--json OUT]

    python -m deepinfer.benchmarks.speculative --verify-forward [--batch-sizes 1,16,64] [--context 512]

    python -m deepinfer.benchmarks.speculative --profile-cost --json FILE [--batch-sizes 1,2,4,8,16,32]
        [--max-drafts 3] [--context 256] [--model PATH] [--device cuda]

`--profile-cost`: the step-cost table of confidence-scheduled verification (`engine.spec_decode.step_cost`):
seconds of one target forward per (requests, tokens per request = 1 .. 1 + `--max-drafts`) on this
device, written as the JSON that `EngineConfig.verify_cost_table` loads (the shipped CPU default is
`engine/spec_decode/step_cost_cpu.json`).

`--verify-forward`: only the target forward of one verify step (every request a `1 + 3`-token chunk
after `--context` tokens of its own), the per-request prefill-chunk path against the batched verify
path (`engine.spec_decode.verify_rows`); best of `--repeats` interleaved runs each, checked equal.

`--ks`: drafts per step; a trailing `c` (e.g. `3c`) runs that k with confidence-scheduled verification
(`verify_schedule="confidence"`, the checkpoint's confidence head when it has one) instead of full blocks,
`d` (e.g. `3d`) the same with the drafts' MTP probabilities as confidences (the head unloaded); a
trailing `p` (e.g. `3p`) runs the verify chunks as per-request prefill chunks instead of the batched
verify path (`engine.spec_decode.verify_rows`; the default wherever the attention backend has it); a trailing
`e` (e.g. `3e`, `3ce`, `0e`) runs with `enforce_eager=True`: no CUDA graphs, neither of decode steps nor of
verify steps (`engine.cuda_graph.VerifyGraphRunner`), so `--device cuda --ks 0,0e,3,3e,3c,3ce` compares them.
Each row says whether its verify steps ran as graphs (`verify_graphs`) and the graph runner's counters
(cumulative: captures happen lazily, in the first repeat, which the best-of-repeats timing leaves out), and with
them the MTP drafter's graph counters (`draft_graph_stats`: the committed pass and chained drafts of a step as one
replay, `engine.spec_decode.draft_graph`). In bfloat16 a row whose greedy outputs differ from k = 0's
(`outputs_changed`) also gives, per changed output, the k = 0 run's gap between its top two logprobs at the first
differing token (`changed_top2_logprob_gaps`): rounding flips only near-ties (gaps of a few hundredths).

Workload (fixed by `--seed`): the built-in demo model's own tasks rendered in its chat format
(two-digit additions, copy / reverse word lists, the weather tool call; thinking mode for half of
them), greedy, natural stops (the outputs are the same for every k: speculation is lossless, which
the script checks). For each batch size, every k runs `--repeats` times, interleaved (k = 0, 1, ...,
then again), on one engine per k built up front; the best wall time of `LLM.generate` counts
(shared CPUs make the others noisy), and so does the best process CPU time (`best_cpu_s`, `cpu_speedup`:
with one torch thread, what the run computed, less inflated by a loaded host's neighbours). Reported per
(batch, k): output tokens / s, the speedup over k = 0, the mean accepted length (tokens per verification, the sampled one included), the acceptance
rate per draft position and the target positions verified per step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import torch


def workload(num: int, seed: int) -> list[list[int]]:
    """`num` chat prompts of the demo model's tasks (token ids)."""
    import deepseek_recipe as recipe

    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.tokenizer import load_chat_encoding

    enc = load_chat_encoding(builtin_model_path())
    rng = random.Random(seed)
    words = ["red", "green", "blue", "apple", "river", "stone", "cloud", "table", "music", "garden"]
    places = ["Paris", "Lisbon", "Tokyo", "Oslo", "Cairo", "Lima"]
    out = []
    for i in range(num):
        kind = i % 4
        if kind == 0:
            q = f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?"
        elif kind == 1:
            q = "Repeat these words: " + " ".join(rng.sample(words, rng.randint(3, 5)))
        elif kind == 2:
            q = "Reverse these words: " + " ".join(rng.sample(words, rng.randint(3, 5)))
        else:
            q = f"What's the weather like in {rng.choice(places)}?"
        out.append(enc.encode(recipe.Conversation([recipe.UserMessage(q)], thinking_mode=(i // 4) % 2 == 0)))
    return out


@torch.inference_mode()
def verify_forward(sizes: list[int], context: int, repeats: int, num_drafts: int = 3) -> list[dict]:
    """Seconds of one target forward over B verify chunks, per-chunk path vs batched path (see the docstring)."""
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.engine import Engine, EngineConfig
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
    from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks

    eng = Engine(EngineConfig(max_num_seqs=1, speculative_tokens=num_drafts))
    model, mc = eng.model, eng.model_config
    bs = eng.cache.block_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in sizes:
        per_seq = -(-(context + num_drafts + 1) // bs)
        cache = V4KVCache(mc, per_seq * B, bs, B)
        tables = [list(range(per_seq * s, per_seq * (s + 1))) for s in range(B)]
        for s in range(B):  # each slot's context, one request at a time
            ids = torch.randint(10, 5000, (context,), generator=g).tolist()
            model(ForwardBatch.build([ids], [SeqChunk(s, tables[s], 0, context, 0)]), cache)
        n = num_drafts + 1
        batch = ForwardBatch.build([torch.randint(10, 5000, (n,), generator=g).tolist() for _ in range(B)],
                                   [SeqChunk(s, tables[s], context, n, 0) for s in range(B)])
        state = {k: v.clone() for k, v in cache.state_tensors().items()}
        best, outs = {}, {}
        for _ in range(repeats):
            for batched in (False, True):
                for k, v in cache.state_tensors().items():
                    v.copy_(state[k])
                t0 = time.perf_counter()
                meta = model.build_attention_metadata(batch, cache)
                if batched:
                    batch_verify_chunks(meta, set(range(B)))
                outs[batched] = model(batch, cache, meta)
                best[batched] = min(best.get(batched, float("inf")), time.perf_counter() - t0)
        err = (outs[True] - outs[False]).abs().max().item()
        if err > 1e-4:
            raise AssertionError(f"the batched verify path differs from the per-chunk one by {err} at B={B}")
        row = {"batch": B, "context": context, "verify_tokens": B * n, "per_chunk_ms": round(best[False] * 1e3, 2),
               "batched_ms": round(best[True] * 1e3, 2), "speedup": round(best[False] / best[True], 3),
               "max_abs_diff": err}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def near_tie_gaps(llm, prompts: list[dict], ids: list[list[int]], ref: list[list[int]], max_tokens: int) -> list[float]:
    """For each output of `ids` that differs from `ref` (the plain engine's, `llm`): the plain run's logprob gap
    between its two most likely tokens at the first differing position.

    NOTE: in bfloat16 a verify chunk's GEMMs and attention have other shapes than a one-token decode step's, so their
    rounding differs; that flips a greedy token only at a near-tie (a gap of a few hundredths of a nat at the
    built-in model's logit scale). A large gap would mean a real difference: a bug to chase, not rounding."""
    from deepinfer.engine.sampling import SamplingParams

    gaps = []
    for prompt, got, want in zip(prompts, ids, ref):
        if got == want:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if i >= min(len(got), len(want)):
            gaps.append(float("nan"))  # one is a prefix of the other: a stop landed differently
            continue
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=min(i + 1, max_tokens), logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        top = out.logprobs[i].top_logprobs
        gaps.append(round(top[0] - top[1], 4) if len(top) > 1 else float("nan"))
    return gaps


def profile_cost(args) -> dict:
    """`--profile-cost`: measure and write the step-cost table (`engine.spec_decode.step_cost`)."""
    from deepinfer.engine.builtin_model import builtin_model_path
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.spec_decode.step_cost import profile_step_cost

    if not args.json:
        raise SystemExit("--profile-cost writes its table to --json FILE; give one")
    path = args.model or str(builtin_model_path())
    model, _ = load_checkpoint(path, device=args.device)
    table = profile_step_cost(model, [int(b) for b in args.batch_sizes.split(",")], args.max_drafts,
                              context=args.context, repeats=args.repeats,
                              log=lambda row: print(json.dumps(row), flush=True))
    table.meta.update(model=path if args.model else "builtin", machine=platform.platform(), cpus=os.cpu_count(),
                      threads=args.threads)
    table.save(args.json)
    return table.to_dict()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,4,16")
    ap.add_argument("--ks", default="0,1,2,3,3c")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--verify-forward", action="store_true", help="only time one verify forward (see above)")
    ap.add_argument("--context", type=int, default=512, help="tokens before each verify chunk (--verify-forward)")
    ap.add_argument("--profile-cost", action="store_true", help="write the step-cost table (see above) to --json")
    ap.add_argument("--max-drafts", type=int, default=3, help="drafts per request of the table (--profile-cost)")
    ap.add_argument("--model", default=None, help="checkpoint (--profile-cost; default the built-in model)")
    ap.add_argument("--device", default="cpu", help="torch device (the sweep, --profile-cost)")
    ap.add_argument("--dtype", default="float32", help="the sweep's engine dtype (bfloat16 on a GPU)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    loadavg_start = os.getloadavg()
    if args.profile_cost:
        return profile_cost(args)
    if args.verify_forward:
        rows = verify_forward([int(b) for b in args.batch_sizes.split(",")], args.context, args.repeats)
        report = {"machine": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
                  "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "verify_forward": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        return report
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling import SamplingParams

    ks = args.ks.split(",")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llms = {k: LLM(device=args.device, dtype=args.dtype, max_num_seqs=max(sizes), speculative_tokens=int(k.rstrip("cdpe")),
                   verify_schedule="confidence" if ("c" in k or "d" in k) else "full", enforce_eager="e" in k)
            for k in ks}
    for k, llm in llms.items():
        if "p" in k:
            llm.engine.spec.batched_verify = False
        if "d" in k:  # the fallback confidences: the drafts' MTP probabilities
            llm.engine.spec.confidence_head = None
            llm.engine.spec.drafter.keep_features = False
    results = []
    for b in sizes:
        prompts = [{"prompt_token_ids": p} for p in workload(b, args.seed)]
        best: dict[int, float] = {}
        best_cpu: dict[int, float] = {}
        stats: dict[int, dict] = {}
        changed: dict[str, int] = {}
        gaps: dict[str, list[float]] = {}
        ref = None
        for _ in range(args.repeats):
            for k in ks:
                llm = llms[k]
                spec = llm.engine.spec
                if spec is not None:
                    spec.metrics = type(spec.metrics)(spec.num_draft_tokens)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0, c0 = time.perf_counter(), time.process_time()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                best_cpu[k] = min(best_cpu.get(k, float("inf")), time.process_time() - c0)
                ids = [o.outputs[0].token_ids for o in outs]
                if ref is None:
                    ref = ids
                elif ids != ref:
                    # NOTE: in float32 speculation must not change a greedy token; in bfloat16 a verify chunk's
                    # rounding differs from a one-token step's, so a near-tie may flip: counted, not fatal
                    if args.dtype == "float32":
                        raise AssertionError(f"k={k} changed a greedy output at batch {b}")
                    changed[k] = sum(a != r for a, r in zip(ids, ref))
                    if k not in gaps:
                        gaps[k] = near_tie_gaps(llms[ks[0]], prompts, ids, ref, args.max_tokens)
                best[k] = min(best.get(k, float("inf")), dt)
                if spec is not None:
                    stats[k] = spec.metrics.as_dict()
        num_out = sum(len(x) for x in ref)
        for k in ks:
            row = {"batch": b, "k": k, "output_tokens": num_out, "best_s": round(best[k], 4),
                   "tokens_per_s": round(num_out / best[k], 1), "speedup": round(best[ks[0]] / best[k], 3),
                   "best_cpu_s": round(best_cpu[k], 4), "cpu_speedup": round(best_cpu[ks[0]] / best_cpu[k], 3),
                   "outputs_changed": changed.get(k, 0)}
            if k in gaps:
                row["changed_top2_logprob_gaps"] = gaps[k]
            spec = llms[k].engine.spec
            if spec is not None:
                row["verify_graphs"] = spec.graphs is not None
                if spec.graphs is not None:
                    row["verify_graph_stats"] = dict(spec.graphs.stats)
                draft_graphs = getattr(spec.drafter, "graphs", None)
                if draft_graphs is not None:
                    row["draft_graph_stats"] = dict(draft_graphs.stats)
            if k in stats:
                s = stats[k]
                row.update(mean_accepted_length=round(s["mean_accepted_length"], 3),
                           acceptance_rate_per_position=[round(x, 3) for x in s["acceptance_rate_per_position"]],
                           verified_tokens_per_step=round(s["verified_tokens_per_step"], 2),
                           verified_drafts=s["num_verified_drafts"], proposed_drafts=s["num_proposed_drafts"])
            results.append(row)
            print(json.dumps(row), flush=True)
    report = {"machine": platform.platform(), "cpus": os.cpu_count(), "threads": args.threads,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "dtype": args.dtype,
              "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
