"""Client side of the launcher: connect to Ray, start or find a cluster's controller, the state files.

```python
started_ray = connect_ray(None, num_cpus=8)          # a local Ray cluster that dies with this process
controller = start_cluster(ClusterConfig.load("deploy/configs/laptop.yaml"))
addresses = ray.get(controller.up.remote())          # {"entrypoint": "127.0.0.1:...", ...}
ray.get(controller.scale.remote({"decode": 2}))
stop_cluster(controller)
```

State files (`$DEEPINFER_HOME/clusters/<name>.json`, default home `~/.cache/deepinfer`) let other
`deepinfer` commands find a cluster without Ray: one per cluster name, written atomically by `deepinfer up`
(first `"status": "starting"` with its pid, then `"up"` with the addresses) and removed when `up`
exits or by `deepinfer down`. A state whose `up` process is gone (non-detached) is stale: the
commands say so within seconds and remove it (`find_state`), instead of waiting on a dead address.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
from pathlib import Path

import ray

from deepinfer.deploy.config import ClusterConfig
from deepinfer.deploy.controller import NAMESPACE, RemoteController, controller_name

DEFAULT_CLUSTER_NAME = "deepinfer"
PROBE_TIMEOUT_S = 2.0
"""How long a TCP probe of a recorded address may take before the cluster counts as unreachable."""
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ClusterNotFound(RuntimeError):
    """No cluster of that name is known or reachable; the message says which and what to do."""


def deepinfer_home() -> Path:
    return Path(os.environ.get("DEEPINFER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer"))


def check_cluster_name(name: str) -> str:
    """`name` if it can name a state file and Ray actors; ValueError otherwise."""
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"cluster name {name!r}: use letters, digits, '.', '_' and '-' (at most 64, "
                         "starting with a letter or digit)")
    return name


def state_path(cluster_name: str) -> Path:
    """Where `deepinfer up` records the cluster called `cluster_name`."""
    return deepinfer_home() / "clusters" / f"{check_cluster_name(cluster_name)}.json"


def write_state(state: dict) -> None:
    """Record `state` (it has a "name") atomically, readable by this user only (it holds the cluster secret)."""
    path = state_path(state["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_state(cluster_name: str) -> dict | None:
    """The recorded cluster called `cluster_name`, or None."""
    try:
        state = json.loads(state_path(cluster_name).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def list_states() -> list[dict]:
    """Every recorded cluster, by name."""
    folder = deepinfer_home() / "clusters"
    states = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        state = read_state(path.stem)
        if state is not None:
            states.append(state)
    return states


def remove_state(cluster_name: str, pid: int | None = None) -> None:
    """Forget the recorded cluster `cluster_name` (only if `pid` recorded it, when given)."""
    state = read_state(cluster_name)
    if state is not None and (pid is None or state.get("pid") == pid):
        state_path(cluster_name).unlink(missing_ok=True)


def default_cluster_name(given: str | None) -> str:
    """`given`, else $DEEPINFER_CLUSTER, else the one recorded cluster when there is exactly one, else "deepinfer"."""
    if given:
        return given
    if os.environ.get("DEEPINFER_CLUSTER"):
        return os.environ["DEEPINFER_CLUSTER"]
    states = list_states()
    return states[0]["name"] if len(states) == 1 else DEFAULT_CLUSTER_NAME


def is_pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def accepts(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether `host:port` accepts a TCP connection within `timeout_s`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def is_port_free(host: str, port: int) -> bool:
    """Whether a server could bind `host:port` now (0 = any port: always)."""
    if port == 0:
        return True
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("" if host in ("0.0.0.0", "::") else host, port))
        except OSError:
            return False
    return True


def state_liveness(state: dict) -> str:
    """`up`, `starting`, or `stale` (the `up` that wrote it is gone, or its Ray cluster does not answer)."""
    is_detached = bool(state.get("is_detached"))
    if not is_detached and not is_pid_alive(state.get("pid")):
        return "stale"
    if state.get("status") == "starting":
        return "starting"
    gcs = state.get("ray_address")
    if gcs and not accepts(gcs):
        return "stale"
    return "up"


def find_state(cluster_name: str) -> dict:
    """The recorded, live cluster `cluster_name`; ClusterNotFound (within seconds) when none is recorded,
    it is still starting, or its record is stale (the record is then removed)."""
    state = read_state(cluster_name)
    if state is None:
        known = [s["name"] for s in list_states()]
        raise ClusterNotFound(f"no cluster named {cluster_name!r} is running here"
                              + (f" (known: {', '.join(known)}; pick one with --name)" if known else "")
                              + "; start one with `deepinfer up` (or pass --address HOST:PORT of its Ray cluster)")
    liveness = state_liveness(state)
    if liveness == "starting":
        raise ClusterNotFound(f"cluster {cluster_name!r} is still starting (`deepinfer up`, pid {state.get('pid')}); "
                              "try again once it printed its addresses")
    if liveness == "stale":
        remove_state(cluster_name)
        raise ClusterNotFound(f"cluster {cluster_name!r} is gone (its `deepinfer up`, pid {state.get('pid')}, exited "
                              f"or its Ray cluster {state.get('ray_address')} does not answer); its stale record was "
                              "removed; start it again with `deepinfer up`")
    return state


def is_loopback(address: str) -> bool:
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
    if address is None or is_loopback(address):
        # NOTE: a local cluster keeps Ray's own GCS/raylet addresses on loopback too (and a driver
        # joining it must then use loopback as well): Ray would otherwise advertise the node's
        # routable IP (it maps 127.0.0.1 to it unless its "cluster" mode is off, which it reads
        # from this constant at init). Every deepinfer server binds the config's `host`.
        import ray._private.ray_constants as ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    if address not in (None, "auto") and not accepts(address):
        raise ConnectionError(f"no Ray cluster answers at {address} (within {PROBE_TIMEOUT_S:.0f} s)")
    if address is None:
        # Actors get their own processes, so idle prestarted task workers would only cost memory.
        ray.init(num_cpus=num_cpus, resources=resources,
                 _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
                 **kwargs)
        return True
    kwargs.pop("include_dashboard")
    ray.init(address=address, **kwargs)
    return False


def write_private_file(cluster_name: str, kind: str, text: str) -> str:
    """Write `text` to `$DEEPINFER_HOME/clusters/.NAME.KIND` (user-only, atomically); returns its path.

    NOTE: secrets reach the roles as the path of such a file, not as a value in Ray's runtime
    environment, which Ray's runtime-env agent writes to its log.
    """
    path = state_path(cluster_name).with_name(f".{cluster_name}.{kind}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return str(path)


def remove_private_files(cluster_name: str) -> None:
    for path in state_path(cluster_name).parent.glob(f".{cluster_name}.*"):
        path.unlink(missing_ok=True)


def start_cluster(config: ClusterConfig, secret: str | None = None, role_env: dict[str, str] | None = None):
    """Create the cluster's named, detached controller (refusing if one runs) and return its handle.

    Call `up` on it (`ray.get(handle.up.remote())`) to launch. Raises RuntimeError if a cluster
    with this name already runs. `secret`: the cluster secret every role gets in its environment
    (`serving.auth`; Ray's runtime environment, which the controller hands on to its roles); None =
    none, internal calls unchecked. `role_env`: environment variables instead of that (e.g. the path
    of a file holding the secret, `DEEPINFER_CLUSTER_SECRET_FILE`, and of one holding the HTTP front's
    API keys, `DEEPINFER_API_KEY_FILE`).
    """
    name = controller_name(config.name)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        pass
    else:
        raise RuntimeError(f"a cluster named {config.name!r} already runs on this Ray cluster; "
                           "`deepinfer down` it first or set another `name:` in the config")
    from deepinfer.serving.auth import SECRET_ENV

    env = dict(role_env or {})
    if secret:
        env[SECRET_ENV] = secret
    runtime_env = {"env_vars": env} if env else None
    return RemoteController.options(name=name, namespace=NAMESPACE, lifetime="detached",
                                    runtime_env=runtime_env).remote(config.model_dump_json())


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
