"""Expert parallelism (issue 25): the MoE layer over a rank group with and without EPLB, and the balance of the
request balancers in front of multi-rank instances.

    python -m deepinfer.benchmarks.expert_parallel moe [--ranks 4] [--experts 64] [--topk 6] [--redundant 16]
        [--hidden 256] [--inter 128] [--tokens 64] [--layers 3] [--zipf 1.2] [--steps 20] [--json OUT]
    python -m deepinfer.benchmarks.expert_parallel balance [--num-requests 48] [--decode-ranks 2] [--bursts 4]
        [--decode-policy kv_load|decode_work|pinned] [--repeats 1] [--seed 0] [--json OUT]

`moe`: `--ranks` gloo rank processes on this host (`engine.distributed.group`), each running `--layers`
independent MoE layers through `engine.moe.ep_backend.ExpertParallelMoEBackend` (the `torch` inner backend,
`AllToAllDispatcher`) on `--tokens` tokens per rank per step. Routing is skewed on purpose: per layer each
expert's popularity is Zipf(`--zipf`) over a random order of the experts (the same on every rank), and each token
draws its top-k distinct experts from it. Two phases of `--steps` steps each, on fresh tokens:
  * `contiguous`: the placement before any load is known (`ExpertPlacement.contiguous`, the redundant slots on
    experts 0, 1, ...);
  * `eplb`: after one EPLB re-placement (`engine.moe.eplb.rebalance`, global policy) from the loads the first
    phase measured (summed over the ranks, as `engine.distributed.expert_parallel.apply_rebalance` does), measured
    on new tokens from the same distribution (so the figure is what EPLB gives on traffic it did not see).
Per phase and MoE layer: the imbalance (max / mean rows per rank computed by the rank's experts,
`engine.distributed.expert_parallel.imbalance_of`, the metric the executor exports) and the per-step host time of
dispatch, expert computation and combine (`ExpertParallelMoEBackend.timings`; gloo collectives synchronise, so the
dispatch time includes waiting for the slowest rank), mean over the ranks and the slowest rank's expert time.
Every rank holds every expert here (the placement change moves no weights; the serving path moves them,
`move_experts`), so only routing and load are measured.

`balance`: a cluster of real processes on loopback (`deploy.processes.ServiceProcesses`, as tests/e2e do): both
balancers (prefix_aware for prefill, `--decode-policy` for decode: kv_load or decode_work), 2 prefill instances, 2
decode instances of `--decode-ranks` ranks each (gloo rank processes) and the entrypoint, on a tiny random checkpoint.
The trace is mixed (prompt 8..96 tokens, output 4..48 tokens) and bursty (`--bursts` bursts, all of a burst's
requests sent at once, `--burst-gap-s` between burst starts). The decode balancer's view of each (instance, rank)
(`ListInstances`: running requests per rank) is sampled every 20 ms; the balance figure is mean / max over the
decode ranks of the request-seconds each rank carried (1.0: the balancers split the work perfectly). Throughput:
output tokens / (first burst sent .. last completion).

The perfect offline split: the same requests split over the decode instances' ranks by a greedy longest-first
partition of their output tokens (`perfect_split`, one share per (instance, rank)); each instance's shares run on an
offline `LLM(expert_parallel_size=--decode-ranks)` (one process per decode instance, the instances side by side,
started together), each request placed on its share's rank (`Engine.prefer_kv_rank`), prefill done in the same
engines. Fairness (what both sides get alike): the same arrivals (each burst's requests are added at the same offset
from the start as the cluster sends them: a perfect split cannot run work before it arrives), every engine warmed
up first (the cluster: concurrent warm-up requests through the entrypoint, enough that both balancers place some on
every prefill instance and decode rank), the same window (first burst .. last completion), `OMP_NUM_THREADS=1`
everywhere, and with `--repeats N` the two sides interleaved (trace r through the cluster, then through the perfect
split, each side's processes idle while the other runs: on a shared host both see the same load; the summary gives
medians). The perfect-split throughput is all output tokens / the slowest instance's window. `--decode-policy
pinned` sends the perfect split's places in the request ids (`loadbalancer.policies.Pinned`): the cluster without the
balancers' decisions, which splits the ratio into what the balancers cost and what the cluster costs. What the ratio
cluster / perfect split still carries beyond the balancers, by definition of the goal: the prefill stage's own
processes, the KV transfer, the RPCs and token streaming, and on a small CPU host every process sharing the cores
(the report shows the host's load average around each phase).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

# ------------------------------------------------------------------ moe: the EP layer and EPLB


def skewed_popularity(num_experts: int, zipf: float, seed: int) -> torch.Tensor:
    """[E] probabilities: Zipf(`zipf`) over a random order of the experts (a few hot ones)."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** zipf
    return (p / p.sum())[torch.argsort(torch.randperm(num_experts, generator=g))]


def skewed_batch(popularity: torch.Tensor, num_tokens: int, topk: int, hidden: int, seed: int):
    """One rank's routed batch: x [T, H], top-k weights [T, k] (softmax) and distinct expert ids [T, k] drawn
    from `popularity`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(popularity.expand(num_tokens, -1), topk, replacement=False, generator=g)
    weights = torch.softmax(torch.randn(num_tokens, topk, generator=g), dim=-1)
    return torch.randn(num_tokens, hidden, generator=g), weights, ids


def _moe_rank(rank: int, args: dict, port: int, out) -> None:
    """One rank of the `moe` benchmark (a spawned process; rank 0 puts the results on `out`)."""
    import torch.distributed as dist

    from deepinfer.engine.distributed.expert_parallel import imbalance_of, layer_loads
    from deepinfer.engine.distributed.group import GroupAddress, join_group, leave_group
    from deepinfer.engine.models.deepseek_v4 import Expert
    from deepinfer.engine.moe.base import get_moe_backend
    from deepinfer.engine.moe.ep_backend import AllToAllDispatcher, ExpertParallelMoEBackend, ExpertPlacement
    from deepinfer.engine.moe.eplb import rebalance

    torch.set_num_threads(1)
    W, E, k, R = args["ranks"], args["experts"], args["topk"], args["redundant"]
    H, inter, T = args["hidden"], args["inter"], args["tokens"]
    ctrl = join_group(GroupAddress("127.0.0.1", port, W, "gloo"), rank)
    dispatcher = AllToAllDispatcher(world_size=W, rank=rank)
    layers = []
    for layer in range(args["layers"]):
        torch.manual_seed(1000 + layer)  # the same expert weights on every rank
        experts = [Expert(H, inter, limit=10.0).requires_grad_(False) for _ in range(E)]
        backend = ExpertParallelMoEBackend(get_moe_backend("torch")(), dispatcher, ExpertPlacement.contiguous(E, W, R))
        backend.prepare(experts)
        layers.append((experts, backend, skewed_popularity(E, args["zipf"], seed=args["seed"] * 100 + layer)))
    backends = [b for _, b, _ in layers]

    @torch.inference_mode()
    def run_steps(first_seed: int, num_steps: int) -> dict:
        for b in backends:
            b.reset_counts()
        t0 = time.perf_counter()
        for step in range(num_steps):
            for layer, (_, b, pop) in enumerate(layers):
                x, w, ids = skewed_batch(pop, T, k, H, seed=(first_seed + step) * 7919 + rank * 131 + layer)
                b(x, w, ids)
        wall = time.perf_counter() - t0
        return {"loads": layer_loads(backends), "timings": [dict(b.timings) for b in backends], "wall_s": wall}

    run_steps(10_000_000, 2)  # warm-up (not measured)
    phases = {"contiguous": run_steps(0, args["steps"])}
    # EPLB from the measured window: every rank sums the counts and computes the same placement
    counts = torch.stack([b.expert_counts for b in backends])  # [L, E]
    dist.all_reduce(counts)
    placements = []
    for (experts, b, _), loads in zip(layers, counts.tolist()):
        placement = rebalance(loads, E + R, W)
        b.set_placement(placement)
        b.prepare(experts)
        placements.append(placement.phy2log)
    phases["eplb"] = run_steps(1_000_000, args["steps"])
    gathered = [None] * W if rank == 0 else None
    dist.gather_object(phases, gathered, dst=0, group=ctrl)
    if rank == 0:
        result = {}
        for name in phases:
            per_rank_loads = [g[name]["loads"] for g in gathered]
            per_layer = []
            for layer in range(len(layers)):
                tm = [g[name]["timings"][layer] for g in gathered]
                n = args["steps"]
                per_layer.append({
                    "imbalance": imbalance_of(per_rank_loads)[layer],
                    "rows_per_rank": [r[layer].num_recv_rows for r in per_rank_loads],
                    "dispatch_ms": 1e3 * statistics.mean(t["dispatch"] for t in tm) / n,
                    "experts_ms": 1e3 * statistics.mean(t["experts"] for t in tm) / n,
                    "experts_max_ms": 1e3 * max(t["experts"] for t in tm) / n,
                    "combine_ms": 1e3 * statistics.mean(t["combine"] for t in tm) / n,
                })
            result[name] = {"layers": per_layer,
                            "step_ms": 1e3 * max(g[name]["wall_s"] for g in gathered) / args["steps"]}
        result["eplb_placements"] = placements
        out.put(result)
    leave_group()


def run_moe(args: argparse.Namespace) -> dict:
    """Blocks while the `moe` benchmark's rank processes run; its results."""
    import torch.multiprocessing as mp

    from deepinfer.engine.distributed.group import free_port

    if (args.experts + args.redundant) % args.ranks:
        raise SystemExit(f"--experts + --redundant ({args.experts + args.redundant}) must divide by --ranks")
    params = {k: getattr(args, k) for k in ("ranks", "experts", "topk", "redundant", "hidden", "inter", "tokens",
                                            "layers", "zipf", "steps", "seed")}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_moe_rank, args=(r, params, port, out), daemon=True) for r in range(args.ranks)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=args.timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return {"benchmark": "moe", "params": params, **result}


def format_moe(r: dict) -> str:
    p = r["params"]
    lines = [f"EP MoE layer: {p['ranks']} gloo ranks, {p['experts']} experts top-{p['topk']} + {p['redundant']} "
             f"redundant, hidden {p['hidden']}, expert width {p['inter']}, {p['tokens']} tokens/rank/step, "
             f"Zipf {p['zipf']}, {p['steps']} steps per phase",
             "", "| phase | layer | max/mean rows per rank | rows per rank | dispatch ms | experts ms (mean / slowest "
             "rank) | combine ms |", "|---|---|---|---|---|---|---|"]
    for phase in ("contiguous", "eplb"):
        for i, lay in enumerate(r[phase]["layers"]):
            lines.append(f"| {phase} | {i} | {lay['imbalance']:.3f} | {lay['rows_per_rank']} | {lay['dispatch_ms']:.2f}"
                         f" | {lay['experts_ms']:.2f} / {lay['experts_max_ms']:.2f} | {lay['combine_ms']:.2f} |")
    for phase in ("contiguous", "eplb"):
        imb = [lay["imbalance"] for lay in r[phase]["layers"]]
        lines.append(f"\n{phase}: mean imbalance {statistics.mean(imb):.3f}, worst {max(imb):.3f}; "
                     f"step (all layers, slowest rank) {r[phase]['step_ms']:.1f} ms")
    return "\n".join(lines)


# ------------------------------------------------------------------ balance: the request balancers


def add_balance_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--bursts", type=int, default=4, help="the trace's bursts (requests of a burst sent at once)")
    parser.add_argument("--burst-gap-s", type=float, default=1.5, help="pause between the starts of two bursts")
    parser.add_argument("--prompt-len", default="8:96")
    parser.add_argument("--output-len", default="4:48")
    parser.add_argument("--decode-instances", type=int, default=2)
    parser.add_argument("--decode-ranks", type=int, default=2, help="ranks per decode instance")
    parser.add_argument("--prefill-instances", type=int, default=2)
    parser.add_argument("--decode-policy", default="kv_load",
                        help="the decode balancer's policy: kv_load, decode_work, or pinned (the perfect split's places "
                        "named in the request ids: the cluster without the balancers' decisions)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="per instance (split over its ranks)")
    parser.add_argument("--num-blocks", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="traces run (seeds --seed, --seed + 1, ...), each through the cluster then the perfect "
                        "split, interleaved so that both see the same host load; the summary gives medians")
    parser.add_argument("--skip-offline", action="store_true", help="run the cluster only (no ratio)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", default=None)


def _range(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo), int(hi)


def make_trace(args: argparse.Namespace, vocab: int = 512) -> list[dict]:
    """The mixed, bursty trace: per request its burst, prompt token ids and output length (fixed by `--seed`)."""
    g = torch.Generator().manual_seed(args.seed)
    (p_lo, p_hi), (o_lo, o_hi) = _range(args.prompt_len), _range(args.output_len)
    trace = []
    for i in range(args.num_requests):
        n = int(torch.randint(p_lo, p_hi + 1, (1,), generator=g))
        trace.append({"burst": i * args.bursts // args.num_requests,
                      "prompt": torch.randint(2, vocab, (n,), generator=g).tolist(),
                      "max_tokens": int(torch.randint(o_lo, o_hi + 1, (1,), generator=g))})
    return trace


def perfect_split(output_lens: list[int], num_shares: int) -> list[list[int]]:
    """Request indices per share: longest first onto the share with the fewest output tokens so far."""
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    totals = [0] * num_shares
    for i in sorted(range(len(output_lens)), key=lambda i: -output_lens[i]):
        s = min(range(num_shares), key=lambda s: (totals[s], s))
        shares[s].append(i)
        totals[s] += output_lens[i]
    return shares


def perfect_places(trace: list[dict], num_instances: int, num_ranks: int) -> list[tuple[int, int]]:
    """Per request of `trace`, the (decode instance, rank) of the perfect split: `perfect_split` of the output tokens
    over every rank of every instance (share s: instance s // num_ranks, rank s % num_ranks)."""
    places = [(0, 0)] * len(trace)
    for s, share in enumerate(perfect_split([r["max_tokens"] for r in trace], num_instances * num_ranks)):
        for i in share:
            places[i] = (s // num_ranks, s % num_ranks)
    return places


class _RankSampler:
    """Samples the decode balancer's per-(instance, rank) running requests every `interval_s` (a thread) and
    integrates them into request-seconds per rank."""

    def __init__(self, lb_address: str, interval_s: float = 0.05) -> None:
        import threading

        import grpc

        from deepinfer.protos import loadbalancer_pb2_grpc

        self._channel = grpc.insecure_channel(lb_address)
        self._stub = loadbalancer_pb2_grpc.LoadBalancerStub(self._channel)
        self.interval_s = interval_s
        self.request_seconds: dict[str, float] = {}
        self.num_samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from deepinfer.protos import loadbalancer_pb2

        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                listed = self._stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=2.0)
            except Exception:
                continue
            now = time.monotonic()
            dt, last = now - last, now
            self.num_samples += 1
            for inst in listed.instances:
                for r in inst.load.ranks or [None]:
                    key = f"{inst.instance_id}/rank{r.rank if r is not None else 0}"
                    running = r.num_running_requests if r is not None else inst.load.num_running_requests
                    self.request_seconds[key] = self.request_seconds.get(key, 0.0) + running * dt

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._channel.close()


class _Cluster:
    """The balance benchmark's cluster of real processes (balancers, prefill and decode instances, entrypoint), warmed
    up; `run(trace)` blocks while one trace runs through it."""

    def __init__(self, args: argparse.Namespace, ckpt: str, logdir: Path) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from deepinfer.deploy.processes import ServiceProcesses
        from deepinfer.entrypoint.client import Client

        self.args = args
        self.processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.client = None
        try:
            self.processes.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware"])
            self.processes.spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", args.decode_policy])
            info = self.processes.wait_ready(120)
            common = ["--model", ckpt, "--loopback-ucx", "--max-num-seqs", str(args.max_num_seqs),
                      "--num-blocks", str(args.num_blocks), "--max-num-batched-tokens", "128"]
            for i in range(args.prefill_instances):
                self.processes.spawn(f"prefill-{i}", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"],
                                                      "--instance-id", f"prefill-{i}", *common])
            for i in range(args.decode_instances):
                self.processes.spawn(f"decode-{i}", ["decode_worker", "--lb-address", info["decode_lb"]["address"],
                                                     "--instance-id", f"decode-{i}", *common,
                                                     "--expert-parallel-size", str(args.decode_ranks)])
            self.processes.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--prefill-lb-address",
                                                info["prefill_lb"]["address"], "--decode-lb-address",
                                                info["decode_lb"]["address"]])
            self.info = self.processes.wait_ready(240)
            self.client = Client(self.info["entrypoint"]["address"], timeout_s=args.timeout_s)
            time.sleep(1.0)  # every instance registered and heartbeating
            # warm-up: concurrent requests, so the balancers place some on every prefill instance and decode rank
            # (their picks between two heartbeats spread out)
            num_warm = 2 * max(args.prefill_instances, args.decode_instances * args.decode_ranks)
            with ThreadPoolExecutor(num_warm) as pool:
                list(pool.map(lambda i: self.client.generate([5 + i, 6, 7], temperature=0.0, max_tokens=2,
                                                             ignore_eos=True), range(num_warm)))
        except BaseException:
            self.close()
            raise

    def run(self, trace: list[dict], tag: str) -> dict:
        """Blocks while `trace` runs (its bursts sent at their offsets); its figures. Sleep 1.5 s before, so that every
        load report the balancers hold is idle again."""
        from concurrent.futures import ThreadPoolExecutor

        args, client = self.args, self.client
        load_before = os.getloadavg()
        sampler = _RankSampler(self.info["decode_lb"]["address"])
        done: list[tuple[float, int] | None] = [None] * len(trace)
        # `pinned`: each request id names its place in the perfect split (what the balancers cost, isolated)
        places = perfect_places(trace, args.decode_instances, args.decode_ranks)

        def send(i: int) -> None:
            req = trace[i]
            rid = f"{tag}-{i}"
            if args.decode_policy == "pinned":
                rid += f"@decode-{places[i][0]}/{places[i][1]}"
            out = client.generate(req["prompt"], temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True,
                                  request_id=rid)
            done[i] = (time.monotonic(), len(out["token_ids"]))

        try:
            t0 = time.monotonic()
            with ThreadPoolExecutor(len(trace)) as pool:
                futures = []
                for burst in range(args.bursts):
                    wait = t0 + burst * args.burst_gap_s - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    futures += [pool.submit(send, i) for i, r in enumerate(trace) if r["burst"] == burst]
                for f in futures:
                    f.result()
        finally:
            sampler.stop()
        span = max(d[0] for d in done) - t0
        num_tokens = sum(d[1] for d in done)
        rs = sampler.request_seconds
        ranks = sorted(k for k in rs if any(k.startswith(f"decode-{i}/") for i in range(args.decode_instances)))
        work = [rs[k] for k in ranks]
        return {"span_s": span, "output_tokens": num_tokens, "tokens_per_s": num_tokens / span,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                "request_seconds_per_rank": dict(zip(ranks, work)),
                "balance_mean_over_max": statistics.mean(work) / max(work) if work and max(work) > 0 else None,
                "num_samples": sampler.num_samples}

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        self.processes.stop(10.0)


def _offline_share(ckpt: str, ranks: int, max_num_seqs: int, repeats: list[list[dict]], gap_s: float, start,
                   out) -> None:
    """One decode instance's part of the perfect split (a spawned process), per repeat: an offline multi-rank `LLM`
    gets each request at its burst's offset from the common start (`start`: a Barrier the main process passes once
    the cluster finished the same repeat), on the rank its share names (`request["rank"]`); puts (repeat, seconds
    until its last completion) on `out`."""
    from deepinfer.engine import LLM, SamplingParams

    torch.set_num_threads(1)  # as every cluster process (OMP_NUM_THREADS=1): spinning threads starve the others
    llm = LLM(ckpt, expert_parallel_size=ranks, max_num_seqs=max_num_seqs, max_num_batched_tokens=128)
    engine = llm.engine
    try:  # warm-up: some requests on every rank, as the cluster's warm-up
        llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(2 * ranks)],
                     [SamplingParams(max_tokens=2, ignore_eos=True)] * (2 * ranks), use_tqdm=False)
        for repeat, requests in enumerate(repeats):
            start.wait()  # a Barrier: every share starts together, while the cluster idles
            t0 = time.perf_counter()
            pending = sorted(requests, key=lambda r: r["burst"])
            num_left = len(pending)
            while num_left:
                now = time.perf_counter() - t0
                while pending and pending[0]["burst"] * gap_s <= now:
                    r = pending.pop(0)
                    rid = f"share-{repeat}-{r['index']}"
                    engine.prefer_kv_rank(rid, r["rank"])
                    engine.add_request(rid, {"prompt_token_ids": r["prompt"]},
                                       SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
                if not engine.has_unfinished_requests():  # idle until the next burst arrives
                    time.sleep(max(0.0, pending[0]["burst"] * gap_s - (time.perf_counter() - t0)))
                    continue
                num_left -= sum(o.finished for o in engine.step())
            out.put((repeat, time.perf_counter() - t0))
    finally:
        llm.shutdown()


class _Offline:
    """The perfect split's processes: one per decode instance, each an offline multi-rank `LLM` (as many rank
    processes as the cluster's decode stage has), started once; `run(repeat)` blocks while every instance runs that
    repeat's trace, the requests arriving as in the cluster."""

    def __init__(self, args: argparse.Namespace, ckpt: str, traces: list[list[dict]]) -> None:
        import torch.multiprocessing as mp

        self.args, self.traces = args, traces
        self.places = [perfect_places(t, args.decode_instances, args.decode_ranks) for t in traces]
        per_instance = [[[{**t[i], "index": i, "rank": rank} for i, (inst, rank) in enumerate(places) if inst == d]
                         for t, places in zip(traces, self.places)] for d in range(args.decode_instances)]
        ctx = mp.get_context("spawn")
        self.start, self.out = ctx.Barrier(args.decode_instances + 1), ctx.Queue()
        # NOTE: not daemons: each share's LLM starts rank processes of its own
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the share processes and their rank processes
        self.procs = [ctx.Process(target=_offline_share, args=(ckpt, args.decode_ranks, args.max_num_seqs, reqs,
                                                               args.burst_gap_s, self.start, self.out))
                      for reqs in per_instance]
        for p in self.procs:
            p.start()

    def run(self, repeat: int) -> dict:
        args, trace = self.args, self.traces[repeat]
        load_before = os.getloadavg()
        self.start.wait(timeout=args.timeout_s)
        times = []
        for _ in self.procs:
            r, t = self.out.get(timeout=args.timeout_s)
            assert r == repeat, (r, repeat)
            times.append(t)
        share_tokens = [0] * (args.decode_instances * args.decode_ranks)
        for req, (instance, rank) in zip(trace, self.places[repeat]):
            share_tokens[instance * args.decode_ranks + rank] += req["max_tokens"]
        num_tokens = sum(req["max_tokens"] for req in trace)
        return {"share_output_tokens": share_tokens, "instance_s": sorted(times), "tokens_per_s": num_tokens / max(times),
                "loadavg_before": load_before, "loadavg_after": os.getloadavg()}

    def close(self) -> None:
        self.start.abort()
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()


def _cpu_seconds(pids: list[int], with_self: bool = False) -> float:
    """CPU seconds (user + system) used so far by the processes `pids` and their live descendants, plus (`with_self`)
    this process's own (not its children's: the other side's processes are its children too)."""
    import psutil

    total = 0.0
    if with_self:
        t = psutil.Process().cpu_times()
        total += t.user + t.system
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


def run_balance(args: argparse.Namespace) -> dict:
    """Blocks while the cluster and the perfect split run `--repeats` traces (seeds `--seed`, `--seed` + 1, ...),
    interleaved: repeat r through the cluster, then through the perfect split (each idle while the other runs)."""
    import tempfile

    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    traces = [make_trace(argparse.Namespace(**{**vars(args), "seed": args.seed + r})) for r in range(args.repeats)]
    repeats = []
    with tempfile.TemporaryDirectory(prefix="ep-balance-") as tmp:
        ckpt = str(make_checkpoint(Path(tmp) / "tiny", preset="tiny", seed=7))
        offline = None if args.skip_offline else _Offline(args, ckpt, traces)  # loads while the cluster starts
        cluster = None
        try:
            cluster = _Cluster(args, ckpt, Path(tmp) / "logs")
            # CPU seconds of each side's process tree (the cluster's with this process: its client threads) in each
            # phase: what each side costs per output token, and what the idle side takes from the running one
            c_pids = [proc.pid for proc in cluster.processes.procs.values()]
            o_pids = [proc.pid for proc in offline.procs] if offline is not None else []
            for r, trace in enumerate(traces):
                time.sleep(1.5)  # every load report idle again (the heartbeats after the previous phase)
                t0, c0, o0 = time.monotonic(), _cpu_seconds(c_pids, True), _cpu_seconds(o_pids)
                c = cluster.run(trace, f"r{r}")
                t1, c1, o1 = time.monotonic(), _cpu_seconds(c_pids, True), _cpu_seconds(o_pids)
                c["cpu_s"], c["other_side_cpu_per_s"] = c1 - c0, (o1 - o0) / (t1 - t0)
                o = offline.run(r) if offline is not None else None
                if o is not None:
                    t2, c2, o2 = time.monotonic(), _cpu_seconds(c_pids, True), _cpu_seconds(o_pids)
                    o["cpu_s"], o["other_side_cpu_per_s"] = o2 - o1, (c2 - c1) / (t2 - t1)
                repeats.append({"cluster": c, "perfect_offline": o,
                                "throughput_ratio": c["tokens_per_s"] / o["tokens_per_s"] if o else None})
        finally:
            if cluster is not None:
                cluster.close()
            if offline is not None:
                offline.close()
    params = {k: getattr(args, k) for k in ("num_requests", "bursts", "burst_gap_s", "prompt_len", "output_len",
                                            "decode_instances", "decode_ranks", "prefill_instances", "decode_policy",
                                            "max_num_seqs", "num_blocks", "seed", "repeats")}
    ratios = [r["throughput_ratio"] for r in repeats if r["throughput_ratio"] is not None]
    summary = {"median_ratio": statistics.median(ratios) if ratios else None,
               "median_balance": statistics.median(r["cluster"]["balance_mean_over_max"] for r in repeats),
               "median_cluster_tokens_per_s": statistics.median(r["cluster"]["tokens_per_s"] for r in repeats)}
    if ratios:
        summary["median_offline_tokens_per_s"] = statistics.median(r["perfect_offline"]["tokens_per_s"]
                                                                   for r in repeats)
    return {"benchmark": "balance", "params": params, "repeats": repeats, "summary": summary}


def format_balance(result: dict) -> str:
    p = result["params"]
    lines = [f"Request balancers: {p['prefill_instances']} prefill instances, {p['decode_instances']} decode "
             f"instances x {p['decode_ranks']} ranks (decode policy {p['decode_policy']}); {p['num_requests']} "
             f"requests in {p['bursts']} bursts {p['burst_gap_s']} s apart, prompts {p['prompt_len']}, outputs "
             f"{p['output_len']} tokens; --max-num-seqs {p['max_num_seqs']} --num-blocks {p['num_blocks']}; "
             f"{p['repeats']} repeat(s), seeds {p['seed']}..{p['seed'] + p['repeats'] - 1}", "",
             "| repeat | balance (mean/max request-s per decode rank) | cluster tok/s (span) | perfect split tok/s "
             "(instances' windows) | ratio | CPU s per 1k tokens (cluster; offline) | idle side's CPU, cores (cluster while the "
             "split runs / split while the cluster runs) | "
             "load average (cluster; offline) |", "|---|---|---|---|---|---|---|---|"]

    def la(x) -> str:
        return "/".join(f"{v:.1f}" for v in x)

    for i, r in enumerate(result["repeats"]):
        c, o = r["cluster"], r["perfect_offline"]
        bal = c["balance_mean_over_max"]
        off = (f"{o['tokens_per_s']:.1f} ({', '.join(f'{t:.2f}' for t in o['instance_s'])} s)" if o else "-")
        ratio = f"{r['throughput_ratio']:.3f}" if r["throughput_ratio"] is not None else "-"
        loads = f"{la(c['loadavg_before'])}" + (f"; {la(o['loadavg_before'])}" if o else "")
        k = 1000 / c["output_tokens"]
        cpu = f"{c['cpu_s'] * k:.2f}" + (f"; {o['cpu_s'] * k:.2f}" if o else "")
        idle = f"{o['other_side_cpu_per_s']:.2f} / {c['other_side_cpu_per_s']:.2f}" if o else "-"
        lines.append(f"| {i} | {f'{bal:.3f}' if bal is not None else 'n/a'} | {c['tokens_per_s']:.1f} "
                     f"({c['span_s']:.2f} s) | {off} | {ratio} | {cpu} | {idle} | {loads} |")
    sm = result["summary"]
    lines += ["", f"median balance {sm['median_balance']:.3f}; median cluster {sm['median_cluster_tokens_per_s']:.1f} "
              "tok/s" + (f"; median perfect split {sm['median_offline_tokens_per_s']:.1f} tok/s; median ratio "
                         f"{sm['median_ratio']:.3f}" if sm["median_ratio"] is not None else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m deepinfer.benchmarks.expert_parallel",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    moe = sub.add_parser("moe", help="the EP MoE layer with and without EPLB on skewed routing")
    moe.add_argument("--ranks", type=int, default=4)
    moe.add_argument("--experts", type=int, default=64)
    moe.add_argument("--topk", type=int, default=6)
    moe.add_argument("--redundant", type=int, default=16)
    moe.add_argument("--hidden", type=int, default=256)
    moe.add_argument("--inter", type=int, default=128)
    moe.add_argument("--tokens", type=int, default=64)
    moe.add_argument("--layers", type=int, default=3)
    moe.add_argument("--zipf", type=float, default=1.2)
    moe.add_argument("--steps", type=int, default=20)
    moe.add_argument("--seed", type=int, default=0)
    moe.add_argument("--timeout-s", type=float, default=600.0)
    moe.add_argument("--json", default=None)
    bal = sub.add_parser("balance", help="cluster throughput under a bursty trace vs a perfect offline split")
    add_balance_args(bal)
    args = parser.parse_args(argv)
    machine = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.command == "moe":
        result = run_moe(args)
        print(format_moe(result))
    else:
        result = run_balance(args)
        print(format_balance(result))
    result["machine"] = machine
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
