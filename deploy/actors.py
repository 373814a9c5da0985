"""The Ray actors the launcher places: each hosts one deepinfer process role.

* `ServiceActor` runs one server in the actor's own OS process: a vision, prefill or decode instance
  (`serve_vision` / `serve_prefill` / `serve_decode`), a stage balancer (`loadbalancer.server.start_server`) or the
  token-level entrypoint (`serve_entrypoint`). Killing that process (SIGKILL, OOM) is a crash Ray
  answers by restarting the actor (`max_restarts`): the constructor runs again and the instance
  re-registers with its balancer under the same instance id (on a new port).
* `ProcessActor` owns a child OS process (`python -m MODULE ...`, e.g. the HTTP front) that dies
  with the actor; if the child dies on its own, the actor exits with an error so Ray restarts both.

Ray only starts, stops and restarts these; tokens go over gRPC and KV over NIXL, never through Ray.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import ray

from deepinfer.deploy.network import is_network, resolve_host

logger = logging.getLogger("deploy")

STOP_GRACE_S = 1.0
"""In-flight calls get this long when a server is stopped (not drained)."""

_DIE_WITH_PARENT = (
    "import ctypes, os, runpy, signal, sys; "
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL); "  # PR_SET_PDEATHSIG: the child dies with the actor
    "os.getppid() == int(sys.argv[1]) or sys.exit(1); "
    "sys.argv = sys.argv[2:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def _advertise_host(host: str) -> str | None:
    """The host others reach a server bound to `host` at: the node's IP for a wildcard bind."""
    return ray.util.get_node_ip_address() if host in ("0.0.0.0", "::", "") else None


@ray.remote
class ServiceActor:
    """One role's server inside this actor's process (see the module docstring).

    `role`: vision, prefill, decode, vision_lb, prefill_lb, decode_lb or entrypoint; `config`: that role's config as
    a dict (`ClusterConfig.role_config(...).model_dump()`).
    """

    def __init__(self, role: str, config: dict) -> None:
        from deepinfer.serving.logs import configure_logging_from_env

        configure_logging_from_env()  # DEEPINFER_LOG_LEVEL / _FORMAT (`up --log-level/--log-format`), request ids
        self.role = role
        self.is_restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self._server = None
        self._balancer = None
        if is_network(config.get("host", "")):  # the cluster network: this node's address in it (`deploy.network`)
            config = {**config, "host": resolve_host(config["host"])}
        advertise = _advertise_host(config.get("host", ""))
        if advertise and "advertise_host" in config:
            config = {**config, "advertise_host": advertise}
        if role in ("vision", "prefill", "decode"):
            import torch

            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
            if role == "vision":
                from deepinfer.vision_worker.config import VisionWorkerConfig
                from deepinfer.vision_worker.server import serve_vision

                self._server = serve_vision(VisionWorkerConfig(**config))
            elif role == "prefill":
                from deepinfer.prefill_worker.config import PrefillWorkerConfig
                from deepinfer.prefill_worker.server import serve_prefill

                self._server = serve_prefill(PrefillWorkerConfig(**config))
            else:
                from deepinfer.decode_worker.config import DecodeWorkerConfig
                from deepinfer.decode_worker.server import serve_decode

                self._server = serve_decode(DecodeWorkerConfig(**config))
            self.address, self.instance_id = self._server.address, self._server.instance_id
        elif role in ("vision_lb", "prefill_lb", "decode_lb"):
            from deepinfer.loadbalancer.config import LoadBalancerConfig
            from deepinfer.loadbalancer.server import start_server

            lb = LoadBalancerConfig(**config)
            self._balancer = start_server(f"{lb.host}:{lb.port}", lb.stage, lb.policy,
                                          heartbeat_timeout_s=lb.heartbeat_timeout_s)
            self.address, self.instance_id = f"{lb.advertise_host or lb.host}:{self._balancer.port}", role
        elif role == "entrypoint":
            from deepinfer.entrypoint.config import EntrypointConfig
            from deepinfer.entrypoint.server import serve_entrypoint

            self._server = serve_entrypoint(EntrypointConfig(**config))
            self.address, self.instance_id = self._server.address, self._server.instance_id
        else:
            raise ValueError(f"unknown role {role!r}; roles: vision, prefill, decode, vision_lb, prefill_lb, decode_lb, "
                             "entrypoint")
        logger.info("%s %s serving on %s (pid %d%s)", role, self.instance_id, self.address, os.getpid(),
                    ", restarted" if self.is_restarted else "")

    def info(self) -> dict:
        """Where this role serves: address, instance id, pid, node IP, and whether Ray restarted it."""
        return {"role": self.role, "address": self.address, "instance_id": self.instance_id, "pid": os.getpid(),
                "node_ip": ray.util.get_node_ip_address(), "is_restarted": self.is_restarted}

    def drain(self, timeout_s: float | None = None) -> int:
        """Blocks until a worker drained (in-flight requests finished, or aborted after `timeout_s`) and
        stopped; returns how many requests were unfinished when the drain began."""
        if self.role not in ("vision", "prefill", "decode"):
            raise ValueError(f"only workers drain, this actor runs {self.role}")
        num_unfinished = self._server.drain(timeout_s)
        self._server.wait()
        return num_unfinished

    def stop(self) -> None:
        """Blocks until the server stopped (workers deregister first); the actor stays until killed."""
        if self._balancer is not None:
            self._balancer.server.stop(STOP_GRACE_S).wait()
        elif self._server is not None:
            self._server.stop(STOP_GRACE_S)


@ray.remote
class ProcessActor:
    """Owns one child process `python -m MODULE ARGS` (see the module docstring).

    Ready once the child printed the JSON line every deepinfer service prints when it listens
    (`{"address": "https://127.0.0.1:8000"}`: its scheme and bound port, so `--port 0` and HTTPS work),
    within `startup_timeout_s`, else the constructor raises with the child's output tail.
    """

    def __init__(self, name: str, module: str, args: list[str], host: str, port: int,
                 startup_timeout_s: float = 120.0) -> None:
        self.name = name
        self._is_stopping = False
        self._log = open(os.path.join(_log_dir(), f"{name}-{os.getpid()}.log"), "ab")
        start = self._log.tell()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), module, *args],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout_s
        while (printed := _printed_address(self._log.name, start)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                tail = open(self._log.name, "rb").read()[-3000:].decode(errors="replace")
                raise RuntimeError(f"{name} (python -m {module}) did not serve on {host}:{port}:\n{tail}")
            time.sleep(0.2)
        advertise = _advertise_host(host)  # a wildcard bind: reached at the node's IP
        self.address = printed.replace(f"//{host}:", f"//{advertise}:", 1) if advertise else printed
        threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    def info(self) -> dict:
        return {"role": self.name, "address": self.address, "pid": self.proc.pid,
                "node_ip": ray.util.get_node_ip_address(), "log": self._log.name}

    def stop(self) -> None:
        """Blocks until the child exited (SIGTERM, then SIGKILL after 10 s)."""
        self._is_stopping = True
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._is_stopping:
            logger.error("%s exited with %s; exiting so that Ray restarts it", self.name, code)
            os._exit(1)


def _printed_address(log_path: str, start: int) -> str | None:
    """The `address` of the first `{"address": ...}` line a child wrote to its log after byte `start`, or None."""
    with open(log_path, "rb") as f:
        f.seek(start)
        for line in f.read().decode(errors="replace").splitlines():
            if line.startswith('{"address"'):
                try:
                    return str(json.loads(line)["address"])
                except (ValueError, KeyError):
                    continue
    return None


def _log_dir() -> str:
    """Where child processes write their output: `$TMPDIR/deepinfer-logs` on the actor's node."""
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "deepinfer-logs")
    os.makedirs(path, exist_ok=True)
    return path
