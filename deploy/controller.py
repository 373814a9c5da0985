"""The cluster controller: a named, detached Ray actor that launches, scales and stops one deployment.

Separate `deepinfer` invocations find it by name (`<cluster name>-controller` in Ray namespace
`deepinfer`). It owns every role actor (`deploy.actors`), so killing it takes them all down.

* `up()`: the stage balancers, then every configured instance (each in its own placement group of
  one bundle holding all its ranks' resources, reserved by its actor: `InstanceGroup.bundles`), the entrypoint, and the HTTP front when `entrypoint.http` exists.
  The vision stage (balancer + instances) runs only when the model has a vision tower.
* `scale({"decode": 3, "prefill.dc-a": 1, "vision": 2})`: new instances register with their balancer; removed
  ones (newest first) drain — they refuse new work (retryably), finish what they hold, deregister
  and exit — before their actor and placement group go. No accepted request fails.
* `status()`: per instance its balancer view (health, load, cache use) and its `Health` stats.
* `down()`: stops everything, front to back.

Ray restarts every role that crashes: a worker comes back on a new port and registers again; a
balancer or the entrypoint comes back on its old address (they run on the controller's node, on a
port fixed at `up`), and the workers' heartbeats register them again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib.util
import json
import logging
import os
import socket
import threading

import grpc
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deepinfer.deploy.actors import ProcessActor, ServiceActor
from deepinfer.deploy.config import STAGES, ClusterConfig, InstanceGroup
from deepinfer.deploy.network import resolve_host
from deepinfer.protos import (
    common_pb2,
    decode_pb2_grpc,
    loadbalancer_pb2,
    loadbalancer_pb2_grpc,
    prefill_pb2_grpc,
    vision_pb2_grpc,
)
from deepinfer.protos.metadata import STATS_METADATA_KEY
from deepinfer.serving.auth import secure_channel
from deepinfer.serving.membership import BALANCER_CHANNEL_OPTIONS

logger = logging.getLogger("deploy")

NAMESPACE = "deepinfer"
"""Ray namespace of every deepinfer actor."""
STARTUP_TIMEOUT_S = 300.0
"""How long a role may take to serve (model load included) before `up`/`scale` fail."""
PLACEMENT_TIMEOUT_S = 60.0
"""How long a placement group may wait for resources before `up`/`scale` fail."""
RPC_TIMEOUT_S = 3.0
API_KEY_FILE_ENV = "DEEPINFER_API_KEY_FILE"
"""The HTTP front reads its API keys (comma-separated) from this file when set (`entrypoint.http`)."""


def controller_name(cluster_name: str) -> str:
    """The Ray actor name of a cluster's controller."""
    return f"{cluster_name}-controller"


class LaunchError(RuntimeError):
    """A role could not be placed or did not come up; the message says which and why."""


@dataclasses.dataclass
class _Instance:
    instance_id: str
    stage: str
    group: str
    datacenter: str
    actor: ray.actor.ActorHandle
    pg: object
    is_draining: bool = False


class ClusterController:
    """See the module docstring. Thread-safe (a threaded actor): `scale` calls run one at a time."""

    def __init__(self, config_json: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.config = ClusterConfig.model_validate_json(config_json)
        self._lock = threading.Lock()
        self._scale_lock = threading.Lock()
        self._instances: dict[str, _Instance] = {}
        self._next_index: dict[tuple[str, str], int] = {}
        self._slice_starts: dict[str, list] = {}
        """Instance id -> the `start` calls of its node-slice actors (an instance spanning nodes), until it serves.
        NOTE: the slice actors live in the instance's placement group and go with it."""
        self._roles: dict[str, ray.actor.ActorHandle] = {}
        self.addresses: dict[str, str] = {}
        self._is_up = False

    # ------------------------------------------------------------------ up / down

    def up(self) -> dict[str, str]:
        """Blocks until every configured role serves; returns the addresses (entrypoint, balancers, http)."""
        with self._scale_lock:
            if self._is_up:
                return dict(self.addresses)
            if self.config.model is None:
                # NOTE: written once here, not by every role at once (their writes would collide); on a
                # multi-node cluster give `model:` a path that exists on every node
                from deepinfer.engine.engine import default_model_path

                self.config = self.config.model_copy(update={"model": str(default_model_path())})
            c = self.config
            stages = c.active_stages()
            balancers = [f"{s}_lb" for s in stages]
            for role in balancers:
                self._start_front_role(role, c.role_config(role))
            infos = self._wait_roles(balancers)
            self.addresses.update({role: info["address"] for role, info in infos.items()})
            self._start_instances([(s, g) for s in stages for g in c.stage(s).groups for _ in range(g.num_instances)])
            self._start_front_role("entrypoint", c.role_config(
                "entrypoint", lb_addresses=(self.addresses["prefill_lb"], self.addresses["decode_lb"]),
                vision_lb_address=self.addresses.get("vision_lb", "")))
            self.addresses["entrypoint"] = self._wait_roles(["entrypoint"])["entrypoint"]["address"]
            if c.http.enabled and _has_module("deepinfer.entrypoint.http.__main__"):
                http_host = resolve_host(c.http.host)  # a network: this node's address in it (the front runs here)
                args = ["--entrypoint", self.addresses["entrypoint"], "--host", http_host, "--port", str(c.http.port),
                        # the balancers let /metrics gather the stages' figures (KV blocks, transfer bytes)
                        "--prefill-lb-address", self.addresses["prefill_lb"],
                        "--decode-lb-address", self.addresses["decode_lb"]]
                if "vision_lb" in self.addresses:
                    args += ["--vision-lb-address", self.addresses["vision_lb"]]
                if c.model:
                    args += ["--model", c.model]
                if c.revision:
                    args += ["--revision", c.revision]
                hosts = c.vision.worker.get("image_url_allowed_hosts", "") if "vision" in c.active_stages() else ""
                if hosts:  # the HTTP front checks image URLs against the vision stage's allow-list early
                    args += ["--image-url-allowed-hosts", hosts]
                args += _flags(c.http.settings)
                if getattr(c, "batch_invariant", False):  # reported by the front's /health
                    args.append("--batch-invariant")
                self._roles["http"] = ProcessActor.options(
                    num_cpus=0, max_concurrency=2, max_restarts=-1, namespace=NAMESPACE, name=f"{c.name}-http",
                    runtime_env={"env_vars": _front_env(c.http.api_keys)},
                    scheduling_strategy=self._this_node()).remote("http", "deepinfer.entrypoint.http", args, http_host,
                                                                  c.http.port)
                self.addresses["http"] = self._wait_roles(["http"])["http"]["address"]
            elif c.http.enabled:
                logger.info("entrypoint.http is not installed; no HTTP front")
            self._is_up = True
            return dict(self.addresses)

    def down(self) -> None:
        """Blocks until every role stopped: HTTP and entrypoint, then the workers (deregistering), then
        the balancers; their actors and placement groups are removed."""
        with self._scale_lock:
            with self._lock:
                instances, self._instances = list(self._instances.values()), {}
            front = [self._roles.pop(r) for r in ("http", "entrypoint") if r in self._roles]
            balancers = [self._roles.pop(r) for r in ("vision_lb", "prefill_lb", "decode_lb") if r in self._roles]
            for group in (front, [i.actor for i in instances], balancers):
                _best_effort([a.stop.remote() for a in group], timeout_s=15.0)
                for actor in group:
                    ray.kill(actor, no_restart=True)
            for inst in instances:
                remove_placement_group(inst.pg)
            self.addresses.clear()
            self._is_up = False

    # ------------------------------------------------------------------ scale

    def scale(self, targets: dict[str, int]) -> dict[str, int]:
        """Blocks until each `stage` or `stage.group` has the target number of instances: new ones
        serve and are registered, removed ones drained and gone. Returns the instances per stage.

        Raises ValueError for an unknown stage/group or a negative count (nothing changes then).
        """
        plan: list[tuple[str, InstanceGroup, int]] = []
        for key, target in targets.items():
            stage, _, group_name = key.partition(".")
            stage_config = self.config.stage(stage) if stage in STAGES else None
            if stage_config is None:
                raise ValueError(f"unknown stage {stage!r} in {key}={target}; stages: {list(STAGES)}")
            if stage not in self.config.active_stages():
                raise ValueError(f"stage {stage!r} is not deployed: the model has no vision tower (no vision_config "
                                 "in its config.json)")
            if not group_name:
                if len(stage_config.groups) != 1:
                    raise ValueError(f"stage {stage} has groups {[g.name for g in stage_config.groups]}; "
                                     f"say which: {stage}.GROUP={target}")
                group = stage_config.groups[0]
            else:
                group = stage_config.group(group_name)
            if target < 0:
                raise ValueError(f"{key}={target}: give a count >= 0")
            plan.append((stage, group, target))
        with self._scale_lock:
            to_start, to_drain = [], []
            for stage, group, target in plan:
                with self._lock:
                    live = [i for i in self._instances.values()
                            if i.stage == stage and i.group == group.name and not i.is_draining]
                if target > len(live):
                    to_start += [(stage, group)] * (target - len(live))
                else:
                    victims = sorted(live, key=lambda i: self._index_of(i.instance_id))[target:]
                    to_drain += victims
            with self._lock:
                for inst in to_drain:
                    inst.is_draining = True
            self._start_instances(to_start)
            self._drain(to_drain)
        return self.num_instances()

    def num_instances(self) -> dict[str, int]:
        """Instances per stage that are not draining."""
        with self._lock:
            return {s: sum(i.stage == s and not i.is_draining for i in self._instances.values())
                    for s in self.config.active_stages()}

    # ------------------------------------------------------------------ status

    def status(self) -> dict:
        """Blocks for a few RPCs: {"addresses", "instances": [row per instance], "balance": {stage: ...},
        "services": [balancers, entrypoint, HTTP front: role, address, pid]}.

        A row: stage, group, instance_id, datacenter, state (serving / draining / not registered /
        unreachable), the balancer's load view (is_healthy, running, waiting, KV blocks used/total,
        heartbeat age) and the worker's Health stats (kv_transfer counters).
        """
        with self._lock:
            instances = list(self._instances.values())
            addresses = dict(self.addresses)
        listed: dict[str, loadbalancer_pb2.Instance] = {}
        balance: dict[str, float | None] = {}
        for stage in self.config.active_stages():
            try:
                # every balancer client's reconnect backoff (serving.membership): a balancer restarting while
                # `status` asks is reached again within a second
                with secure_channel(addresses[f"{stage}_lb"], options=BALANCER_CHANNEL_OPTIONS) as channel:
                    reply = loadbalancer_pb2_grpc.LoadBalancerStub(channel).ListInstances(
                        loadbalancer_pb2.ListInstancesRequest(), timeout=RPC_TIMEOUT_S)
                listed.update({i.instance_id: i for i in reply.instances})
                balance[stage] = reply.balance
            except (grpc.RpcError, KeyError):
                balance[stage] = None
        with concurrent.futures.ThreadPoolExecutor(max(1, len(instances))) as pool:
            rows = list(pool.map(lambda inst: self._row(inst, listed.get(inst.instance_id)), instances))
        return {"addresses": addresses, "instances": rows, "balance": balance, "services": self._services()}

    def _services(self) -> list[dict]:
        """The balancers, the entrypoint and the HTTP front: role, address, pid (and the front's log file)."""
        with self._lock:
            roles = dict(self._roles)
        out = []
        for role in ("vision_lb", "prefill_lb", "decode_lb", "entrypoint", "http"):
            if role not in roles:
                continue
            try:
                info = ray.get(roles[role].info.remote(), timeout=RPC_TIMEOUT_S)
                out.append({"role": role, "address": info.get("address"), "pid": info.get("pid"),
                            "log": info.get("log"), "state": "serving"})
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                out.append({"role": role, "address": self.addresses.get(role), "pid": None, "state": "restarting"})
        return out

    def _row(self, inst: _Instance, seen: loadbalancer_pb2.Instance | None) -> dict:
        row = {"stage": inst.stage, "group": inst.group, "instance_id": inst.instance_id,
               "datacenter": inst.datacenter, "state": "draining" if inst.is_draining else "serving"}
        try:
            row.update(ray.get(inst.actor.info.remote(), timeout=RPC_TIMEOUT_S))
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):  # incl. ActorUnavailableError
            row["state"] = "restarting"
        if seen is None:
            row["state"] = "not registered" if row["state"] == "serving" else row["state"]
            return row
        load = seen.load
        row.update(address=seen.address, is_healthy=load.is_healthy, is_draining=load.is_draining,
                   num_running_requests=load.num_running_requests, num_waiting_requests=load.num_waiting_requests,
                   num_queued_prefill_tokens=load.num_queued_prefill_tokens,
                   num_kv_blocks_used=load.num_kv_blocks_used, num_kv_blocks_total=load.num_kv_blocks_total,
                   num_cached_block_hashes=seen.num_cached_block_hashes, heartbeat_age_ms=seen.heartbeat_age_ms)
        if load.ranks:  # a multi-rank instance: each rank's own requests and KV pool
            row["ranks"] = [{"rank": r.rank, "num_running_requests": r.num_running_requests,
                             "num_waiting_requests": r.num_waiting_requests, "num_kv_blocks_used": r.num_kv_blocks_used,
                             "num_kv_blocks_total": r.num_kv_blocks_total} for r in load.ranks]
        stub_cls = {"vision": vision_pb2_grpc.VisionStub, "prefill": prefill_pb2_grpc.PrefillStub,
                    "decode": decode_pb2_grpc.DecodeStub}[inst.stage]
        try:
            with secure_channel(seen.address) as channel:
                reply, call = stub_cls(channel).Health.with_call(common_pb2.HealthRequest(), timeout=RPC_TIMEOUT_S)
            row["stats"] = json.loads(dict(call.trailing_metadata()).get(STATS_METADATA_KEY, "{}"))
            row["is_healthy"] = row["is_healthy"] and reply.is_healthy
        except grpc.RpcError as e:
            row["state"] = "unreachable"
            row["error"] = e.code().name
        return row

    # ------------------------------------------------------------------ helpers

    def _start_front_role(self, role: str, config) -> None:
        """Start a balancer or the entrypoint on this controller's node, on a fixed port.

        NOTE: others hold its address, so a restart must come back on the same one: an ephemeral
        port is picked here, once, and the actor (restarted by Ray like the workers) binds it each time.
        """
        if config.port == 0:
            config = config.model_copy(update={"port": _free_port(resolve_host(config.host))})
        self._roles[role] = ServiceActor.options(
            num_cpus=0, max_concurrency=4, max_restarts=-1, namespace=NAMESPACE, name=f"{self.config.name}-{role}",
            runtime_env=_role_runtime_env(),
            scheduling_strategy=self._this_node()).remote(role, config.model_dump())

    @staticmethod
    def _this_node() -> NodeAffinitySchedulingStrategy:
        """Placement on the controller's node (roles with a fixed address: balancers, entrypoint, HTTP)."""
        return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)

    def _start_instances(self, wanted: list[tuple[str, InstanceGroup]]) -> None:
        """Blocks until each wanted instance serves and is registered with its balancer."""
        c = self.config
        started: list[_Instance] = []
        for stage, group in wanted:
            key = (stage, group.name)
            index = self._next_index.get(key, 0)
            self._next_index[key] = index + 1
            instance_id = f"{stage}-{index}" if group.name == "default" else f"{stage}-{group.name}-{index}"
            bundles = group.bundles()
            slices = group.node_slices()
            pg = placement_group(bundles, strategy=group.placement_strategy_of(), name=f"{c.name}-{instance_id}")
            try:
                ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(pg)
                where = "on one node" if len(slices) == 1 else f"in {len(slices)} node slices"
                raise LaunchError(
                    f"cannot place {instance_id} ({group.num_ranks} rank(s) {where}): {bundles} did not fit within "
                    f"{PLACEMENT_TIMEOUT_S:.0f} s (available: {ray.available_resources()}); add nodes or lower "
                    f"resources_per_rank (or ranks_per_node) of {stage} group {group.name!r}") from None
            spanning = {}
            if len(slices) > 1:  # NOTE: the other slices' actors start first and wait for rank 0's spec
                from deepinfer.deploy.rank_slice import pick_group_address, start_node_slices
                from deepinfer.engine.distributed.group import backend_for

                address = pick_group_address(pg)
                slice_actors = start_node_slices(pg, bundles, slices, address, backend_for(c.device),
                                                 runtime_env=_role_runtime_env())
                self._slice_starts[instance_id] = [a.start.remote() for a in slice_actors]
                spanning = dict(rank_group_address=address, local_ranks=len(slices[0]))
            bundle = dict(bundles[0])
            role_config = c.role_config(stage, instance_id=instance_id, lb_address=self.addresses[f"{stage}_lb"],
                                        datacenter=group.datacenter, num_ranks=group.num_ranks, **spanning)
            actor = ServiceActor.options(
                num_cpus=bundle.pop("CPU", 0), num_gpus=bundle.pop("GPU", 0), resources=bundle,
                # NOTE: a group spanning nodes meets once: Ray restarting rank 0 alone would wait for ranks gone
                max_restarts=0 if spanning else c.stage(stage).max_restarts, max_concurrency=4, namespace=NAMESPACE,
                name=f"{c.name}-{instance_id}", runtime_env=_role_runtime_env(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0),
            ).remote(stage, role_config.model_dump())
            started.append(_Instance(instance_id, stage, group.name, group.datacenter, actor, pg))
        for inst in started:
            try:
                ray.get(inst.actor.info.remote(), timeout=STARTUP_TIMEOUT_S)
                ray.get(self._slice_starts.pop(inst.instance_id, []), timeout=STARTUP_TIMEOUT_S)
            except Exception as e:
                for other in started:
                    ray.kill(other.actor, no_restart=True)
                    remove_placement_group(other.pg)  # NOTE: its node-slice actors go with it
                    self._slice_starts.pop(other.instance_id, None)
                raise LaunchError(f"{inst.instance_id} did not start: {e}") from None
        with self._lock:
            self._instances.update({i.instance_id: i for i in started})

    def _drain(self, victims: list[_Instance]) -> None:
        """Blocks until each victim drained and exited; then its actor and placement group go."""
        refs = {inst.instance_id: inst.actor.drain.remote(self.config.stage(inst.stage).drain_timeout_s)
                for inst in victims}
        for inst in victims:
            try:
                left = ray.get(refs[inst.instance_id])
                logger.info("drained %s (%d requests were in flight)", inst.instance_id, left)
            except ray.exceptions.RayError as e:  # it died while draining: nothing left to finish
                logger.warning("%s died while draining: %s", inst.instance_id, e)
            ray.kill(inst.actor, no_restart=True)
            remove_placement_group(inst.pg)
            with self._lock:
                self._instances.pop(inst.instance_id, None)

    def _wait_roles(self, roles: list[str]) -> dict[str, dict]:
        infos = {}
        for role in roles:
            try:
                infos[role] = ray.get(self._roles[role].info.remote(), timeout=STARTUP_TIMEOUT_S)
            except Exception as e:
                raise LaunchError(f"{role} did not start: {e}") from None
        return infos

    @staticmethod
    def _index_of(instance_id: str) -> int:
        return int(instance_id.rsplit("-", 1)[1])


def _flags(settings: dict) -> list[str]:
    """Command-line flags of config fields (`serving.config_cli`'s spelling: --name-with-dashes, --[no-]bool)."""
    out: list[str] = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + name.replace("_", "-"))
        elif value is not None:
            out += [flag, str(value)]
    return out


def _secret_env() -> dict[str, str]:
    """The cluster secret this controller got (`serving.auth`: its value or its file's path) and its TLS
    files (`DEEPINFER_TLS_*`), which every role gets too."""
    from deepinfer.serving.auth import SECRET_ENV, SECRET_FILE_ENV, tls_env

    return {**{k: os.environ[k] for k in (SECRET_ENV, SECRET_FILE_ENV) if os.environ.get(k)}, **tls_env()}


def _role_runtime_env() -> dict | None:
    """Ray runtime environment of a role actor: the cluster secret, given explicitly rather than left
    to Ray's inheritance; None when the cluster has none."""
    env = _secret_env()
    return {"env_vars": env} if env else None


def _front_env(api_keys: list[str]) -> dict[str, str]:
    """The HTTP front's environment: its API keys (never on its command line, which `ps` shows: the
    path of a user-only file `deepinfer up` wrote, else the keys) and the cluster secret."""
    env = _secret_env()
    if os.environ.get(API_KEY_FILE_ENV):
        env[API_KEY_FILE_ENV] = os.environ[API_KEY_FILE_ENV]
    elif api_keys:
        env["DEEPINFER_API_KEY"] = ",".join(api_keys)
    return env


def _free_port(host: str) -> int:
    """A TCP port free on this node right now (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("" if host in ("0.0.0.0", "::") else host, 0))
        return sock.getsockname()[1]


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def _best_effort(refs: list, timeout_s: float) -> None:
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as e:  # a dead or stuck role is killed next anyway
            logger.warning("stopping a role failed: %s", e)


RemoteController = ray.remote(num_cpus=0, max_concurrency=16)(ClusterController)
"""The Ray actor class (the plain class stays importable for reading)."""
