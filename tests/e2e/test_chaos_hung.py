"""A decode instance that hangs while requests are reserving KV on it does not hold them for as long as
it hangs (issue 26): the entrypoint watches the Reserve call like the decode stream (`DecodeLiveness`:
missed heartbeats at the balancer and no answer to a Health probe), cancels it and reserves on the
other instance. Found by the chaos battery (benchmarks/chaos.py): requests picked onto a SIGSTOPped
decode instance waited the whole 20 s stop before this.

Loopback processes: one prefill, two decode instances, both balancers, the entrypoint. Marked `slow`
(about 30 s on 2 cores).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client

pytest.importorskip("nixl")

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 120.0
HEARTBEAT_TIMEOUT_S = 1.0
STOP_S = 15.0


def test_requests_reserving_on_a_hung_decode_move_on_without_waiting_for_it(tmp_path_factory):
    from deepinfer.engine import LLM, SamplingParams
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (int(torch.randint(5, 40, (1,), generator=g)),), generator=g).tolist()
               for _ in range(8)]
    kwargs = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(ckpt).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(**kwargs), use_tqdm=False)]

    logdir = tmp_path_factory.mktemp("logs")
    processes = ServiceProcesses(logdir, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    client = None
    try:
        for stage, policy in (("prefill", "prefix_aware"), ("decode", "kv_load")):
            processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy,
                                            "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)])
        info = processes.wait_ready(STARTUP_TIMEOUT_S)
        for stage, name in (("prefill", "prefill-0"), ("decode", "decode-0"), ("decode", "decode-1")):
            processes.spawn(name, [f"{stage}_worker", "--lb-address", info[f"{stage}_lb"]["address"],
                                   "--instance-id", name, "--model", ckpt, "--loopback-ucx", "--max-num-seqs", "8",
                                   "--num-blocks", "256"])
        processes.spawn("entrypoint", ["entrypoint", "--model", ckpt, "--prefill-lb-address",
                                       info["prefill_lb"]["address"], "--decode-lb-address",
                                       info["decode_lb"]["address"], "--kv-lease-ms", "5000",
                                       "--liveness-interval-s", "0.25", "--liveness-probe-timeout-s", "0.5"])
        processes.wait_ready(STARTUP_TIMEOUT_S)
        client = Client(info["entrypoint"]["address"], timeout_s=90)
        assert client.generate(prompts[0], **kwargs)["token_ids"] == ref[0]  # every stage answered once

        processes.procs["decode-0"].send_signal(signal.SIGSTOP)
        t = time.monotonic()
        wake = threading.Timer(STOP_S, lambda: processes.procs["decode-0"].send_signal(signal.SIGCONT))
        wake.start()
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:  # picked before its heartbeats time out: some reserve on it
                outs = list(pool.map(lambda p: client.generate(p, deadline_ms=60_000, **kwargs), prompts))
            took = time.monotonic() - t
        finally:
            wake.join()
        assert [o["token_ids"] for o in outs] == ref
        log = (logdir / "entrypoint.err").read_text()
        assert "stopped answering while reserving KV" in log, "no request reserved on the hung instance"
        assert took < STOP_S - 5, f"requests waited {took:.1f} s: for the hung instance"
    finally:
        if client is not None:
            client.close()
        for proc in processes.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        processes.stop(10.0)
