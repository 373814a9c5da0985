"""The chaos battery (issue 26): a steady request load on a local cluster while a seeded schedule
kills, hangs and cuts things; every accepted request's fate is reported.

    python -m deepinfer.benchmarks.chaos [--duration-s 300] [--seed 26] [--clients 6] [--no-netns]
        [--no-vision] [--migration-limit 3] [--stop-s 20] [--cut-s 4] [--json OUT] [--logdir DIR]

Cluster (each a `python -m ...` process, `deploy.processes.ServiceProcesses`, a tiny random-weight
checkpoint `engine.testing.make_checkpoint(preset="tiny", vision=True)`): two prefill and two decode
instances, one vision instance, the three balancers and the entrypoint. Where this host can create
network namespaces (root, iproute2: `deploy.netns.can_create`), prefill, vision, their balancers
and the entrypoint run in datacenter `dc-a`, decode and its balancer in `dc-b`, joined by a veth
link capped by tbf (`--link-mbit`), the KV and the image embeddings crossing it by NIXL over UCX TCP;
this process (the client) enters `dc-a` first. Elsewhere (or with `--no-netns`) everything runs in
one namespace on loopback and the link cut is skipped, with a printed notice.

Load: `--clients` threads, each sending one request after another for `--duration-s` (and until the
schedule ended), cycling through `--num-specs` request specs fixed by `--seed`: prompts of 5-60
tokens, 16 output tokens (`ignore_eos`), even specs greedy, odd specs seeded sampling; with vision,
every eighth spec carries an image. The offline engine (`LLM`) computes each spec's output once;
a completed request must equal it token for token (seeded sampling is a function of (seed,
position), so migration keeps it exact).

Schedule (seeded, faults one after another from `--warmup-s` on, spread over the duration): SIGKILL
of a random prefill or decode worker (restarted under its id, as the Ray launcher and
tests/e2e/test_chaos.py do), at least two of them (one per minute of duration); SIGSTOP of a random
worker for `--stop-s`, then SIGCONT; SIGKILL of a random balancer (prefill or decode), restarted on
its address after 2 s (workers re-register on their next heartbeat; the entrypoint's picks wait);
the inter-datacenter link taken down for `--cut-s` (both veth ends), then up; with vision, SIGKILL
of the (only) vision worker, restarted under its id (image requests wait for it).

Fates: *accepted* (not refused at admission with RESOURCE_EXHAUSTED, counted apart as *refused*),
*completed* (finished, tokens equal the offline engine's), *wrong* (finished with other tokens: a
bug, the request and the schedule are printed), *failed* (ended with an error: its message is
kept), *lost* (the stream ended without a finish, or the client never heard back). *Migrated*:
the entrypoint's counters (requests that moved to another prefill -> decode pair, migrations).
Recovery after each fault: the time from the fault's end (worker serving again, SIGCONT, balancer
serving again, link up) to the first request completing after it, and to the first completion of a
request submitted after it. At the end every worker must hold no KV block (after the short lease).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RPC_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 180.0
HEARTBEAT_TIMEOUT_S = 1.5
KV_LEASE_MS = 8000
DEADLINE_MS = 90_000
IMAGE_PLACEHOLDER = 129279
BALANCER_DOWN_S = 2.0
"""How long a killed balancer stays away before it is started again on its address."""


def png(color: tuple[int, int, int], size: int = 48) -> bytes:
    """A small PNG (a colored disc) for image requests."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (size, size), (255, 255, 255))
    ImageDraw.Draw(im).ellipse((6, 6, size - 6, size - 6), fill=color)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def health_stats(address: str, stage: str) -> dict:
    """The counters a stage instance (or the entrypoint) reports in its Health trailing metadata."""
    import grpc

    from deepinfer.protos import common_pb2, decode_pb2_grpc, entrypoint_pb2_grpc, prefill_pb2_grpc, vision_pb2_grpc
    from deepinfer.protos.metadata import STATS_METADATA_KEY

    stub_class = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
                  "vision": vision_pb2_grpc.VisionStub, "entrypoint": entrypoint_pb2_grpc.EntrypointStub}[stage]
    with grpc.insecure_channel(address) as channel:
        _, call = stub_class(channel).Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
    return json.loads(dict(call.trailing_metadata())[STATS_METADATA_KEY])


class Cluster:
    """Balancers, workers and the entrypoint as processes, in two namespaces (`link` given) or one.

    Every process is remembered with its arguments, namespace and environment, so `restart(name)`
    starts it again exactly so (a balancer on the address it had: `--port`)."""

    def __init__(self, logdir: Path, checkpoint: str, link=None, worker_flags: Sequence[str] = (),
                 entrypoint_flags: Sequence[str] = ()) -> None:
        from deepinfer.deploy.processes import ServiceProcesses

        self.link = link
        self.checkpoint = checkpoint
        self.worker_flags = list(worker_flags)
        self.entrypoint_flags = list(entrypoint_flags)
        self.processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.specs: dict[str, tuple[list[str], str | None, dict | None]] = {}
        self.stage_of: dict[str, str] = {}

    @property
    def info(self) -> dict[str, dict]:
        return self.processes.info

    def datacenter(self, stage: str) -> str:
        """The namespace label a stage runs in: decode in dc-b, the rest in dc-a."""
        return "dc-b" if stage == "decode" else "dc-a"

    def _netns(self, stage: str) -> str | None:
        if self.link is None:
            return None
        return self.link.names[1] if stage == "decode" else self.link.names[0]

    def _host(self, stage: str) -> list[str]:
        return [] if self.link is None else ["--host", self.link.address(self._netns(stage))]

    def spawn(self, name: str, stage: str, args: list[str], env: dict | None = None) -> None:
        self.specs[name] = (args, self._netns(stage), env)
        self.stage_of[name] = stage
        self.processes.spawn(name, args, netns=self._netns(stage), env=env)

    def start(self, stages: Sequence[str], workers: dict[str, Sequence[str]]) -> dict[str, dict]:
        """Balancers of `stages`, then `workers` (stage -> instance ids), then the entrypoint; blocks
        until all serve."""
        policies = {"vision": "image_affinity", "prefill": "prefix_aware", "decode": "kv_load"}
        for stage in stages:
            self.spawn(f"{stage}_lb", stage, ["loadbalancer", "--stage", stage, "--policy", policies[stage],
                                              "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), *self._host(stage)])
        self.processes.wait_ready(STARTUP_TIMEOUT_S)
        for stage, names in workers.items():
            for name in names:
                self.spawn(name, stage, self.worker_args(stage, name), env=self._ucx_env(stage))
        lbs = [f"--{stage}-lb-address" for stage in stages]
        self.spawn("entrypoint", "entrypoint", [
            "entrypoint", "--model", self.checkpoint, *self._host("entrypoint"), "--kv-lease-ms", str(KV_LEASE_MS),
            *[x for flag, stage in zip(lbs, stages) for x in (flag, self.info[f"{stage}_lb"]["address"])],
            *self.entrypoint_flags])
        return self.processes.wait_ready(STARTUP_TIMEOUT_S)

    def _ucx_env(self, stage: str) -> dict | None:
        return None if self.link is None else self.link.ucx_env(self._netns(stage))

    def worker_args(self, stage: str, name: str) -> list[str]:
        args = [f"{stage}_worker", "--lb-address", self.info[f"{stage}_lb"]["address"], "--instance-id", name,
                "--model", self.checkpoint, *self._host(stage)]
        if self.link is None:
            args.append("--loopback-ucx")
        else:
            args += ["--datacenter", self.datacenter(stage)]
        if stage != "vision":
            args += self.worker_flags
        return args

    def kill(self, name: str) -> None:
        proc = self.processes.procs[name]
        proc.kill()
        proc.wait()

    def restart(self, name: str, port: str | None = None) -> None:
        """Start `name` again as it was started (a balancer: on `port`); blocks until it serves."""
        args, netns, env = self.specs[name]
        if port is not None:
            args = [*args, "--port", port]
        self.processes.info.pop(name, None)
        self.processes.spawn(name, args, netns=netns, env=env)
        self.processes.wait_ready(STARTUP_TIMEOUT_S)

    def stop(self) -> None:
        for proc in self.processes.procs.values():  # a stopped process would not see SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        self.processes.stop(10.0)


class Schedule:
    """The seeded fault schedule (run in a thread); `faults` records each one's kind, target, start and end."""

    def __init__(self, cluster: Cluster, rng: random.Random, workers: dict[str, Sequence[str]], *,
                 duration_s: float, warmup_s: float, stop_s: float, cut_s: float, num_kills: int) -> None:
        self.cluster = cluster
        self.rng = rng
        self.workers = workers
        self.stop_s = stop_s
        self.cut_s = cut_s
        self.t0 = time.monotonic()
        self.faults: list[dict] = []
        plan = [("kill_worker", None)] * num_kills + [("stop_worker", None), ("kill_balancer", None),
                                                      ("cut_link", None)]
        if workers.get("vision"):
            plan.append(("kill_vision", None))
        rng.shuffle(plan)
        self.plan = [kind for kind, _ in plan]
        # spread the faults' starts over the duration (each waits for the previous one to end)
        span = max(0.0, duration_s - warmup_s - stop_s - 15.0)
        self.starts = [warmup_s + span * i / max(1, len(self.plan)) for i in range(len(self.plan))]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _record(self, kind: str, target: str, start: float, note: str = "") -> None:
        self.faults.append({"kind": kind, "target": target, "start_s": round(start, 2),
                            "end_s": round(self.now(), 2), "note": note})
        print(f"  [{self.now():6.1f}s] {kind} {target} done ({self.now() - start:.1f} s){' ' + note if note else ''}",
              flush=True)

    def run(self) -> None:
        for kind, at in zip(self.plan, self.starts):
            wait = at - self.now()
            if wait > 0:
                time.sleep(wait)
            getattr(self, kind)()

    def kill_worker(self) -> None:
        stage = self.rng.choice(("prefill", "decode"))
        name = self.rng.choice(self.workers[stage])
        start = self.now()
        self.cluster.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.cluster.restart(name)
        self._record("SIGKILL worker", name, start, "restarted under its id")

    def kill_vision(self) -> None:
        name = self.rng.choice(self.workers["vision"])
        start = self.now()
        self.cluster.kill(name)
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.cluster.restart(name)
        self._record("SIGKILL vision worker", name, start, "restarted under its id")

    def stop_worker(self) -> None:
        name = self.rng.choice([*self.workers["prefill"], *self.workers["decode"]])
        proc = self.cluster.processes.procs[name]
        start = self.now()
        proc.send_signal(signal.SIGSTOP)
        time.sleep(self.stop_s)
        proc.send_signal(signal.SIGCONT)
        self._record(f"SIGSTOP {self.stop_s:g} s", name, start)

    def kill_balancer(self) -> None:
        name = f"{self.rng.choice(('prefill', 'decode'))}_lb"
        port = self.cluster.info[name]["address"].rsplit(":", 1)[1]
        start = self.now()
        self.cluster.kill(name)
        time.sleep(BALANCER_DOWN_S)
        self.cluster.restart(name, port=port)
        self._record("SIGKILL balancer", name, start, f"restarted on port {port}")

    def cut_link(self) -> None:
        link = self.cluster.link
        start = self.now()
        if link is None:
            self._record("link cut", "dc-a <-> dc-b", start, "SKIPPED: one namespace, no link to cut")
            return
        link.set_link(False)
        time.sleep(self.cut_s)
        link.set_link(True)
        self._record(f"link cut {self.cut_s:g} s", "dc-a <-> dc-b", start)


def make_specs(n: int, seed: int, with_images: bool) -> list[dict]:
    """`n` request specs: prompt ids, sampling kwargs, images (bytes) or none."""
    import torch

    g = torch.Generator().manual_seed(seed)
    colors = [(220, 30, 30), (30, 30, 220), (30, 160, 30)]
    specs = []
    for i in range(n):
        prompt = torch.randint(2, 512, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
        images = []
        if with_images and i % 8 == 3:
            prompt = prompt[:8] + [IMAGE_PLACEHOLDER] + prompt[8:]
            images = [png(colors[(i // 8) % len(colors)])]
        kwargs = (dict(temperature=0.0, max_tokens=16, ignore_eos=True) if i % 2 == 0 else
                  dict(temperature=1.0, seed=1000 + i, max_tokens=16, ignore_eos=True))
        specs.append({"prompt": prompt, "kwargs": kwargs, "images": images})
    return specs


def offline_outputs(checkpoint: str, specs: list[dict]) -> list[list[int]]:
    """The offline engine's tokens for every spec (the oracle)."""
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(checkpoint, num_blocks=512, max_num_seqs=8)
    prompts = [{"prompt_token_ids": s["prompt"], **({"multi_modal_data": {"image": s["images"]}} if s["images"]
                                                    else {})} for s in specs]
    outs = llm.generate(prompts, [SamplingParams(**s["kwargs"]) for s in specs], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_load(client, specs: list[dict], ref: list[list[int]], clients: int, t0: float, keep_going) -> list[dict]:
    """`clients` threads send requests back to back while `keep_going()`; one record per request."""
    import grpc

    from deepinfer.entrypoint.client import GenerateError

    records: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(1 << 30))

    def one(i: int) -> dict:
        spec = specs[i]
        rec = {"spec": i, "submit_s": time.monotonic() - t0, "fate": "lost", "error": "", "num_tokens": 0}
        tokens: list[int] = []
        images = ["data:image/png;base64," + base64.b64encode(b).decode() for b in spec["images"]] or None
        try:
            finish = None
            for delta in client.stream(spec["prompt"], deadline_ms=DEADLINE_MS, images=images, **spec["kwargs"]):
                if not tokens and delta["token_ids"]:
                    rec["first_token_s"] = time.monotonic() - t0
                tokens.extend(delta["token_ids"])
                finish = delta["finish_reason"] or finish
            if finish is None:
                rec["error"] = "the stream ended without a finish_reason"
            else:
                rec["fate"] = "completed" if tokens == ref[i] else "wrong"
        except GenerateError as e:
            rec["fate"] = "refused" if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "failed"
            rec["error"] = str(e)
        except Exception as e:  # the client never heard a status: lost
            rec["error"] = f"{type(e).__name__}: {e}"
        rec["end_s"] = time.monotonic() - t0
        rec["num_tokens"] = len(tokens)
        if rec["fate"] == "wrong":
            rec["tokens"], rec["expected"] = tokens, ref[i]
        return rec

    def loop() -> None:
        while keep_going():
            with lock:
                n = next(counter)
            rec = one(n % len(specs))
            with lock:
                records.append(rec)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(loop) for _ in range(clients)]:
            f.result()
    return records


def recovery(faults: list[dict], records: list[dict]) -> None:
    """Per fault: time from its end to the first completion after it, and to the first completion of a
    request submitted after it; completions while it lasted."""
    done = sorted((r["end_s"], r["submit_s"]) for r in records if r["fate"] == "completed")
    for f in faults:
        after = [e for e, _ in done if e >= f["end_s"]]
        fresh = [e for e, s in done if s >= f["end_s"]]
        f["recovery_s"] = round(after[0] - f["end_s"], 2) if after else None
        f["first_new_request_s"] = round(fresh[0] - f["end_s"], 2) if fresh else None
        f["completed_during"] = sum(1 for e, _ in done if f["start_s"] <= e < f["end_s"])


def markdown(result: dict) -> str:
    c = result["counts"]
    lines = ["| requests | count |", "|---|---:|"]
    for key in ("accepted", "completed", "migrated", "failed", "wrong", "lost", "refused"):
        lines.append(f"| {key} | {c[key]} |")
    lines += ["", "| t (s) | fault | target | lasted (s) | recovery (s) | first new request (s) | completed meanwhile |",
              "|---:|---|---|---:|---:|---:|---:|"]
    for f in result["faults"]:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.2f}"
        new = "-" if f["first_new_request_s"] is None else f"{f['first_new_request_s']:.2f}"
        note = f" ({f['note']})" if f["note"].startswith("SKIPPED") else ""
        lines.append(f"| {f['start_s']:.1f} | {f['kind']}{note} | {f['target']} | {f['end_s'] - f['start_s']:.1f} | "
                     f"{rec} | {new} | {f['completed_during']} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from deepinfer.deploy.netns import TwoDatacenters, can_create, enter_netns
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint
    from deepinfer.entrypoint.client import Client

    workdir = Path(args.logdir or tempfile.mkdtemp(prefix="deepinfer-chaos-"))
    with_vision = not args.no_vision
    if with_vision:
        try:
            import PIL  # noqa: F401
        except ImportError:
            print("NOTICE: Pillow is not installed: the vision stage is left out (no image requests)", flush=True)
            with_vision = False
    checkpoint = args.checkpoint or str(make_checkpoint(workdir / "ckpt", preset="tiny", seed=args.seed,
                                                        vision=with_vision))
    specs = make_specs(args.num_specs, args.seed, with_vision)
    print(f"offline reference for {len(specs)} request specs ...", flush=True)
    ref = offline_outputs(checkpoint, specs)

    link = None
    ok, why = can_create()
    if args.no_netns or not ok:
        print(f"NOTICE: one network namespace (loopback), no inter-datacenter link to cut: "
              f"{'--no-netns' if args.no_netns else why}", flush=True)
    else:
        link = TwoDatacenters(bandwidth_mbit=args.link_mbit, names=(f"dc-a-{os.getpid()}", f"dc-b-{os.getpid()}"),
                              subnet=args.subnet).create()
        enter_netns(link.names[0])  # before any gRPC thread exists: they all live in dc-a with this one
        print(f"two datacenters: {link.names[0]} (prefill, vision, balancers, entrypoint, this client) and "
              f"{link.names[1]} (decode, its balancer), veth capped at {args.link_mbit:g} Mbit/s", flush=True)
    workers = {"prefill": ("prefill-0", "prefill-1"), "decode": ("decode-0", "decode-1")}
    stages = ["vision", "prefill", "decode"] if with_vision else ["prefill", "decode"]
    if with_vision:
        workers = {"vision": ("vision-0",), **workers}
    cluster = Cluster(workdir / "logs", checkpoint, link,
                      worker_flags=["--max-num-seqs", "8", "--num-blocks", "256"],
                      entrypoint_flags=["--migration-limit", str(args.migration_limit), "--liveness-interval-s",
                                        "0.25", "--liveness-probe-timeout-s", "0.5"])
    client = None
    try:
        t_start = time.monotonic()
        info = cluster.start(stages, workers)
        print(f"cluster serving after {time.monotonic() - t_start:.1f} s; logs in {workdir / 'logs'}", flush=True)
        client = Client(info["entrypoint"]["address"], timeout_s=DEADLINE_MS / 1000 + 30)
        client.generate(specs[0]["prompt"], **specs[0]["kwargs"])  # warm: every stage answered once

        rng = random.Random(args.seed)
        schedule = Schedule(cluster, rng, workers,
                            duration_s=args.duration_s, warmup_s=args.warmup_s, stop_s=args.stop_s,
                            cut_s=args.cut_s, num_kills=max(2, int(args.duration_s // 60)))
        print(f"schedule: {', '.join(schedule.plan)} starting at "
              f"{', '.join(f'{s:.0f}' for s in schedule.starts)} s", flush=True)
        chaos = threading.Thread(target=schedule.run, name="chaos")
        t0 = schedule.t0
        chaos.start()
        records = run_load(client, specs, ref, args.clients, t0,
                           lambda: time.monotonic() - t0 < args.duration_s or chaos.is_alive())
        chaos.join()
        load_s = time.monotonic() - t0
        recovery(schedule.faults, records)
        stats = health_stats(info["entrypoint"]["address"], "entrypoint")
        # the reservations a hung or cut-off prefill might still have written into end with their lease
        held: dict[str, int] = {}
        deadline = time.monotonic() + KV_LEASE_MS / 1000 + 15
        while True:
            held = {n: health_stats(cluster.info[n]["address"], cluster.stage_of[n])["num_kv_blocks_used"]
                    for names in (workers["prefill"], workers["decode"]) for n in names}
            if not any(held.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        if client is not None:
            client.close()
        cluster.stop()
        if link is not None:
            link.destroy()

    counts = {fate: sum(1 for r in records if r["fate"] == fate)
              for fate in ("completed", "wrong", "failed", "lost", "refused")}
    counts["accepted"] = len(records) - counts["refused"]
    counts["migrated"] = stats.get("num_migrated_requests_total", 0)
    result = {
        "benchmark": "chaos", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join(["python -m deepinfer.benchmarks.chaos", *sys.argv[1:]]),
        "namespaces": "two (dc-a, dc-b)" if link is not None else "one (loopback)",
        "vision": with_vision, "duration_s": args.duration_s, "load_s": round(load_s, 1), "seed": args.seed,
        "clients": args.clients, "migration_limit": args.migration_limit, "counts": counts,
        "num_migrations_total": stats.get("num_migrations_total", 0),
        "num_not_migrated_total": stats.get("num_not_migrated_total", 0),
        "completed_per_s": round(counts["completed"] / load_s, 2), "faults": schedule.faults,
        "kv_blocks_held_at_end": held,
        "failed_errors": sorted({r["error"] for r in records if r["fate"] in ("failed", "lost")}),
        "wrong_requests": [r for r in records if r["fate"] == "wrong"],
        "requests": [{k: v for k, v in r.items() if k not in ("tokens", "expected")} for r in records],
    }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=300.0, help="seconds of load (the schedule may extend it)")
    ap.add_argument("--seed", type=int, default=26, help="seeds the checkpoint, the requests and the schedule")
    ap.add_argument("--clients", type=int, default=6, help="client threads, each one request at a time")
    ap.add_argument("--num-specs", type=int, default=48, help="distinct request specs the clients cycle through")
    ap.add_argument("--warmup-s", type=float, default=8.0, help="load before the first fault")
    ap.add_argument("--stop-s", type=float, default=20.0, help="how long the SIGSTOPped worker stays stopped")
    ap.add_argument("--cut-s", type=float, default=4.0, help="how long the inter-datacenter link is down")
    ap.add_argument("--link-mbit", type=float, default=1000.0, help="tbf cap of the inter-datacenter link")
    ap.add_argument("--subnet", default="10.81.0", help="/24 of the veth link (two namespaces)")
    ap.add_argument("--migration-limit", type=int, default=3, help="the entrypoint's --migration-limit")
    ap.add_argument("--no-netns", action="store_true", help="one namespace even where two could be made")
    ap.add_argument("--no-vision", action="store_true", help="leave the vision stage out")
    ap.add_argument("--checkpoint", default=None, help="use this checkpoint instead of a tiny random one")
    ap.add_argument("--logdir", default=None, help="keep the checkpoint and process logs here")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print()
    print(markdown(result))
    c = result["counts"]
    print(f"\n{result['date']}, {result['namespaces']}, vision {'on' if result['vision'] else 'off'}: "
          f"{c['accepted']} accepted in {result['load_s']} s ({result['completed_per_s']} completed/s), "
          f"{result['num_migrations_total']} migrations")
    for err in result["failed_errors"]:
        print(f"  failed/lost: {err}")
    for r in result["wrong_requests"]:
        print(f"  WRONG TOKENS: spec {r['spec']} submitted at {r['submit_s']:.2f} s, ended {r['end_s']:.2f} s: "
              f"{r['tokens']} != {r['expected']}")
    if any(result["kv_blocks_held_at_end"].values()):
        print(f"  KV blocks still held at the end: {result['kv_blocks_held_at_end']}")
    return result


if __name__ == "__main__":
    main()
