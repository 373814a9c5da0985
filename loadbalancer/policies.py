"""Routing policies: which pickable instance gets a request. Plug-ins in a registry.

A policy sees only pickable candidates (live, healthy, not draining; sorted by id; the `Balancer`
filters them) and the `RequestInfo`, and returns one of them, or None when none can take the
request (the balancer then raises `InsufficientCapacity`). Register a new one with
`@register_policy("name")`; `POLICIES` (name -> class) also feeds CLI choices.

| name | stage | rule |
|---|---|---|
| `round_robin` | any | next instance id after the previous pick, cyclically |
| `power_of_two` | any | two distinct random candidates (seeded RNG); the lower `stage_load` wins |
| `prefix_aware` | prefill | max `alpha * matched_tokens - queued_prefill_tokens`; ties to lower load |
| `prefix_store_aware` | prefill | `prefix_aware`, where a prefix the shared KV store holds counts on every instance at `store_weight` |
| `kv_load` | decode | fewest KV blocks used, then fewest running requests, among those with room; on multi-rank instances per (instance, rank) |
| `decode_work` | decode | least predicted decode work (output tokens its requests may still generate), among those with room; per (instance, rank) |
| `pinned` | decode | the place a request id names (`<id>@<instance>/<rank>`: a split computed offline, for benchmarks), else `decode_work` |
| `image_affinity` | vision | max `alpha * cached_image_tokens - pending_image_tokens`; ties to fewer requests |

Ties always end on the instance id, so every policy is deterministic given its seed.

Room (decode): free KV blocks for the request and, where the instance reports them, a free state slot (each
decode request holds one from Reserve to its end): a full rank is never picked while another has room.

Ranks: a multi-rank instance (expert_parallel_size > 1) reports each rank's load (`InstanceLoad.ranks`: each
rank owns its requests and their KV pools). A rank-aware policy also names the rank a request goes to
(`select_rank`, returned in `PickResponse.rank` and passed to the decode's Reserve); the others leave the
choice to the instance.
"""

from __future__ import annotations

import abc
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from deepinfer.loadbalancer.membership import Instance, InstanceLoad, RankLoad, Stage


@dataclass(frozen=True)
class RequestInfo:
    """What a policy may know about the request to place (mirrors `deepinfer.v1.PickRequest`)."""

    request_id: str = ""
    """For logs only."""
    block_hashes: tuple[int, ...] = ()
    """Chained prefix hashes of the prompt's full blocks, in order."""
    num_prompt_tokens: int = 0
    """Prompt length in tokens."""
    num_kv_blocks_needed: int = 0
    """KV blocks the request needs on a decode instance; 0 = derive from `num_prompt_tokens`."""
    num_output_tokens: int = 0
    """Output tokens the request may still generate (its max_tokens less those it has); 0 = unknown."""
    preferred_datacenter: str = ""
    """Prefer instances with this label when any is pickable; empty = no preference."""
    exclude_instance_ids: frozenset[str] = frozenset()
    """Never pick these."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
        object.__setattr__(self, "exclude_instance_ids", frozenset(self.exclude_instance_ids))
        if self.num_prompt_tokens < 0 or self.num_kv_blocks_needed < 0 or self.num_output_tokens < 0:
            raise ValueError("num_prompt_tokens, num_kv_blocks_needed and num_output_tokens must be >= 0")


# ---------------------------------------------------------------------------------------- load measures


def stage_load(instance: Instance) -> float:
    """The one load number of an instance that balance metrics and generic policies compare.

    prefill: queued prefill tokens (the work ahead of a new prompt); decode: KV blocks in use (what
    limits a decode batch); vision: image tokens waiting to be encoded (reported in
    `num_queued_prefill_tokens`).
    """
    load = instance.load
    if instance.stage in (Stage.PREFILL, Stage.VISION):
        return float(load.num_queued_prefill_tokens)
    if instance.stage == Stage.DECODE:
        return float(load.num_kv_blocks_used)
    return float(load.num_running_requests + load.num_waiting_requests)


def matched_prefix_blocks(instance: Instance, block_hashes: Iterable[int]) -> int:
    """Leading blocks of a prompt (its chained prefix hashes, in order) that the instance has cached."""
    cached = instance.cached_block_hashes
    count = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        count += 1
    return count


def matched_prefix_tokens(instance: Instance, request: RequestInfo) -> int:
    """Prompt tokens the instance holds in its prefix cache (whole blocks, at most the prompt)."""
    if not request.block_hashes or instance.block_size == 0:
        return 0
    tokens = matched_prefix_blocks(instance, request.block_hashes) * instance.block_size
    return min(tokens, request.num_prompt_tokens) if request.num_prompt_tokens else tokens


def num_kv_blocks_needed(instance: Instance, request: RequestInfo) -> int:
    """KV blocks the request needs on the instance: the request's own figure, else its prompt plus one
    output token rounded up to whole blocks (0 for instances without a KV cache)."""
    if request.num_kv_blocks_needed:
        return request.num_kv_blocks_needed
    if instance.block_size == 0:
        return 0
    return -(-(request.num_prompt_tokens + 1) // instance.block_size)


# ---------------------------------------------------------------------------------------- registry


class Policy(abc.ABC):
    """Chooses one instance among pickable candidates. May keep state (counters, an RNG): the
    `Balancer` calls `select` under its membership lock, one pick at a time."""

    name: ClassVar[str] = ""

    def load(self, instance: Instance) -> float:
        """The load this policy balances; `Balancer.balance()` reports max / mean of it."""
        return stage_load(instance)

    @abc.abstractmethod
    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        """One of `candidates` (non-empty, sorted by id), or None if none can take the request."""

    def select_rank(self, chosen: Instance, request: RequestInfo) -> int | None:
        """The rank of `chosen` (just selected) the request should go to; None leaves it to the instance (the
        default, and always for a one-rank instance)."""
        return None

    def predicted_output_tokens(self, request: RequestInfo) -> int:
        """The output tokens a pick counts on the chosen instance (and rank) until its next report: the request's
        own figure (0 when unknown) unless the policy predicts one."""
        return request.num_output_tokens


POLICIES: dict[str, type[Policy]] = {}
"""Registered policies by name."""


def register_policy(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: register a `Policy` subclass under `name` (unique)."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} is already registered (by {POLICIES[name].__name__})")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return wrap


def make_policy(name: str, **kwargs) -> Policy:
    """A new instance of the policy registered as `name`; kwargs go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(**kwargs)


# ---------------------------------------------------------------------------------------- policies


@register_policy("round_robin")
class RoundRobin(Policy):
    """Cycles through instance ids; an instance that joins or leaves shifts nobody else's turn."""

    def __init__(self) -> None:
        self._last_id: str | None = None

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        chosen = candidates[0]
        if self._last_id is not None:
            chosen = next((c for c in candidates if c.instance_id > self._last_id), candidates[0])
        self._last_id = chosen.instance_id
        return chosen


@register_policy("power_of_two")
class PowerOfTwo(Policy):
    """Power of two choices: two distinct candidates drawn at random (seeded), the lower load wins."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        if len(candidates) == 1:
            return candidates[0]
        pair = self._rng.sample(list(candidates), 2)
        return min(pair, key=lambda c: (self.load(c), c.instance_id))


@register_policy("prefix_aware")
class PrefixAware(Policy):
    """Prefill: trade prefix-cache hits against queueing.

    score = alpha * matched_tokens - queued_prefill_tokens, highest wins; ties go to fewer queued
    tokens, then fewer running + waiting requests, then the instance id.

    With `alpha = 1` (the default) the score is, up to a constant, minus the prefill work ahead of the
    request's first token on that instance: `queued + (prompt - matched)` tokens, i.e. the estimated
    time to first token in units of prefill tokens. `alpha > 1` favours cache hits (e.g. to keep
    shared prefixes on few instances), `alpha < 1` favours even queues.

    NOTE: a prefix hit still recomputes a bounded replay window (DESIGN.md §4); that cost is the
    same on every instance with a hit, so it is left out.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        def key(c: Instance):
            queued = c.load.num_queued_prefill_tokens
            score = self.alpha * matched_prefix_tokens(c, request) - queued
            return (-score, queued, c.load.num_running_requests + c.load.num_waiting_requests, c.instance_id)

        return min(candidates, key=key)


@register_policy("prefix_store_aware")
class PrefixStoreAware(PrefixAware):
    """Prefill with a KV store every instance shares (`kvstore`, Mooncake for a cluster): a cluster-wide hit is as
    good as a local one, minus the time to load it.

    matched = max(local matched tokens, store_weight * stored matched tokens) on every candidate, then the
    `prefix_aware` score. So a stored prefix no longer pulls its requests onto the one instance that computed
    it: the least loaded instance wins unless the local hit saves more than the queue costs.

    What the store holds, as this balancer sees it: the prefixes it routed (each prompt it sent to an instance
    was computed there and written to the store), remembered for `store_ttl_s` in a bounded LRU of
    `max_tracked_blocks` hashes, plus every hash the candidates report cached. NOTE: a prefix is counted as
    stored from the moment it is routed (its write lands after the prefill); an early duplicate simply
    computes it again.
    """

    def __init__(self, alpha: float = 1.0, store_weight: float = 0.9, store_ttl_s: float = 3 * 86400.0,
                 max_tracked_blocks: int = 1 << 20, clock: Callable[[], float] | None = None) -> None:
        super().__init__(alpha)
        if not 0.0 <= store_weight <= 1.0:
            raise ValueError(f"store_weight must be in [0, 1], got {store_weight}")
        self.store_weight = store_weight
        self.store_ttl_s = store_ttl_s
        self.max_tracked_blocks = max_tracked_blocks
        self._clock = clock or time.monotonic
        self._stored: OrderedDict[int, float] = OrderedDict()  # block hash -> when last routed

    def stored_prefix_blocks(self, candidates: Sequence[Instance], block_hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt the shared store is believed to hold."""
        horizon = self._clock() - self.store_ttl_s
        count = 0
        for h in block_hashes:
            seen = self._stored.get(h)
            if (seen is None or seen < horizon) and not any(h in c.cached_block_hashes for c in candidates):
                break
            count += 1
        return count

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        stored = self.stored_prefix_blocks(candidates, request.block_hashes) if request.block_hashes else 0

        def key(c: Instance):
            queued = c.load.num_queued_prefill_tokens
            stored_tokens = stored * c.block_size
            if request.num_prompt_tokens:
                stored_tokens = min(stored_tokens, request.num_prompt_tokens)
            matched = max(float(matched_prefix_tokens(c, request)), self.store_weight * stored_tokens)
            score = self.alpha * matched - queued
            return (-score, queued, c.load.num_running_requests + c.load.num_waiting_requests, c.instance_id)

        pick = min(candidates, key=key)
        now = self._clock()
        for h in request.block_hashes:
            self._stored[h] = now
            self._stored.move_to_end(h)
        while len(self._stored) > self.max_tracked_blocks:
            self._stored.popitem(last=False)
        return pick


def has_room(c: Instance, request: RequestInfo, rank: RankLoad | None = None) -> bool:
    """Whether the instance (or its `rank`) has the KV blocks the request needs and, where slots are reported, a
    free state slot."""
    load = rank if rank is not None else c.load
    return load.num_kv_blocks_free >= num_kv_blocks_needed(c, request) and load.has_free_slot


def could_ever_fit(c: Instance, request: RequestInfo) -> bool:
    """Whether the instance (one of its ranks) could take the request when empty: its pool holds the KV blocks the
    request needs. True when it reports no pool size (nothing to judge by)."""
    needed = num_kv_blocks_needed(c, request)
    totals = [r.num_kv_blocks_total for r in c.load.ranks] or [c.load.num_kv_blocks_total]
    return any(total == 0 or total >= needed for total in totals)


@register_policy("kv_load")
class KVLoad(Policy):
    """Decode: the fewest KV blocks in use, then the fewest running requests, then the id; instances
    with fewer free blocks than the request needs (`num_kv_blocks_needed`), or no free state slot (where
    reported), are refused.

    Multi-rank instances are compared rank by rank: a request goes to one rank's pools, so the (instance, rank)
    with the fewest blocks used among the ranks with room wins, then the fewest running (and waiting) requests
    on that rank; `select_rank` names the rank.

    NOTE: blocks track the prompt (and the tokens generated so far), not the work left: a short prompt with a
    long answer looks light. `decode_work` ranks by the predicted work instead."""

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        best = min(((key, c) for c in candidates for key, _ in self._fitting(c, request)), default=None,
                   key=lambda kc: kc[0])
        return best[1] if best is not None else None

    def select_rank(self, chosen: Instance, request: RequestInfo) -> int | None:
        if not chosen.load.ranks:
            return None
        return min(self._fitting(chosen, request), key=lambda kr: kr[0], default=(None, None))[1]

    def _key(self, c: Instance, load: InstanceLoad | RankLoad, rank: int) -> tuple:
        return (load.num_kv_blocks_used, load.num_running_requests, load.num_waiting_requests if c.load.ranks else 0,
                c.instance_id, rank)

    def _fitting(self, c: Instance, request: RequestInfo):
        """`(key, rank)` of each place in `c` with room for the request (rank None: a one-rank instance)."""
        if not c.load.ranks:
            if has_room(c, request):
                yield self._key(c, c.load, 0), None
            return
        for r in c.load.ranks:
            if has_room(c, request, r):
                yield self._key(c, r, r.rank), r.rank


@register_policy("decode_work")
class DecodeWork(KVLoad):
    """Decode: the least predicted decode work, among the places with room (free KV blocks and a free state slot).

    A place's work is the output tokens its requests may still generate (`num_output_tokens_left`: per request its
    max_tokens, else the context left, less the tokens it has), as the decode reported it, plus the predicted
    tokens of the picks made since (`Membership.add_pending`; the next report corrects them). A request's own
    prediction is its `num_output_tokens`, or `default_output_tokens` when unknown. Ties go to the instance with
    less work in all (an EP instance steps its ranks in lockstep, so its busiest rank paces all of them), then
    fewer KV blocks used, fewer running and waiting requests, the id and the rank.

    NOTE: the prediction is an upper bound (a request may stop early at EOS or a stop string); it is exact for
    `ignore_eos` requests, and a finished request leaves the report at the next heartbeat either way.
    """

    def __init__(self, default_output_tokens: int = 256) -> None:
        if default_output_tokens < 0:
            raise ValueError(f"default_output_tokens must be >= 0, got {default_output_tokens}")
        self.default_output_tokens = default_output_tokens

    def load(self, instance: Instance) -> float:
        return float(instance.load.num_output_tokens_left)

    def predicted_output_tokens(self, request: RequestInfo) -> int:
        return request.num_output_tokens or self.default_output_tokens

    def _key(self, c: Instance, load: InstanceLoad | RankLoad, rank: int) -> tuple:
        return (load.num_output_tokens_left, c.load.num_output_tokens_left, load.num_kv_blocks_used,
                load.num_running_requests + load.num_waiting_requests, c.instance_id, rank)


@register_policy("pinned")
class Pinned(DecodeWork):
    """Decode, for benchmarks and tests: the place the request id names, `<id>@<instance_id>[/<rank>]` (e.g. a split
    computed offline, replayed through the cluster to isolate what the balancers cost), when it has room; any
    other request, or a named place without room or not pickable, as `decode_work`."""

    @staticmethod
    def named_place(request: RequestInfo) -> tuple[str, int | None] | None:
        """`(instance id, rank or None)` the request id names, or None."""
        _, sep, place = request.request_id.rpartition("@")
        if not sep or not place:
            return None
        instance_id, _, rank = place.partition("/")
        return instance_id, int(rank) if rank.isdigit() else None

    def _named(self, c: Instance, request: RequestInfo) -> int | None | bool:
        """The named rank of `c` (None: any) when `c` is the named instance and that place has room; else False."""
        named = self.named_place(request)
        if named is None or named[0] != c.instance_id:
            return False
        places = {rank for _, rank in self._fitting(c, request)}
        if named[1] is None or not c.load.ranks:
            return None if places else False
        return named[1] if named[1] in places else False

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        for c in candidates:
            if self._named(c, request) is not False:
                return c
        return super().select(candidates, request)

    def select_rank(self, chosen: Instance, request: RequestInfo) -> int | None:
        named = self._named(chosen, request)
        if named is not False and (named is not None or not chosen.load.ranks):
            return named
        return super().select_rank(chosen, request)


@register_policy("image_affinity")
class ImageAffinity(Policy):
    """Vision: the fewest pending image tokens, unless another instance has the request's images cached.

    The request's `block_hashes` are its images' 64-bit content-hash keys (one per image) and
    `num_prompt_tokens` its (estimated) image tokens; an instance's cached hashes are the images
    whose embeddings it holds. score = alpha * (image tokens of cached images) - pending image
    tokens, highest wins; ties go to fewer running + waiting requests, then the instance id. With
    `alpha = 1` the score is minus the encoding work ahead of the request on that instance.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {alpha}")
        self.alpha = alpha

    def select(self, candidates: Sequence[Instance], request: RequestInfo) -> Instance | None:
        tokens_per_image = request.num_prompt_tokens / len(request.block_hashes) if request.block_hashes else 0.0

        def key(c: Instance):
            queued = c.load.num_queued_prefill_tokens
            cached = sum(h in c.cached_block_hashes for h in request.block_hashes)
            score = self.alpha * cached * tokens_per_image - queued
            return (-score, c.load.num_running_requests + c.load.num_waiting_requests, c.instance_id)

        return min(candidates, key=key)
