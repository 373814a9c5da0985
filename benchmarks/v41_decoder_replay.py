"""DeepSeek-V4.1's decoder-side bounded replay in the paged prefill: time and FLOPs with it on and off.

    python -m deepinfer.benchmarks.v41_decoder_replay [--prompt-len 2048] [--chunk 2048] [--layers 16]
        [--hidden 256] [--window 128] [--reps 3] [--device cpu] [--threads N] [--json OUT]
    python -m deepinfer.benchmarks.v41_decoder_replay --shape flash --device cuda --dtype bfloat16 \
        --prompt-len 8192,32768 --chunk 4096 --layers 10 --experts 8    # the H200 run (issue 28's benchmark)

A random-weight V4.1-shaped model (`random_v41_model`, float32): layers 0-1 window only, then ratio-2 layers with
a KV source at layer 2, then ratio-1 layers from a KV source at `--layers // 2` on (DeepSeek-V4.1-Flash: 40 layers,
last KV source 20, so 19 layers after it; here `layers - layers // 2 - 1` of them), Engram at layers 1 and 4. One
prompt of `--prompt-len` tokens is prefilled through the model's paged step (`DeepseekV41ForCausalLM.step` over a
`V41KVCache`, chunks of `--chunk` tokens, the prompt's length given to the step as the engine gives it) with
`decoder_replay` off (every layer over every token) and on (the layers after the last KV source over the last
`--window` tokens only). Reported per case: matmul FLOPs of the whole prefill (`torch.utils.flop_counter`: every
mm / bmm / einsum the step runs, attention included), the median wall time over `--reps` runs (each from an empty
cache after one untimed warm-up (the FLOP count's), on and off alternating, so other load falls on both alike; and the
process CPU time, less sensitive to other processes on a shared host), and the last position's logits difference
(on vs off; a random model, so only the order of magnitude means anything) with whether their argmax agrees.

`--shape flash`: DeepSeek-V4.1-Flash's widths (`flash_config`: hidden 5120, 64 heads x 512, q_lora 1280, o_groups
8 x 1024, index 32 heads x 128 with top-512, candidate blocks 2048 x 8, hc 4 with 20 Sinkhorn iterations, experts of
width 2304 top-6, vocab 129280, Engram 8 heads x 256 over 3 n-gram orders) on a short stack of the same kinds
(`--layers`, `--experts` routed experts, Engram tables of ~1M rows from `--engram-vocab`), drawn on `--device`.
Several `--prompt-len` values run one after another on the same model; the JSON then holds one result per length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def medium_config(layers: int, hidden: int, window: int) -> dict:
    """The text config of the benchmark's model (see the module docstring)."""
    if layers < 6:
        raise ValueError("--layers must be at least 6 (window, ratio-2 and ratio-1 layers and the Engram layers)")
    src1 = layers // 2
    ratios = [0, 0] + [2] * (src1 - 2) + [1] * (layers - src1)
    index = sorted({2, src1, *range(src1 + 2, layers, 2)})
    return {
        "vocab_size": 256, "hidden_size": hidden, "moe_intermediate_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 32, "q_lora_rank": hidden // 2,
        "o_lora_rank": 64, "o_groups": 2, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
        "max_position_embeddings": 65536, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 4096},
        "n_routed_experts": 8, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "sliding_window": window, "compress_ratios": ratios,
        "kv_source_layer_ids": [2, src1], "index_source_layer_ids": index, "index_n_heads": 2, "index_head_dim": 64,
        "index_topk": 64, "candidate_source_layer_id": src1, "candidate_topk_blocks": 8, "candidate_block_size": 16,
        "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6, "engram_layer_ids": [1, 4],
        "engram_num_embeddings": [72, 138], "engram_max_ngram_size": 3, "engram_vocab_size": 13, "engram_n_heads": 2,
        "engram_head_dim": 32, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 20,
        "num_nextn_predict_layers": 0,
    }


def flash_config(layers: int, experts: int, window: int, engram_vocab: int = 40000) -> dict:
    """The text config of `--shape flash`: V4.1-Flash's widths (tests/engine/v41/configs.py `flash_config` holds the
    published file) on `layers` layers laid out as `medium_config`'s (Flash: 40 layers, KV sources 2, 8, 14, 20;
    here two sources, the second at `layers // 2`, so that about half the stack follows the last one, as in Flash)."""
    from deepinfer.engine.config import engram_primes

    text = medium_config(layers, 5120, window)
    src1 = layers // 2
    engram_layers = [1, src1 - 1]
    primes = engram_primes(tuple(engram_layers), 4, 8, engram_vocab)
    text.update({
        "vocab_size": 129280, "moe_intermediate_size": 2304, "num_attention_heads": 64, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8,
        "max_position_embeddings": 1048576,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": experts, "num_experts_per_tok": min(6, experts),
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_topk_blocks": 2048,
        "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "engram_layer_ids": engram_layers, "engram_num_embeddings": [sum(map(sum, p)) for p in primes],
        "engram_max_ngram_size": 4, "engram_vocab_size": engram_vocab, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_compressed_vocab_size": 99092,
    })
    return text


def prefill(model, ids: list[int], chunk: int, device) -> torch.Tensor:
    """One prompt through the paged step from an empty cache; the last position's logits [vocab]."""
    from deepinfer.engine.cache.v41 import V41KVCache
    from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk

    block = 64
    nblocks = -(-len(ids) // block)
    cache = V41KVCache(model.config, nblocks, block, 1, device=device)
    table, out = list(range(nblocks)), None
    for a in range(0, len(ids), chunk):
        part = ids[a:a + chunk]
        batch = ForwardBatch.build([part], [SeqChunk(0, table, a, len(part), 0, 0, len(ids))], device=device)
        batch.attn_metadata = model.build_attention_metadata(batch, cache)
        out = model.step(batch, cache)[0]
    return out


def run_length(model, text: dict, prompt_len: int, chunk: int, reps: int, device: str) -> dict:
    """Replay off and on for one prompt length: FLOPs, times and the last logits' difference (module docstring)."""
    from torch.utils.flop_counter import FlopCounterMode

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    ids = torch.randint(3, text["vocab_size"], (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    res: dict = {"prompt_len": prompt_len, "chunk": chunk, "cases": {}}
    logits = {}
    for on in (False, True):
        model.decoder_replay = on
        with FlopCounterMode(display=False) as fc:
            logits[on] = prefill(model, ids, chunk, device).float()
        res["cases"]["on" if on else "off"] = {"flops": fc.get_total_flops(), "seconds": [], "cpu_seconds": []}
    for _ in range(reps):
        for on in (False, True):
            model.decoder_replay = on
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            prefill(model, ids, chunk, device)
            sync()
            case = res["cases"]["on" if on else "off"]
            case["seconds"].append(time.perf_counter() - t0)
            case["cpu_seconds"].append(time.process_time() - c0)
    for case in res["cases"].values():
        case["median_s"] = statistics.median(case["seconds"])
        case["median_cpu_s"] = statistics.median(case["cpu_seconds"])
        case["min_s"], case["min_cpu_s"] = min(case["seconds"]), min(case["cpu_seconds"])
        case["tflops_per_s"] = case["flops"] / case["median_s"] / 1e12
    off, on = res["cases"]["off"], res["cases"]["on"]
    res["flops_ratio"] = on["flops"] / off["flops"]
    res["time_ratio"] = on["median_s"] / off["median_s"]
    res["cpu_time_ratio"] = on["median_cpu_s"] / off["median_cpu_s"]
    diff = (logits[True] - logits[False]).abs().max().item()
    res["last_logits_max_abs_diff"] = diff
    res["last_logits_rel_diff"] = diff / logits[False].abs().max().item()
    res["argmax_equal"] = bool(logits[True].argmax() == logits[False].argmax())
    return res


def main(argv: list[str] | None = None) -> dict:
    from deepinfer.engine.config import V41Config
    from deepinfer.engine.models.deepseek_v41 import cast_for_engine
    from deepinfer.engine.testing.make_checkpoint import random_v41_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", default="2048", help="one length or several, comma-separated")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (the engine's max_num_batched_tokens)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shape", choices=("medium", "flash"), default="medium")
    ap.add_argument("--hidden", type=int, default=256, help="--shape medium only")
    ap.add_argument("--experts", type=int, default=8, help="--shape flash: routed experts (top-6 of them)")
    ap.add_argument("--engram-vocab", type=int, default=40000,
                    help="--shape flash: Engram bucket primes start here (24 of them a layer: ~24x this many rows)")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in str(args.prompt_len).split(",")]

    if args.shape == "flash":
        text = flash_config(args.layers, args.experts, args.window, args.engram_vocab)
    else:
        text = medium_config(args.layers, args.hidden, args.window)
    cfg = V41Config.from_hf_dict({"model_type": "deepseek_v41", "text_config": text})
    model = random_v41_model(cfg, seed=0, device=args.device)
    model = cast_for_engine(model, getattr(torch, args.dtype)).eval()  # compressors etc. stay float32, as loaded
    params = sum(p.numel() for p in model.parameters())
    head = {"config": {k: text[k] for k in ("num_hidden_layers", "hidden_size", "sliding_window", "n_routed_experts",
                                            "kv_source_layer_ids", "compress_ratios")},
            "shape": args.shape, "dtype": args.dtype, "params": params, "device": args.device,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "threads": torch.get_num_threads()}
    runs = []
    for n in lengths:
        with torch.inference_mode():
            r = run_length(model, text, n, args.chunk, args.reps, args.device)
        runs.append(r)
        print(f"V4.1 paged prefill ({args.shape}, {args.dtype}), {n} tokens (chunks of {args.chunk}), {args.layers} "
              f"layers (last KV source {text['kv_source_layer_ids'][-1]}), hidden {text['hidden_size']}, window "
              f"{args.window}, {params / 1e9:.2f} B params, {head['device_name']}, {torch.get_num_threads()} threads")
        print("| decoder replay | matmul GFLOP | wall s (median / min) | TFLOP/s | process CPU s (median / min) |\n"
              "|---|---|---|---|---|")
        for name in ("off", "on"):
            c = r["cases"][name]
            print(f"| {name} | {c['flops'] / 1e9:.2f} | {c['median_s']:.3f} / {c['min_s']:.3f} | "
                  f"{c['tflops_per_s']:.1f} | {c['median_cpu_s']:.3f} / {c['min_cpu_s']:.3f} |")
        print(f"on/off: FLOPs {r['flops_ratio']:.3f}, wall {r['time_ratio']:.3f}, CPU {r['cpu_time_ratio']:.3f}; "
              f"last logits max |diff| {r['last_logits_max_abs_diff']:.4g} "
              f"({100 * r['last_logits_rel_diff']:.2f} % of the largest), argmax equal: {r['argmax_equal']}")
    # one length: the result flat, as before (its keys beside the run's); several: a list under "runs"
    res = {**head, **runs[0]} if len(runs) == 1 else {**head, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
