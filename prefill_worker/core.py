"""The prefill instance's pure core: prefill, sample the first token, push the KV to decode.

No sockets: the gRPC shell (`server.py`) feeds `submit` and drains `step()`'s events. One
request's life here:

1. `submit(PrefillWork)`: the engine queues the prompt with `max_tokens=1` and `hold_kv=True`
   (plus `hold_state=True` when the destination names a state slot).
2. `step()` runs engine steps; when the first token is sampled the request finishes in the engine
   but its blocks stay held, and the core posts one NIXL WRITE of those blocks into the decode
   instance's reserved blocks (`KVTransferAgent.send_blocks`), and the bounded state into its
   reserved slot when it named one, the notification carrying the first token.
3. When the agent reports the WRITE finished (or failed, or its lease ran out) the hold is dropped
   and a `PrefillDone` event (with the first token, or an error) is returned.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

from engine.engine import Engine
from engine.sampling import SamplingParams
from kv_transfer import KVTransferAgent


@dataclass
class KVDestination:
    """Where the decode instance wants the KV."""

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
class PrefillWork:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    destination: KVDestination


@dataclass
class PrefillDone:
    """The outcome of one request on this instance."""

    request_id: str
    first_token_id: int | None = None
    num_cached_tokens: int = 0
    num_kv_tokens: int = 0
    num_bytes: int = 0
    error: str | None = None


@dataclass
class _Inflight:
    work: PrefillWork
    first_token_id: int | None = None
    num_cached_tokens: int = 0
    num_bytes: int = 0
    extra: dict = field(default_factory=dict)


class PrefillCore:
    """Engine + KV transfer agent of one prefill instance (rank 0 of its group)."""

    def __init__(self, engine: Engine, agent: KVTransferAgent) -> None:
        self.engine = engine
        self.agent = agent
        self._reqs: dict[str, _Inflight] = {}
        self._by_transfer: dict[str, str] = {}

    def submit(self, work: PrefillWork) -> None:
        """Queue a prefill; raises InvalidRequestError before any compute on bad input."""
        params = replace(work.params, max_tokens=1, min_tokens=0, n=1)
        with_state = work.destination.state_slot is not None
        if with_state and not self.agent.send_state:
            raise ValueError("the destination wants the bounded state but this instance's agent does not "
                             "register it (KVTransferAgent(send_state=True))")
        self.engine.add_request(work.request_id, {"prompt_token_ids": work.prompt_token_ids}, params,
                                hold_kv=True, hold_state=with_state)
        self._reqs[work.request_id] = _Inflight(work)

    def abort(self, request_id: str) -> None:
        """Forget a request; its blocks are released (a WRITE in flight finishes or fails first)."""
        inflight = self._reqs.get(request_id)
        if inflight is not None and inflight.work.destination.transfer_id in self._by_transfer:
            return  # the agent reports the send; the hold is dropped then
        self._reqs.pop(request_id, None)
        self.engine.abort_request(request_id)

    @property
    def num_inflight(self) -> int:
        return len(self._reqs)

    def step(self) -> list[PrefillDone]:
        """One engine step plus transfer progress; returns the requests that are done here."""
        done: list[PrefillDone] = []
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                inflight = self._reqs.get(out.request_id)
                if inflight is None:
                    continue
                if out.error:
                    done.append(PrefillDone(out.request_id, error=out.error))
                    self._finish(out.request_id)
                    continue
                if not out.outputs[0].token_ids or out.kv_block_ids is None:
                    continue
                inflight.first_token_id = out.outputs[0].token_ids[0]
                inflight.num_cached_tokens = out.num_cached_tokens
                dest = inflight.work.destination
                n = len(dest.block_ids)
                src = out.kv_block_ids[:n]
                if len(src) < n:
                    done.append(PrefillDone(out.request_id, error=f"destination has {n} blocks, prompt KV has {len(src)}"))
                    self._finish(out.request_id)
                    continue
                lease_s = dest.lease_s
                if dest.send_deadline is not None:
                    lease_s = min(lease_s, dest.send_deadline - time.monotonic())
                    if lease_s <= 0:
                        done.append(PrefillDone(out.request_id, error="the decode reservation's lease ran out "
                                                "before the KV was ready to send"))
                        self._finish(out.request_id)
                        continue
                notify = json.dumps({"first_token_id": inflight.first_token_id}).encode()
                try:
                    slots = {}
                    if dest.state_slot is not None:
                        slots = {"src_slot": out.kv_state_slot, "dst_slot": dest.state_slot}
                    inflight.num_bytes = self.agent.send_blocks(dest.transfer_id, dest.peer, src, dest.block_ids,
                                                                notify, lease_s=lease_s, **slots)
                except ValueError as e:
                    done.append(PrefillDone(out.request_id, error=f"KV transfer refused: {e}"))
                    self._finish(out.request_id)
                    continue
                self._by_transfer[dest.transfer_id] = out.request_id
        ev = self.agent.poll()
        for tid in ev.sent_ids:
            rid = self._by_transfer.pop(tid, None)
            inflight = self._reqs.get(rid)
            if inflight is not None:
                done.append(PrefillDone(rid, inflight.first_token_id, inflight.num_cached_tokens,
                                        len(inflight.work.prompt_token_ids), inflight.num_bytes))
                self._finish(rid)
        for tid in ev.send_failed_ids:
            rid = self._by_transfer.pop(tid, None)
            if rid in self._reqs:
                done.append(PrefillDone(rid, error="KV transfer to the decode instance failed"))
                self._finish(rid)
        return done

    def _finish(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.engine.release_kv(request_id)
        self.engine.abort_request(request_id)
