"""Starting a loopback cluster for an e2e test: the balancers, one prefill instance, the decode instances and the
entrypoint, each as `python -m ...` (`deploy.processes.ServiceProcesses`), NIXL over UCX loopback (`spawn_cluster`;
`running_cluster` adds a client and stops it all after). What a test does with them (its `Cluster` view, the vision
instances it adds) stays in the test."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.entrypoint.client import Client

POLICIES = {"vision": "image_affinity", "prefill": "prefix_aware", "decode": "kv_load"}
"""Each stage's balancer policy."""


def service_processes(tmp_path_factory) -> ServiceProcesses:
    """A process group logging under a new `logs` directory; one OpenMP thread and unbuffered output per process."""
    return ServiceProcesses(tmp_path_factory.mktemp("logs"),
                            {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def spawn_cluster(processes: ServiceProcesses, ckpt: str, worker_args: Sequence[str], startup_timeout_s: float, *,
                  stages: Sequence[str] = ("prefill", "decode"), lb_args: Mapping[str, Sequence[str]] | None = None,
                  decodes: Mapping[str, Sequence[str]] | None = None, entrypoint_args: Sequence[str] = ()) -> dict:
    """Blocks until every process is ready; returns their address lines (`ServiceProcesses.wait_ready`).

    A balancer per stage of `stages` (`<stage>_lb`, `POLICIES`, plus `lb_args[stage]`), then the prefill instance
    (process `prefill`, instance `prefill-0`) and the decode instances, every worker on `ckpt` with `--loopback-ucx`
    and `worker_args`: `decodes` maps a process name to its extra arguments (default: one, `decode`), the name being
    the instance id but for a process named `decode`, which serves `decode-0`. Last the entrypoint, on every
    stage's balancer, with `entrypoint_args`. Vision instances are the test's to add (`vision_lb` is running)."""
    for stage in stages:
        processes.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", POLICIES[stage],
                                        *(lb_args or {}).get(stage, ())])
    info = processes.wait_ready(startup_timeout_s)
    args = ["--model", ckpt, "--loopback-ucx", *worker_args]
    processes.spawn("prefill", ["prefill_worker", "--lb-address", info["prefill_lb"]["address"],
                                "--instance-id", "prefill-0", *args])
    for name, extra in (decodes or {"decode": ()}).items():
        processes.spawn(name, ["decode_worker", "--lb-address", info["decode_lb"]["address"],
                               "--instance-id", "decode-0" if name == "decode" else name, *args, *extra])
    processes.spawn("entrypoint", [
        "entrypoint", "--model", ckpt, *(arg for stage in ("prefill", "decode", "vision") if stage in stages
                                         for arg in (f"--{stage}-lb-address", info[f"{stage}_lb"]["address"])),
        *entrypoint_args])
    return processes.wait_ready(startup_timeout_s)


@contextmanager
def running_cluster(tmp_path_factory, ckpt: str, worker_args: Sequence[str], startup_timeout_s: float,
                    client_timeout_s: float, stop_timeout_s: float = 10.0,
                    **spawn_kwargs) -> Iterator[tuple[ServiceProcesses, Client]]:
    """`spawn_cluster` (`spawn_kwargs` its options) in a new process group, with an entrypoint client; yields both,
    then closes the client and stops the processes (front to back, so the workers can still deregister)."""
    processes = service_processes(tmp_path_factory)
    client = None
    try:
        info = spawn_cluster(processes, ckpt, worker_args, startup_timeout_s, **spawn_kwargs)
        client = Client(info["entrypoint"]["address"], timeout_s=client_timeout_s)
        yield processes, client
    finally:
        if client is not None:
            client.close()
        processes.stop(stop_timeout_s)
