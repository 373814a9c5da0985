"""The disaggregated path on one GPU (issue 22 §7): per request, the KV transfer time and the time to first token
through a prefill + decode cluster on one device, against one colocated instance on the same device.

    python -m deepinfer.benchmarks.pd_gpu [--config flash-kv-4l|small|tiny] [--device cuda:0] [--dtype bfloat16]
        [--prompt-lens 512,2048,8192] [--reps 3] [--max-tokens 8] [--json OUT]
    python -m deepinfer.benchmarks.pd_gpu --smoke [--json OUT]     # the CPU: tiny, float32, short prompts

Setup: a random checkpoint written on the spot (the device carry leaves the built-in model out):
`flash-kv-4l` is `benchmarks.gpu_roofline`'s V4-Flash-shaped 4-layer stack (SWA, SWA, CSA, HCA) with V4-Flash's
attention and cache widths, so the compressed KV and bounded state per token and layer, hence the bytes a
transfer moves, are V4-Flash's, but 8 routed experts (top-6) and a 16,384-token vocabulary, so that it writes
and loads in seconds; `small` and `tiny` are the test presets. Both modes run the same engine settings
(`--max-num-seqs`, `--num-blocks`, `max_model_len` = the longest prompt + `--max-tokens` rounded up, the
dtype, backends "auto": the Triton ones and CUDA-graph decode on a GPU).

Modes, run one after the other, each request alone (no other load), fresh prompt ids per request (no prefix
hits), greedy with `ignore_eos`; one warm-up request per prompt length before the timed ones:

- `colocated`: the offline `Engine` in one spawned process (`benchmarks.serving.EngineProcess`): TTFT =
  `add_request` + `step()` until the request's first (and only, `max_tokens=1`) token. No RPC: an upper bound
  for a colocated server.
- `disaggregated`: `benchmarks.serving.LocalCluster`: two balancers, a prefill and a decode worker on the same
  device (`--loopback-ucx`: `UCX_TLS=cuda_copy,cuda_ipc,tcp,self` on a GPU, `cma,tcp,self` on the CPU) and the
  entrypoint, each its own process; this process is the client. Per request: TTFT = the first streamed token
  (`Client.stream`, `--max-tokens` tokens), the transfer time = the prefill worker's
  `kv_transfer_send_seconds_sum` delta (its NIXL WRITE, post to DONE as its engine loop sees it: the loop polls
  every millisecond while a send is in flight, so a WRITE shorter than that reads as up to ~1 ms), the bytes = its `kv_transfer_sent_bytes_total` delta (prompt blocks + the bounded-state slot) and
  how many of them went VRAM -> VRAM (`kv_transfer_sent_bytes_vram_to_vram_total`). Also `workers_direct`
  (`benchmarks.serving.direct_latencies`): the same prompts straight to the workers, Reserve / Prefill (prefill
  + WRITE) / Start, so the entrypoint's and balancers' share shows.

The JSON (`--json`) is rewritten after every prompt length, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from deepinfer.benchmarks.serving import EngineProcess, LocalCluster, _save, direct_latencies, wait_until_serving

CONFIGS = ("flash-kv-4l", "small", "tiny")
STARTUP_TIMEOUT_S = 300.0
"""Each start-up wave of the cluster (a cold GPU start compiles the Triton kernels and captures decode graphs)."""


def checkpoint_config(name: str) -> str | dict:
    """A `make_checkpoint` preset name, or the transformers-style config dict of `flash-kv-4l`."""
    if name != "flash-kv-4l":
        return name
    from deepinfer.benchmarks.gpu_roofline import v4_flash_4l

    cfg = v4_flash_4l()
    cfg.update(vocab_size=16384, n_routed_experts=8, num_experts_per_tok=6)
    return cfg


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _prompts(vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(count)]


def _wait_sends(cluster: LocalCluster, before: int, n: int, timeout_s: float = 30.0) -> dict:
    """The prefill worker's stats once `n` more sends are done than `before` (its engine loop reports a WRITE's
    DONE on its own schedule, after or before the decode side saw the notification)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = cluster.stats("prefill")
        if stats["kv_transfer_sends_done_total"] - before >= n or time.monotonic() > deadline:
            return stats
        time.sleep(0.01)


def measure_cluster_request(cluster: LocalCluster, client, prompt: list[int], max_tokens: int) -> dict:
    """One request through the entrypoint: TTFT and end-to-end seconds, and its KV transfer (prefill stats deltas)."""
    p0 = cluster.stats("prefill")
    t0 = time.monotonic()
    ttft = None
    num_tokens = 0
    for delta in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if delta["error"]:
            raise RuntimeError(f"request failed: {delta['error']}")
        if delta["token_ids"] and ttft is None:
            ttft = time.monotonic() - t0
        num_tokens += len(delta["token_ids"])
    e2e = time.monotonic() - t0
    p1 = _wait_sends(cluster, p0["kv_transfer_sends_done_total"], 1)

    def d(key: str):
        return p1.get(key, 0) - p0.get(key, 0)

    if d("kv_transfer_sends_done_total") != 1:
        raise RuntimeError(f"expected one KV send for the request, the prefill counted {d('kv_transfer_sends_done_total')}")
    seconds, nbytes = d("kv_transfer_send_seconds_sum"), d("kv_transfer_sent_bytes_total")
    return {"ttft_s": ttft, "e2e_s": e2e, "num_tokens": num_tokens, "transfer_s": seconds, "transfer_bytes": nbytes,
            "vram_to_vram_bytes": d("kv_transfer_sent_bytes_vram_to_vram_total"),
            "transfer_gbps": nbytes / seconds / 1e9 if seconds > 0 else None}


def _case_summary(case: dict) -> dict:
    dis, col = case["disaggregated"], case["colocated"]
    out = {
        "colocated_ttft_ms_p50": _ms(_median(col["ttft_s"])),
        "disaggregated_ttft_ms_p50": _ms(_median([r["ttft_s"] for r in dis])),
        "transfer_ms_p50": _ms(_median([r["transfer_s"] for r in dis])),
        "transfer_bytes": statistics.median_low([r["transfer_bytes"] for r in dis]) if dis else None,
        "transfer_gbps_p50": _median([r["transfer_gbps"] for r in dis if r["transfer_gbps"] is not None]),
        "all_bytes_vram_to_vram": all(r["vram_to_vram_bytes"] == r["transfer_bytes"] for r in dis),
    }
    direct = case.get("workers_direct")
    if direct:
        out["workers_direct_ms_p50"] = {k: _ms(_median(v)) for k, v in direct.items()}
    if out["colocated_ttft_ms_p50"] and out["disaggregated_ttft_ms_p50"]:
        out["ttft_added_ms_p50"] = out["disaggregated_ttft_ms_p50"] - out["colocated_ttft_ms_p50"]
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def machine_info(device: str) -> dict:
    import torch

    info = {"hostname": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "os_cpu_count": os.cpu_count(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            info["nixl"] = f"{dist} {version(dist)}"
            break
        except PackageNotFoundError:
            continue
    return info


def run(args: argparse.Namespace) -> dict:
    """Blocks for the whole benchmark; returns the results (also written to `--json` as it goes)."""
    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.engine.testing.presets import get_preset
    from deepinfer.entrypoint.client import Client

    lens = [int(x) for x in args.prompt_lens.split(",")]
    max_model_len = -(-(max(lens) + args.max_tokens + 1) // 256) * 256
    preset = checkpoint_config(args.config)
    hf = get_preset(preset).hf_config() if isinstance(preset, str) else preset
    mc = ModelConfig.from_hf_dict(hf)
    if max_model_len > mc.max_position_embeddings:
        raise SystemExit(f"--prompt-lens up to {max(lens)} need max_model_len {max_model_len}, over the config's "
                         f"{mc.max_position_embeddings} positions")
    num_blocks = args.num_blocks
    engine_kwargs = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs, num_blocks=num_blocks,
                         max_model_len=max_model_len)
    worker_args = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
                   "--num-blocks", str(num_blocks), "--max-model-len", str(max_model_len)]
    results = {"benchmark": "pd_gpu", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "machine": machine_info(args.device), "config": args.config, "dtype": args.dtype,
               "engine": engine_kwargs, "max_tokens": args.max_tokens, "reps": args.reps, "cases": []}
    with tempfile.TemporaryDirectory(prefix="pd_gpu_") as tmp:
        t0 = time.monotonic()
        ckpt = str(make_checkpoint(Path(tmp) / "ckpt", preset=preset, seed=args.seed, dtype=args.dtype))
        results["checkpoint_write_s"] = time.monotonic() - t0
        print(f"checkpoint {args.config} ({args.dtype}) written in {results['checkpoint_write_s']:.1f} s", flush=True)
        vocab = mc.vocab_size
        prompts = {n: _prompts(vocab, n, args.reps + 1, args.seed * 1000 + i) for i, n in enumerate(lens)}
        cases = {n: {"prompt_len": n, "colocated": {}, "disaggregated": []} for n in lens}

        # colocated first: its start also compiles the Triton kernels into the cache the workers then read
        t0 = time.monotonic()
        engine = EngineProcess(ckpt, args.engine_threads, engine_kwargs)
        results["colocated_start_s"] = time.monotonic() - t0
        try:
            for n in lens:
                lat = engine.single_latencies(prompts[n])  # the first is the warm-up
                cases[n]["colocated"] = {"ttft_s": lat[1:], "warmup_s": lat[0]}
                print(f"colocated    len {n:6d}: TTFT p50 {_ms(_median(lat[1:])):9.2f} ms", flush=True)
        finally:
            engine.close()

        other = _prompts(vocab, 1, 1, args.seed + 7)[0]  # decorrelate the cluster's prompts from the colocated ones
        cl_prompts = {n: [[(t + other[0]) % (vocab - 2) + 2 for t in p] for p in prompts[n]] for n in lens}
        with tempfile.TemporaryDirectory(prefix="pd_gpu_logs_", dir=args.log_dir) as logdir:
            t0 = time.monotonic()
            cluster = LocalCluster(ckpt, args.engine_threads, worker_args, Path(logdir),
                                   startup_timeout_s=args.startup_timeout_s)
            client = None
            try:
                client = Client(cluster.info["entrypoint"]["address"], timeout_s=120.0)
                wait_until_serving(client, 120.0)
                results["cluster_start_s"] = time.monotonic() - t0
                for n in lens:
                    case = cases[n]
                    warm, *timed = cl_prompts[n]
                    measure_cluster_request(cluster, client, warm, args.max_tokens)
                    case["disaggregated"] = [measure_cluster_request(cluster, client, p, args.max_tokens)
                                             for p in timed]
                    if args.direct:
                        fresh = [[(t + 1) % (vocab - 2) + 2 for t in p] for p in timed]
                        case["workers_direct"] = direct_latencies(cluster, fresh)
                    case["summary"] = _case_summary(case)
                    results["cases"].append(case)
                    _save(results, args.json)
                    s = case["summary"]
                    print(f"disaggregated len {n:6d}: TTFT p50 {s['disaggregated_ttft_ms_p50']:9.2f} ms "
                          f"(colocated {s['colocated_ttft_ms_p50']:.2f}), KV {s['transfer_bytes']} B in "
                          f"{s['transfer_ms_p50']:.3f} ms, VRAM->VRAM {s['all_bytes_vram_to_vram']}", flush=True)
                results["prefill_stats"] = {k: v for k, v in cluster.stats("prefill").items()
                                            if k.startswith("kv_transfer_")}
            finally:
                if client is not None:
                    client.close()
                cluster.stop()
                if args.keep_logs:  # the workers' logs (UCX warnings, start-up) beside the JSON
                    dest = Path(args.keep_logs)
                    dest.mkdir(parents=True, exist_ok=True)
                    for f in Path(logdir).iterdir():
                        (dest / f.name).write_bytes(f.read_bytes()[-200_000:])
    _save(results, args.json)
    print(format_table(results), flush=True)
    return results


def format_table(results: dict) -> str:
    """The per-length medians as a markdown table (what BENCHMARKS.md shows)."""
    def f(x, spec=".2f"):
        return "–" if x is None else format(x, spec)

    rows = ["| prompt tokens | KV bytes / request | transfer ms (p50) | GB/s | VRAM->VRAM | TTFT colocated ms | "
            "TTFT disaggregated ms | added ms | direct: prefill+WRITE ms |",
            "|---:|---:|---:|---:|:---:|---:|---:|---:|---:|"]
    for case in results["cases"]:
        s = case["summary"]
        direct = (s.get("workers_direct_ms_p50") or {}).get("prefill")
        rows.append(f"| {case['prompt_len']:,} | {f(s['transfer_bytes'], ',')} | {f(s['transfer_ms_p50'], '.3f')} | "
                    f"{f(s['transfer_gbps_p50'])} | {'yes' if s['all_bytes_vram_to_vram'] else 'no'} | "
                    f"{f(s['colocated_ttft_ms_p50'])} | {f(s['disaggregated_ttft_ms_p50'])} | "
                    f"{f(s.get('ttft_added_ms_p50'))} | {f(direct)} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash-kv-4l", choices=CONFIGS)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--prompt-lens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=3, help="timed requests per prompt length and mode (+1 warm-up)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per disaggregated request (TTFT is the first)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of each engine process")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-direct", dest="direct", action="store_false",
                    help="skip the straight-to-workers phase breakdown")
    ap.add_argument("--startup-timeout-s", type=float, default=STARTUP_TIMEOUT_S)
    ap.add_argument("--log-dir", default=None, help="where the cluster's process logs are written (a temp dir in it)")
    ap.add_argument("--keep-logs", default=None, help="copy the cluster's process logs (tails) to this folder")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="a fast CPU run: tiny, float32, prompts of 16 and 80 tokens, one timed request each")
    args = ap.parse_args(argv)
    if args.smoke:
        args.config, args.device, args.dtype = "tiny", "cpu", "float32"
        args.prompt_lens, args.reps, args.max_tokens, args.num_blocks = "16,80", 1, 3, 64
    return args


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
