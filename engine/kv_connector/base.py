"""KV connectors: where a request's KV comes from and goes to besides the local pools. This
docstring is the contract.

The local prefix cache answers "which of this prompt's tokens are already here". A connector
answers the same question for the world outside this instance, and moves the bytes: a prefill
instance *saves* a prompt's compressed KV into a decode instance's blocks
(`kv_transfer.PDConnector`, the first implementation), a decode instance *loads* it; the
persistent store tier will load on a prefix miss and save after a prefill (a second
implementation, the same calls). `Engine` has exactly one path for "KV from / to outside",
through this interface; a connector is handed to it once (`Engine.set_kv_connector`), and the
engine never imports a transport (NIXL, gRPC): the connector owns that.

Units: a connector speaks in the engine's request ids (`req_id`: the id given to
`add_request`), block ids of the local `BlockPool` (block `i` of a table holds tokens
`[i * block_size, (i + 1) * block_size)`, every pool and layer: byte ranges come from
`engine.cache.layout`), and bounded-state slot ids.

Who calls what, and when
------------------------
All calls come from the engine's thread (the one that calls `Engine.step`); none may block.

Scheduler side (admission and the end of a request):

1. `get_load(req_id, prompt_token_ids)` when a request is added (n = 1 only): `None`, or a
   `KVLoadSpec` saying that the prompt's first `num_tokens` tokens' KV will come from outside
   (and, `with_state`, the bounded state after them too). The engine then allocates blocks for
   those tokens (and a state slot), keeps the request out of the scheduler and calls
   `start_load(req_id, block_ids, state_slot)`. Raising here refuses the request.
2. `get_save(req_id)` when a request is added: `None`, or a `KVSaveSpec`: once the prompt is
   computed (the first token is sampled) the engine pins the request's blocks (and with
   `with_state` moves its state slot under the pin, as it is after the prompt) and calls
   `start_save(req_id, block_ids, state_slot, output_token_ids)`. The pin outlives the request
   (a prefill request finishes right after its first token) until the connector reports the
   save.
3. `abort_load(req_id)`: the request was aborted while its load was pending (or after the
   connector reported it failed). Returns a hold key, or None. With a key, the engine keeps the
   blocks and slot out of circulation under that key until a later `poll()` lists the key in
   `released` (a remote WRITE that cannot be recalled may still land in them); None frees them
   at once.
4. `abort_save(req_id)`: the request was aborted while pinned for a save. True: the save is in
   flight (bytes may still be read), keep the pin until `poll()` reports it; False: the save
   never started or is over, free at once.

Worker side (moving bytes): `start_load` and `start_save` start the movement and return at once;
they raise nothing for transport trouble (that is reported by `poll()`), only for a programming
error. `poll()` is called by the engine's owner once per loop iteration
(`Engine.poll_kv_connector()`, before `Engine.step()`), drives the transport and returns
`KVConnectorEvents`; each req_id appears at most once in one of `loaded`, `load_failed`, and at
most once in one of `saved`, `save_failed`, over its whole life.

What "finished" means
---------------------
- `loaded[req_id]`: every byte of the load is in the allocated blocks (and slot): the engine
  commits the request (it joins the scheduler and continues from token `num_tokens`, after the
  bounded replay, or none with `with_state`). The value lists output tokens sampled elsewhere
  (the prefill's first token), which become the request's first outputs.
- `load_failed[req_id]`: the load will not complete (lease ran out, sender gone). The engine
  aborts the request (so `abort_load` decides about a quarantine) and reports the error.
- `saved[req_id]`: every byte was read out of the pinned blocks and is at its destination: the
  engine drops the pin. `save_failed[req_id]`: the save ended without reaching its destination
  (the source may be freed; the connector promises no further reads): the engine drops the pin.
- `released`: hold keys (from `abort_load`) whose blocks no transfer can touch any more.

NOTE: the engine frees nothing a connector still uses: blocks and slots of a pending load, a
pending save and a quarantine stay referenced until the event above says otherwise. So after
every request ended and every hold was released, `BlockPool.num_free_blocks` is back to its total.

The store tier as a second implementation
-----------------------------------------
A store connector answers `get_load` with the longest block-aligned prefix it holds (fewer tokens
than the prompt, so the engine computes at least the last one), `with_state=False` (the store
keeps compressed entries only; the bounded state is rebuilt by bounded replay), copies the
entries into the given blocks in `start_load` and reports `loaded[req_id] = []`. It answers
`get_save` with `KVSaveSpec()` for prompts worth keeping and, in `start_save`, copies out only the
prompt's *full* blocks (the request may keep decoding into its last, partial one while pinned).
Neither needs anything from `Engine` beyond these calls.

Multi-rank instances (expert parallelism)
-----------------------------------------
With `expert_parallel_size > 1` each rank owns its requests' KV in its own pools, and rank 0's
scheduler names their blocks by global ids (`engine.distributed.kv_pools`: block `g` is block
`g % B` of rank `g // B`; a request's blocks and state slot are all on one rank). The calls above
stay the same and keep those global ids; a connector that serves such an instance says so
(`serves_ranks(world_size)`) and maps the ids to a rank and its local ids itself
(`kv_pools.locate_blocks`), moving the bytes on that rank (`kv_transfer.ranked`: one NIXL agent per
rank, driven from rank 0 through the executor's rank endpoints). `Engine.set_kv_connector` refuses
a connector that does not serve the instance's ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVLoadSpec:
    """The part of a request's prompt whose KV comes from outside."""

    num_tokens: int
    """Prompt tokens (from the first) whose compressed KV the load writes, in [1, len(prompt)]."""
    with_state: bool = False
    """The load also writes the bounded state as it is after those tokens into a reserved slot
    (no bounded replay); False: the engine rebuilds it by bounded replay."""


@dataclass(frozen=True)
class KVSaveSpec:
    """What to keep for a save once a request's prompt is computed."""

    with_state: bool = False
    """Also pin the request's bounded-state slot (as it is after the prompt) for the save."""


@dataclass
class KVConnectorEvents:
    """What one `KVConnector.poll()` observed (see the module docstring for what each list means)."""

    loaded: dict[str, list[int]] = field(default_factory=dict)
    """req_id -> output tokens sampled elsewhere (may be empty): the load is complete."""
    loaded_drafts: dict[str, list[int]] = field(default_factory=dict)
    """req_id (of `loaded`) -> draft tokens proposed elsewhere after those outputs (speculative decoding: the
    first decode step verifies them); absent: none."""
    load_failed: dict[str, str] = field(default_factory=dict)
    """req_id -> why: the load will not complete."""
    saved: list[str] = field(default_factory=list)
    """req_ids whose save completed: their pinned blocks may be freed."""
    save_failed: dict[str, str] = field(default_factory=dict)
    """req_id -> why: the save ended without reaching its destination; the pin may be dropped."""
    released: list[str] = field(default_factory=list)
    """Hold keys (from `abort_load`) whose blocks and slot may be reused now."""

    def __bool__(self) -> bool:
        return bool(self.loaded or self.load_failed or self.saved or self.save_failed or self.released)


class KVConnector(ABC):
    """Moves KV between this instance's pools and the outside; see the module docstring (the spec).

    Not thread-safe: the engine's thread calls every method.
    """

    def serves_ranks(self, world_size: int) -> bool:
        """Whether this connector addresses the KV of an instance of `world_size` ranks (global block ids of
        per-rank pools, see the module docstring); the default serves one-rank instances only."""
        return world_size == 1

    # ------------------------------------------------------------------ scheduler side

    def get_load(self, req_id: str, prompt_token_ids: list[int]) -> KVLoadSpec | None:
        """Whether (and how much of) a new request's prompt KV comes from outside; None = none."""
        return None

    def get_save(self, req_id: str) -> KVSaveSpec | None:
        """Whether a new request's prompt KV goes outside once computed; None = no."""
        return None

    def abort_load(self, req_id: str) -> str | None:
        """A request with a load was aborted: a hold key to quarantine its blocks under, or None."""
        return None

    def abort_save(self, req_id: str) -> bool:
        """A request pinned for a save was aborted: True keeps the pin until `poll()` reports the save."""
        return False

    # ------------------------------------------------------------------ worker side

    def start_load(self, req_id: str, block_ids: list[int], state_slot: int | None) -> None:
        """Start writing the load's KV into `block_ids` (and `state_slot` with `with_state`); returns at once."""
        raise NotImplementedError(f"{type(self).__name__} loads nothing")

    def start_save(self, req_id: str, block_ids: list[int], state_slot: int | None,
                   output_token_ids: list[int], draft_token_ids: Sequence[int] = ()) -> None:
        """Start reading the prompt's KV out of `block_ids` (and `state_slot`); returns at once.

        `block_ids` is the request's whole table (the prompt's blocks first); `output_token_ids`
        are the tokens sampled after the prompt (the first token), for a receiver that continues;
        `draft_token_ids` the drafts proposed after them (speculative decoding), for a receiver that
        verifies them (the engine passes them, by keyword, only when there are some; a connector
        may drop them: they only save the receiver a step).
        """
        raise NotImplementedError(f"{type(self).__name__} saves nothing")

    @abstractmethod
    def poll(self) -> KVConnectorEvents:
        """Drive the transport once (never blocks); what finished, failed or was released since the last call."""
