"""A live local cluster for the HTTP tests and benchmark: two balancers, one prefill and one decode
instance (NIXL over UCX loopback), the token entrypoint and the HTTP front, each a real process
started as `python -m ...` on loopback.

```python
with LocalCluster(checkpoint, logdir, api_key="k") as cluster:
    cluster.http_url        # "http://127.0.0.1:PORT"
    cluster.grpc_address    # the token entrypoint
    cluster.worker_stats("decode")["num_kv_blocks_used"]
```

The processes are started and stopped by `deploy.processes.ServiceProcesses`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import grpc

from deepinfer.deploy.processes import ProcessStartError, ServiceProcesses
from deepinfer.protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, vision_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
STATS_KEY = "deepinfer-stats-json"


class ClusterError(RuntimeError):
    """A process of the cluster did not come up."""


class LocalCluster:
    """Starts the processes on enter (blocks until all serve), stops them front to back on exit."""

    def __init__(self, checkpoint: str | Path, logdir: str | Path, *, api_key: str | None = None,
                 http_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = ("--max-num-seqs", "8",
                                                                                   "--num-blocks", "256"),
                 vision_args: tuple[str, ...] | None = None, entrypoint_args: tuple[str, ...] = ()) -> None:
        """`vision_args`: also start the vision stage (balancer + one `vision_worker` with these extra
        arguments) and give the entrypoint its balancer; None = text only."""
        self.checkpoint = str(checkpoint)
        self.logdir = Path(logdir)
        self.api_key = api_key
        self.http_args = http_args
        self.worker_args = worker_args
        self.vision_args = vision_args
        self.entrypoint_args = entrypoint_args
        self._channels: dict[str, grpc.Channel] = {}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("DEEPINFER_API_KEY", None)
        self.processes = ServiceProcesses(self.logdir, env)
        self.info = self.processes.info

    @property
    def http_url(self) -> str:
        return self.info["http"]["address"]

    @property
    def grpc_address(self) -> str:
        return self.info["entrypoint"]["address"]

    def __enter__(self) -> LocalCluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        stages = (("prefill", "prefix_aware"), ("decode", "kv_load"))
        if self.vision_args is not None:
            stages += (("vision", "image_affinity"),)
        for stage, policy in stages:
            self._spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", policy,
                                        "--heartbeat-timeout-s", "3"])
        self._wait_ready()
        common = ["--model", self.checkpoint, "--loopback-ucx", *self.worker_args]
        self._spawn("prefill", ["prefill_worker", "--lb-address", self.info["prefill_lb"]["address"],
                                "--instance-id", "prefill-0", *common])
        self._spawn("decode", ["decode_worker", "--lb-address", self.info["decode_lb"]["address"],
                               "--instance-id", "decode-0", *common])
        vision = []
        if self.vision_args is not None:
            self._spawn("vision", ["vision_worker", "--lb-address", self.info["vision_lb"]["address"],
                                   "--instance-id", "vision-0", "--model", self.checkpoint, "--loopback-ucx",
                                   *self.vision_args])
            vision = ["--vision-lb-address", self.info["vision_lb"]["address"]]
        self._spawn("entrypoint", ["entrypoint", "--model", self.checkpoint, "--prefill-lb-address",
                                   self.info["prefill_lb"]["address"], "--decode-lb-address",
                                   self.info["decode_lb"]["address"], *vision, *self.entrypoint_args])
        self._wait_ready()
        http = ["deepinfer.entrypoint.http", "--entrypoint", self.grpc_address, "--host", "127.0.0.1", "--port", "0",
                "--model", self.checkpoint, "--prefill-lb-address", self.info["prefill_lb"]["address"],
                "--decode-lb-address", self.info["decode_lb"]["address"], *self.http_args]
        if self.vision_args is not None:
            http += ["--vision-lb-address", self.info["vision_lb"]["address"]]
        if self.api_key is not None:
            http += ["--api-key", self.api_key]
        self._spawn("http", http)
        self._wait_ready()
        self._wait_workers_registered()

    def _spawn(self, name: str, args: list[str]) -> None:
        self.processes.spawn(name, args)

    def _wait_ready(self) -> None:
        try:
            self.processes.wait_ready(STARTUP_TIMEOUT_S)
        except ProcessStartError as e:
            raise ClusterError(str(e)) from None

    def _wait_workers_registered(self) -> None:
        from deepinfer.entrypoint.client import Client

        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with Client(self.grpc_address) as client:
            while not client.health()["is_healthy"]:
                if time.monotonic() > deadline:
                    raise ClusterError("the entrypoint never reported healthy")
                time.sleep(0.1)

    def worker_stats(self, name: str) -> dict:
        """A worker's ("prefill" / "decode" / "vision") Health stats (from its trailing metadata)."""
        if name not in self._channels:
            self._channels[name] = grpc.insecure_channel(self.info[name]["address"])
        stub = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
                "vision": vision_pb2_grpc.VisionStub}[name](
            self._channels[name])
        _, call = stub.Health.with_call(common_pb2.HealthRequest(), timeout=10.0)
        return json.loads(dict(call.trailing_metadata())[STATS_KEY])

    def blocks_freed(self) -> bool:
        """No KV blocks held and no request unfinished on either worker."""
        p, d = self.worker_stats("prefill"), self.worker_stats("decode")
        return p["num_kv_blocks_used"] == 0 and d["num_kv_blocks_used"] == 0 and d["num_unfinished_requests"] == 0

    def stop(self) -> None:
        """SIGTERM front to back (workers can still deregister), kill what outlives STOP_TIMEOUT_S."""
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self.processes.stop(STOP_TIMEOUT_S)
