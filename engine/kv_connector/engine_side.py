"""The engine's one path for KV that comes from or goes to outside (mixed into `engine.engine.Engine`).

Two drivers share it:

* a `KVConnector` handed to the engine (`set_kv_connector`): the engine asks it at admission
  (`get_load` / `get_save`), starts loads and saves, and applies its events in
  `poll_kv_connector()` (the contract is `engine/kv_connector/base.py`);
* the caller itself, by hand (tests, tools, a connector-less embedding): `reserve_kv` /
  `commit_kv` for a load, `add_request(hold_kv=True)` / `release_kv` for a save.

Both go through the same allocation (`_start_kv_load`), commit (`commit_kv`) and pinning
(`_pin_for_save`, `KVHolds`) code. The mixin uses the engine's request tables, block manager
and slot pool; it imports no transport.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.kv_connector.base import KVConnector, KVLoadSpec, KVSaveSpec
from deepinfer.engine.kv_connector.holds import KVHolds

if TYPE_CHECKING:
    from deepinfer.engine.engine import RequestOutput, _Seq
    from deepinfer.engine.multimodal import ImageSpan
    from deepinfer.engine.sampling import SamplingParams


@dataclass
class KVPollResult:
    """What `Engine.poll_kv_connector()` applied, for the engine's owner to report."""

    outputs: list[RequestOutput] = field(default_factory=list)
    """Outputs of loaded requests that their imported tokens already finished (e.g. EOS as first token)."""
    load_failed: dict[str, str] = field(default_factory=dict)
    """request_id -> why: the load failed; the request was aborted (blocks freed or quarantined)."""
    saved: list[str] = field(default_factory=list)
    """request_ids whose save completed; their pins were dropped."""
    save_failed: dict[str, str] = field(default_factory=dict)
    """request_id -> why: the save failed; its pin was dropped."""


def _quarantine_key(key: str) -> str:
    return f"quarantine:{key}"


class ExternalKVMixin:
    """`Engine` methods for KV from / to outside: loads, saves, holds and the connector's events."""

    def _init_external_kv(self) -> None:
        self.kv_connector: KVConnector | None = None
        """Where KV comes from / goes to besides the local pools (None: only by hand)."""
        self.kv_holds = KVHolds(self.kv_manager.block_pool, self.slots)
        """Blocks and slots kept out of circulation for saves and quarantined loads."""
        self._loading: dict[str, _Seq] = {}
        """Requests whose KV is being written from outside (not yet in the scheduler), by req_id."""
        self._connector_loads: set[str] = set()
        """Request ids whose load the connector drives (the others wait for `commit_kv` by hand)."""
        self._connector_saves: set[str] = set()
        """Request ids whose save the connector drives (the others wait for `release_kv` by hand)."""

    # ------------------------------------------------------------------ the connector

    def set_kv_connector(self, connector: KVConnector | None) -> None:
        """Hand the engine its KV connector (once, before any request uses it)."""
        if self._loading or self._connector_saves:
            raise RuntimeError("cannot change the KV connector while loads or saves are pending")
        world = self.config.expert_parallel_size
        if connector is not None and not connector.serves_ranks(world):
            # NOTE: a multi-rank instance has one pool per rank (`engine.distributed.kv_pools`): a connector must
            # map its global block ids to a rank's pools (`kv_transfer.ranked`)
            raise ValueError(
                f"the KV connector {type(connector).__name__} cannot serve an instance with expert_parallel_size="
                f"{world}: its KV lives in per-rank pools the connector does not address. Give it the instance's "
                "per-rank agents (`kv_transfer.ranked.RankedAgents`), run it with expert_parallel_size=1, or serve "
                "this instance without it (the KV store does not serve multi-rank instances yet).")
        self.kv_connector = connector

    def poll_kv_connector(self) -> KVPollResult:
        """Poll the connector once (never blocks) and apply its events: commit loaded requests, abort
        failed loads, drop the pins of finished saves, lift quarantines. Call once per loop iteration,
        before `step()`."""
        res = KVPollResult()
        if self.kv_connector is None:
            return res
        ev = self.kv_connector.poll()
        for key in ev.released:
            self.kv_holds.release(_quarantine_key(key))
        for rid in ev.saved:
            if rid in self._connector_saves:
                self._connector_saves.discard(rid)
                self.kv_holds.release(rid)
                res.saved.append(rid)
        for rid, error in ev.save_failed.items():
            if rid in self._connector_saves:
                self._connector_saves.discard(rid)
                self.kv_holds.release(rid)
                res.save_failed[rid] = error
        for rid, output_token_ids in ev.loaded.items():
            if rid in self._loading and rid in self._connector_loads:
                res.outputs += self.commit_kv(rid, output_token_ids, ev.loaded_drafts.get(rid))
        for rid, error in ev.load_failed.items():
            if rid in self._loading and rid in self._connector_loads:
                self.abort_request(rid)
                res.load_failed[rid] = error
        return res

    # ------------------------------------------------------------------ admission

    def _kv_specs(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, hold_kv: bool,
                  hold_state: bool, load: KVLoadSpec | None) -> tuple[KVLoadSpec | None, KVSaveSpec | None]:
        """Decide at admission whether a request loads and / or saves KV (by hand or via the connector).

        Records which ones the connector drives (`_connector_loads` / `_connector_saves`); the
        caller must then register the request or call `_forget_kv(request_id)`.
        """
        save = None
        if hold_state and not hold_kv:
            raise InvalidRequestError("hold_state needs hold_kv", field="hold_state")
        if (hold_kv or load is not None) and self.config.expert_parallel_size > 1:
            raise InvalidRequestError("KV loads and holds (hold_kv) are not supported with expert_parallel_size > 1 "
                                      "yet (per-rank KV pools)", field="hold_kv" if hold_kv else "kv_load")
        if hold_kv:
            if params.n != 1:
                raise InvalidRequestError("hold_kv requests must have n = 1", field="n")
            save = KVSaveSpec(with_state=hold_state)
        connector = self.kv_connector
        if connector is not None and params.n == 1:
            if save is None:
                save = connector.get_save(request_id)
                if save is not None:
                    self._connector_saves.add(request_id)
            if load is None:
                load = connector.get_load(request_id, prompt_token_ids)
                if load is not None:
                    self._connector_loads.add(request_id)
        if load is not None:
            if params.n != 1:
                raise InvalidRequestError("requests with imported KV must have n = 1", field="n")
            if not 0 < load.num_tokens <= len(prompt_token_ids):
                self._forget_kv(request_id)
                raise InvalidRequestError(f"num_kv_tokens must be in [1, {len(prompt_token_ids)}]",
                                          field="num_kv_tokens")
        return load, save

    def _forget_kv(self, request_id: str) -> None:
        self._connector_loads.discard(request_id)
        self._connector_saves.discard(request_id)

    def _start_kv_load(self, seq: _Seq, load: KVLoadSpec) -> None:
        """Reserve blocks (and with `with_state` a slot) for an imported prefix; start the connector's
        load. Raises NoFreeBlocksError / NoFreeSlotsError (the caller aborts the request)."""
        req = seq.req
        self._loading[req.req_id] = seq
        block_ids = self.kv_manager.import_blocks(req, load.num_tokens)
        req.num_computed_tokens = load.num_tokens
        slot = None
        if load.with_state:
            slot = self.slots.allocate(req.req_id)
            # the window rows the first decode step reads (positions num_kv - W + 1 ...) were computed
            # by the prefill with at least W - 1 exact tokens before them (its replay, if any, is longer);
            # V4.1's slot also holds the last token ids its Engram hashes read (`engram_tokens`,
            # `V41Config.engram_history_tokens`), which must count as history too
            history = max(self.model_config.sliding_window - 1, getattr(self.model_config, "engram_history_tokens", 0))
            req.imported_state_start = max(0, load.num_tokens - history)
        if req.req_id in self._connector_loads:
            self.kv_connector.start_load(req.req_id, list(block_ids), slot)

    def _abort_kv_load(self, seq: _Seq) -> bool:
        """Free (or quarantine, as the connector asks) a pending load's blocks and slot; False if none."""
        rid = seq.req.req_id
        if self._loading.pop(rid, None) is None:
            return False
        key = None
        if rid in self._connector_loads:
            self._connector_loads.discard(rid)
            key = self.kv_connector.abort_load(rid)
        if key is not None:
            self.kv_holds.hold(_quarantine_key(key), self.kv_manager.get_block_ids(seq.req), slot_owner=rid)
        self.kv_manager.free(seq.req)
        self.slots.free(rid)
        return True

    def _abort_kv_save(self, request_id: str) -> None:
        """At abort: drop a save's pin, unless the connector still reads from it (then its event will)."""
        if request_id in self._connector_saves:
            if request_id in self.kv_holds and self.kv_connector.abort_save(request_id):
                return
            self._connector_saves.discard(request_id)
        self.kv_holds.release(request_id)

    def _pin_for_save(self, seq: _Seq, output_token_ids: list[int], draft_token_ids: Sequence[int] = ()) -> None:
        """The prompt is computed: pin its blocks (and slot) past the request's end; start the save (with the
        drafts proposed after the outputs, speculative decoding: the receiver's first step verifies them)."""
        rid = seq.parent.request_id
        held = self.kv_holds.hold(rid, self.kv_manager.get_block_ids(seq.req),
                                  slot_owner=seq.req.req_id if seq.save.with_state else None)
        seq.pinned_block_ids, seq.pinned_slot = held.block_ids, held.state_slot
        if rid in self._connector_saves:
            drafts = {"draft_token_ids": list(draft_token_ids)} if draft_token_ids else {}
            self.kv_connector.start_save(rid, list(held.block_ids), held.state_slot, list(output_token_ids), **drafts)

    # ------------------------------------------------------------------ by hand

    def reserve_kv(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                   num_kv_tokens: int, *, with_state: bool = False,
                   images: Sequence[ImageSpan] | None = None,
                   num_original_prompt_tokens: int | None = None) -> list[tuple[str, int, int, int]]:
        """Reserve blocks for a request whose first `num_kv_tokens` tokens' compressed KV will be
        written from outside, by the caller; returns their `(pool, block, byte_offset, num_bytes)`.

        The request waits until `commit_kv`; it then continues from token `num_kv_tokens`. Without
        `with_state` it first rebuilds its bounded state by bounded replay; with it, a state slot
        is reserved too (`kv_state_slot`) and must receive the bounded state as it is after the
        prompt (the prefill's `hold_state` slot): no replay. `abort_request` releases everything.
        Raises `InvalidRequestError` on bad input, `NoFreeBlocksError` / `NoFreeSlotsError` when full
        (reserving nothing).

        `images` (as in `add_request`): an image prompt needs its spans here too, with embeddings,
        whenever this instance may compute image positions (bounded replay without `with_state`,
        recompute after preemption) and so that its prefix-cache hashes carry the images.
        `num_original_prompt_tokens` (as in `add_request`): a continuation's original prompt length.
        """
        if params.n != 1:
            raise InvalidRequestError("requests with imported KV must have n = 1", field="n")
        self.add_request(request_id, {"prompt_token_ids": prompt_token_ids}, params, images=images,
                         num_original_prompt_tokens=num_original_prompt_tokens,
                         _kv_load=KVLoadSpec(num_kv_tokens, with_state))
        return self.kv_descriptors(request_id)

    def commit_kv(self, request_id: str, first_token_ids: list[int] | None = None,
                  draft_token_ids: Sequence[int] | None = None) -> list[RequestOutput]:
        """The reserved KV has landed: let the request run.

        `first_token_ids` are output tokens already sampled elsewhere (the prefill instance's first
        token): they count as this request's outputs (stop checks, penalties, limits) and decoding
        continues after them. Returns an output at once when they already finish the request.
        `draft_token_ids`: drafts proposed elsewhere after them (a speculative prefill instance's MTP
        layer); with speculative decoding on here, the request's first decode step verifies them
        (at most `num_draft_tokens`, those its structured-output constraint allows), else they are ignored.
        """
        parent = self._parents[request_id]
        seq = parent.seqs[0]
        self._loading.pop(seq.req.req_id)
        self._connector_loads.discard(seq.req.req_id)
        if first_token_ids:
            upd = seq.stop.append(list(first_token_ids))
            accepted = list(first_token_ids)[: upd.num_accepted_tokens]
            seq.req.append_output_token_ids(accepted)
            co = parent.outputs[0]
            co.token_ids.extend(accepted)
            co.text += upd.text_delta
            grammar_finish = self._advance_grammar(seq, seq.req.output_token_ids)
            if upd.finish_reason is not None or grammar_finish is not None:
                reason = upd.finish_reason if upd.finish_reason is not None else grammar_finish
                co.finish_reason = str(reason.value if hasattr(reason, "value") else reason)
                co.stop_reason = upd.stop_reason
                self.kv_manager.free(seq.req)
                self.slots.free(seq.req.req_id)
                ro = self._make_output(parent, {seq.req.req_id: (accepted, upd.text_delta)})
                self._seqs.pop(seq.req.req_id, None)
                del self._parents[request_id]
                return [ro]
        if draft_token_ids and self.spec is not None:
            drafts = list(draft_token_ids)[:self.spec.num_draft_tokens]
            if seq.grammar is not None:
                drafts = drafts[:seq.grammar.count_acceptable(drafts)[0]]
            seq.req.spec_token_ids = drafts
            self.spec.metrics.num_imported_drafts += len(drafts)
        parent.queued_at = time.monotonic()  # its queue time (`Engine.latency`) starts now, not at the reservation
        self.scheduler.add_request(seq.req)
        return []

    def release_kv(self, request_id: str) -> None:
        """Drop the hold on a `hold_kv` request's blocks (its KV has been sent, or never will be)."""
        self._connector_saves.discard(request_id)
        self.kv_holds.release(request_id)

    # ------------------------------------------------------------------ introspection

    def kv_block_ids(self, request_id: str) -> list[int]:
        """Block table of a live (or reserved) request's first sequence."""
        return self.kv_manager.get_block_ids(self._parents[request_id].seqs[0].req)

    def kv_state_slot(self, request_id: str) -> int | None:
        """The state slot a reserved (`with_state`) or running request holds, if any."""
        return self.slots.get_slot_id(self._parents[request_id].seqs[0].req.req_id)

    def kv_descriptors(self, request_id: str) -> list[tuple[str, int, int, int]]:
        """`(pool, block, byte_offset, num_bytes)` of a live request's compressed KV blocks."""
        return self.cache.block_byte_ranges(self.kv_block_ids(request_id))

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block."""
        return self.kv_manager.block_size

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks in the pool."""
        return self.kv_manager.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        """KV blocks an allocation may take now (free, including evictable cached ones)."""
        return self.kv_manager.num_free_blocks

    def num_kv_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return self.kv_manager.num_blocks_for(num_tokens)

    def cached_block_hashes(self) -> frozenset:
        """Prefix hashes of every cached block (what a cache-aware balancer routes by)."""
        pool = self.kv_manager.block_pool
        return frozenset(h for h in map(pool.block_hash, range(pool.num_blocks)) if h is not None)

    def kv_rank_loads(self) -> list:
        """Each rank's load (`engine.distributed.kv_pools.RankLoad`: KV blocks, running and waiting requests); one
        entry for a one-rank instance."""
        from deepinfer.engine.distributed.kv_pools import RankedKVCacheManager, RankLoad, rank_loads

        if isinstance(self.kv_manager, RankedKVCacheManager):
            return rank_loads(self.kv_manager, self.scheduler.running)
        return [RankLoad(0, self.num_kv_blocks, self.num_kv_blocks - self.num_free_kv_blocks,
                         self.num_running_requests, self.num_waiting_requests + self.num_loading_kv)]

    def prefer_kv_rank(self, request_id: str, rank: int | None) -> None:
        """Place the next `add_request(request_id)` on `rank` when it has room (a balancer's (instance, rank) pick);
        ignored by a one-rank instance (rank 0 only). Raises InvalidRequestError for a rank the instance lacks."""
        from deepinfer.engine.distributed.kv_pools import RankedKVCacheManager

        world = self.config.expert_parallel_size
        if rank is not None and not 0 <= rank < world:
            raise InvalidRequestError(f"rank {rank} is not one of this instance's {world} rank(s)", field="rank")
        if isinstance(self.kv_manager, RankedKVCacheManager):
            self.kv_manager.prefer_rank(request_id, rank)

    @property
    def num_running_requests(self) -> int:
        """Requests the scheduler is running."""
        return self.scheduler.num_running

    @property
    def num_waiting_requests(self) -> int:
        """Requests waiting in the scheduler (loads not yet committed excluded: `num_loading_kv`)."""
        return self.scheduler.num_waiting

    @property
    def num_loading_kv(self) -> int:
        """Requests whose KV is still being written from outside."""
        return len(self._loading)

    @property
    def num_kv_holds(self) -> int:
        """Pins and quarantines that keep blocks out of circulation."""
        return len(self.kv_holds)

    def has_runnable_requests(self) -> bool:
        """Whether `step()` has something to advance: a scheduled request or a step in flight (requests
        waiting for their KV to load do not count)."""
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)
