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
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.engine.engine import Engine, RequestOutput
from deepinfer.engine.sampling import SamplingParams
from deepinfer.kv_transfer import KVTransferAgent
from deepinfer.kv_transfer.pd_connector import PDConnector


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
    """Engine + KV transfer agent of one decode instance (rank 0 of its group): protocol glue around
    the engine's KV connector (`kv_transfer.PDConnector`), which does the loading."""

    def __init__(self, engine: Engine, agent: KVTransferAgent, agent_name: str, *,
                 quarantine_margin_s: float = 2.0) -> None:
        """`quarantine_margin_s`: extra time past a reservation's lease before the blocks of an
        aborted, never-completed transfer are reused (covers clock skew with the prefill host)."""
        self.engine = engine
        self.agent = agent
        self.agent_name = agent_name
        self.connector = PDConnector(agent, agent_name, quarantine_margin_s=quarantine_margin_s)
        engine.set_kv_connector(self.connector)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                lease_s: float = 60.0, images=None) -> Reservation:
        """Reserve blocks for the prompt's KV; raises InvalidRequestError on bad input,
        NoFreeBlocksError / NoFreeSlotsError when full (reserving nothing).

        `images`: the prompt's `engine.multimodal.ImageSpan`s with embeddings, so this instance can
        compute image positions (bounded replay, recompute after preemption)."""
        transfer_id = self.connector.expect_load(request_id, len(prompt_token_ids), lease_s)
        try:
            self.engine.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params,
                                    **({"images": images} if images else {}))
        except BaseException:
            self.connector.forget_load(request_id)
            raise
        block_ids, slot = self.connector.reservation(request_id)
        return Reservation(request_id, transfer_id, self.agent_name, block_ids, lease_s, slot)

    def abort(self, request_id: str) -> None:
        """Abort wherever the request is; its reserved or running blocks are freed.

        A reservation whose KV has not arrived may still receive a WRITE the prefill posted (NIXL
        cannot recall it): its blocks and state slot stay out of circulation until the lease (which
        bounds the prefill's send) has ended plus `quarantine_margin_s`, then `step()` frees them.
        """
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
        return events
