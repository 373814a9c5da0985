"""What the HTTP front (FastAPI + deepseek-recipe) adds over the token-level gRPC API, on one cluster.

    python -m deepinfer.benchmarks.http_overhead [--model CKPT] [--num-sequential 30] [--num-concurrent 64]
        [--concurrency 8] [--stream-tokens 64] [--num-streams 3] [--json OUT]

Starts a live local cluster (tests/entrypoint/http/cluster.py: two balancers, one prefill and one decode worker,
the token entrypoint and the HTTP front, each a process on loopback) with the default model unless
`--model`, then measures, from this process as the client:

- `max_tokens=1` latency, sequential (one request at a time): `POST /v1/chat/completions`
  (non-streaming, thinking disabled, temperature 0; httpx keep-alive) vs `Client.generate` on the
  token API with the very prompt token ids recipe renders for that chat request, so both paths do
  the same prefill work (the same prompt every time: both hit the prefix cache alike after warm-up).
  added latency = HTTP mean - gRPC mean.
- `max_tokens=1` requests/s with `--concurrency` client threads, same two paths.
- streaming: `--num-streams` requests of `--stream-tokens` output tokens each (HTTP: SSE chat
  completion; gRPC: `Client.stream` with `ignore_eos`), inter-token latency = gap between
  consecutive deliveries at the client (a delivery of k tokens counts as k gaps of gap/k; HTTP SSE
  events carry one recipe delta each) and TPOT = (last - first delivery) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MESSAGES = [{"role": "user", "content": "What is 37 + 48?"}]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _summary(values_s: list[float]) -> dict:
    return {"mean_ms": statistics.fmean(values_s) * 1e3, "p50_ms": _pct(values_s, 0.5) * 1e3,
            "p99_ms": _pct(values_s, 0.99) * 1e3, "n": len(values_s)}


def _prompt_ids(model_dir: Path, model: str) -> list[int]:
    """The prompt token ids the HTTP front sends for the benchmark's chat request."""
    from deepinfer.entrypoint.http.conversion import CHAT, ImageUrlPolicy, RecipeFront

    front = RecipeFront(model_dir, model, 1 << 30, ImageUrlPolicy([]))
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "thinking": {"type": "disabled"}}
    return front.prepare(CHAT, json.dumps(body).encode()).prompt_token_ids


def run(model_dir: Path, args) -> dict:
    import httpx

    from deepinfer.entrypoint.client import Client
    from tests.entrypoint.http.cluster import LocalCluster

    model = model_dir.name
    prompt_ids = _prompt_ids(model_dir, model)
    body = {"model": model, "messages": MESSAGES, "max_tokens": 1, "temperature": 0,
            "thinking": {"type": "disabled"}}
    results: dict = {"model": str(model_dir), "prompt_tokens": len(prompt_ids)}
    with tempfile.TemporaryDirectory() as logdir, LocalCluster(model_dir, logdir, http_args=(
            "--max-inflight-requests", "1024")) as cluster, Client(cluster.grpc_address, timeout_s=120) as grpc_client:
        local = threading.local()

        def http_client() -> httpx.Client:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=cluster.http_url, timeout=120)
            return local.client

        def via_http() -> float:
            t = time.perf_counter()
            resp = http_client().post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            return time.perf_counter() - t

        def via_grpc() -> float:
            t = time.perf_counter()
            grpc_client.generate(prompt_ids, max_tokens=1, temperature=0.0)
            return time.perf_counter() - t

        for fn in (via_http, via_grpc) * 3:  # warm-up: connections, prefix cache
            fn()
        # sequential, interleaved so both paths see the same machine load
        seq = {"http": [], "grpc": []}
        for _ in range(args.num_sequential):
            seq["http"].append(via_http())
            seq["grpc"].append(via_grpc())
        results["sequential_max_tokens_1"] = {k: _summary(v) for k, v in seq.items()}
        results["added_latency_ms"] = (statistics.fmean(seq["http"]) - statistics.fmean(seq["grpc"])) * 1e3

        rps = {}
        for name, fn in (("grpc", via_grpc), ("http", via_http), ("grpc_again", via_grpc)):
            with ThreadPoolExecutor(args.concurrency) as pool:
                t = time.perf_counter()
                list(pool.map(lambda _, fn=fn: fn(), range(args.num_concurrent)))
                rps[name] = args.num_concurrent / (time.perf_counter() - t)
        results["requests_per_s_max_tokens_1"] = {"concurrency": args.concurrency, **rps}

        itl = {"http": [], "grpc": []}
        tpot = {"http": [], "grpc": []}
        stream_body = {**body, "max_tokens": args.stream_tokens, "stream": True}
        for _ in range(args.num_streams):
            stamps = []
            with http_client().stream("POST", "/v1/chat/completions", json=stream_body) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                        stamps.append((time.perf_counter(), 1))
            _add_stream(stamps, itl["http"], tpot["http"])
            stamps = []
            for delta in grpc_client.stream(prompt_ids, max_tokens=args.stream_tokens, temperature=0.0,
                                            ignore_eos=True):
                if delta["token_ids"]:
                    stamps.append((time.perf_counter(), len(delta["token_ids"])))
            _add_stream(stamps, itl["grpc"], tpot["grpc"])
        results["streaming"] = {"tokens_per_request": args.stream_tokens,
                                **{k: {"itl": _summary(itl[k]), "tpot": _summary(tpot[k])} for k in itl}}
    return results


def _add_stream(stamps: list[tuple[float, int]], itl: list[float], tpot: list[float]) -> None:
    for (t0, _), (t1, k) in zip(stamps, stamps[1:]):
        itl.extend([(t1 - t0) / k] * k)
    num_tokens = sum(k for _, k in stamps)
    if num_tokens > 1:
        tpot.append((stamps[-1][0] - stamps[0][0]) / (num_tokens - 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.http_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="checkpoint directory (default: the built-in default model)")
    parser.add_argument("--num-sequential", type=int, default=30)
    parser.add_argument("--num-concurrent", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument("--num-streams", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.model is None:
        from deepinfer.engine.testing.default_model import ensure_default_model

        args.model = Path(ensure_default_model())
    results = run(args.model, args)
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
