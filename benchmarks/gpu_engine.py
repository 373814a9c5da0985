"""Engine throughput on a CUDA GPU with a larger random-weight V4 preset in bf16.

    python -m deepinfer.benchmarks.gpu_engine [--preset-scale medium] [--batches 1,32,128] [--skip-hf] [--json OUT]
        [--attention-backend NAME] [--moe-backend NAME] [--enforce-eager] [--batch-invariant]

The engine runs with its CUDA defaults: overlapped scheduling (the threaded executor) and, when the
backends are graph-safe, CUDA-graph decode (`--enforce-eager` turns graphs off).

1. Decode tokens/s at fixed batch sizes: B requests (prompt 128 random tokens) are prefilled,
   then `--decode-steps` engine steps that each decode one token for all B are timed
   (`torch.cuda.synchronize` around the timed region).
2. Offline throughput: 64 requests, prompts uniform in [16, 512], outputs uniform in [64, 256]
   (seed 0), ours `LLM.generate` vs HF `generate` (batches of 16 sorted by length, left-padded,
   greedy, `eos_token_id=None`); output tokens/s counts each request's own `max_tokens`.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.llm import LLM
from deepinfer.engine.sampling import SamplingParams
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.presets import get_preset

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def medium_config() -> dict:
    """hidden 2048, 8 layers, 64 experts (top-6): the issue's 'larger random preset'."""
    cfg = get_preset("small").hf_config()
    cfg.update(
        vocab_size=32768, hidden_size=2048, moe_intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=16, head_dim=128, q_lora_rank=512, o_groups=4, o_lora_rank=256,
        n_routed_experts=64, num_experts_per_tok=6, hc_mult=4, index_n_heads=16, index_head_dim=64,
        index_topk=128, sliding_window=128, compress_rates={CSA: 4, HCA: 128},
        layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6, max_position_embeddings=8192,
    )
    return cfg


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_rate(path: str, batch: int, steps: int, dtype: str, device: str, **engine_kw) -> dict:
    eng = Engine(EngineConfig(model=path, dtype=dtype, device=device, max_num_seqs=max(batch, 1),
                              max_num_batched_tokens=8192, max_model_len=1024, enable_prefix_caching=False,
                              **engine_kw))
    g = random.Random(batch)
    vocab = eng.model_config.vocab_size
    for i in range(batch):
        eng.add_request(str(i), [g.randrange(2, vocab) for _ in range(128)],
                        SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    # NOTE: warm up until every request decodes and no new CUDA graph is captured for 3 steps: graphs are captured
    # lazily per batch bucket, and a capture inside the timed window (H200, 2026-12-05: 11 captures at batch 128,
    # 103 ms a step) measured the capture, not the decode
    graphs = eng.runner.cuda_graphs
    stable, last = 0, None
    for _ in range(64):
        eng.step()
        caps = graphs.stats.get("captures", 0) if graphs is not None else 0
        stable = stable + 1 if caps == last else 0
        last = caps
        if stable >= 3 and not eng.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running.values()):
            break
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    dt = time.perf_counter() - t0
    eng.shutdown()
    return {"batch": batch, "steps": steps, "seconds": dt, "tokens_per_s": batch * steps / dt,
            "ms_per_step": 1000 * dt / steps, "cuda_graphs": dict(graphs.stats) if graphs is not None else None,
            "cuda_graph_blockers": eng.runner.cuda_graph_blockers}


def workload(n: int = 64, seed: int = 0, vocab: int = 32768):
    g = random.Random(seed)
    prompts = [[g.randrange(2, vocab) for _ in range(g.randint(16, 512))] for _ in range(n)]
    outs = [g.randint(64, 256) for _ in range(n)]
    return prompts, outs


def offline_ours(path: str, prompts, outs, dtype: str, device: str, **engine_kw) -> dict:
    llm = LLM(path, dtype=dtype, device=device, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=1024,
              **engine_kw)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warmup
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    sync()
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    dt = time.perf_counter() - t0
    n_out = sum(len(r.outputs[0].token_ids) for r in res)
    return {"seconds": dt, "output_tokens": n_out, "output_tokens_per_s": n_out / dt,
            "timings": dict(llm.engine.timings)}


def offline_hf(path: str, prompts, outs, dtype: str, device: str, batch_size: int = 16) -> dict:
    import transformers

    tdt = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=tdt).to(device).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        for a in range(0, len(order), batch_size):
            idx = order[a:a + batch_size]
            L = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), L, dtype=torch.long)
            mask = torch.zeros(len(idx), L, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, L - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[r, L - len(prompts[i]):] = 1
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                           max_new_tokens=max(outs[i] for i in idx), eos_token_id=None, pad_token_id=0)
    sync()
    dt = time.perf_counter() - t0
    n_out = sum(outs)
    return {"seconds": dt, "output_tokens": n_out, "output_tokens_per_s": n_out / dt, "batch_size": batch_size}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.gpu_engine")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--preset", default=None, help="use a named preset instead of the medium config (smoke runs)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--attention-backend", default="auto", help="auto: the engine's default for the device")
    ap.add_argument("--moe-backend", default="auto")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine in batch-invariant mode (issue 23: its cost is this run against one without)")
    args = ap.parse_args(argv)
    engine_kw = {"attention_backend": args.attention_backend, "moe_backend": args.moe_backend,
                 "enforce_eager": args.enforce_eager, "batch_invariant": args.batch_invariant}
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    path = str(make_checkpoint(tmp / "medium", preset=args.preset or medium_config(), seed=0, dtype=args.dtype))
    print(f"checkpoint written in {time.perf_counter() - t0:.1f}s", flush=True)
    report = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "decode": [], **engine_kw}
    for b in [int(x) for x in args.batches.split(",")]:
        r = decode_rate(path, b, args.decode_steps, args.dtype, args.device, **engine_kw)
        print(f"decode batch {b:4d}: {r['tokens_per_s']:10.1f} tok/s  ({r['ms_per_step']:.2f} ms/step)", flush=True)
        report["decode"].append(r)
    if not args.skip_offline:
        prompts, outs = workload()
        ours = offline_ours(path, prompts, outs, args.dtype, args.device, **engine_kw)
        print(f"offline ours: {ours['output_tokens_per_s']:.1f} output tok/s in {ours['seconds']:.1f}s "
              f"timings {ours['timings']}", flush=True)
        report["offline_ours"] = ours
        if not args.skip_hf:
            hf = offline_hf(path, prompts, outs, args.dtype, args.device)
            print(f"offline HF:   {hf['output_tokens_per_s']:.1f} output tok/s in {hf['seconds']:.1f}s", flush=True)
            report["offline_hf"] = hf
            report["ratio"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
            print(f"ratio ours/HF: {report['ratio']:.2f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
