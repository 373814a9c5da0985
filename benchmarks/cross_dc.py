"""Prefill in one datacenter, decode in another (issue 26): TTFT and throughput as functions of the
link's bandwidth and latency, against the same cluster in one namespace; KV bytes per request over
the link; DeepSeek's link budget in prefill tokens/s for V4-Flash's compressed KV.

    python -m deepinfer.benchmarks.cross_dc [--bandwidths-mbit 1000,100,10] [--latencies-ms 0,5,25]
        [--num-requests 12] [--concurrency 4] [--ttft-requests 4] [--prompt-len 192] [--output-len 16]
        [--json OUT] [--logdir DIR]

Cluster: one prefill and one decode instance, their balancers and the entrypoint (`python -m ...`
processes), a tiny random-weight checkpoint (`make_checkpoint(preset="tiny")`, as the cross-datacenter
e2e test uses).

- `one namespace`: everything on loopback, NIXL over UCX as a one-host deployment runs it
  (`--loopback-ucx`).
- `two datacenters` (`deploy.netns`, needs root): prefill, its balancer, the entrypoint and this
  client in `dc-a`; decode and its balancer in `dc-b`; the KV crosses the veth by NIXL over UCX TCP,
  capped by tbf (changed in place between points: `tc qdisc change`). Latency: the entrypoint reaches
  dc-b's services (decode balancer, decode worker) through `DelayProxy`s in dc-a that delay every
  chunk by the point's one-way latency in each direction; the decode worker advertises the proxy's
  address (a second address of dc-a standing for dc-b, same port), so Pick, Reserve and the token
  stream pay the latency. NOTE: NIXL/UCX opens its own connections, so the KV WRITE itself sees the
  bandwidth cap but not the added latency (a user-space proxy cannot sit on that path; tc netem is
  not available here) — TTFT at a latency point is a lower bound of a real link's.

Points: each bandwidth at the first latency, then each other latency at the first bandwidth. Each
point sends fresh prompts (no prefix-cache hit): `--ttft-requests` one at a time (TTFT unloaded),
then `--num-requests` with `--concurrency` in flight (TTFT under load, request and token
throughput). Greedy; every output is checked against the offline engine's. KV bytes per request:
the prefill worker's `kv_transfer_sent_bytes_total` delta over the point's requests (and what left
dc-a on the veth, headers and control traffic included).

Budget: 400 Gb/s of inter-datacenter links per 8 GPUs (DeepSeek's figure) divided by V4-Flash's
compressed KV bytes per token (`engine.cache.kv_cache.compressed_bytes_per_token` of the default
`ModelConfig`, which is V4-Flash's published config) gives the prefill tokens/s such a link carries,
per node and per GPU, for bf16 and fp8 cache entries. The bounded per-request state (sliding window,
compressor buffers) moves once per request on top of that and is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deepinfer.benchmarks.chaos import health_stats

STARTUP_TIMEOUT_S = 180.0
LINK_GBPS_PER_8_GPUS = 400.0
"""DeepSeek's inter-datacenter budget: 400 Gb/s of links per 8 GPUs."""
FAR_LB_PORT, FAR_DECODE_PORT = 47101, 47102
"""Fixed ports of dc-b's services (a fresh namespace has nothing listening), mirrored by the proxies."""


def budget() -> dict:
    """DeepSeek's link budget in prefill tokens/s of V4-Flash's compressed KV."""
    import torch

    from deepinfer.engine.cache.kv_cache import compressed_bytes_per_token
    from deepinfer.engine.config import ModelConfig

    bytes_per_s = LINK_GBPS_PER_8_GPUS * 1e9 / 8
    out = {"link_gbps_per_8_gpus": LINK_GBPS_PER_8_GPUS}
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        bpt = compressed_bytes_per_token(ModelConfig.from_hf_dict({}), dtype)
        out[name] = {"bytes_per_token": bpt, "tokens_per_s_per_8_gpus": bytes_per_s / bpt,
                     "tokens_per_s_per_gpu": bytes_per_s / bpt / 8}
    return out


def _link_tx_bytes(link, name: str) -> int:
    r = subprocess.run(["ip", "-n", name, "-j", "-s", "link", "show", link.device(name)], capture_output=True,
                       text=True, check=True)
    return json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"]


def _set_rate(link, mbit: float) -> None:
    for ns in link.names:
        cmd = ["tc", "-n", ns, "qdisc", "change", "dev", link.device(ns), "root", "tbf", "rate", f"{mbit}mbit",
               "burst", f"{link.burst_kbit}kbit", "latency", f"{link.tbf_latency_ms}ms"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


class Setup:
    """One cluster (either layout); `measure(...)` runs one point on it."""

    def __init__(self, logdir: Path, checkpoint: str, link=None) -> None:
        from deepinfer.deploy.processes import ServiceProcesses

        self.link = link
        self.proxies = []
        self.procs = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        worker = ["--model", checkpoint, "--max-num-seqs", "8", "--num-blocks", "512"]
        if link is None:
            self.procs.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware"])
            self.procs.spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", "kv_load"])
            info = self.procs.wait_ready(STARTUP_TIMEOUT_S)
            for stage in ("prefill", "decode"):
                self.procs.spawn(stage, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                         "--loopback-ucx", *worker])
            decode_lb = info["decode_lb"]["address"]
            self.procs.spawn("entrypoint", ["entrypoint", "--model", checkpoint, "--prefill-lb-address",
                                            info["prefill_lb"]["address"], "--decode-lb-address", decode_lb])
        else:
            from deepinfer.deploy.netns import DelayProxy

            a, b = link.names
            near, far_real = link.address(a), link.address(b)
            self.far = f"{link.subnet.rsplit('.', 1)[0]}.{int(link.subnet.rsplit('.', 1)[1]) + 1}.2"
            r = subprocess.run(["ip", "-n", a, "addr", "add", f"{self.far}/32", "dev", "lo"], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise RuntimeError(f"cannot add {self.far} to {a}: {r.stderr.strip()}")
            self.procs.spawn("prefill_lb", ["loadbalancer", "--stage", "prefill", "--policy", "prefix_aware",
                                            "--host", near], netns=a)
            self.procs.spawn("decode_lb", ["loadbalancer", "--stage", "decode", "--policy", "kv_load", "--host",
                                           far_real, "--port", str(FAR_LB_PORT)], netns=b)
            info = self.procs.wait_ready(STARTUP_TIMEOUT_S)
            for port in (FAR_LB_PORT, FAR_DECODE_PORT):  # this process lives in dc-a: so do the proxies
                self.proxies.append(DelayProxy((far_real, port), 0.0, listen=(self.far, port)).start())
            self.procs.spawn("prefill", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"], "--host",
                                         near, "--datacenter", "dc-a", *worker], netns=a, env=link.ucx_env(a))
            self.procs.spawn("decode", ["decode_worker", "--lb-address", info["decode_lb"]["address"], "--host",
                                        far_real, "--port", str(FAR_DECODE_PORT), "--advertise-host", self.far,
                                        "--datacenter", "dc-b", *worker], netns=b, env=link.ucx_env(b))
            decode_lb = f"{self.far}:{FAR_LB_PORT}"
            self.procs.spawn("entrypoint", ["entrypoint", "--model", checkpoint, "--host", near,
                                            "--prefill-lb-address", info["prefill_lb"]["address"],
                                            "--decode-lb-address", decode_lb], netns=a)
        self.info = self.procs.wait_ready(STARTUP_TIMEOUT_S)
        self.decode_address = (self.info["decode"]["address"] if link is None
                               else f"{self.far}:{FAR_DECODE_PORT}")

    def set_link(self, mbit: float, latency_ms: float) -> None:
        _set_rate(self.link, mbit)
        for proxy in self.proxies:
            proxy.delay_s = latency_ms / 1000

    def measure(self, client, prompts: list[list[int]], ref: list[list[int]], output_len: int,
                ttft_requests: int, concurrency: int) -> dict:
        """TTFT one at a time over the first `ttft_requests` prompts, then the rest `concurrency` at a time."""
        before = health_stats(self.info["prefill"]["address"], "prefill")
        tx_before = _link_tx_bytes(self.link, self.link.names[0]) if self.link is not None else None

        def one(i: int) -> tuple[float, float, list[int]]:
            t = time.perf_counter()
            first, tokens = None, []
            for delta in client.stream(prompts[i], temperature=0.0, max_tokens=output_len, ignore_eos=True,
                                       deadline_ms=120_000):
                if first is None and delta["token_ids"]:
                    first = time.perf_counter() - t
                tokens.extend(delta["token_ids"])
            return first, time.perf_counter() - t, tokens

        unloaded = [one(i) for i in range(ttft_requests)]
        rest = list(range(ttft_requests, len(prompts)))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            loaded = list(pool.map(one, rest))
        wall = time.perf_counter() - t0
        outs = [o[2] for o in unloaded + loaded]
        wrong = [i for i, (o, r) in enumerate(zip(outs, ref)) if o != r]
        if wrong:
            raise AssertionError(f"outputs differ from the offline engine's for prompts {wrong}")
        after = health_stats(self.info["prefill"]["address"], "prefill")
        kv = after["kv_transfer_sent_bytes_total"] - before["kv_transfer_sent_bytes_total"]
        res = {
            "ttft_unloaded_ms": 1000 * sum(u[0] for u in unloaded) / max(1, len(unloaded)),
            "ttft_loaded_ms": 1000 * sum(x[0] for x in loaded) / max(1, len(loaded)),
            "ttft_loaded_max_ms": 1000 * max((x[0] for x in loaded), default=0.0),
            "requests_per_s": len(loaded) / wall, "output_tokens_per_s": len(loaded) * output_len / wall,
            "prompt_tokens_per_s": sum(len(prompts[i]) for i in rest) / wall,
            "kv_bytes_per_request": kv / len(prompts),
        }
        if tx_before is not None:
            res["link_bytes_per_request"] = (_link_tx_bytes(self.link, self.link.names[0]) - tx_before) / len(prompts)
        return res

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        self.procs.stop(10.0)


def markdown(result: dict) -> str:
    lines = ["| layout | bandwidth (Mbit/s) | latency one-way (ms) | TTFT unloaded (ms) | TTFT at concurrency (ms) | "
             "req/s | output tok/s | prompt tok/s | KV bytes/request | link bytes/request |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in result["points"]:
        link = p.get("link_bytes_per_request")
        lines.append(
            f"| {p['layout']} | {p.get('bandwidth_mbit', '-')} | {p.get('latency_ms', '-')} | "
            f"{p['ttft_unloaded_ms']:.0f} | {p['ttft_loaded_ms']:.0f} | {p['requests_per_s']:.2f} | "
            f"{p['output_tokens_per_s']:.1f} | {p['prompt_tokens_per_s']:.0f} | {p['kv_bytes_per_request']:,.0f} | "
            f"{'-' if link is None else f'{link:,.0f}'} |")
    b = result["budget"]
    lines += ["", f"DeepSeek's budget, {b['link_gbps_per_8_gpus']:g} Gb/s per 8 GPUs, V4-Flash compressed KV:", "",
              "| cache entries | bytes/token | prefill tokens/s per 8 GPUs | per GPU |", "|---|---:|---:|---:|"]
    for name in ("bf16", "fp8"):
        x = b[name]
        lines.append(f"| {name} | {x['bytes_per_token']:,.0f} | {x['tokens_per_s_per_8_gpus']:,.0f} | "
                     f"{x['tokens_per_s_per_gpu']:,.0f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    import torch

    from deepinfer.deploy.netns import TwoDatacenters, can_create, enter_netns
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.entrypoint.client import Client

    workdir = Path(args.logdir or tempfile.mkdtemp(prefix="deepinfer-cross-dc-"))
    link_budget = budget()
    checkpoint = args.checkpoint or str(make_checkpoint(workdir / "ckpt", preset="tiny", seed=args.seed))
    bws = [float(x) for x in args.bandwidths_mbit.split(",")]
    lats = [float(x) for x in args.latencies_ms.split(",")]
    points = [("one namespace", None, None)] + [("two datacenters", bw, lats[0]) for bw in bws] + [
        ("two datacenters", bws[0], lat) for lat in lats[1:]]
    g = torch.Generator().manual_seed(args.seed)
    n = args.ttft_requests + args.num_requests
    prompts = [[torch.randint(2, 512, (args.prompt_len,), generator=g).tolist() for _ in range(n)] for _ in points]
    print(f"offline reference for {len(points)} x {n} prompts ...", flush=True)
    outs = LLM(checkpoint, num_blocks=512).generate(
        [{"prompt_token_ids": p} for ps in prompts for p in ps],
        SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    refs = [[o.outputs[0].token_ids for o in outs[i * n:(i + 1) * n]] for i in range(len(points))]

    results = []
    ok, why = can_create()
    two = None
    if ok:
        two = TwoDatacenters(bandwidth_mbit=bws[0], names=(f"dc-a-{os.getpid()}", f"dc-b-{os.getpid()}"),
                             subnet=args.subnet).create()
        # before any gRPC thread exists: this process (client, proxies) and every thread it starts live in
        # dc-a; the one-namespace cluster runs there too (its processes inherit dc-a: loopback only)
        enter_netns(two.names[0])
    else:
        print(f"NOTICE: two datacenters skipped: {why}", flush=True)
    for layout in ("one namespace", "two datacenters"):
        link = two if layout == "two datacenters" else None
        if layout == "two datacenters" and two is None:
            break
        setup = None
        try:
            setup = Setup(workdir / layout.replace(" ", "_"), checkpoint, link)
            with Client(setup.info["entrypoint"]["address"], timeout_s=180) as client:
                client.generate([5, 6, 7], max_tokens=2)  # warm every stage
                for idx, (name, bw, lat) in enumerate(points):
                    if name != layout:
                        continue
                    if link is not None:
                        setup.set_link(bw, lat)
                    res = setup.measure(client, prompts[idx], refs[idx], args.output_len, args.ttft_requests,
                                        args.concurrency)
                    res.update(layout=name, **({} if bw is None else {"bandwidth_mbit": bw, "latency_ms": lat}))
                    results.append(res)
                    print(f"  {name} {bw or ''} Mbit/s {lat or ''} ms: TTFT {res['ttft_unloaded_ms']:.0f} / "
                          f"{res['ttft_loaded_ms']:.0f} ms, {res['requests_per_s']:.2f} req/s, "
                          f"{res['kv_bytes_per_request']:,.0f} KV bytes/request", flush=True)
        finally:
            if setup is not None:
                setup.close()
            if link is not None:
                link.destroy()
    return {"benchmark": "cross_dc", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python -m deepinfer.benchmarks.cross_dc", *sys.argv[1:]]),
            "prompt_len": args.prompt_len, "output_len": args.output_len, "concurrency": args.concurrency,
            "points": results, "budget": link_budget}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bandwidths-mbit", default="1000,100,10", help="tbf caps of the link (first: latency sweep's)")
    ap.add_argument("--latencies-ms", default="0,5,25", help="one-way latencies (first: bandwidth sweep's)")
    ap.add_argument("--num-requests", type=int, default=12, help="requests per point at --concurrency")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--ttft-requests", type=int, default=4, help="requests per point sent one at a time")
    ap.add_argument("--prompt-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--subnet", default="10.82.0", help="/24 of the veth link; the next /24 stands for dc-b in dc-a")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of a tiny random one")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not args.bandwidths_mbit or not args.latencies_ms:
        ap.error("--bandwidths-mbit and --latencies-ms need one value at least")
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print()
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
