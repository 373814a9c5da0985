"""The cluster config: what runs where, as data (YAML), validated by frozen pydantic models.

```yaml
model: /ckpt/DeepSeek-V4-Flash        # omitted = the built-in default model
host: 127.0.0.1                       # 0.0.0.0 = every interface, advertised as the node's IP
vision:                               # started only when the model has a vision tower (config.json vision_config)
  balancer: {policy: image_affinity}
  worker: {max_batch_images: 8, image_url_allowed_hosts: "images.example.com"}
  groups: [{num_instances: 1}]
prefill:
  balancer: {policy: prefix_aware}
  worker: {max_num_seqs: 16}          # any PrefillWorkerConfig field the launcher does not set itself
  groups:
    - {name: dc-a, datacenter: dc-a, num_instances: 2, resources_per_rank: {GPU: 1}}
decode:
  balancer: {policy: kv_load}
  worker: {speculative: mtp, num_draft_tokens: 3}   # speculative decoding (MTP drafts, lossless) on decode;
                                                   # V4.1: dspark (prefill too), engram_placement: pinned_host
  groups:
    - {datacenter: dc-b, num_instances: 1, resources_per_rank: {GPU: 1}}
entrypoint: {max_attempts: 3}         # any EntrypointConfig field the launcher does not set itself
http: {enabled: true, port: 8000}
tls: {cert_file: /etc/deepinfer/tls.crt, key_file: /etc/deepinfer/tls.key, ca_file: /etc/deepinfer/ca.crt}  # optional
kv_store_dir: /nvme/deepinfer-kvstore # omitted = $DEEPINFER_HOME/kvstore/<name>, kept across down/up; fresh; off
```

`ClusterConfig.load(path)` reads and validates a file; errors name the field and how to fix it.
Each instance of a group is one Ray placement group of one bundle: `num_ranks` times `resources_per_rank` (plus
the datacenter's custom resource, see `datacenter_resource`), all reserved by the instance's actor, which starts
its ranks 1..N-1 itself on its node (`InstanceGroup.bundles`); with `ranks_per_node` < `num_ranks`, one bundle
per node slice, each other slice's ranks started by a node-slice actor (`deploy.rank_slice`).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deepinfer.decode_worker.config import DecodeWorkerConfig
from deepinfer.entrypoint.config import EntrypointConfig
from deepinfer.loadbalancer.config import LoadBalancerConfig
from deepinfer.prefill_worker.config import PrefillWorkerConfig
from deepinfer.vision_worker.config import VisionWorkerConfig

STAGES = ("vision", "prefill", "decode")
"""The stages the launcher runs, front to back; vision only for models with a vision tower
(`ClusterConfig.active_stages`)."""

LAUNCHER_SET_FIELDS = frozenset({"model", "revision", "dtype", "device", "host", "port", "advertise_host", "lb_address",
                                 "instance_id", "agent_name", "datacenter", "loopback_ucx",
                                 "prefill_lb_address", "decode_lb_address", "vision_lb_address", "stage",
                                 "batch_invariant"})
"""Role-config fields the launcher fills in itself; a YAML file must not set them per role."""

DATACENTER_RESOURCE_PREFIX = "datacenter_"
"""Datacenter labels are Ray custom resources: start each node of datacenter X with
`ray start --resources '{"datacenter_X": 1000}'`; every rank of a group in X asks for a sliver of it."""

DATACENTER_RESOURCE_PER_RANK = 0.001


def datacenter_resource(datacenter: str) -> str:
    """The Ray custom resource that names `datacenter`."""
    return DATACENTER_RESOURCE_PREFIX + datacenter


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class InstanceGroup(_Frozen):
    """Instances of one stage that share a datacenter and a per-rank resource shape."""

    name: str = "default"
    """Group name, unique within its stage (`deepinfer scale prefill.NAME=N` addresses it)."""
    num_instances: int = Field(1, ge=0)
    """Instances started by `up` (changed live by `deepinfer scale`)."""
    datacenter: str = ""
    """Datacenter label: reported to the balancer and turned into a Ray custom resource; "" = anywhere."""
    num_ranks: int = Field(1, ge=1)
    """Ranks (processes) per instance, on one node. A prefill or decode instance of N > 1 ranks runs expert-parallel
    (the worker's `expert_parallel_size`); vision instances have 1."""
    resources_per_rank: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    """Ray resources of one rank: {"CPU": 1} here, {"GPU": 1, "CPU": 8} on GPU nodes."""
    ranks_per_node: int | None = Field(None, ge=1)
    """Ranks of an instance per node (e.g. 8 on 8-GPU nodes); None = all `num_ranks` on one node. With fewer than
    `num_ranks` the instance spans nodes: one placement bundle per node slice (`bundles`)."""
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """The Ray strategy of an instance's placement group. One node (one bundle): nothing to choose. Spanning nodes:
    a bundle is one node slice (Ray never splits a bundle), so STRICT_PACK (every slice on one node) is replaced by
    PACK (as few nodes as possible, `placement_strategy_of`); STRICT_SPREAD puts each slice on its own node."""

    @field_validator("resources_per_rank")
    @classmethod
    def _resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if amount < 0:
                raise ValueError(f"resources_per_rank[{name!r}] = {amount} is negative")
            if name.startswith(DATACENTER_RESOURCE_PREFIX):
                raise ValueError(f"resources_per_rank[{name!r}]: set `datacenter:` instead of the datacenter resource")
        return value

    def bundles(self) -> list[dict[str, float]]:
        """The placement group of one instance: one bundle per node slice (`node_slices`; one unless
        `ranks_per_node` < `num_ranks`) of its ranks x `resources_per_rank` (with the datacenter resource per rank).

        NOTE: one bundle, not one per rank: the instance's actor (rank 0) spawns ranks 1..N-1 itself, so it must
        reserve every rank's resources (Ray gives an actor the resources of one bundle only); with GPUs, Ray then
        sets the actor's CUDA_VISIBLE_DEVICES to its N GPUs and rank r runs on visible device r
        (`engine.distributed.group.rank_device`). The same holds per node slice: bundle 0 is the actor's, each
        other bundle a node-slice actor's (`deploy.rank_slice`), which starts its ranks on its node."""
        return [self._bundle(len(ranks)) for ranks in self.node_slices()]

    def node_slices(self) -> list[range]:
        """The ranks of each node slice (one bundle each): one slice of all ranks unless `ranks_per_node` is
        smaller than `num_ranks`; slice 0 holds rank 0, the instance's actor."""
        from deepinfer.engine.distributed.group import node_slices

        return node_slices(self.num_ranks, min(self.ranks_per_node or self.num_ranks, self.num_ranks))

    def placement_strategy_of(self) -> str:
        """The strategy the placement group gets: `placement_strategy`, except STRICT_PACK over several node slices
        (impossible when a slice fills a node) becomes PACK: slices on as few nodes as possible."""
        if len(self.node_slices()) > 1 and self.placement_strategy == "STRICT_PACK":
            return "PACK"
        return self.placement_strategy

    def _bundle(self, num_ranks: int) -> dict[str, float]:
        bundle = {name: amount * num_ranks for name, amount in self.resources_per_rank.items() if amount > 0}
        if self.datacenter:
            bundle[datacenter_resource(self.datacenter)] = DATACENTER_RESOURCE_PER_RANK * num_ranks
        if not bundle:
            raise ValueError(f"group {self.name!r}: a placement bundle needs at least one resource")
        return bundle


class BalancerSettings(_Frozen):
    """A stage's balancer (one process)."""

    policy: str
    """Routing policy (`loadbalancer.policies.POLICIES`)."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = ephemeral."""
    heartbeat_timeout_s: float = Field(3.0, gt=0)
    """An instance silent this long is dropped."""


class StageConfig(_Frozen):
    """One stage: its balancer, its instance groups and the settings every instance shares."""

    balancer: BalancerSettings
    """The stage's balancer."""
    groups: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    """Instance groups (e.g. one per datacenter)."""
    worker: dict[str, Any] = Field(default_factory=dict)
    """Worker settings shared by the stage's instances (fields of the stage's worker config)."""
    drain_timeout_s: float = Field(120.0, gt=0)
    """Scale-down: in-flight requests of a removed instance get this long before they are aborted."""
    max_restarts: int = Field(-1, ge=-1)
    """Ray restarts of a crashed instance (-1 = always)."""

    @field_validator("groups")
    @classmethod
    def _unique_groups(cls, value: list[InstanceGroup]) -> list[InstanceGroup]:
        names = [g.name for g in value]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique within a stage, got {names}")
        if not value:
            raise ValueError("a stage needs at least one group (num_instances may be 0)")
        return value

    @field_validator("worker")
    @classmethod
    def _no_launcher_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(LAUNCHER_SET_FIELDS & set(value))
        if taken:
            raise ValueError(f"worker settings {taken} are set by the launcher; set model/dtype/device/host at the "
                             "top level and datacenter per group")
        return value

    def group(self, name: str) -> InstanceGroup:
        """The group called `name`; KeyError listing the groups otherwise."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r}; groups: {[g.name for g in self.groups]}")


HTTP_LAUNCHER_SET_FIELDS = frozenset({"entrypoint", "host", "port", "model", "revision", "api_key",
                                      "prefill_lb_address", "decode_lb_address", "vision_lb_address"})
"""Fields of the HTTP front's own config (`entrypoint.http.config.HttpConfig`) the launcher sets itself."""


class HttpConfig(_Frozen):
    """The HTTP front (`python -m deepinfer.entrypoint.http`), started when that module exists."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True,
                              hide_input_in_errors=True)  # NOTE: a bad api_keys entry must not print the keys

    enabled: bool = True
    """Start it (ignored, with a note, when `entrypoint.http` is not installed)."""
    host: str = "127.0.0.1"
    """Interface it binds."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port."""
    api_keys: list[str] = Field(default_factory=list)
    """API keys the front accepts (any one; `Authorization: Bearer KEY` or `x-api-key`); empty = no key.
    Each may carry its policy: `KEY;name=NAME;class=agent|chat;max_concurrent=C;rpm=R` (`entrypoint.http.keys`).
    Handed to the front through its environment, never on a command line."""
    settings: dict[str, Any] = Field(default_factory=dict)
    """More settings of the front (fields of `entrypoint.http.config.HttpConfig`: served_model_name,
    max_model_len, default_thinking, thinking_sampling, log_level, log_format, max_inflight_requests, ...)."""

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, value: list[str]) -> list[str]:
        for key in value:
            if not key or "," in key or key != key.strip():
                raise ValueError("an API key must be non-empty, without commas or surrounding spaces")
        from deepinfer.entrypoint.http.keys import parse_keys

        parse_keys(",".join(value))  # the keys' options (name, class, max_concurrent, rpm); names no key value
        return value

    @field_validator("settings")
    @classmethod
    def _front_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        from deepinfer.entrypoint.http.config import HttpConfig as FrontConfig

        taken = sorted(HTTP_LAUNCHER_SET_FIELDS & set(value))
        if taken:
            raise ValueError(f"http settings {taken} are set by the launcher (host/port/api_keys are http fields)")
        try:
            FrontConfig(**value)
        except ValidationError as e:
            raise ValueError(f"http settings: {e}") from None
        return value


class TlsConfig(_Frozen):
    """TLS for every internal gRPC service and the HTTP front (`serving.auth`). Files are paths on every node;
    `deepinfer up` hands them to every role through its environment (`DEEPINFER_TLS_*`)."""

    cert_file: str
    """PEM certificate (chain) every gRPC server presents (and the HTTP front, unless `http.settings` name
    `https_cert` / `https: false`); its names (SANs) must cover every address services are dialled at (the
    cluster `host` or the nodes' IPs), or set `server_name`."""
    key_file: str
    """PEM private key of `cert_file`."""
    ca_file: str | None = None
    """PEM CA bundle every client (roles, the CLI) checks server certificates against; None = the system roots."""
    server_name: str | None = None
    """Name clients expect in server certificates instead of the dialled host (one DNS name for the whole cluster)."""

    def env(self) -> dict[str, str]:
        """The `serving.auth` environment of these settings."""
        from deepinfer.serving.auth import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, TLS_SERVER_NAME_ENV

        env = {TLS_CERT_ENV: self.cert_file, TLS_KEY_ENV: self.key_file}
        if self.ca_file:
            env[TLS_CA_ENV] = self.ca_file
        if self.server_name:
            env[TLS_SERVER_NAME_ENV] = self.server_name
        return env


PREFILL_KV_STORE_DEFAULT = "embedded"
"""The prefill stage's `kv_store` when its worker settings name none: the embedded persistent KV store
(`kvstore`), in `ClusterConfig.kv_store_dir` unless the settings give `kv_store_dirs`; `kv_store: "off"` disables it.
The decode stage gets the prefill stage's store settings unless its own name a `kv_store` (it writes finished
conversation turns there: `decode_worker.core`)."""

STORE_SETTINGS = ("kv_store", "kv_store_dirs", "kv_store_capacity_gb", "kv_store_mooncake_master",
                  "kv_store_mooncake_metadata")
"""Worker settings of the KV store, the same on prefill and decode workers."""

STORE_DIR_FRESH = "fresh"
"""`kv_store_dir: fresh`: a new directory for this start, removed when the cluster goes down (the demo's)."""
STORE_DIR_OFF = "off"
"""`kv_store_dir: off`: no KV store (the stages' `kv_store` default to "off")."""


def cluster_store_dir(name: str) -> Path:
    """The default embedded KV store of cluster `name`: `$DEEPINFER_HOME/kvstore/<name>` (default home
    `~/.cache/deepinfer`), kept across `down` / `up` and machine restarts. One per cluster name, not per model:
    the store's keys are rooted in the model and cache fingerprint, so another model never reads these blocks."""
    home = os.environ.get("DEEPINFER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(home) / "kvstore" / name


def fresh_store_root() -> Path:
    """Where `up` keeps the per-start embedded KV store directories: `$DEEPINFER_HOME/clusters/kvstore`
    (beside the cluster records; default home `~/.cache/deepinfer`)."""
    home = os.environ.get("DEEPINFER_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "deepinfer")
    return Path(home) / "clusters" / "kvstore"


def is_fresh_store_dir(path: str | None) -> bool:
    """Whether `path` is a per-start store directory made by `ClusterConfig` (removed when its cluster goes down)."""
    return bool(path) and Path(path).parent == fresh_store_root()


def _default_prefill() -> StageConfig:
    return StageConfig(balancer=BalancerSettings(policy="prefix_aware"))


def _default_decode() -> StageConfig:
    return StageConfig(balancer=BalancerSettings(policy="kv_load"))


def _default_vision() -> StageConfig:
    return StageConfig(balancer=BalancerSettings(policy="image_affinity"))


def model_has_vision(model: str | None, revision: str | None = None) -> bool:
    """Whether a checkpoint (None = the built-in default model; a Hugging Face repo id: its cached or
    downloaded snapshot) has a vision tower: a `vision_config` in its config.json. Reads only that file."""
    try:
        from deepinfer.engine.config import read_config_json
        from deepinfer.engine.hub import resolve_model

        return "vision_config" in read_config_json(resolve_model(model, revision))
    except (OSError, ValueError):
        return False  # not readable here (e.g. a path on other nodes): the workers will say


class ClusterConfig(_Frozen):
    """A whole deployment: model, addresses, both stages, the entrypoint and the HTTP front."""

    name: str = "deepinfer"
    """Cluster name: the controller is the detached Ray actor `<name>-controller` in namespace `deepinfer`."""
    model: str | None = None
    """Checkpoint directory on every node, or a Hugging Face repo id (each node resolves it in its own
    cache); None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    dtype: str = "float32"
    """Weights and cache dtype of every worker."""
    device: str = "cpu"
    """torch device of the workers: cpu, or cuda (Ray sets CUDA_VISIBLE_DEVICES per rank)."""
    host: str = "127.0.0.1"
    """Interface every internal server binds: an address, or the cluster network (`10.0.0.0/8`: each node's own
    address in it, `deploy.network`); 0.0.0.0 = every interface (public ones too), advertised as the node's IP."""
    loopback_ucx: bool | None = None
    """Keep NIXL's UCX on loopback; None = true exactly when `host` is a loopback address."""
    batch_invariant: bool = False
    """Batch-invariant numerics on every prefill and decode worker (`engine.batch_invariant`): a request's output
    does not depend on its batch, chunking, cache hits or placement; slower. One switch for both stages."""
    vision: StageConfig = Field(default_factory=_default_vision)
    """The vision stage (started only when the model has a vision tower)."""
    prefill: StageConfig = Field(default_factory=_default_prefill)
    """The prefill stage."""
    decode: StageConfig = Field(default_factory=_default_decode)
    """The decode stage."""
    entrypoint: dict[str, Any] = Field(default_factory=lambda: {"max_attempts": 3})
    """Entrypoint settings (fields of `EntrypointConfig` the launcher does not set)."""
    http: HttpConfig = Field(default_factory=HttpConfig)
    """The HTTP front."""
    cluster_secret_file: str | None = None
    """File (on every node) holding the secret every internal gRPC call carries and every server checks
    (`serving.auth`); None = `deepinfer up` generates a fresh one for each start."""
    tls: TlsConfig | None = None
    """TLS certificate paths for the gRPC services and the HTTP front; None = plaintext (keep internal
    addresses on a private network: README, "What is exposed")."""
    kv_store_dir: str | None = None
    """Directory of the stages' embedded KV store (`PREFILL_KV_STORE_DEFAULT`) when the worker settings name no
    `kv_store_dirs`. Omitted: `cluster_store_dir(name)`, which survives `down` / `up` and machine restarts (a
    prompt served before a restart is a store hit after it). "fresh": a new directory for this start under
    `fresh_store_root()`, shared by its instances (restarted by Ray or added by `scale`) and removed by `deepinfer
    down`. "off": no store. On a multi-node cluster name a path that exists on every prefill and decode node."""

    @model_validator(mode="before")
    @classmethod
    def _resolve_store_dir(cls, data: Any) -> Any:
        # NOTE: resolved here, on the host that loads the config, not per role: the controller (which gets this
        # config as JSON) and every instance of one start agree on the directory
        if not isinstance(data, dict):
            return data
        chosen = data.get("kv_store_dir")
        if chosen is False:  # YAML reads an unquoted `off` as false
            chosen = STORE_DIR_OFF
            data = {**data, "kv_store_dir": chosen}
        if not chosen:
            data = {**data, "kv_store_dir": str(cluster_store_dir(data.get("name") or "deepinfer"))}
        elif chosen == STORE_DIR_FRESH:
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            data = {**data, "kv_store_dir": str(fresh_store_root() / f"{stamp}-{secrets.token_hex(4)}")}
        return data

    @property
    def is_store_off(self) -> bool:
        """`kv_store_dir: off`: the stages run without a KV store unless their worker settings name one."""
        return self.kv_store_dir == STORE_DIR_OFF

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted((LAUNCHER_SET_FIELDS - {"port"}) & set(value))
        if taken:
            raise ValueError(f"entrypoint settings {taken} are set by the launcher")
        return value

    @model_validator(mode="after")
    def _role_configs_validate(self) -> ClusterConfig:
        # NOTE: builds every role's config once so that a bad value fails at load time, naming the role
        for role in ("vision", "prefill", "decode", "vision_lb", "prefill_lb", "decode_lb", "entrypoint"):
            groups = self.stage(role).groups if role in STAGES else ()
            if role == "vision" and any(g.num_ranks != 1 for g in groups):
                raise ValueError("vision groups: num_ranks must be 1 (only prefill and decode instances run as "
                                 "expert-parallel rank groups)")
            for num_ranks in sorted({1} | {g.num_ranks for g in groups}):
                try:
                    config = self.role_config(role, instance_id=f"{role}-check", lb_address="127.0.0.1:1",
                                              lb_addresses=("127.0.0.1:1", "127.0.0.1:2"), num_ranks=num_ranks)
                    if num_ranks > 1:  # the engine's rules of a rank group (e.g. no speculative decoding yet)
                        config.engine_config()
                except ValidationError as e:
                    raise ValueError(f"{role} settings{f' (num_ranks={num_ranks})' if num_ranks > 1 else ''}: {e}") \
                        from None
        return self

    @model_validator(mode="after")
    def _dspark_rings_have_a_sender(self) -> ClusterConfig:
        # NOTE: a decode stage that takes the sent state with DSpark also takes the DSpark rings from the prefill's
        # slot (`spec_decode.dspark_drafter`); a prefill without the drafter has none to send (its agent refuses)
        decode = self.role_config("decode", instance_id="decode-check", lb_address="127.0.0.1:1")
        prefill = self.role_config("prefill", instance_id="prefill-check", lb_address="127.0.0.1:1")
        if decode.speculative == "dspark" and decode.is_state_sent and prefill.speculative != "dspark":
            raise ValueError("decode settings speculative: dspark take the DSpark stages' window rings with the "
                             "prefill's state: set `speculative: dspark` in the prefill worker settings too (`deepinfer "
                             "up --speculative dspark` sets both), or `bounded_state: replay` in the decode's")
        return self

    @property
    def is_loopback(self) -> bool:
        from deepinfer.deploy.network import is_loopback_host

        return is_loopback_host(self.host)

    def stage(self, stage: str) -> StageConfig:
        if stage not in STAGES:
            raise KeyError(f"unknown stage {stage!r}; stages: {list(STAGES)}")
        return getattr(self, stage)

    def active_stages(self) -> tuple[str, ...]:
        """The stages this deployment runs: vision only when the model has a vision tower."""
        return STAGES if model_has_vision(self.model, self.revision) else tuple(s for s in STAGES if s != "vision")

    def _with_store_defaults(self, worker: dict[str, Any]) -> dict[str, Any]:
        """A prefill or decode worker's settings with the cluster's KV store defaults filled in (`kv_store`
        embedded, or off with `kv_store_dir: off`; the directory)."""
        worker = dict(worker)
        worker.setdefault("kv_store", "off" if self.is_store_off else PREFILL_KV_STORE_DEFAULT)
        if worker["kv_store"] is False:  # YAML reads an unquoted `off` as false
            worker["kv_store"] = "off"
        if worker["kv_store"] == "embedded" and not worker.get("kv_store_dirs"):
            if self.is_store_off:
                raise ValueError("kv_store_dir is off but a worker's settings ask for the embedded store: give them "
                                 "kv_store_dirs, or name a kv_store_dir")
            worker["kv_store_dirs"] = self.kv_store_dir
        return worker

    def role_config(self, role: str, *, instance_id: str = "", lb_address: str = "", datacenter: str = "",
                    lb_addresses: tuple[str, str] = ("", ""), advertise_host: str | None = None,
                    vision_lb_address: str = "", num_ranks: int = 1, rank_group_address: str = "",
                    local_ranks: int | None = None):
        """The validated config of one process: a vision/prefill/decode worker, a balancer or the entrypoint.
        `num_ranks`: the instance's group's (a prefill / decode worker's `expert_parallel_size`); an instance
        spanning nodes also gets `rank_group_address` and `local_ranks` (`deploy.rank_slice`)."""
        loopback = self.is_loopback if self.loopback_ucx is None else self.loopback_ucx
        common = dict(host=self.host, port=0, advertise_host=advertise_host)
        if role in STAGES:
            cls = {"vision": VisionWorkerConfig, "prefill": PrefillWorkerConfig, "decode": DecodeWorkerConfig}[role]
            worker = dict(self.stage(role).worker)
            if role == "decode" and "kv_store" not in worker:  # the prefill stage's store (conversation turns)
                prefill = self._with_store_defaults(self.prefill.worker)
                worker = {**{k: v for k, v in prefill.items() if k in STORE_SETTINGS}, **worker}
            elif role in ("prefill", "decode"):
                worker = self._with_store_defaults(worker)
            return cls(**worker, **common, model=self.model, revision=self.revision, dtype=self.dtype,
                       device=self.device,
                       lb_address=lb_address, instance_id=instance_id, agent_name=instance_id, datacenter=datacenter,
                       loopback_ucx=loopback,
                       **({"batch_invariant": self.batch_invariant} if role != "vision" else {}),
                       **({"expert_parallel_size": num_ranks} if num_ranks > 1 else {}),
                       **({"rank_group_address": rank_group_address, "local_ranks": local_ranks}
                          if rank_group_address else {}))
        if role.endswith("_lb"):
            stage = role.removesuffix("_lb")
            b = self.stage(stage).balancer
            return LoadBalancerConfig(stage=stage, policy=b.policy, host=self.host, port=b.port,
                                      advertise_host=advertise_host, heartbeat_timeout_s=b.heartbeat_timeout_s)
        if role == "entrypoint":
            return EntrypointConfig(**{**common, **self.entrypoint}, model=self.model, revision=self.revision,
                                    instance_id=instance_id,
                                    prefill_lb_address=lb_addresses[0], decode_lb_address=lb_addresses[1],
                                    vision_lb_address=vision_lb_address)
        raise KeyError(f"unknown role {role!r}")

    def num_instances(self) -> dict[str, int]:
        """Instances per active stage as configured."""
        return {s: sum(g.num_instances for g in self.stage(s).groups) for s in self.active_stages()}

    @classmethod
    def load(cls, path: str | Path) -> ClusterConfig:
        """Read and validate a YAML cluster file; ValueError naming the file and the bad field."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read cluster config {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"cluster config {path}: the top level must be a mapping, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"cluster config {path}: {e}") from None
