"""`RankedAgents`: the KV transfer agents of a multi-rank instance (one NIXL agent per rank) seen as one agent.

An instance with `expert_parallel_size > 1` keeps each request's KV in the pools of the rank that runs it
(`engine.distributed.kv_pools`), in that rank's process. Only an agent in that process can register those
pools, and on a cluster each rank's GPU has its own NIC, so each rank owns one `KVTransferAgent` over its own
cache (the production design; nothing is relayed through rank 0):

* rank 0's agent is the worker shell's (in the engine's process); ranks 1..N-1 build theirs in their own
  process (`make_rank_endpoint`, attached through the multi-rank executor's rank endpoints,
  `MultiRankExecutor.attach_endpoints`). Rank 0 keeps the instance's agent name; rank `r > 0` is
  `{name}-rank{r}` (`rank_agent_name`).
* a decode reservation names the rank whose pools hold the request's KV: `locate(global block ids, slot)`
  gives that rank's agent name, its local block ids and local slot, which the decode worker answers Reserve
  with (with that agent's metadata and layout, `agent_infos()`), so the prefill writes straight into the
  chosen decode rank's pools;
* a prefill sends from the rank that computed the prompt: `send_blocks` takes the instance's global block ids
  and posts the WRITE on the agent of the rank that owns them; `add_peer` connects every rank's agent to the
  decode agent (any rank may send to it).

`RankedAgents` offers `KVTransferAgent`'s interface with the instance's global ids, so `PDConnector` drives
one agent or N the same way (`PDConnector.serves_ranks`). Rank 0's calls go to its agent at once; another
rank's `expect` / `cancel_expect` / `send_blocks` / `add_peer` queue as ops for that rank and travel with the
executor's step plan: every engine step carries each rank its queued ops, and after the forward each rank
applies them in order, polls its agent and answers with its `KVTransferEvents` in the step's own round
(`MultiRankExecutor.attach_endpoints(step_payloads=...)`); `poll()` merges the answers of the steps since the
last poll. When no step ran since (an idle instance waiting for KV), `poll()` runs one command round of its
own for that (`call_endpoints`, about 3 ms at 2 CPU ranks, 7 ms at 4 on the 2-core CI VM). A queued op's
lease is shortened by its time in the queue, so it ends when the caller computed. Validation
that needs the peer (layout mismatch) runs synchronously on rank 0's agent (same geometry on every rank);
what a rank refuses later (a bad id) comes back as `send_failed_ids` / `expired_ids`.

The rank agents' progress happens only in `poll()`, which the worker loop calls every iteration (`POLL` mode
while sends or reservations are pending: `num_inflight_sends` / `num_pending_recvs` count the queued ops
too). A rank that fails or dies fails the executor, hence the instance as a whole.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from deepinfer.engine.distributed.kv_pools import locate_blocks
from deepinfer.kv_transfer.agent import AgentInfo, KVTransferAgent, KVTransferEvents

logger = logging.getLogger("kv_transfer")


def rank_agent_name(name: str, rank: int) -> str:
    """The NIXL agent name of rank `rank` of an instance whose (rank 0) agent is `name`."""
    return name if rank == 0 else f"{name}-rank{rank}"


# ---------------------------------------------------------------------- ops shipped to a rank


@dataclass
class AddPeer:
    name: str
    metadata: bytes
    layout: Mapping


@dataclass
class RemovePeer:
    name: str


@dataclass
class Expect:
    transfer_id: str
    block_ids: list[int]
    lease_s: float
    slot: int | None
    t_queued: float = 0.0


@dataclass
class CancelExpect:
    transfer_id: str


@dataclass
class Send:
    transfer_id: str
    peer: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    notify: bytes
    lease_s: float
    src_slot: int | None
    dst_slot: int | None
    t_queued: float = 0.0


@dataclass
class RankPoll:
    """A rank's answer to one round: its agent's events and what rank 0 reports about it."""

    events: KVTransferEvents
    unmatched_ids: list[str] = field(default_factory=list)
    """Notifications that arrived without a reservation claiming them (`notification_arrived`)."""
    stats: dict = field(default_factory=dict)
    num_inflight_sends: int = 0
    num_pending_recvs: int = 0


class RankEndpoint:
    """A rank's agent as a rank endpoint of the multi-rank executor (`engine.distributed.worker`): applies the
    ops rank 0 queued for it, then polls the agent."""

    def __init__(self, agent: KVTransferAgent) -> None:
        self.agent = agent

    def describe(self) -> AgentInfo:
        return self.agent.agent_infos()[self.agent.name]

    def handle(self, ops: list) -> RankPoll:
        """Apply `ops` in order, poll once; never raises for transport trouble or a refused op."""
        agent = self.agent
        failed_sends, failed_expects = [], []
        for op in ops:
            try:
                if isinstance(op, AddPeer):
                    agent.add_peer(op.name, op.metadata, op.layout)
                elif isinstance(op, RemovePeer):
                    agent.remove_peer(op.name)
                elif isinstance(op, Expect):
                    agent.expect(op.transfer_id, op.block_ids, op.lease_s, dst_slot=op.slot)
                elif isinstance(op, CancelExpect):
                    agent.cancel_expect(op.transfer_id)
                elif isinstance(op, Send):
                    agent.send_blocks(op.transfer_id, op.peer, op.src_block_ids, op.dst_block_ids, op.notify,
                                      src_slot=op.src_slot, dst_slot=op.dst_slot, lease_s=op.lease_s)
                else:
                    raise TypeError(f"unknown rank KV op {op!r}")
            except ValueError as e:  # refused: reported like a transport failure of that transfer
                logger.warning("agent %s refused %s: %s", agent.name, type(op).__name__, e)
                if isinstance(op, Send):
                    failed_sends.append(op.transfer_id)
                elif isinstance(op, Expect):
                    failed_expects.append(op.transfer_id)
        ev = agent.poll()
        ev.send_failed_ids += failed_sends
        ev.expired_ids += failed_expects
        stats = {k: v for k, v in agent.stats().items() if not isinstance(v, list)}
        return RankPoll(ev, agent.unmatched_notification_ids(), stats, agent.num_inflight_sends,
                        agent.num_pending_recvs)

    def close(self) -> None:
        self.agent.close()


def make_rank_endpoint(rank: int, cache, *, name: str, send_state: bool, ucx_env: dict | None, backend: str,
                       send_lease_s: float, unmatched_notif_ttl_s: float) -> RankEndpoint:
    """On rank `rank`'s process: its agent over its own cache (the `factory` of `attach_endpoints`)."""
    agent = KVTransferAgent(rank_agent_name(name, rank), cache, backend, send_state=send_state,
                            send_lease_s=send_lease_s, unmatched_notif_ttl_s=unmatched_notif_ttl_s, ucx_env=ucx_env)
    return RankEndpoint(agent)


class RankedAgents:
    """The per-rank agents of a multi-rank instance behind `KVTransferAgent`'s interface, in the instance's global
    block ids and slots (see the module docstring). Lives on rank 0; not thread-safe (the engine loop's thread)."""

    def __init__(self, engine, agent: KVTransferAgent, *, ucx_env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Blocks while ranks 1..N-1 of `engine` (a multi-rank `Engine`) build their agents; `agent` is rank 0's, over
        `engine.cache`. `ucx_env`: the UCX settings of the rank agents (as `agent`'s)."""
        executor = engine.executor
        if not hasattr(executor, "attach_endpoints"):
            raise ValueError("RankedAgents needs a multi-rank engine (expert_parallel_size > 1)")
        self.world_size = engine.config.expert_parallel_size
        self.blocks_per_rank = engine.kv_manager.block_pool.blocks_per_rank
        self.local = agent
        self.name = agent.name
        self.cache = agent.cache
        self.send_state = agent.send_state
        self._clock = clock
        self._executor = executor
        kwargs = dict(name=agent.name, send_state=agent.send_state, ucx_env=dict(ucx_env or {}),
                      backend=agent.backend, send_lease_s=agent.send_lease_s,
                      unmatched_notif_ttl_s=agent.unmatched_notif_ttl_s)
        self._infos: list[AgentInfo] = executor.attach_endpoints(make_rank_endpoint, kwargs, RankEndpoint(agent),
                                                                 step_payloads=self._take_payloads)
        self._ops: list[list] = [[] for _ in range(self.world_size)]
        self._peers: set[str] = set()
        self._expect_rank: dict[str, int] = {}
        self._unmatched: set[str] = set()
        self._reported: list[RankPoll] = [RankPoll(KVTransferEvents()) for _ in range(self.world_size)]

    @property
    def num_ranks(self) -> int:
        return self.world_size

    # ------------------------------------------------------------------ handshake

    def metadata(self) -> bytes:
        """Rank 0's agent metadata (a sender connects to each rank it writes to: `agent_infos`)."""
        return self.local.metadata()

    def layout(self):
        return self.local.layout()

    def pool_layout(self) -> dict[str, dict]:
        return self.local.pool_layout()

    def agent_infos(self) -> dict[str, AgentInfo]:
        """Every rank's agent (name, metadata, layout), by name."""
        return {info.name: info for info in self._infos}

    def locate(self, block_ids: Sequence[int], slot: int | None = None) -> tuple[str, list[int], int | None]:
        """`(agent name, local block ids, local slot)` of the rank whose pools hold these global ids."""
        rank, local, local_slot = locate_blocks(block_ids, self.blocks_per_rank, self.world_size, slot)
        return self._infos[rank].name, local, local_slot

    def add_peer(self, name: str, metadata: bytes, layout) -> None:
        """Connect every rank's agent to peer `name`; raises ValueError as `KVTransferAgent.add_peer` does (checked
        on rank 0's agent: every rank has the same geometry)."""
        from deepinfer.kv_transfer.agent import layout_from_wire

        regions = layout_from_wire(layout)
        self.local.add_peer(name, metadata, regions)
        for ops in self._ops[1:]:
            ops.append(AddPeer(name, bytes(metadata), regions))
        self._peers.add(name)

    def remove_peer(self, name: str) -> None:
        self.local.remove_peer(name)
        for ops in self._ops[1:]:
            ops.append(RemovePeer(name))
        self._peers.discard(name)

    # ------------------------------------------------------------------ sending / receiving

    def transfer_nbytes(self, num_blocks: int, with_slot: bool = False) -> int:
        return self.local.transfer_nbytes(num_blocks, with_slot)

    def send_blocks(self, transfer_id: str, peer: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                    notify: bytes = b"", *, src_slot: int | None = None, dst_slot: int | None = None,
                    lease_s: float | None = None) -> int:
        """`KVTransferAgent.send_blocks` from the rank that owns `src_block_ids` (global ids; `src_slot` global);
        `dst_block_ids` / `dst_slot` are the peer's own. Returns the bytes it posts."""
        if (src_slot is None) != (dst_slot is None) or (src_slot is not None and not self.send_state):
            raise ValueError("src_slot and dst_slot go together, and need agents built with send_state=True")
        if len(src_block_ids) != len(dst_block_ids) or not src_block_ids:
            raise ValueError(f"need as many destination as source blocks, at least one (got {len(src_block_ids)} -> "
                             f"{len(dst_block_ids)})")
        rank, src, slot = locate_blocks(src_block_ids, self.blocks_per_rank, self.world_size, src_slot)
        lease_s = self.local.send_lease_s if lease_s is None else lease_s
        if rank == 0:
            return self.local.send_blocks(transfer_id, peer, src, dst_block_ids, notify, src_slot=slot,
                                          dst_slot=dst_slot, lease_s=lease_s)
        if peer not in self._peers:
            raise ValueError(f"unknown peer {peer!r}; call add_peer with its metadata and layout first")
        self._ops[rank].append(Send(transfer_id, peer, src, list(dst_block_ids), bytes(notify), lease_s, slot,
                                    dst_slot, self._clock()))
        return self.transfer_nbytes(len(src), slot is not None)

    def expect(self, transfer_id: str, dst_block_ids: Sequence[int], lease_s: float, *,
               dst_slot: int | None = None) -> None:
        """`KVTransferAgent.expect` on the rank that owns `dst_block_ids` (global ids; `dst_slot` global)."""
        if transfer_id in self._expect_rank:
            raise ValueError(f"transfer {transfer_id!r} is already expected")
        if dst_slot is not None and not self.send_state:
            raise ValueError("dst_slot needs agents built with send_state=True")
        rank, local, slot = locate_blocks(dst_block_ids, self.blocks_per_rank, self.world_size, dst_slot)
        if rank == 0:
            self.local.expect(transfer_id, local, lease_s, dst_slot=slot)
        else:
            self._ops[rank].append(Expect(transfer_id, local, lease_s, slot, self._clock()))
        self._expect_rank[transfer_id] = rank

    def cancel_expect(self, transfer_id: str) -> bool:
        rank = self._expect_rank.pop(transfer_id, None)
        if rank is None:
            return False
        if rank == 0:
            return self.local.cancel_expect(transfer_id)
        ops = self._ops[rank]
        queued = [op for op in ops if isinstance(op, Expect) and op.transfer_id == transfer_id]
        if queued:  # never left rank 0: nothing to cancel on the rank
            ops.remove(queued[0])
        else:
            ops.append(CancelExpect(transfer_id))
        return True

    def notification_arrived(self, transfer_id: str) -> bool:
        return transfer_id in self._unmatched or self.local.notification_arrived(transfer_id)

    def unmatched_notification_ids(self) -> list[str]:
        return sorted(self._unmatched | set(self.local.unmatched_notification_ids()))

    # ------------------------------------------------------------------ progress

    def poll(self) -> KVTransferEvents:
        """The merged events of every rank's agent since the last call (each id once, in one list, as
        `KVTransferAgent.poll`). The ranks polled their agents (and applied their queued ops) at the end of
        each engine step since then; when no step ran, this blocks for one command round over the ranks (a
        few ms) that does it."""
        rounds = self._executor.take_endpoint_results()
        if not rounds:
            rounds = [self._executor.call_endpoints(self._take_payloads())]
        ev = KVTransferEvents()
        for polls in rounds:
            for rp in polls:
                e = rp.events
                ev.sent_ids += e.sent_ids
                ev.send_failed_ids += e.send_failed_ids
                ev.received_ids += e.received_ids
                ev.expired_ids += e.expired_ids
                ev.payloads.update(e.payloads)
        self._reported = rounds[-1]
        self._unmatched = {tid for rp in self._reported for tid in rp.unmatched_ids}
        for tid in ev.received_ids + ev.expired_ids:
            self._expect_rank.pop(tid, None)
        return ev

    def _take_payloads(self) -> list[list]:
        """Every rank's queued ops (rank 0: none, its calls are direct), leases shortened by their time in the
        queue; the queues restart empty. Called per round: `poll`'s own, or each engine step's."""
        now = self._clock()
        payloads: list[list] = [[]]
        for ops in self._ops[1:]:
            for op in ops:  # NOTE: the lease runs from the caller's call, not from the round that ships it
                if isinstance(op, (Expect, Send)):
                    op.lease_s -= now - op.t_queued
            payloads.append(ops)
        self._ops = [[] for _ in range(self.world_size)]
        return payloads

    @property
    def num_inflight_sends(self) -> int:
        """Sends posted or queued on any rank, not yet reported."""
        queued = sum(isinstance(op, Send) for ops in self._ops for op in ops)
        return self.local.num_inflight_sends + sum(rp.num_inflight_sends for rp in self._reported[1:]) + queued

    @property
    def num_pending_recvs(self) -> int:
        """Reservations expected on any rank (queued ones included), not yet reported."""
        return len(self._expect_rank)

    def rank_stats(self) -> list[dict]:
        """Each rank's agent counters, by rank (rank 0's live, the others' as of the last `poll`)."""
        local = {k: v for k, v in self.local.stats().items() if not isinstance(v, list)}
        return [local] + [dict(rp.stats) for rp in self._reported[1:]]

    def stats(self) -> dict[str, float | int | list[float]]:
        """The counters of every rank's agent summed (rank 0's live, the others' as of the last `poll`;
        `kv_transfer_send_seconds_recent` is rank 0's), plus each rank's sends and receives done
        (`kv_transfer_rank{r}_sends_done_total`, `kv_transfer_rank{r}_recvs_done_total`)."""
        out = dict(self.local.stats())
        per_rank = self.rank_stats()
        for r, stats in enumerate(per_rank):
            if r:
                for k, v in stats.items():
                    if isinstance(v, (int, float)) and k in out and not isinstance(out[k], list):
                        out[k] += v
            for k in ("sends_done", "recvs_done"):
                out[f"kv_transfer_rank{r}_{k}_total"] = stats.get(f"kv_transfer_{k}_total", 0)
        return out

    def close(self) -> None:
        """Closes rank 0's agent; the other ranks close theirs when the executor stops them."""
        self.local.close()


def open_instance_agent(engine, name: str, *, send_state: bool, ucx_env: Mapping[str, str] | None = None):
    """The KV transfer agent(s) of an instance: a `KVTransferAgent` over `engine.cache`, or, for a multi-rank engine,
    `RankedAgents` over one agent per rank (blocks while the ranks build theirs)."""
    agent = KVTransferAgent(name, engine.cache, send_state=send_state, ucx_env=ucx_env)
    if engine.config.expert_parallel_size == 1:
        return agent
    try:
        return RankedAgents(engine, agent, ucx_env=ucx_env)
    except BaseException:
        agent.close()
        raise
