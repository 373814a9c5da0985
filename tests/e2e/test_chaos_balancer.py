"""A balancer killed mid-load and restarted on the same address loses no request (issue 26).

A loopback cluster of real processes (one prefill, one decode, both balancers, the entrypoint) serves
a steady stream of requests while the decode balancer, then the prefill balancer, is SIGKILLed and
started again on its port after a pause. The restarted balancer knows no instance until the workers'
next heartbeats re-register them (`serving.membership`); meanwhile the entrypoint's picks wait for it
within the request's deadline (`StageOutages.mark_out`) instead of failing. Every request, including
those that arrived while a balancer was down, completes with the offline engine's output token for
token. Marked `slow` (about 40 s on 2 cores).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client, GenerateError
from deepinfer.protos import loadbalancer_pb2, loadbalancer_pb2_grpc

pytest.importorskip("nixl")

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 120.0
HEARTBEAT_TIMEOUT_S = 1.5
DOWN_S = 2.0
"""How long a killed balancer stays away before it is started again."""
DEADLINE_MS = 60_000
NUM_CLIENTS = 4


def _requests(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 512, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    return prompts, dict(temperature=0.0, max_tokens=8, ignore_eos=True)


def _listed(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        reply = loadbalancer_pb2_grpc.LoadBalancerStub(channel).ListInstances(
            loadbalancer_pb2.ListInstancesRequest(), timeout=5)
    return {i.instance_id for i in reply.instances}


def test_a_killed_balancer_restarted_on_its_port_loses_no_request(tmp_path_factory):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    prompts, kwargs = _requests(24, 5)
    ref = [o.outputs[0].token_ids for o in LLM(ckpt).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**kwargs), use_tqdm=False)]

    processes = ServiceProcesses(tmp_path_factory.mktemp("logs"),
                                 {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    lb_args = {stage: ["loadbalancer", "--stage", stage, "--policy", policy, "--heartbeat-timeout-s",
                       str(HEARTBEAT_TIMEOUT_S)] for stage, policy in (("prefill", "prefix_aware"),
                                                                       ("decode", "kv_load"))}
    try:
        for stage, args in lb_args.items():
            processes.spawn(f"{stage}_lb", args)
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        for stage in ("prefill", "decode"):
            processes.spawn(stage, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                    "--instance-id", f"{stage}-0", "--model", ckpt, "--loopback-ucx",
                                    "--max-num-seqs", "8", "--num-blocks", "256"])
        processes.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--prefill-lb-address",
                                       info["prefill_lb"]["address"], "--decode-lb-address",
                                       info["decode_lb"]["address"], "--liveness-interval-s", "0.25"])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=DEADLINE_MS / 1000 + 30)

        downs: list[tuple[str, float, float]] = []  # (balancer, killed at, serving again at)

        def chaos() -> None:
            for stage in ("decode", "prefill"):
                time.sleep(2.0)
                name = f"{stage}_lb"
                address = info[name]["address"]
                processes.procs[name].kill()
                processes.procs[name].wait()
                killed = time.monotonic()
                time.sleep(DOWN_S)
                processes.info.pop(name)
                processes.spawn(name, [*lb_args[stage], "--port", address.rsplit(":", 1)[1]])
                processes.wait_ready(STARTUP_TIMEOUT_S)
                assert processes.info[name]["address"] == address
                downs.append((name, killed, time.monotonic()))

        chaos_thread = threading.Thread(target=chaos, name="chaos")
        results: list[tuple[int, float, float, list[dict] | GenerateError]] = []  # (prompt, started, ended, fate)
        counter = iter(range(1 << 30))
        lock = threading.Lock()

        def client_loop() -> None:
            while True:
                with lock:
                    n = next(counter)
                if n >= len(prompts) and not chaos_thread.is_alive():
                    return
                i = n % len(prompts)
                started = time.monotonic()
                try:
                    fate = list(client.stream(prompts[i], deadline_ms=DEADLINE_MS, **kwargs))
                except GenerateError as e:
                    fate = e
                with lock:
                    results.append((i, started, time.monotonic(), fate))

        chaos_thread.start()
        with ThreadPoolExecutor(NUM_CLIENTS) as pool:
            for f in [pool.submit(client_loop) for _ in range(NUM_CLIENTS)]:
                f.result()
        chaos_thread.join()
        assert len(downs) == 2, "the chaos schedule did not finish"

        failed = [(i, r) for i, _, _, r in results if isinstance(r, GenerateError)]
        assert not failed, f"requests failed while a balancer restarted: {failed}"
        for i, _, _, deltas in results:
            assert [t for d in deltas for t in d["token_ids"]] == ref[i], f"request {i}"
        for name, killed, back in downs:
            # NOTE: a request in flight at the kill that had not yet picked that stage waits the whole outage as
            # one arriving during it does; when every client holds such a request, none arrives
            # (2026-12-05: the decode reservation before the prefill pick took ~0.1-0.2 s of a request's ~0.3 s)
            during = [i for i, started, ended, _ in results if killed <= started < back or started < killed <= back <= ended]
            assert during, f"no request arrived or waited while {name} was down: the test did not test it"
        # both workers re-registered with their restarted balancers on their own
        assert _listed(info["decode_lb"]["address"]) == {"decode-0"}
        assert _listed(info["prefill_lb"]["address"]) == {"prefill-0"}
    finally:
        if client is not None:
            client.close()
        for proc in processes.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        processes.stop(10.0)
