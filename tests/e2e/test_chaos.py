"""A chaos battery on a loopback cluster (issue 26): two prefill and two decode instances, both
balancers and the entrypoint, each a `python -m ...` process, serve a steady stream of requests
while a seeded schedule SIGKILLs workers (restarted under their id, as the Ray launcher does),
SIGSTOPs one for longer than its balancer's heartbeat timeout (then SIGCONT), and SIGSTOPs both
prefill instances at once for a while (a whole stage down, for less than the requests' deadline).

Every accepted request must complete with the offline engine's output token for token (no duplicated
or missing token, right usage): a lost decode instance's streams migrate, a lost or hung prefill
instance's requests are retried on the other one, and requests wait while a whole stage is down
(`entrypoint.migration.StageOutages`). At the end no instance holds a KV block (Health stats).
Marked `slow` (about a minute and a half on 2 cores).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client, GenerateError
from deepinfer.protos import common_pb2, decode_pb2_grpc, entrypoint_pb2_grpc, prefill_pb2_grpc

pytest.importorskip("nixl")

pytestmark = pytest.mark.slow

SEED = 26
STARTUP_TIMEOUT_S = 120.0
RPC_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"
HEARTBEAT_TIMEOUT_S = 1.5
STOP_S = 3.0
"""How long a SIGSTOPped worker stays stopped (twice its balancer's heartbeat timeout: found hung)."""
DEADLINE_MS = 90_000
"""Each request's deadline: longer than any stage is down in the schedule."""
KV_LEASE_MS = 8000
"""Short leases: the reservations a hung prefill might still write into are quarantined until theirs ends."""
NUM_CLIENTS = 6
WORKERS = {"prefill": ("prefill-0", "prefill-1"), "decode": ("decode-0", "decode-1")}


def _worker_args(stage: str, instance_id: str, ckpt: str, lb_address: str) -> list[str]:
    return [f"{stage}_worker", "--lb-address", lb_address, "--instance-id", instance_id, "--model", ckpt,
            "--loopback-ucx", "--max-num-seqs", "8", "--num-blocks", "256"]


class _Chaos:
    """The cluster and the fault schedule (runs in a thread; `log` says what happened when)."""

    def __init__(self, processes: ServiceProcesses, ckpt: str, rng: random.Random) -> None:
        self.processes = processes
        self.ckpt = ckpt
        self.rng = rng
        self.log: list[str] = []
        self.t0 = time.monotonic()

    def _say(self, what: str) -> None:
        self.log.append(f"{time.monotonic() - self.t0:6.1f}s {what}")

    def kill_and_restart(self, stage: str) -> None:
        name = self.rng.choice(WORKERS[stage])
        self.processes.procs[name].kill()
        self.processes.procs[name].wait()
        self._say(f"SIGKILL {name}")
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.processes.info.pop(name, None)
        self.processes.spawn(name, _worker_args(stage, name, self.ckpt,
                                                self.processes.info[f"{stage}_lb"]["address"]))
        self.processes.wait_ready(STARTUP_TIMEOUT_S)
        self._say(f"{name} restarted")

    def stop_and_continue(self, names: tuple[str, ...]) -> None:
        for name in names:
            self.processes.procs[name].send_signal(signal.SIGSTOP)
        self._say(f"SIGSTOP {', '.join(names)}")
        time.sleep(STOP_S)
        for name in names:
            self.processes.procs[name].send_signal(signal.SIGCONT)
        self._say(f"SIGCONT {', '.join(names)}")

    def run(self) -> None:
        faults = [lambda: self.kill_and_restart("decode"), lambda: self.kill_and_restart("prefill"),
                  lambda: self.stop_and_continue((self.rng.choice(WORKERS["decode"]),)),
                  lambda: self.stop_and_continue((self.rng.choice(WORKERS["prefill"]),)),
                  lambda: self.stop_and_continue(WORKERS["prefill"])]
        self.rng.shuffle(faults)
        for fault in faults:
            time.sleep(self.rng.uniform(0.5, 1.5))
            fault()


def _requests(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 512, (int(torch.randint(5, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    kwargs = [dict(temperature=0.0, max_tokens=16, ignore_eos=True) if i % 2 == 0 else
              dict(temperature=1.0, seed=1000 + i, max_tokens=16, ignore_eos=True) for i in range(n)]
    return prompts, kwargs


def _stats(address: str, stage: str) -> dict:
    stub_class = prefill_pb2_grpc.PrefillStub if stage == "prefill" else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(address) as channel:
        _, call = stub_class(channel).Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
    return json.loads(dict(call.trailing_metadata())[STATS_KEY])


def _all_drained(processes: ServiceProcesses) -> bool:
    for stage, names in WORKERS.items():
        for name in names:
            s = _stats(processes.info[name]["address"], stage)
            if s["num_kv_blocks_used"] or s.get("num_unfinished_requests", 0) or s.get("num_inflight_requests", 0):
                return False
    return True


def test_every_accepted_request_survives_kills_and_hangs(tmp_path_factory):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    logdir = tmp_path_factory.mktemp("logs")
    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    prompts, kwargs = _requests(48, SEED)
    outs = LLM(ckpt).generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**k) for k in kwargs],
                              use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in outs]

    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    try:
        for stage, policy in (("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy,
                                            "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        for stage, names in WORKERS.items():
            for name in names:
                processes.spawn(name, _worker_args(stage, name, ckpt, info[f"{stage}_lb"]["address"]))
        processes.spawn("entrypoint", [
            "entrypoint", "--model", ckpt, "--prefill-lb-address", info["prefill_lb"]["address"],
            "--decode-lb-address", info["decode_lb"]["address"], "--migration-limit", "8",
            "--kv-lease-ms", str(KV_LEASE_MS), "--liveness-interval-s", "0.25", "--liveness-probe-timeout-s", "0.5"])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=DEADLINE_MS / 1000 + 30)

        chaos = _Chaos(processes, ckpt, random.Random(SEED))
        chaos_thread = threading.Thread(target=chaos.run, name="chaos")
        results: list[tuple[int, list[dict] | GenerateError]] = []  # (request spec, its fate), one per request
        counter = iter(range(1 << 30))
        lock = threading.Lock()

        def client_loop() -> None:
            # requests keep coming while the schedule runs (cycling through the specs), each list once at least
            while True:
                with lock:
                    n = next(counter)
                if n >= len(prompts) and not chaos_thread.is_alive():
                    return
                i = n % len(prompts)
                try:
                    fate = list(client.stream(prompts[i], deadline_ms=DEADLINE_MS, **kwargs[i]))
                except GenerateError as e:
                    fate = e
                with lock:
                    results.append((i, fate))

        chaos_thread.start()
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            for f in [pool.submit(client_loop) for _ in range(NUM_CLIENTS)]:
                f.result()
        chaos_thread.join()
        schedule = "\n".join(chaos.log)

        failed = [(i, r) for i, r in results if isinstance(r, GenerateError)]
        assert not failed, f"failed requests (no stage was down longer than their deadline):\n{failed}\n{schedule}"
        for i, deltas in results:
            tokens = [t for d in deltas for t in d["token_ids"]]
            assert tokens == ref[i], f"request {i}: {tokens} != {ref[i]}\n{schedule}"
            assert deltas[-1]["finish_reason"] == "length"
            assert deltas[-1]["usage"]["prompt_tokens"] == len(prompts[i])
            assert deltas[-1]["usage"]["completion_tokens"] == len(ref[i])
        with grpc.insecure_channel(info["entrypoint"]["address"]) as channel:
            reply, call = entrypoint_pb2_grpc.EntrypointStub(channel).Health.with_call(common_pb2.HealthRequest(),
                                                                                       timeout=RPC_TIMEOUT_S)
        assert reply.is_healthy, reply.message
        stats = json.loads(dict(call.trailing_metadata())[STATS_KEY])
        print(f"chaos: {len(results)} requests accepted and completed, {stats['num_migrated_requests_total']} "
              f"migrated ({stats['num_migrations_total']} migrations), 0 failed, 0 lost\n{schedule}")
        assert stats["num_migrations_total"] > 0  # the faults hit requests in flight
        # quarantined reservations (a hung prefill might still have written) end with their lease
        deadline = time.monotonic() + KV_LEASE_MS / 1000 + 10
        while not _all_drained(processes):
            assert time.monotonic() < deadline, f"KV blocks still held at the end\n{schedule}"
            time.sleep(0.25)
    finally:
        for proc in processes.procs.values():  # a stopped process would not see SIGTERM
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        if client is not None:
            client.close()
        processes.stop(10.0)
