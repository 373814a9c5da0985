"""The decode instance's pure core: reserve blocks, wait for the KV, then decode.

No sockets: the gRPC shell (`server.py`) calls `reserve`, forwards the prefill's outcome and
drains `step()`. One request's life here:

1. `reserve(...)`: the engine reserves blocks for the prompt's compressed KV (held outside the
   scheduler) and the agent starts expecting the transfer; the destination goes back to the
   entrypoint, which hands it to the prefill instance.
2. `step()` polls the agent: when the notification arrives (it carries the first token sampled by
   prefill) the request is committed to the engine, which decodes from the token after the first
   after rebuilding the bounded state by bounded replay, or, on an agent built with
   `send_state=True`, on the state the prefill wrote into the reserved slot. An expired lease aborts the request and
   frees its blocks.
3. `step()` returns the engine's incremental outputs (`RequestOutput`) and `DecodeFailed` events.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from engine.engine import Engine, RequestOutput
from engine.sampling import SamplingParams
from kv_transfer import KVTransferAgent


@dataclass
class Reservation:
    request_id: str
    transfer_id: str
    peer: str
    """This instance's agent name (the prefill side sends to it)."""
    block_ids: list[int]
    lease_s: float
    state_slot: int | None = None
    """Reserved bounded-state slot the prefill writes the state into; None = bounded replay here."""


@dataclass
class DecodeFailed:
    request_id: str
    error: str


class DecodeCore:
    """Engine + KV transfer agent of one decode instance (rank 0 of its group)."""

    def __init__(self, engine: Engine, agent: KVTransferAgent, agent_name: str, *,
                 quarantine_margin_s: float = 2.0) -> None:
        """`quarantine_margin_s`: extra time past a reservation's lease before the blocks of an
        aborted, never-completed transfer are reused (covers clock skew with the prefill host)."""
        self.engine = engine
        self.agent = agent
        self.agent_name = agent_name
        self.quarantine_margin_s = quarantine_margin_s
        self._by_transfer: dict[str, str] = {}
        self._lease_end: dict[str, float] = {}  # transfer id -> time.monotonic() its lease ends
        self._quarantine: dict[str, float] = {}  # hold key -> time.monotonic() it may be released

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                lease_s: float = 60.0, images=None) -> Reservation:
        """Reserve blocks for the prompt's KV; raises InvalidRequestError on bad input.

        `images`: the prompt's `engine.multimodal.ImageSpan`s with embeddings, so this instance can
        compute image positions (bounded replay, recompute after preemption)."""
        transfer_id = f"{request_id}/{self.agent_name}"
        with_state = self.agent.send_state
        self.engine.reserve_kv(request_id, prompt_token_ids, params, num_kv_tokens=len(prompt_token_ids),
                               with_state=with_state, **({"images": images} if images else {}))
        block_ids = self.engine.kv_block_ids(request_id)
        slot = self.engine.kv_state_slot(request_id) if with_state else None
        self.agent.expect(transfer_id, block_ids, lease_s, dst_slot=slot)
        self._by_transfer[transfer_id] = request_id
        self._lease_end[transfer_id] = time.monotonic() + lease_s
        return Reservation(request_id, transfer_id, self.agent_name, list(block_ids), lease_s, slot)

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is; its reserved or running blocks are freed.

        A reservation whose KV has not arrived may still receive a WRITE the prefill posted (NIXL
        cannot recall it): its blocks and state slot stay out of circulation until the lease (which
        bounds the prefill's send) has ended plus `quarantine_margin_s`, then `step()` frees them.
        """
        hold_as = None
        for tid, rid in list(self._by_transfer.items()):
            if rid == request_id:
                self.agent.cancel_expect(tid)
                del self._by_transfer[tid]
                hold_as = self._hold(tid, self._lease_end.pop(tid))
        self.engine.abort_request(request_id, hold_as=hold_as)

    def _hold(self, transfer_id: str, lease_end: float) -> str:
        self._quarantine[transfer_id] = lease_end + self.quarantine_margin_s
        return f"quarantine:{transfer_id}"

    @property
    def num_quarantined(self) -> int:
        """Aborted reservations whose blocks wait for their lease to end."""
        return len(self._quarantine)

    def step(self) -> list[RequestOutput | DecodeFailed]:
        events: list[RequestOutput | DecodeFailed] = []
        ev = self.agent.poll()
        now = time.monotonic()
        for tid, until in list(self._quarantine.items()):
            # the WRITE's notification means its bytes have landed; none can come after the lease
            if now >= until or self.agent.notification_arrived(tid):
                del self._quarantine[tid]
                self.engine.release_kv(f"quarantine:{tid}")
        for tid in ev.received_ids:
            self._lease_end.pop(tid, None)
            rid = self._by_transfer.pop(tid, None)
            if rid is None:
                continue
            first = json.loads(ev.payloads.get(tid, b"{}") or b"{}").get("first_token_id")
            events += self.engine.commit_kv(rid, [first] if first is not None else None)
        for tid in ev.expired_ids:
            lease_end = self._lease_end.pop(tid, now)
            rid = self._by_transfer.pop(tid, None)
            if rid is not None:
                self.engine.abort_request(rid, hold_as=self._hold(tid, lease_end))
                events.append(DecodeFailed(rid, "the KV did not arrive before the reservation's lease expired"))
        if self.engine.scheduler.has_unfinished_requests():
            events += self.engine.step()
        return events
