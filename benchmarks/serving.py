"""Online serving benchmark: a request-rate sweep, disaggregated 1P+1D against one colocated engine.

    python -m deepinfer.benchmarks.serving [--preset small] [--rates 1,2,4,8,16] [--num-requests 20] [--seed 0]
        [--prompt-len 32:256] [--output-len 32:128] [--fixed-len P,O] [--cpus 0-3]
        [--engine-threads 1] [--colocated-threads 1,2] [--modes disaggregated,colocated]
        [--overhead-requests 20] [--nixl-mb 64] [--ucx-tls TLS] [--json OUT] [--plot-dir DIR]
    python -m deepinfer.benchmarks.serving --plot-from OUT.json[,OUT2.json] --plot-dir DIR      # plots only

Workload (all of it fixed by `--seed`): each rate point sends `--num-requests` requests whose
arrival times are a Poisson process of that rate (unit exponential gaps drawn once, divided by the
rate, so every point has the same arrival shape), with prompt and output lengths uniform in
`--prompt-len` / `--output-len` (or all equal with `--fixed-len`). Lengths are the same at every
point and in every mode; the prompt token ids differ per point (ids in [2, vocab)) so that no
point hits the prefix cache left by an earlier one. Sampling is greedy with `ignore_eos`, so every
request produces exactly its `max_tokens`. A few warm-up requests run before each mode's sweep.

Modes (same checkpoint, same engine limits `--max-num-seqs` / `--max-num-batched-tokens` /
`--max-model-len`, same CPU set):

- `disaggregated`: two balancers (`python -m deepinfer.loadbalancer`: prefix_aware for prefill, kv_load for
  decode), one prefill and one decode worker (`python -m deepinfer.prefill_worker` /
  `decode_worker`, NIXL over UCX loopback, `OMP_NUM_THREADS=--engine-threads` each) and the
  entrypoint, each its own OS process. This process is the client: one thread per request calls
  `entrypoint.client.Client.stream` at the request's arrival time and stamps every delta. The
  sweep starts once a 1-token probe request succeeded. With `--bounded-state send|replay` the mode
  is named `disaggregated_send` / `disaggregated_replay` (the decode worker's flag); without it, the
  worker's default applies.
- `colocated` (one per `--colocated-threads` value, named `colocated_tN`): the code has no
  single worker process that serves both prefill and decode behind a socket (prefill_worker and
  decode_worker are prefill-only / decode-only), so "one colocated instance" is the offline
  `Engine` (what `LLM` drives) in one spawned process with N torch threads, serving the same
  request stream: its loop adds each request when its arrival time has passed, then runs one
  `step()` (continuous batching, chunked prefill) and stamps the new tokens after the step. That is
  what a colocated worker's engine loop would do, minus its gRPC server; so this mode pays no RPC,
  serialization or client cost, and its numbers are an upper bound for a colocated server.
  `colocated_t{2 x engine-threads}` uses as many compute threads as the two disaggregated workers.

Metrics per point (client-side times for `disaggregated`, engine-loop times for `colocated`):
TTFT = first token's time - scheduled arrival (queueing included); inter-token latency (ITL) =
gap between consecutive token deliveries of a request, a delivery of k tokens counting as k gaps
of gap/k; TPOT = (last - first token time) / (tokens - 1); output tokens/s and requests/s over the
point's span (first arrival to last completion). p50/p99 are linear-interpolation percentiles.

Also measured:
- `overhead_max_tokens_1`: sequential single requests (no other load) with `max_tokens=1` and
  prompts of `--overhead-prompt-len` tokens, wall time per request along three paths:
  `entrypoint` (Client.generate: entrypoint -> decode balancer Pick -> Decode.Reserve -> prefill
  balancer Pick -> Prefill.Prefill (prefill + NIXL write) -> Decode.Start stream), `workers_direct`
  (this process sends the same Reserve / Prefill / Start messages straight to the two workers: no
  entrypoint, no balancers) and `offline_engine` (`Engine.add_request` + `step()` until finished, in
  a process with `--engine-threads` threads, as the prefill worker). entrypoint - workers_direct is
  the latency the entrypoint and the balancers add; workers_direct - offline_engine is what the
  disaggregated workers add over running the engine in-process (gRPC, NIXL transfer, engine-loop
  wake-ups, the decode side's commit). NOTE: with `max_tokens=1` the decode side finishes the
  request when the KV lands, so this path never pays a bounded replay (the sweep does, in
  `--bounded-state replay`).
- `kv_transfer_in_sweep`: the prefill worker's kv_transfer counters after the sweep (bytes sent,
  mean post-to-DONE seconds per transfer).
- `nixl_vs_memcpy`: `benchmarks.kv_transfer.run` (NIXL WRITE of `--nixl-mb` MiB of compressed-KV blocks
  between two processes vs a torch copy of the same bytes in one process).

The JSON (`--json`) is rewritten after every point, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deepinfer.benchmarks.offline_throughput import source_digest
from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.protos.metadata import STATS_METADATA_KEY
from deepinfer.serving.auth import secure_channel

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float
    """Scheduled arrival, seconds after the point's start."""


def request_lengths(num: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> list[tuple[int, int]]:
    """`(prompt_len, output_len)` of each request: uniform in the ranges (equal bounds = fixed length)."""
    rng = random.Random(f"lengths-{seed}")
    return [(rng.randint(*prompt_len), rng.randint(*output_len)) for _ in range(num)]


def point_requests(lengths: list[tuple[int, int]], rate: float, vocab: int, seed: int, point: int) -> list[Request]:
    """The requests of sweep point `point`: Poisson arrivals at `rate` req/s, fresh prompt ids."""
    gaps = random.Random(f"arrivals-{seed}")
    ids = random.Random(f"prompts-{seed}-{point}")
    t, out = 0.0, []
    for i, (n_prompt, n_out) in enumerate(lengths):
        if i:
            t += gaps.expovariate(1.0) / rate
        out.append(Request([ids.randrange(2, vocab) for _ in range(n_prompt)], n_out, t))
    return out


# ---------------------------------------------------------------------------------------- records, metrics


@dataclass
class Record:
    """One request's life as the measuring side saw it (monotonic seconds)."""

    arrival: float
    num_prompt_tokens: int
    max_tokens: int
    deliveries: list[tuple[float, int]] = field(default_factory=list)
    """(time, number of tokens) of every delivery that carried tokens."""
    error: str | None = None


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(records: list[Record]) -> dict:
    """TTFT / ITL / TPOT / end-to-end percentiles (ms) and throughputs of one point."""
    ok = [r for r in records if r.error is None and r.deliveries]
    ttft = [(r.deliveries[0][0] - r.arrival) * 1e3 for r in ok]
    itl, tpot, e2e = [], [], []
    for r in ok:
        for (t0, _), (t1, k) in zip(r.deliveries, r.deliveries[1:]):
            itl += [(t1 - t0) * 1e3 / k] * k
        n = sum(k for _, k in r.deliveries)
        if n > 1:
            tpot.append((r.deliveries[-1][0] - r.deliveries[0][0]) * 1e3 / (n - 1))
        e2e.append((r.deliveries[-1][0] - r.arrival) * 1e3)
    num_out = sum(k for r in ok for _, k in r.deliveries)
    span = (max(r.deliveries[-1][0] for r in ok) - min(r.arrival for r in records)) if ok else 0.0

    def stats(xs: list[float]) -> dict:
        return {"p50": percentile(xs, 50), "p99": percentile(xs, 99),
                "mean": sum(xs) / len(xs) if xs else None, "n": len(xs)}

    return {
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "num_output_tokens": num_out,
        "num_prompt_tokens": sum(r.num_prompt_tokens for r in ok),
        "span_s": span,
        "output_tokens_per_s": num_out / span if span else None,
        "requests_per_s": len(ok) / span if span else None,
        "ttft_ms": stats(ttft),
        "itl_ms": stats(itl),
        "tpot_ms": stats(tpot),
        "e2e_ms": stats(e2e),
    }


# ---------------------------------------------------------------------------------------- colocated engine


def _engine_child(conn, checkpoint: str, threads: int, engine_kwargs: dict) -> None:
    """A process holding one `Engine`; answers ("sweep", requests, timeout) and ("single", prompts) commands."""
    import torch

    torch.set_num_threads(threads)
    from deepinfer.engine.engine import Engine, EngineConfig
    from deepinfer.engine.sampling import SamplingParams

    engine = Engine(EngineConfig(model=checkpoint, **engine_kwargs))
    conn.send(("ready", torch.get_num_threads()))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        if msg[0] == "sweep":
            _, requests, timeout_s = msg
            conn.send(("records", _engine_serve(engine, SamplingParams, requests, timeout_s)))
        elif msg[0] == "single":
            lat = []
            for prompt in msg[1]:
                t0 = time.monotonic()
                rid = engine.add_request(None, {"prompt_token_ids": prompt},
                                         SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                done = False
                while not done:
                    done = any(o.request_id == rid and o.finished for o in engine.step())
                lat.append(time.monotonic() - t0)
            conn.send(("latencies", lat))


def _engine_serve(engine, SamplingParams, requests: list[Request], timeout_s: float) -> list[dict]:
    """Blocks until every request finished (or `timeout_s`): the colocated engine loop."""
    t0 = time.monotonic() + 0.05
    recs = [Record(t0 + r.arrival_s, len(r.prompt_token_ids), r.max_tokens) for r in requests]
    by_id: dict[str, Record] = {}
    nxt, num_done = 0, 0
    while num_done < len(requests):
        now = time.monotonic()
        if now - t0 > timeout_s:
            for rid, rec in by_id.items():
                rec.error = rec.error or f"not finished after {timeout_s} s"
                engine.abort_request(rid)
            break
        while nxt < len(requests) and recs[nxt].arrival <= now:
            rid = f"r{nxt}"
            engine.add_request(rid, {"prompt_token_ids": requests[nxt].prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=requests[nxt].max_tokens, ignore_eos=True))
            by_id[rid] = recs[nxt]
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < len(requests):
                time.sleep(max(0.0, min(recs[nxt].arrival - time.monotonic(), 0.01)))
            continue
        outs = engine.step()
        t = time.monotonic()
        for o in outs:
            rec = by_id[o.request_id]
            k = len(o.new_token_ids.get(0, []))
            if k:
                rec.deliveries.append((t, k))
            if o.error:
                rec.error = o.error
            if o.finished:
                num_done += 1
                del by_id[o.request_id]
    return [asdict(r) for r in recs]


class EngineProcess:
    """A spawned `_engine_child` (one colocated instance)."""

    def __init__(self, checkpoint: str, threads: int, engine_kwargs: dict) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_child, args=(child, checkpoint, threads, engine_kwargs), daemon=True)
        self.proc.start()
        child.close()  # so that recv() raises EOFError once the child is gone
        try:
            tag, self.num_threads = self.conn.recv()
        except EOFError:
            self.proc.join(10)
            raise RuntimeError(f"the engine process exited with {self.proc.exitcode} before it was ready") from None
        assert tag == "ready"

    def serve(self, requests: list[Request], timeout_s: float) -> list[Record]:
        self.conn.send(("sweep", requests, timeout_s))
        return [Record(**{**d, "deliveries": [tuple(x) for x in d["deliveries"]]}) for d in self.conn.recv()[1]]

    def single_latencies(self, prompts: list[list[int]]) -> list[float]:
        self.conn.send(("single", prompts))
        return self.conn.recv()[1]

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# ---------------------------------------------------------------------------------------- disaggregated cluster


class LocalCluster:
    """Balancers, one prefill and one decode worker and the entrypoint, each `python -m ...` on loopback."""

    def __init__(self, checkpoint: str, engine_threads: int, worker_args: list[str], logdir: Path,
                 ucx_tls: str | None = None, bounded_state: str | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """`startup_timeout_s`: how long each start-up wave may take (GPU workers compile kernels and capture
        CUDA graphs before they serve)."""
        self.startup_timeout_s = startup_timeout_s
        env = {**os.environ, "OMP_NUM_THREADS": str(engine_threads), "PYTHONUNBUFFERED": "1"}
        if ucx_tls:
            # NOTE: the workers then read UCX's settings from the environment instead of `--loopback-ucx`
            env.update(UCX_TLS=ucx_tls, UCX_NET_DEVICES="lo")
        self.processes = ServiceProcesses(logdir, env)
        self.info = self.processes.info
        try:
            self._spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware"])
            self._spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", "kv_load"])
            self._wait_ready()
            common = ["--model", checkpoint, *([] if ucx_tls else ["--loopback-ucx"]), *worker_args]
            self._spawn("prefill", ["prefill_worker", "--lb-address", self.info["prefill_lb"]["address"],
                                    "--instance-id", "prefill-0", *common])
            self._spawn("decode", ["decode_worker", "--lb-address", self.info["decode_lb"]["address"],
                                   "--instance-id", "decode-0", *common,
                                   *(["--bounded-state", bounded_state] if bounded_state else [])])
            max_len = worker_args[worker_args.index("--max-model-len") + 1]
            self._spawn("entrypoint", ["entrypoint", "--model", checkpoint, "--max-model-len", max_len,
                                       "--prefill-lb-address", self.info["prefill_lb"]["address"],
                                       "--decode-lb-address", self.info["decode_lb"]["address"]])
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> None:
        self.processes.spawn(name, args)

    def _wait_ready(self) -> None:
        self.processes.wait_ready(self.startup_timeout_s, poll_s=0.05)

    def stats(self, name: str) -> dict:
        """A worker's Health stats (its trailing-metadata JSON)."""

        from deepinfer.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

        stub_cls = prefill_pb2_grpc.PrefillStub if name == "prefill" else decode_pb2_grpc.DecodeStub
        with secure_channel(self.info[name]["address"]) as channel:  # the cluster secret and TLS when set
            _, call = stub_cls(channel).Health.with_call(common_pb2.HealthRequest(), timeout=10)
            return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])

    def stop(self) -> None:
        """SIGTERM front to back (workers deregister while their balancers still run); kill stragglers."""
        self.processes.stop(STOP_TIMEOUT_S)


def wait_until_serving(client, timeout_s: float = 30.0) -> None:
    """Blocks until a 1-token request succeeds (both workers registered and pickable); raises after `timeout_s`."""
    from deepinfer.entrypoint.client import GenerateError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.generate([2, 3, 4], max_tokens=1, temperature=0.0, ignore_eos=True)
            return
        except GenerateError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not serve within {timeout_s} s: {e}") from None
            time.sleep(0.2)


def serve_disaggregated(client, requests: list[Request], timeout_s: float) -> list[Record]:
    """Blocks until every request finished: one client thread per request, started at its arrival."""
    from deepinfer.entrypoint.client import GenerateError

    t0 = time.monotonic() + 0.05
    recs = [Record(t0 + r.arrival_s, len(r.prompt_token_ids), r.max_tokens) for r in requests]

    def one(req: Request, rec: Record) -> None:
        try:
            for delta in client.stream(req.prompt_token_ids, max_tokens=req.max_tokens, temperature=0.0,
                                       ignore_eos=True, deadline_ms=int(timeout_s * 1000)):
                if delta["token_ids"]:
                    rec.deliveries.append((time.monotonic(), len(delta["token_ids"])))
                if delta["error"]:
                    rec.error = str(delta["error"])
        except GenerateError as e:
            rec.error = str(e)

    threads = []
    for req, rec in zip(requests, recs):
        time.sleep(max(0.0, rec.arrival - time.monotonic()))
        th = threading.Thread(target=one, args=(req, rec), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(max(0.0, t0 + timeout_s + 5 - time.monotonic()))
        if th.is_alive():
            break
    return recs


def direct_latencies(cluster: LocalCluster, prompts: list[list[int]]) -> dict:
    """Blocks: `max_tokens=1` requests sent straight to the workers (Reserve -> Prefill -> Start), no
    entrypoint and no balancers; per-request wall time and its three phases, in seconds."""

    from deepinfer.entrypoint.client import sampling_params_proto
    from deepinfer.protos import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

    sampling = sampling_params_proto(temperature=0.0, max_tokens=1, ignore_eos=True)
    out = {"total": [], "reserve": [], "prefill": [], "start": []}
    with secure_channel(cluster.info["decode"]["address"]) as dch, \
            secure_channel(cluster.info["prefill"]["address"]) as pch:
        d, p = decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch)
        for prompt in prompts:
            rid = f"direct-{uuid.uuid4().hex}"
            t0 = time.monotonic()
            r = d.Reserve(decode_pb2.ReserveRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sampling,
                                                    num_kv_tokens=len(prompt), lease_ms=30000), timeout=30)
            assert not r.error.code, r.error.message
            t1 = time.monotonic()
            dest = prefill_pb2.KVDestination(
                decode_instance_id="decode-0", agent_name=r.agent_name, agent_metadata=r.agent_metadata,
                agent_layout=r.agent_layout, block_ids=r.block_ids, block_size=r.block_size,
                transfer_id=r.transfer_id, lease_deadline_unix_ms=r.lease_deadline_unix_ms)
            if r.HasField("state_slot"):  # as the entrypoint does: the bounded state travels with the KV
                dest.state_slot = r.state_slot
            pf = p.Prefill(prefill_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=sampling,
                                                      destination=dest, num_kv_tokens=len(prompt)), timeout=30)
            assert not pf.error.code, pf.error.message
            t2 = time.monotonic()
            chunks = list(d.Start(decode_pb2.StartRequest(request_id=rid, transfer_id=r.transfer_id), timeout=30))
            t3 = time.monotonic()
            assert chunks and chunks[-1].finish_reason and sum(len(c.token_ids) for c in chunks) == 1, chunks
            for k, v in (("total", t3 - t0), ("reserve", t1 - t0), ("prefill", t2 - t1), ("start", t3 - t2)):
                out[k].append(v)
    return out


def entrypoint_latencies(client, prompts: list[list[int]]) -> list[float]:
    lat = []
    for prompt in prompts:
        t0 = time.monotonic()
        out = client.generate(prompt, max_tokens=1, temperature=0.0, ignore_eos=True)
        lat.append(time.monotonic() - t0)
        assert len(out["token_ids"]) == 1, out
    return lat


def _ms(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 50) * 1e3, "p90": percentile(xs, 90) * 1e3,
            "mean": sum(xs) / len(xs) * 1e3, "min": min(xs) * 1e3, "n": len(xs)}


# ---------------------------------------------------------------------------------------- plots


def plot(results: dict, out_dir: Path) -> list[str]:
    """TTFT, ITL and throughput vs request rate, every mode, as PNGs in `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    m = results["machine"]
    sub = (f"{results['config']['preset']} preset, {m['num_cpus_used']} CPU cores ({m['cpu_model']}), "
           f"{results['date_utc'][:10]}")
    paths = []
    panels = (("ttft", [("TTFT (ms)", "ttft_ms", ("p50", "p99"))]),
              ("itl", [("inter-token latency (ms)", "itl_ms", ("p50", "p99"))]),
              ("throughput", [("output tokens/s", "output_tokens_per_s", (None,)),
                              ("completed requests/s", "requests_per_s", (None,))]))
    for name, axes_spec in panels:
        fig, axes = plt.subplots(1, len(axes_spec), figsize=(6.4 * len(axes_spec), 4.4), squeeze=False)
        for ax, (ylabel, key, quantiles) in zip(axes[0], axes_spec):
            for i, (mode, data) in enumerate(results["modes"].items()):
                pts = [p for p in data["points"] if p["summary"]["num_completed"]]
                for q, style in zip(quantiles, ("-", "--")):
                    ys = [p["summary"][key][q] if q else p["summary"][key] for p in pts]
                    ax.plot([p["rate"] for p in pts], ys, style, marker="o", color=f"C{i}",
                            label=mode + (f" {q}" if q else ""))
            if name == "throughput":
                if key == "requests_per_s":
                    offered = sorted({p["rate"] for d in results["modes"].values() for p in d["points"]})
                    ax.plot(offered, offered, ":", color="gray", label="offered rate")
            else:
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("offered request rate (req/s, Poisson)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{ylabel.split(' (')[0]} vs request rate\n{sub}", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"serving_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


# ---------------------------------------------------------------------------------------- main


def merge_results(runs: list[dict]) -> dict:
    """The first run with the modes of the later ones added (for plotting runs side by side)."""
    merged = {**runs[0], "modes": dict(runs[0]["modes"])}
    for run in runs[1:]:
        for mode, data in run["modes"].items():
            merged["modes"][mode if mode not in merged["modes"] else f"{mode} ({run['date_utc']})"] = data
    return merged


def _range(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(":")
    return int(lo), int(hi or lo)


def _cpus(s: str) -> list[int]:
    out: list[int] = []
    for part in s.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def machine_info(cpus: list[int] | None) -> dict:
    import torch

    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    used = sorted(os.sched_getaffinity(0))
    return {"hostname": platform.node(), "cpu_model": model, "os_cpu_count": os.cpu_count(), "cpus_used": used,
            "num_cpus_used": len(used), "pinned": cpus is not None, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(), "loadavg_start": os.getloadavg()}


def _save(results: dict, path: str | None) -> None:
    if path:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict:
    """Blocks for the whole benchmark; returns the results (also written to `--json` as it goes)."""
    import torch

    from deepinfer.engine.config import ModelConfig
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    if args.cpus:
        os.sched_setaffinity(0, _cpus(args.cpus))  # children inherit it
    torch.set_num_threads(1)  # this process is the client; the engines run elsewhere
    tmp = Path(tempfile.mkdtemp(prefix="deepinfer-serving-"))
    ckpt = args.checkpoint or str(make_checkpoint(tmp / "ckpt", preset=args.preset, seed=args.seed))
    vocab = ModelConfig.from_hf_dict(json.loads((Path(ckpt) / "config.json").read_text())).vocab_size
    prompt_len, output_len = (_range(args.prompt_len), _range(args.output_len))
    if args.fixed_len:
        p, o = (int(x) for x in args.fixed_len.split(","))
        prompt_len, output_len = (p, p), (o, o)
    lengths = request_lengths(args.num_requests, prompt_len, output_len, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    engine_kwargs = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                     "max_model_len": args.max_model_len}
    worker_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len)]
    modes = args.modes.split(",")
    results: dict = {
        "benchmark": "deepinfer.benchmarks.serving",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "engine_source_digest": source_digest(),
        "machine": machine_info(_cpus(args.cpus) if args.cpus else None),
        "config": {**vars(args), "checkpoint": args.checkpoint or f"make_checkpoint(preset={args.preset!r}, "
                   f"seed={args.seed})", "engine": engine_kwargs},
        "workload": {"prompt_len": prompt_len, "output_len": output_len, "rates": rates,
                     "num_requests_per_point": args.num_requests, "lengths": lengths,
                     "num_prompt_tokens_per_point": sum(p for p, _ in lengths),
                     "num_output_tokens_per_point": sum(o for _, o in lengths)},
        "modes": {},
    }
    t_start = time.monotonic()
    warm = [Request(r.prompt_token_ids, r.max_tokens, 0.02 * i)
            for i, r in enumerate(point_requests(lengths[:args.warmup], 1.0, vocab, args.seed, 1000))]
    over_rng = random.Random(f"overhead-{args.seed}")
    over_prompts = [[over_rng.randrange(2, vocab) for _ in range(args.overhead_prompt_len)]
                    for _ in range(2 * args.overhead_requests + 2)]
    overhead: dict = {}

    if args.nixl_mb:
        from deepinfer.benchmarks.kv_transfer import run as nixl_bench

        results["nixl_vs_memcpy"] = nixl_bench(mb=args.nixl_mb, preset=args.preset, block_size=args.nixl_block_size,
                                               reps=args.nixl_reps, ucx_tls=args.ucx_tls or "cma,tcp,self")
        _save(results, args.json)

    if "disaggregated" in modes:
        from deepinfer.entrypoint.client import Client

        logdir = tmp / "logs"
        logdir.mkdir()
        t0 = time.monotonic()
        cluster = LocalCluster(ckpt, args.engine_threads, worker_args, logdir, args.ucx_tls, args.bounded_state)
        client = Client(cluster.info["entrypoint"]["address"], timeout_s=args.point_timeout_s + 30)
        try:
            entry = {"description": f"1 prefill + 1 decode worker, 2 balancers (python -m deepinfer.loadbalancer), "
                     f"entrypoint; separate processes, OMP_NUM_THREADS={args.engine_threads} each; decode "
                     f"--bounded-state {args.bounded_state or '(worker default)'}; client = this process",
                     "startup_s": time.monotonic() - t0, "points": []}
            mode = f"disaggregated_{args.bounded_state}" if args.bounded_state else "disaggregated"
            results["modes"][mode] = entry
            wait_until_serving(client)
            serve_disaggregated(client, warm, args.point_timeout_s)
            for i, rate in enumerate(rates):
                recs = serve_disaggregated(client, point_requests(lengths, rate, vocab, args.seed, i),
                                           args.point_timeout_s)
                entry["points"].append({"rate": rate, "summary": summarize(recs)})
                _print_point(mode, rate, entry["points"][-1]["summary"])
                _save(results, args.json)
            p = cluster.stats("prefill")
            results["kv_transfer_in_sweep"] = {
                "num_requests_sent": 1 + len(warm) + len(rates) * args.num_requests,  # probe + warm-up + sweep
                **{k: p.get(k) for k in ("kv_transfer_sent_bytes_total", "kv_transfer_sent_blocks_total",
                                      "kv_transfer_sends_done_total", "kv_transfer_sends_failed_total",
                                      "kv_transfer_send_seconds_sum")}}
            n = p.get("kv_transfer_sends_done_total") or 0
            if n and p.get("kv_transfer_send_seconds_sum"):
                results["kv_transfer_in_sweep"]["mean_bytes_per_transfer"] = p["kv_transfer_sent_bytes_total"] / n
                results["kv_transfer_in_sweep"]["mean_send_ms"] = p["kv_transfer_send_seconds_sum"] / n * 1e3
                results["kv_transfer_in_sweep"]["gbps_post_to_done"] = (
                    p["kv_transfer_sent_bytes_total"] / p["kv_transfer_send_seconds_sum"] / 1e9)
            if args.overhead_requests:
                ep = entrypoint_latencies(client, over_prompts[:1])  # warm the path once
                direct_latencies(cluster, over_prompts[1:2])
                # alternate the two paths request by request; each prompt is used once (no prefix hits)
                ep, direct = [], {"total": [], "reserve": [], "prefill": [], "start": []}
                for j in range(2 * args.overhead_requests):
                    prompt = over_prompts[2 + j]
                    if j % 2 == 0:
                        ep += entrypoint_latencies(client, [prompt])
                    else:
                        for k, v in direct_latencies(cluster, [prompt]).items():
                            direct[k] += v
                overhead["entrypoint"] = _ms(ep)
                overhead["workers_direct"] = {k: _ms(v) for k, v in direct.items()}
        finally:
            client.close()
            cluster.stop()
        _save(results, args.json)

    colocated_threads = [int(t) for t in args.colocated_threads.split(",")] if "colocated" in modes else []
    need_offline = bool(args.overhead_requests) and "disaggregated" in modes
    for threads in sorted(set(colocated_threads) | ({args.engine_threads} if need_offline else set())):
        t0 = time.monotonic()
        eng = EngineProcess(ckpt, threads, engine_kwargs)
        try:
            if threads in colocated_threads:
                name = f"colocated_t{threads}"
                entry = {"description": f"one Engine in one process, {eng.num_threads} torch threads, engine loop "
                         "adds requests at their arrival times (no RPC)", "startup_s": time.monotonic() - t0,
                         "points": []}
                results["modes"][name] = entry
                eng.serve(warm, args.point_timeout_s)
                for i, rate in enumerate(rates):
                    recs = eng.serve(point_requests(lengths, rate, vocab, args.seed, i), args.point_timeout_s)
                    entry["points"].append({"rate": rate, "summary": summarize(recs)})
                    _print_point(name, rate, entry["points"][-1]["summary"])
                    _save(results, args.json)
            if need_offline and threads == args.engine_threads:
                eng.single_latencies(over_prompts[:2])
                # the prompts of both disaggregated paths, each once (a fresh engine: no prefix hits)
                overhead["offline_engine"] = _ms(eng.single_latencies(over_prompts[2:]))
        finally:
            eng.close()

    if overhead:
        ep, direct, off = overhead["entrypoint"], overhead["workers_direct"]["total"], overhead["offline_engine"]
        results["overhead_max_tokens_1"] = {
            "prompt_len": args.overhead_prompt_len, "engine_threads": args.engine_threads,
            "note": "sequential requests, no other load; entrypoint and workers_direct alternate request by request",
            **overhead,
            "added_by_entrypoint_and_balancers_ms_p50": ep["p50"] - direct["p50"],
            "added_by_disaggregated_workers_ms_p50": direct["p50"] - off["p50"],
        }
        _save(results, args.json)

    results["total_s"] = time.monotonic() - t_start
    results["machine"]["loadavg_end"] = os.getloadavg()
    _save(results, args.json)
    return results


def _print_point(mode: str, rate: float, s: dict) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"{mode:14s} rate {rate:5.2f}: {s['num_completed']}/{s['num_requests']} ok, "
          f"TTFT p50 {f(s['ttft_ms']['p50'])} p99 {f(s['ttft_ms']['p99'])} ms, "
          f"ITL p50 {f(s['itl_ms']['p50'])} p99 {f(s['itl_ms']['p99'])} ms, "
          f"{f(s['output_tokens_per_s'])} out tok/s, {f(s['requests_per_s'])} req/s", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", help="engine.testing.presets name of the random checkpoint")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of making one")
    ap.add_argument("--seed", type=int, default=0, help="seeds the checkpoint, lengths, prompts and arrivals")
    ap.add_argument("--modes", default="disaggregated,colocated", help="comma list of disaggregated, colocated")
    ap.add_argument("--rates", default="1,2,4,8,16", help="comma list of offered request rates (req/s)")
    ap.add_argument("--num-requests", type=int, default=20, help="requests per rate point")
    ap.add_argument("--prompt-len", default="32:256", help="prompt length range LO:HI (uniform)")
    ap.add_argument("--output-len", default="32:128", help="output length range LO:HI (uniform)")
    ap.add_argument("--fixed-len", default=None, help="P,O: every prompt P tokens, every output O tokens")
    ap.add_argument("--warmup", type=int, default=4, help="warm-up requests before each mode's sweep")
    ap.add_argument("--cpus", default=None, help="pin this process and every child to these CPUs, e.g. 0-3")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of each disaggregated worker")
    ap.add_argument("--colocated-threads", default="1,2", help="comma list: one colocated run per thread count")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--point-timeout-s", type=float, default=120.0, help="give up on a point after this long")
    ap.add_argument("--overhead-requests", type=int, default=20,
                    help="max_tokens=1 requests per disaggregated path (the two alternate); 0 = skip")
    ap.add_argument("--overhead-prompt-len", type=int, default=128)
    ap.add_argument("--nixl-mb", type=float, default=64, help="MiB for benchmarks.kv_transfer; 0 = skip")
    ap.add_argument("--nixl-reps", type=int, default=5)
    ap.add_argument("--nixl-block-size", type=int, default=64,
                    help="tokens per block in benchmarks.kv_transfer (the engine's default for tiny and small: 64)")
    ap.add_argument("--ucx-tls", default=None,
                    help="UCX_TLS for the workers and benchmarks.kv_transfer (UCX_NET_DEVICES=lo); default: the "
                         "workers' --loopback-ucx (cma,tcp,self). NIXL refuses that on a host with NVIDIA GPUs: "
                         "there use cma,tcp,self,cuda_copy")
    ap.add_argument("--bounded-state", default=None, choices=["send", "replay"],
                    help="the decode worker's --bounded-state (send: with the KV; replay: recomputed on decode); "
                         "default: the worker's default")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after every point)")
    ap.add_argument("--plot-dir", default=None, help="write serving_{ttft,itl,throughput}.png here")
    ap.add_argument("--plot-from", default=None,
                    help="only plot these results JSONs, comma-separated, modes side by side (needs --plot-dir)")
    args = ap.parse_args(argv)
    if args.plot_from:
        results = merge_results([json.loads(Path(f).read_text()) for f in args.plot_from.split(",")])
    else:
        results = run(args)
    if args.plot_dir:
        for path in plot(results, Path(args.plot_dir)):
            print("wrote", path)
    return results


if __name__ == "__main__":
    main()
