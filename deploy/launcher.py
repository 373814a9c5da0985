"""Client side of the launcher: connect to Ray, start or find a cluster's controller, the state file.

```python
started_ray = connect_ray(None, num_cpus=8)          # a local Ray cluster that dies with this process
controller = start_cluster(ClusterConfig.load("deploy/configs/laptop.yaml"))
addresses = ray.get(controller.up.remote())          # {"entrypoint": "127.0.0.1:...", ...}
ray.get(controller.scale.remote({"decode": 2}))
stop_cluster(controller)
```

The state file (`$DEEPINFER_HOME/cluster.json`, default `~/.cache/deepinfer/cluster.json`) lets
other `deepinfer` commands find a running cluster without Ray: the entrypoint, HTTP and Ray
addresses, written by `deepinfer up` and removed by `deepinfer down` (or when `up` exits).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from deepinfer.deploy.config import ClusterConfig
from deepinfer.deploy.controller import NAMESPACE, RemoteController, controller_name


class ClusterNotFound(RuntimeError):
    """No controller of that name runs on the Ray cluster."""


def state_path() -> Path:
    """Where `deepinfer up` records the running cluster."""
    home = os.environ.get("DEEPINFER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(home) / "cluster.json"


def write_state(state: dict) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def read_state() -> dict | None:
    """The recorded cluster, or None."""
    try:
        return json.loads(state_path().read_text())
    except (OSError, ValueError):
        return None


def remove_state(cluster_name: str | None = None) -> None:
    """Forget the recorded cluster (only the one called `cluster_name`, when given)."""
    state = read_state()
    if state is not None and (cluster_name is None or state.get("name") == cluster_name):
        state_path().unlink(missing_ok=True)


def _is_loopback(address: str) -> bool:
    """Whether a Ray address ("host:port" or "auto") points at a cluster on this host's loopback."""
    if address == "auto":
        try:
            from ray._private.services import canonicalize_bootstrap_address

            address = canonicalize_bootstrap_address("auto") or ""
        except Exception:
            return False
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def connect_ray(address: str | None, *, num_cpus: int | None = None, resources: dict[str, float] | None = None) -> bool:
    """Connect this process to Ray; True if it started a local cluster (which dies with this process).

    `address` None starts a local single-node cluster (`num_cpus` logical CPUs, custom `resources`
    such as {"datacenter_dc-a": 100} to place datacenter-labelled groups on it); "auto" or
    "host:port" joins a running one.
    """
    if ray.is_initialized():
        return False
    kwargs = dict(namespace=NAMESPACE, log_to_driver=False, include_dashboard=False)
    if address is None or _is_loopback(address):
        # NOTE: a local cluster keeps Ray's own GCS/raylet addresses on loopback too (and a driver
        # joining it must then use loopback as well): Ray would otherwise advertise the node's
        # routable IP (it maps 127.0.0.1 to it unless its "cluster" mode is off, which it reads
        # from this constant at init). Every deepinfer server binds the config's `host`.
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    if address is None:
        # Actors get their own processes, so idle prestarted task workers would only cost memory.
        ray.init(num_cpus=num_cpus, resources=resources,
                 _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
                 **kwargs)
        return True
    kwargs.pop("include_dashboard")
    ray.init(address=address, **kwargs)
    return False


def start_cluster(config: ClusterConfig):
    """Create the cluster's named, detached controller (refusing if one runs) and return its handle.

    Call `up` on it (`ray.get(handle.up.remote())`) to launch. Raises RuntimeError if a cluster
    with this name already runs.
    """
    name = controller_name(config.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RuntimeError(f"a cluster named {config.name!r} already runs on this Ray cluster; "
                           "`deepinfer down` it first or set another `name:` in the config")
    return RemoteController.options(name=name, namespace=NAMESPACE, lifetime="detached").remote(
        config.model_dump_json())


def find_controller(cluster_name: str = "deepinfer"):
    """The handle of a running cluster's controller; ClusterNotFound otherwise."""
    try:
        return ray.get_actor(controller_name(cluster_name), namespace=NAMESPACE)
    except ValueError:
        raise ClusterNotFound(f"no deepinfer cluster named {cluster_name!r} on this Ray cluster; "
                              "start one with `deepinfer up`") from None


def stop_cluster(controller, timeout_s: float = 120.0) -> None:
    """Blocks until the cluster's roles stopped, then kills its controller."""
    try:
        ray.get(controller.down.remote(), timeout=timeout_s)
    finally:
        ray.kill(controller, no_restart=True)
