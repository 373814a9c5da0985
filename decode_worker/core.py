"""The decode instance's pure core: reserve blocks, wait for the KV, then decode.

No sockets: the gRPC shell (`server.py`) calls `reserve`, forwards the prefill's outcome and
drains `step()`. One request's life here:

1. `reserve(...)`: the connector is told to expect a load (`PDConnector.expect_load`) and the
   request is added to the engine, which reserves blocks for the prompt's compressed KV (held
   outside the scheduler) and has the connector expect the transfer; the destination goes back
   to the entrypoint, which hands it to the prefill instance.
2. `step()` polls the connector (`Engine.poll_kv_connector`): when the notification arrives (its
   `KVTransferNotice` carries the first token sampled by prefill) the request is committed, and
   decodes from the token after the first after rebuilding the bounded state by bounded replay,
   or, on an agent built with `send_state=True`, on the state the prefill wrote into the reserved
   slot. An expired lease aborts the request; its blocks are quarantined until no WRITE can land.
3. `step()` returns the engine's incremental outputs (`RequestOutput`) and `DecodeFailed` events.
4. With a KV store (`store=`), a request reserved with `is_conversation` that finishes normally has the
   full blocks of its prompt and answer written to the store (`StoreConnector.save_computed`: one copy
   out of the pools on the loop thread, the write itself on the store's writer thread), so the next turn
   of the conversation, whose prompt is this prompt + this answer + a new message, loads all of it on
   prefill instead of recomputing the answer.

Which requests are conversations is the caller's word (`ReserveRequest.is_conversation`, set by the HTTP
front on its chat APIs), not a guess here: a decode-side write costs a device-to-host copy of the answer's
blocks and their bytes on disk, and pays off only when a later prompt extends this one. That is what a chat
turn is by construction (the client sends the history back), and what a one-shot completion or a raw
token request rarely is; a traffic class alone does not tell them apart (every HTTP request has one, from
its API key). NOTE: a template that drops earlier turns' reasoning (thinking mode) changes the answer's
tokens in the next prompt: the store then hits up to the answer's start, as without these writes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from deepinfer.engine.engine import Engine, RequestOutput
from deepinfer.engine.kv_connector.store_connector import StoreConnector
from deepinfer.engine.sampling import SamplingParams
from deepinfer.kv_transfer import KVTransferAgent
from deepinfer.kv_transfer.pd_connector import PDConnector
from deepinfer.kvstore import KVStore

_MAX_CONVERSATIONS = 4096
"""Conversation turns tracked at most (a request that never reports a finish is forgotten, oldest first)."""


@dataclass
class Reservation:
    request_id: str
    transfer_id: str
    peer: str
    """The agent the prefill side sends to: this instance's, or on a multi-rank instance the agent of the rank
    whose pools hold the request's KV (`block_ids` and `state_slot` are then that rank's own)."""
    block_ids: list[int]
    lease_s: float
    state_slot: int | None = None
    """Reserved bounded-state slot the prefill writes the state into; None = bounded replay here."""


@dataclass
class DecodeFailed:
    request_id: str
    error: str


class DecodeCore:
    """Engine + KV transfer agent of one decode instance (rank 0 of its group): protocol glue around
    the engine's KV connector (`kv_transfer.PDConnector`), which does the loading."""

    def __init__(self, engine: Engine, agent: KVTransferAgent, agent_name: str, *,
                 quarantine_margin_s: float = 2.0, store: KVStore | None = None) -> None:
        """`quarantine_margin_s`: extra time past a reservation's lease before the blocks of an
        aborted, never-completed transfer are reused (covers clock skew with the prefill host).
        `store`: the persistent KV store finished conversation turns are written to (module docstring)."""
        self.engine = engine
        self.agent = agent
        self.agent_name = agent_name
        self.connector = PDConnector(agent, agent_name, quarantine_margin_s=quarantine_margin_s)
        engine.set_kv_connector(self.connector)
        # NOTE: not the engine's connector (loads come from the prefill, and nothing is pinned for a save):
        # it serves `save_computed` only. A multi-rank instance keeps its KV in per-rank pools the store
        # connector does not address (as `Engine.set_kv_connector` says): no writes there yet
        if store is not None and engine.config.expert_parallel_size > 1:
            logging.getLogger("deepinfer.kvstore").warning(
                "decode instance with expert_parallel_size=%d: finished conversation turns are not written to the "
                "KV store (per-rank KV pools)", engine.config.expert_parallel_size)
            store = None
        self.store_writer = StoreConnector.for_engine(engine, store) if store is not None else None
        self._conversations: OrderedDict[str, tuple[list[int], str | None]] = OrderedDict()
        """request_id -> (prompt, traffic class) of reserved conversation turns (written to the store at their end)."""
        self.num_conversation_blocks_saved = 0
        """Blocks of finished conversation turns queued for the store, since start."""

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                lease_s: float = 60.0, images=None, *, traffic_class: str | None = None,
                is_conversation: bool = False, rank: int | None = None,
                num_original_prompt_tokens: int | None = None) -> Reservation:
        """Reserve blocks for the prompt's KV; raises InvalidRequestError on bad input,
        NoFreeBlocksError / NoFreeSlotsError when full (reserving nothing).

        `images`: the prompt's `engine.multimodal.ImageSpan`s with embeddings, so this instance can
        compute image positions (bounded replay, recompute after preemption). `is_conversation`: write
        the prompt and answer to the store when the request finishes (with a store; filed under
        `traffic_class`, None = the store's default class). `rank`: on a multi-rank instance, the rank a
        balancer picked (taken when it has room); the reservation names the rank whose pools hold the KV:
        its agent and its own block ids and slot (`PDConnector.destination`). `num_original_prompt_tokens`: a
        continuation's original prompt length (`Engine.add_request`; the prefill gets the same)."""
        self.engine.prefer_kv_rank(request_id, rank)
        transfer_id = self.connector.expect_load(request_id, len(prompt_token_ids), lease_s)
        try:
            self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params,
                                    num_original_prompt_tokens=num_original_prompt_tokens,
                                    **({"images": images} if images else {}))
        except BaseException:
            self.connector.forget_load(request_id)
            self.engine.prefer_kv_rank(request_id, None)
            raise
        if is_conversation and self.store_writer is not None and not images:
            self._conversations[request_id] = (list(prompt_token_ids), traffic_class or None)
            while len(self._conversations) > _MAX_CONVERSATIONS:
                self._conversations.popitem(last=False)
        # the blocks and slot may have been freed by a request a step still in flight writes (async scheduling):
        # the prefill's WRITE, outside this engine's stream order, may start once the destination is out
        self.engine.wait_steps_in_flight()
        peer, block_ids, slot = self.connector.destination(request_id)
        return Reservation(request_id, transfer_id, peer, block_ids, lease_s, slot)

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is; its reserved or running blocks are freed.

        A reservation whose KV has not arrived may still receive a WRITE the prefill posted (NIXL
        cannot recall it): its blocks and state slot stay out of circulation until the lease (which
        bounds the prefill's send) has ended plus `quarantine_margin_s`, then `step()` frees them.
        """
        self._conversations.pop(request_id, None)
        self.engine.abort_request(request_id)

    def release_quarantine(self, transfer_id: str) -> bool:
        """Lift the quarantine of an aborted reservation at the connector's next poll (in `step()`),
        for when its writer is known dead (its process is gone: no WRITE of it can land any more);
        False when the transfer is not quarantined (its KV had arrived, or it never was reserved)."""
        return self.connector.release_quarantine(transfer_id)

    @property
    def num_quarantined(self) -> int:
        """Aborted reservations whose blocks wait for their lease to end."""
        return self.connector.num_quarantined

    @property
    def num_loading(self) -> int:
        """Reservations whose KV has not arrived yet."""
        return self.engine.num_loading_kv

    def step(self) -> list[RequestOutput | DecodeFailed]:
        """Transfer progress (commits arrived KV, fails expired reservations), then one engine step
        when anything can run; returns the engine's outputs and `DecodeFailed` events."""
        res = self.engine.poll_kv_connector()
        events: list[RequestOutput | DecodeFailed] = list(res.outputs)
        events += [DecodeFailed(rid, error) for rid, error in res.load_failed.items()]
        if self.engine.has_runnable_requests():
            events += self.engine.step()
        if self._conversations:
            self._save_conversations(events)
        return events

    def _save_conversations(self, events: list[RequestOutput | DecodeFailed]) -> None:
        """Write the finished conversation turns among `events` to the store (before the next step's
        allocations may reuse their freed, still cached blocks)."""
        for ev in events:
            if isinstance(ev, DecodeFailed):
                self._conversations.pop(ev.request_id, None)
                continue
            if not ev.finished:
                continue
            turn = self._conversations.pop(ev.request_id, None)
            if turn is None or ev.error is not None or ev.outputs[0].finish_reason in ("abort", "error"):
                continue
            prompt, traffic_class = turn
            # the last answer token's KV was never computed: its block, if full, is not cached (nor saved)
            self.num_conversation_blocks_saved += self.store_writer.save_computed(
                prompt + list(ev.outputs[0].token_ids), traffic_class)
