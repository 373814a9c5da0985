"""Who serves a stage, and how loaded each instance is: registration, heartbeats, expiry, health.

`Membership` is pure (no sockets, no threads of its own) and takes a `clock`, so tests drive time by
hand. Expiry is lazy: every read first drops the instances silent for `heartbeat_timeout_s` or
longer, so a silent instance is never picked once its timeout has passed, with no sweeper thread.

An instance is *pickable* when it is registered, not expired, reports `is_healthy` and is not
draining. A newly registered instance is pickable at once (its initial load defaults to idle and
healthy).

Prefix-cache state: each instance reports the prefix hashes its cache holds, either as the full set
or as a delta (added + evicted) against its previous report. The balancer keeps one set per
instance; `HeartbeatResult.needs_full_cached_hashes` asks for a full set while it has none.

NOTE: every method takes `lock` (reentrant); `Balancer.pick` holds it across a whole pick so a
concurrent heartbeat cannot change a candidate mid-decision.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0
"""An instance silent this long is dropped."""


class Stage(str, enum.Enum):
    """A serving stage; each has its own balancer."""

    VISION = "vision"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance declares once, at registration."""

    instance_id: str
    """Unique within the stage, e.g. "prefill-0"."""
    stage: Stage
    """The stage it serves."""
    address: str = ""
    """host:port of its gRPC service."""
    kv_agent_name: str = ""
    """Name of its kv_transfer (NIXL) agent; empty without one."""
    kv_agent_metadata: bytes = b""
    """Serialized metadata of that agent, handed to peers."""
    datacenter: str = ""
    """Datacenter label; picks may prefer a datacenter."""
    block_size: int = 0
    """Tokens per KV block; 0 = no KV cache (prefix matching and block needs are then 0)."""

    def __post_init__(self) -> None:
        if not self.instance_id:
            raise ValueError("instance_id must be a non-empty string")
        if not isinstance(self.stage, Stage):
            object.__setattr__(self, "stage", Stage(self.stage))
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0 = no KV cache), got {self.block_size}")


@dataclass(frozen=True)
class RankLoad:
    """The load of one rank of a multi-rank instance (mirrors `deepinfer.v1.RankLoad`)."""

    rank: int
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    """Requests placed on the rank that do not run yet (waiting, or their KV loading)."""
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_free_slots: int | None = None
    """State slots free for a new request; None = not reported (only KV blocks are checked then)."""
    num_output_tokens_left: int = 0
    """Output tokens the rank's requests may still generate (the decode work ahead of it)."""

    @property
    def num_kv_blocks_free(self) -> int:
        return max(0, self.num_kv_blocks_total - self.num_kv_blocks_used)

    @property
    def has_free_slot(self) -> bool:
        """Whether a new request can get a state slot here (True when slots are not reported)."""
        return self.num_free_slots is None or self.num_free_slots > 0


@dataclass(frozen=True)
class InstanceLoad:
    """One heartbeat's load report (mirrors `deepinfer.v1.LoadReport`)."""

    num_queued_prefill_tokens: int = 0
    """Prompt tokens waiting to be prefilled (queued plus unfinished parts of running prefills)."""
    num_running_requests: int = 0
    """Requests holding a batch slot."""
    num_waiting_requests: int = 0
    """Requests waiting for admission."""
    num_kv_blocks_used: int = 0
    """KV blocks in use, reservations included."""
    num_kv_blocks_total: int = 0
    """KV blocks in the pool."""
    cached_block_hashes: frozenset[int] = frozenset()
    """Prefix hashes the cache holds: the full set, or those added since the last report if a delta."""
    is_cached_hashes_delta: bool = False
    """True: `cached_block_hashes` / `evicted_block_hashes` are changes since the previous report."""
    evicted_block_hashes: frozenset[int] = frozenset()
    """With `is_cached_hashes_delta`: hashes evicted since the previous report."""
    is_healthy: bool = True
    """False: the instance stays registered but is not picked."""
    is_draining: bool = False
    """True: not picked; its in-flight requests finish."""
    ranks: tuple[RankLoad, ...] = ()
    """Per rank of a multi-rank instance, by rank (the fields above are then its emptiest rank's); () for one rank."""
    num_free_slots: int | None = None
    """State slots free for a new request (summed over the ranks); None = not reported."""
    num_output_tokens_left: int = 0
    """Output tokens its requests may still generate (summed over the ranks): the decode work ahead."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        for name in ("cached_block_hashes", "evicted_block_hashes"):
            value = getattr(self, name)
            if not isinstance(value, frozenset):
                object.__setattr__(self, name, frozenset(value))

    @property
    def num_kv_blocks_free(self) -> int:
        """KV blocks neither used nor reserved (never negative)."""
        return max(0, self.num_kv_blocks_total - self.num_kv_blocks_used)

    @property
    def has_free_slot(self) -> bool:
        """Whether a new request can get a state slot (True when slots are not reported)."""
        return self.num_free_slots is None or self.num_free_slots > 0


@dataclass
class Instance:
    """A registered instance as the balancer sees it (mutated only by `Membership`)."""

    info: InstanceInfo
    load: InstanceLoad
    """The latest report, plus picks made since (`Membership.add_pending`); hashes live in `cached_block_hashes`."""
    last_seen: float
    """Clock time of its latest heartbeat or registration."""
    cached_block_hashes: set[int] = field(default_factory=set)
    """Prefix hashes its cache holds, as far as the balancer knows."""
    has_full_cached_hashes: bool = False
    """Whether a full hash set arrived since registration (deltas alone may miss older blocks)."""

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def stage(self) -> Stage:
        return self.info.stage

    @property
    def block_size(self) -> int:
        return self.info.block_size

    @property
    def is_healthy(self) -> bool:
        return self.load.is_healthy

    @property
    def is_draining(self) -> bool:
        return self.load.is_draining

    @property
    def is_pickable(self) -> bool:
        """Healthy and not draining (expired instances are already gone)."""
        return self.load.is_healthy and not self.load.is_draining


@dataclass(frozen=True)
class HeartbeatResult:
    """What a heartbeat tells the instance back."""

    is_known: bool
    """False: the instance is not registered (never, deregistered or expired) and must register again."""
    needs_full_cached_hashes: bool = False
    """True: send the full cached hash set next time."""


class Membership:
    """The registered instances of one or more stages, with heartbeat expiry (pure, thread-safe)."""

    def __init__(
        self, heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.lock = threading.RLock()
        """Held by every method; hold it yourself to read several instances consistently."""
        self._instances: dict[str, Instance] = {}

    # ------------------------------------------------------------------ changes

    def register(self, info: InstanceInfo, load: InstanceLoad | None = None) -> Instance:
        """Add an instance, or replace the one with the same id (a restart); pickable at once if healthy.

        Without `load` the instance starts idle and healthy, with no known cached hashes (its first
        heartbeat is asked for the full set).
        """
        with self.lock:
            inst = Instance(info, InstanceLoad(), last_seen=self.clock())
            if load is not None:
                inst.load = dataclasses.replace(
                    load, cached_block_hashes=frozenset(), evicted_block_hashes=frozenset()
                )
                self._apply_hashes(inst, load)
            self._instances[info.instance_id] = inst
            return inst

    def deregister(self, instance_id: str) -> bool:
        """Remove an instance; False if it was not registered."""
        with self.lock:
            return self._instances.pop(instance_id, None) is not None

    def heartbeat(self, instance_id: str, load: InstanceLoad) -> HeartbeatResult:
        """Record a load report; an unknown (or just expired) instance gets `is_known=False`."""
        with self.lock:
            self.expire()
            inst = self._instances.get(instance_id)
            if inst is None:
                return HeartbeatResult(is_known=False)
            inst.last_seen = self.clock()
            inst.load = dataclasses.replace(load, cached_block_hashes=frozenset(), evicted_block_hashes=frozenset())
            self._apply_hashes(inst, load)
            return HeartbeatResult(is_known=True, needs_full_cached_hashes=not inst.has_full_cached_hashes)

    def add_pending(
        self, instance_id: str, *, num_prefill_tokens: int = 0, num_requests: int = 0, num_kv_blocks: int = 0,
        num_output_tokens: int = 0, rank: int | None = None,
    ) -> None:
        """Count a pick toward an instance's load (and, with `rank`, that rank's) until its next heartbeat
        replaces the report: its prefill tokens, requests, KV blocks, one state slot per request (where slots are
        reported) and its predicted output tokens.

        NOTE: without this, every pick between two heartbeats would see the same loads and go to the
        same instance (herding), or the same rank. The next report corrects the prediction (what the decode
        really holds and has left to generate).
        """
        with self.lock:
            inst = self._instances.get(instance_id)
            if inst is None:
                return
            load = inst.load

            def slots(n: int | None) -> int | None:
                return None if n is None else max(0, n - num_requests)

            ranks = tuple(dataclasses.replace(r, num_waiting_requests=r.num_waiting_requests + num_requests,
                                              num_kv_blocks_used=r.num_kv_blocks_used + num_kv_blocks,
                                              num_free_slots=slots(r.num_free_slots),
                                              num_output_tokens_left=r.num_output_tokens_left + num_output_tokens)
                          if r.rank == rank else r for r in load.ranks)
            inst.load = dataclasses.replace(
                load,
                num_queued_prefill_tokens=load.num_queued_prefill_tokens + num_prefill_tokens,
                num_waiting_requests=load.num_waiting_requests + num_requests,
                num_kv_blocks_used=load.num_kv_blocks_used + num_kv_blocks,
                num_free_slots=slots(load.num_free_slots),
                num_output_tokens_left=load.num_output_tokens_left + num_output_tokens,
                ranks=ranks,
            )

    def expire(self) -> list[str]:
        """Drop every instance silent for `heartbeat_timeout_s` or longer; returns their ids."""
        with self.lock:
            now = self.clock()
            dead = [i for i, inst in self._instances.items() if now - inst.last_seen >= self.heartbeat_timeout_s]
            for instance_id in dead:
                del self._instances[instance_id]
            return dead

    # ------------------------------------------------------------------ reads

    def get(self, instance_id: str) -> Instance | None:
        """The live instance with this id, or None."""
        with self.lock:
            self.expire()
            return self._instances.get(instance_id)

    def instances(self, stage: Stage | None = None) -> list[Instance]:
        """Live instances (of `stage`, if given), healthy or not, sorted by id."""
        with self.lock:
            self.expire()
            return sorted(
                (i for i in self._instances.values() if stage is None or i.stage == stage),
                key=lambda i: i.instance_id,
            )

    def pickable(self, stage: Stage) -> list[Instance]:
        """Live, healthy, non-draining instances of `stage`, sorted by id."""
        return [i for i in self.instances(stage) if i.is_pickable]

    def heartbeat_age_s(self, instance: Instance) -> float:
        """Seconds since the instance's latest heartbeat or registration."""
        return max(0.0, self.clock() - instance.last_seen)

    def __len__(self) -> int:
        return len(self.instances())

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _apply_hashes(inst: Instance, load: InstanceLoad) -> None:
        if load.is_cached_hashes_delta:
            inst.cached_block_hashes.difference_update(load.evicted_block_hashes)
            inst.cached_block_hashes.update(load.cached_block_hashes)
        else:
            inst.cached_block_hashes = set(load.cached_block_hashes)
            inst.has_full_cached_hashes = True

