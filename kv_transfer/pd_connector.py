"""`PDConnector`: prefill -> decode KV transfer as an engine `KVConnector` (the NIXL-driving half).

The engine side is transport-free (`engine/kv_connector/base.py` is the contract it implements);
this class turns its calls into `KVTransferAgent` calls and the agent's events back into the
connector's. One connector per process, over the process's one agent; the worker cores
(`prefill_worker/core.py`, `decode_worker/core.py`) register per-request protocol data with it
and hand it to their engine (`Engine.set_kv_connector`).

Decode side (loads)
-------------------
`expect_load(req_id, num_tokens, lease_s)` before `Engine.add_request`: the engine then asks
`get_load`, reserves blocks (and a slot when this agent registers the state) and calls
`start_load`, which `expect`s the transfer (`reservation(req_id)` tells the caller the blocks and
slot to hand to the prefill). The agent's `received_ids` become `loaded` with the output tokens
of the transfer's `KVTransferNotice`; `expired_ids` become `load_failed`. An aborted or failed
load is quarantined (`abort_load` returns the transfer id as hold key): a WRITE the prefill
posted cannot be recalled, so the blocks come back (`released`) once the notification arrived or
the lease plus `quarantine_margin_s` has passed.

Prefill side (saves)
--------------------
`expect_save(req_id, destination)` before `Engine.add_request`: the engine pins the prompt's
blocks once the first token is sampled and calls `start_save`, which posts one WRITE (blocks, and
the slot when the destination names one) whose notification carries the `KVTransferNotice`
with the first token. The agent's `sent_ids` / `send_failed_ids` become `saved` / `save_failed`;
a refused or too-late send is reported as `save_failed` at the next poll.

Multi-rank instances
--------------------
Over `kv_transfer.ranked.RankedAgents` (one agent per rank of an instance with expert_parallel_size > 1) the
same calls work on the engine's global block ids and slots: `destination(req_id)` names the rank's agent and
its local ids (what the decode answers Reserve with), and a save is posted by the rank that computed the
prompt. `serves_ranks` tells the engine which instances the connector serves.

The transfer notice
-------------------
NOTE: the first token travels in one channel only: the NIXL notification's payload, a serialized
`deepinfer.v1.KVTransferNotice` (`protos/kv_transfer.proto`), which arrives only after the KV's
bytes. The decode instance never reads it from a control-plane message.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.engine.kv_connector import KVConnector, KVConnectorEvents, KVLoadSpec, KVSaveSpec
from deepinfer.kv_transfer.agent import KVTransferAgent
from deepinfer.protos import kv_transfer_pb2


def encode_notice(output_token_ids: list[int], draft_token_ids: Sequence[int] = ()) -> bytes:
    """The notification payload of a transfer: a serialized `deepinfer.v1.KVTransferNotice` (with speculative
    decoding, the drafts proposed after the output tokens, for the receiver's first decode step to verify)."""
    return kv_transfer_pb2.KVTransferNotice(output_token_ids=list(output_token_ids),
                                            draft_token_ids=list(draft_token_ids)).SerializeToString()


def decode_notice(payload: bytes) -> list[int]:
    """The output tokens of a `KVTransferNotice` payload (empty payload: none)."""
    return list(kv_transfer_pb2.KVTransferNotice.FromString(bytes(payload)).output_token_ids)


def notice_draft_token_ids(payload: bytes) -> list[int]:
    """The draft tokens of a `KVTransferNotice` payload (none from a sender without speculative decoding)."""
    return list(kv_transfer_pb2.KVTransferNotice.FromString(bytes(payload)).draft_token_ids)


@dataclass
class KVDestination:
    """Where the decode instance wants a request's KV (the prefill side's protocol data)."""

    peer: str
    """Decode agent name (added with `KVTransferAgent.add_peer`)."""
    block_ids: list[int]
    """Reserved destination blocks, in table order."""
    transfer_id: str
    lease_s: float = 30.0
    """Seconds the WRITE may take before it is failed (shorter than the decode side's lease)."""
    send_deadline: float | None = None
    """`time.monotonic()` after which the WRITE must neither start nor run (the decode lease minus a
    margin); caps `lease_s` at send time. None = only `lease_s` bounds it."""
    state_slot: int | None = None
    """The decode side's reserved bounded-state slot: the state after the prompt is written there
    too (no replay on decode). None = decode rebuilds the state by bounded replay."""


@dataclass
class _Load:
    transfer_id: str
    num_tokens: int
    lease_s: float
    lease_end: float = 0.0
    block_ids: list[int] | None = None
    state_slot: int | None = None
    is_failed: bool = False


@dataclass
class _Save:
    destination: KVDestination
    num_bytes: int = 0
    is_posted: bool = False


class PDConnector(KVConnector):
    """Prefill -> decode transfer over one `KVTransferAgent` (both roles; a process uses one)."""

    def __init__(self, agent: KVTransferAgent, agent_name: str | None = None, *,
                 quarantine_margin_s: float = 2.0, clock=time.monotonic) -> None:
        """`agent_name`: this agent's name (transfer ids are `{req_id}/{agent_name}/{nonce}.{n}`, one per
        reservation); defaults to the agent's. `quarantine_margin_s`: extra time past a reservation's lease before the blocks of an
        aborted, never-completed transfer are reused (covers clock skew with the prefill host)."""
        self.agent = agent
        self.agent_name = agent_name or agent.name
        self.quarantine_margin_s = quarantine_margin_s
        self._clock = clock
        self._nonce = secrets.token_hex(4)  # this process's reservations only (a restart reuses the agent name)
        self._num_reservations = 0
        self._loads: dict[str, _Load] = {}
        self._by_transfer: dict[str, str] = {}
        self._quarantine: dict[str, float] = {}  # transfer id -> clock() it may be released
        self._saves: dict[str, _Save] = {}
        self._save_by_transfer: dict[str, str] = {}
        self._save_failed: dict[str, str] = {}  # refused at start_save, reported at the next poll

    # ------------------------------------------------------------------ protocol glue (the cores)

    def expect_load(self, req_id: str, num_tokens: int, lease_s: float) -> str:
        """Decode side: the next `add_request(req_id)` loads its first `num_tokens` tokens' KV from a
        prefill within `lease_s`; returns the transfer id."""
        if req_id in self._loads:
            raise ValueError(f"request id {req_id!r} already has a pending load")
        # one id per reservation, never per request: a retry of the request on this instance (after its
        # prefill was lost) must not be completed by the lost attempt's late WRITE notice, and each aborted
        # reservation keeps its own quarantine
        self._num_reservations += 1
        tid = f"{req_id}/{self.agent_name}/{self._nonce}.{self._num_reservations}"
        self._loads[req_id] = _Load(tid, num_tokens, lease_s)
        return tid

    def forget_load(self, req_id: str) -> None:
        """Drop an `expect_load` whose request the engine refused (nothing was started)."""
        load = self._loads.get(req_id)
        if load is not None and load.block_ids is None:
            del self._loads[req_id]

    def reservation(self, req_id: str) -> tuple[list[int], int | None]:
        """The blocks and slot the engine reserved for a started load, in the engine's ids."""
        load = self._loads[req_id]
        return list(load.block_ids), load.state_slot

    def destination(self, req_id: str) -> tuple[str, list[int], int | None]:
        """`(agent name, block ids, slot)` the prefill writes a started load into: the agent of the rank whose pools
        hold the reservation, and that agent's own ids (the engine's ids on a one-rank instance)."""
        load = self._loads[req_id]
        return self.agent.locate(load.block_ids, load.state_slot)

    def serves_ranks(self, world_size: int) -> bool:
        """One agent serves a one-rank instance; `RankedAgents` the instance whose ranks it was built over."""
        return getattr(self.agent, "num_ranks", 1) == world_size

    def expect_save(self, req_id: str, destination: KVDestination) -> KVSaveSpec:
        """Prefill side: the next `add_request(req_id)` sends its prompt KV to `destination` once computed.

        Raises ValueError when the destination wants the bounded state and this agent does not register it.
        """
        if destination.state_slot is not None and not self.agent.send_state:
            raise ValueError("the destination wants the bounded state but this instance's agent does not "
                             "register it (KVTransferAgent(send_state=True))")
        if req_id in self._saves:
            raise ValueError(f"request id {req_id!r} already has a pending save")
        self._saves[req_id] = _Save(destination)
        return KVSaveSpec(with_state=destination.state_slot is not None)

    def forget_save(self, req_id: str) -> None:
        """Drop an `expect_save` whose request never reached the engine, or whose save never started."""
        save = self._saves.get(req_id)
        if save is not None and not save.is_posted:
            del self._saves[req_id]

    def is_saving(self, req_id: str) -> bool:
        """Whether the request's WRITE is posted and its completion not yet reported."""
        save = self._saves.get(req_id)
        return save is not None and save.is_posted

    def num_bytes_sent(self, req_id: str) -> int:
        """Bytes the request's WRITE posted (0 before it started)."""
        save = self._saves.get(req_id)
        return save.num_bytes if save is not None else 0

    def release_quarantine(self, transfer_id: str, grace_s: float = 1.0) -> bool:
        """Shorten the quarantine of an aborted reservation to `grace_s` from now (then a `poll` releases its
        blocks), for when its writer is known dead (its process is gone: it posts nothing more; the grace
        covers bytes of it still in flight on the network); False when the transfer is not quarantined (its
        KV had arrived, or it never was reserved here)."""
        until = self._quarantine.get(transfer_id)
        if until is None:
            return False
        self._quarantine[transfer_id] = min(until, self._clock() + grace_s)
        return True

    @property
    def num_quarantined(self) -> int:
        """Aborted reservations whose blocks wait for their lease to end (or their WRITE to land)."""
        return len(self._quarantine)

    # ------------------------------------------------------------------ scheduler side

    def get_load(self, req_id: str, prompt_token_ids: list[int]) -> KVLoadSpec | None:
        load = self._loads.get(req_id)
        if load is None or load.block_ids is not None:
            return None
        return KVLoadSpec(load.num_tokens, with_state=self.agent.send_state)

    def get_save(self, req_id: str) -> KVSaveSpec | None:
        save = self._saves.get(req_id)
        if save is None or save.is_posted:
            return None
        return KVSaveSpec(with_state=save.destination.state_slot is not None)

    def abort_load(self, req_id: str) -> str | None:
        load = self._loads.pop(req_id, None)
        if load is None or load.block_ids is None:
            return None
        self._by_transfer.pop(load.transfer_id, None)
        self.agent.cancel_expect(load.transfer_id)
        # NOTE: the prefill may still WRITE into these blocks until its lease (shorter than ours) ends
        self._quarantine[load.transfer_id] = load.lease_end + self.quarantine_margin_s
        return load.transfer_id

    def abort_save(self, req_id: str) -> bool:
        if self.is_saving(req_id):
            return True  # the WRITE reads the pinned blocks until the agent reports it
        self._saves.pop(req_id, None)
        self._save_failed.pop(req_id, None)
        return False

    # ------------------------------------------------------------------ worker side

    def start_load(self, req_id: str, block_ids: list[int], state_slot: int | None) -> None:
        load = self._loads[req_id]
        self.agent.expect(load.transfer_id, block_ids, load.lease_s, dst_slot=state_slot)
        load.block_ids, load.state_slot = list(block_ids), state_slot
        load.lease_end = self._clock() + load.lease_s
        self._by_transfer[load.transfer_id] = req_id

    def start_save(self, req_id: str, block_ids: list[int], state_slot: int | None,
                   output_token_ids: list[int], draft_token_ids: Sequence[int] = ()) -> None:
        save = self._saves[req_id]
        dest = save.destination
        n = len(dest.block_ids)
        src = block_ids[:n]
        if len(src) < n:
            self._save_failed[req_id] = f"destination has {n} blocks, prompt KV has {len(src)}"
            return
        lease_s = dest.lease_s
        if dest.send_deadline is not None:
            lease_s = min(lease_s, dest.send_deadline - self._clock())
            if lease_s <= 0:
                self._save_failed[req_id] = "the decode reservation's lease ran out before the KV was ready to send"
                return
        slots = {"src_slot": state_slot, "dst_slot": dest.state_slot} if dest.state_slot is not None else {}
        try:
            save.num_bytes = self.agent.send_blocks(dest.transfer_id, dest.peer, src, dest.block_ids,
                                                    encode_notice(output_token_ids, draft_token_ids), lease_s=lease_s,
                                                    **slots)
        except ValueError as e:
            self._save_failed[req_id] = f"KV transfer refused: {e}"
            return
        save.is_posted = True
        self._save_by_transfer[dest.transfer_id] = req_id

    def poll(self) -> KVConnectorEvents:
        ev = KVConnectorEvents()
        for rid, error in self._save_failed.items():
            self._saves.pop(rid, None)
            ev.save_failed[rid] = error
        self._save_failed.clear()
        tev = self.agent.poll()
        now = self._clock()
        for tid in tev.sent_ids:
            rid = self._save_by_transfer.pop(tid, None)
            if rid is not None and self._saves.pop(rid, None) is not None:
                ev.saved.append(rid)
        for tid in tev.send_failed_ids:
            rid = self._save_by_transfer.pop(tid, None)
            if rid is not None and self._saves.pop(rid, None) is not None:
                ev.save_failed[rid] = "KV transfer to the decode instance failed"
        for tid, until in list(self._quarantine.items()):
            # the WRITE's notification means its bytes have landed; none can come after the lease
            if now >= until or self.agent.notification_arrived(tid):
                del self._quarantine[tid]
                ev.released.append(tid)
        for tid in tev.received_ids:
            rid = self._by_transfer.pop(tid, None)
            if rid is not None:
                self._loads.pop(rid, None)
                payload = tev.payloads.get(tid, b"")
                ev.loaded[rid] = decode_notice(payload)
                drafts = notice_draft_token_ids(payload)
                if drafts:
                    ev.loaded_drafts[rid] = drafts
        for tid in tev.expired_ids:
            rid = self._by_transfer.pop(tid, None)
            if rid is not None:
                # kept in _loads (is_failed) so the engine's abort quarantines it until lease end + margin
                self._loads[rid].is_failed = True
                ev.load_failed[rid] = "the KV did not arrive before the reservation's lease expired"
        return ev
