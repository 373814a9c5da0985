"""The decode instance's process shell: the `deepinfer.v1.Decode` gRPC service around a `DecodeCore`.

```python
worker = serve_decode(DecodeWorkerConfig(model=path, lb_address="127.0.0.1:7002", loopback_ucx=True))
print(worker.address)   # host:port, registered with the decode balancer
worker.wait()           # until Drain finished or stop()
```

Threads: one engine loop (`serving.loop.EngineLoop`) owns the core, the engine and the NIXL agent; gRPC
handlers post work to it; a heartbeat thread reports the load to the decode balancer. A request:

1. `Reserve`: on the loop thread, `core.reserve` takes blocks for the prompt's KV and expects the
   transfer; the answer carries the block ids, the transfer id, the lease deadline, and what a
   prefill needs to connect: the agent name, `agent_metadata` and `agent_layout` (a serialized
   `KVLayout`, `KVTransferAgent.layout()`). Refusals (bad params, no room, draining) are in-band `Error`s.
   An image prompt's embeddings are READ first (`EmbeddingAgent.read_now`, blocking the loop a few
   ms) from the vision instance holding them, and go to the engine as `ImageSpan`s, so bounded
   replay and recompute after preemption see the images; embeddings that cannot be read are an
   in-band UNAVAILABLE on field `image_embeddings` (the entrypoint encodes them again).
2. The prefill's WRITE lands; its notification (with the first token) commits the request and the
   loop decodes it. Its outputs go, as `TokenChunk` deltas, into the request's buffer, which exists
   from Reserve on, so nothing is lost when decoding starts before `Start` arrives.
3. `Start`: streams the buffered and following chunks until the one with a finish_reason (usage
   on it). A cancelled stream, `Abort`, the `deadline_ms` of Reserve, or a lease that ran out
   (the KV never came, or Start never came within `start_grace_s` after it) abort the request and
   free its blocks.

`Health`, `Abort` and `Drain` are the shared ones of `serving.shell` (`Health`'s trailing stats carry
the load report and the kv_transfer counters); refusals map to the wire through `serving.errors`.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from functools import partial

from deepinfer.decode_worker.config import DecodeWorkerConfig
from deepinfer.decode_worker.core import DecodeCore, DecodeFailed
from deepinfer.decode_worker.load_report import (
    RequestWork,
    engine_free_slots,
    engine_rank_of,
    fill_decode_work,
    output_tokens_left,
)
from deepinfer.engine.cache.block_pool import NoFreeBlocksError, NoFreeSlotsError
from deepinfer.engine.engine import RequestOutput
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.scheduler import check_num_original_prompt_tokens
from deepinfer.kv_transfer.embeddings import EmbeddingSource
from deepinfer.kvstore.store import open_worker_store
from deepinfer.protos import common_pb2, decode_pb2, decode_pb2_grpc, loadbalancer_pb2
from deepinfer.protos.convert import sampling_params_from_proto, token_chunk
from deepinfer.serving.errors import QUARANTINE_FIELD, STALE_RESERVATION_FIELD, Refused, count_error, error_of
from deepinfer.serving.loop import LoopMode
from deepinfer.serving.shell import LOOP_CALL_TIMEOUT_S, EngineShell, ShellServicer, queue_items, serve_worker

EMBEDDING_READ_TIMEOUT_S = 3.0
"""Longest a Reserve waits for the READ of its images' embeddings (under the loop-call timeout)."""


@dataclasses.dataclass
class _Stream:
    """One reserved request's output buffer and progress (loop-thread state; `chunks` is thread-safe)."""

    request_id: str
    transfer_id: str
    num_prompt_tokens: int
    lease_deadline: float
    """time.monotonic() when the reservation's lease ends."""
    deadline: float | None
    """time.monotonic() when the request's deadline_ms runs out; None = no deadline."""
    max_tokens: int | None = None
    """The request's max_tokens (the load report's decode work ahead); None = up to the context length."""
    rank: int = 0
    """The rank its KV was reserved on (a multi-rank instance; the load report's fallback while it is unplaced)."""
    chunks: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    is_started: bool = False
    is_finished: bool = False
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


class DecodeWorker(EngineShell):
    """A running decode instance: engine loop, gRPC server and balancer membership (see `serve_decode`)."""

    stage_name = "decode"
    stage = common_pb2.STAGE_DECODE

    def __init__(self, config: DecodeWorkerConfig) -> None:
        # image prompts: the embeddings are READ (during Reserve) from the vision instance holding them
        super().__init__(config, send_state=config.is_state_sent)
        self.agent_layout = self.agent.layout().SerializeToString()  # NOTE: as agent_metadata
        self.agent_infos = self.agent.agent_infos()  # each rank's agent (name, metadata, layout): Reserve names one
        self.kv_store = open_worker_store(config.kv_store_config(), self.logger)  # conversation turns (`core`)
        self.core = DecodeCore(self.engine, self.agent, self.agent_name, store=self.kv_store)
        self._streams: dict[str, _Stream] = {}  # loop-thread state
        self._bind(decode_pb2_grpc.add_DecodeServicer_to_server, DecodeServicer(self))

    # ------------------------------------------------------------------ loop thread

    def _num_unfinished(self) -> int:
        return sum(not st.is_finished for st in self._streams.values())

    def _reserve(self, request_id: str, prompt_token_ids: list[int], params, lease_s: float,
                 deadline: float | None, images=(), traffic_class: str = "", is_conversation: bool = False,
                 rank: int | None = None, num_original_prompt_tokens: int | None = None):
        if request_id in self._streams:
            # NOTE: the entrypoint that owns the id retries it here while the Abort of its earlier attempt is
            # still on its way (sent in a daemon thread to an instance it had lost): it aborts and retries
            raise Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"request id {request_id!r} already holds a "
                          f"reservation on decode instance {self.instance_id}; abort it first", STALE_RESERVATION_FIELD)
        num_needed = self.engine.num_kv_blocks_for(len(prompt_token_ids))
        num_free = self.engine.num_free_kv_blocks
        if num_needed > num_free:
            raise Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                          f"decode instance {self.instance_id} has {num_free} free KV blocks, the "
                          f"prompt needs {num_needed}; retry later or on another instance{self._quarantine_note()}",
                          QUARANTINE_FIELD if self.core.num_quarantined else "")
        spans = None
        if images:
            from deepinfer.engine.multimodal import ImageSpan

            if self.emb_agent is None:
                raise InvalidRequestError("this decode instance's model has no vision tower; it cannot take images",
                                          field="images")
            try:  # NOTE: blocks the loop for the READs (a few ms; bounded by EMBEDDING_READ_TIMEOUT_S)
                embeds = self.emb_agent.read_now(request_id, [src for _, src in images], EMBEDDING_READ_TIMEOUT_S)
            except RuntimeError as e:  # the holder is gone or too slow: the entrypoint encodes again
                raise Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"decode instance {self.instance_id}: {e}",
                              "image_embeddings") from None
            except ValueError as e:
                raise Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, f"decode instance {self.instance_id}: {e}") \
                    from None
            spans = [ImageSpan(ref.offset, ref.num_tokens, ref.content_hash, embeds=emb)
                     for (ref, _), emb in zip(images, embeds)]
        try:
            reservation = self.core.reserve(request_id, prompt_token_ids, params, lease_s=lease_s, images=spans,
                                            traffic_class=traffic_class, is_conversation=is_conversation,
                                            rank=rank, num_original_prompt_tokens=num_original_prompt_tokens)
        except (NoFreeBlocksError, NoFreeSlotsError) as e:  # RESOURCE_EXHAUSTED (serving.errors)
            self.engine.abort_request(request_id)
            if self.core.num_quarantined:
                raise Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, f"decode instance {self.instance_id}: {e}"
                              f"{self._quarantine_note()}", QUARANTINE_FIELD) from None
            raise
        self._streams[request_id] = _Stream(request_id, reservation.transfer_id, len(prompt_token_ids),
                                            time.monotonic() + lease_s, deadline, params.max_tokens,
                                            engine_rank_of(self.engine)(request_id) or 0)
        return reservation

    def _quarantine_note(self) -> str:
        n = self.core.num_quarantined
        return f" ({n} aborted reservations hold capacity until their leases end)" if n else ""

    def _attach(self, request_id: str, transfer_id: str) -> _Stream:
        st = self._streams.get(request_id)
        if st is None:
            raise Refused(common_pb2.ERROR_CODE_NOT_FOUND, f"request {request_id!r} holds no reservation on decode "
                          f"instance {self.instance_id} (never reserved, aborted, or its lease ran out)")
        if transfer_id and transfer_id != st.transfer_id:
            raise Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"transfer_id {transfer_id!r} is not this "
                          f"reservation's ({st.transfer_id!r})", "transfer_id")
        if st.is_started:
            raise Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"request {request_id!r} was already started",
                          "request_id")
        st.is_started = True
        if st.is_finished:
            del self._streams[request_id]
        return st

    def _step(self) -> None:
        for ev in self.core.step():
            st = self._streams.get(ev.request_id)
            if st is None or st.is_finished:
                continue
            if isinstance(ev, DecodeFailed):
                self._finish(st, common_pb2.FINISH_REASON_ERROR, common_pb2.ERROR_CODE_DEADLINE_EXCEEDED, ev.error,
                             common_pb2.Usage(prompt_tokens=st.num_prompt_tokens))
            else:
                chunk = self._chunk(st, ev)
                if chunk is not None:
                    self._emit(st, chunk)
        now = time.monotonic()
        for st in list(self._streams.values()):
            if st.deadline is not None and now >= st.deadline and not st.is_finished:
                self._abort(st.request_id, "deadline_ms ran out", common_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
            elif not st.is_started and now >= st.lease_deadline + self.config.start_grace_s:
                self._abort(st.request_id, "Start did not come before the lease (plus start_grace_s) ran out",
                            common_pb2.ERROR_CODE_DEADLINE_EXCEEDED)
                self._streams.pop(st.request_id, None)

    def _chunk(self, st: _Stream, out: RequestOutput) -> decode_pb2.TokenChunk | None:
        chunk = token_chunk(st.request_id, out, st.num_sent_tokens, st.num_sent_chars, st.num_prompt_tokens)
        co = out.outputs[0]
        st.num_sent_tokens, st.num_sent_chars = len(co.token_ids), len(co.text)
        return chunk

    def _emit(self, st: _Stream, chunk: decode_pb2.TokenChunk) -> None:
        st.chunks.put(chunk)
        if chunk.finish_reason:
            st.is_finished = True
            if st.is_started:
                self._streams.pop(st.request_id, None)
            if self.reporter is not None:
                # NOTE: the balancer counts each pick as a held state slot and its KV blocks until the next report;
                # without one now, an instance whose requests end within a heartbeat interval looked full until it
                # (sequential requests on a 4-slot instance waited ~0.4 s for room: `benchmarks/pd_gpu.py`)
                self.reporter.report_now()

    def _finish(self, st: _Stream, finish_reason: int, code: int, message: str,
                usage: common_pb2.Usage | None = None) -> None:
        """Emit the last chunk of a request that did not finish normally (error or abort)."""
        count_error(code)  # errors by cause in Health's stats (`serving.errors`)
        self._emit(st, decode_pb2.TokenChunk(request_id=st.request_id, finish_reason=finish_reason, usage=usage,
                                             error=common_pb2.Error(code=code, message=message)))

    def _abort_rpc(self, request_id: str, reason: str, writer_gone: bool) -> bool:
        st = self._streams.get(request_id)
        was_found = self._abort(request_id, reason)
        if st is not None and writer_gone:
            # the entrypoint found the prefill that was to WRITE here dead: no late WRITE can land, so the
            # reservation's blocks go back now instead of after the lease (a restarted prefill needs them)
            if self.core.release_quarantine(st.transfer_id):
                self.logger.info("shortened the quarantine of %s (its writer is gone): %s", request_id, reason)
        return was_found

    def _abort(self, request_id: str, reason: str, code: int = common_pb2.ERROR_CODE_ABORTED) -> bool:
        st = self._streams.get(request_id)
        self.core.abort(request_id)
        if st is None or st.is_finished:
            if st is not None and not st.is_started:
                # a reservation that already failed (e.g. its KV load) and that nobody will Start now: free
                # its request id so that a retry of the request may reserve here again
                self._streams.pop(request_id, None)
            return False
        self.logger.info("aborted %s: %s", request_id, reason)
        self._finish(st, common_pb2.FINISH_REASON_ABORT, code, f"request {request_id!r} was aborted: {reason}",
                     common_pb2.Usage(prompt_tokens=st.num_prompt_tokens, completion_tokens=st.num_sent_tokens))
        if not st.is_started:
            self._streams.pop(request_id, None)
        return True

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, "drain timeout")

    def _on_fatal(self, exc: BaseException) -> None:
        for st in list(self._streams.values()):
            if not st.is_finished:
                self._finish(st, common_pb2.FINISH_REASON_ERROR, common_pb2.ERROR_CODE_INTERNAL,
                             f"the decode engine failed: {exc}")
        self._streams.clear()

    def _mode(self) -> LoopMode:
        if self.engine.has_runnable_requests():
            return LoopMode.COMPUTE
        return LoopMode.POLL if self.agent.num_pending_recvs else LoopMode.IDLE

    def _load(self) -> loadbalancer_pb2.LoadReport:
        report = self._kv_load(num_waiting_requests=self.engine.num_waiting_requests + self.engine.num_loading_kv)
        # the decode work ahead and the free state slots, per rank (`decode_worker.load_report`)
        rank_of, max_len = engine_rank_of(self.engine), self.engine.max_model_len
        work = [RequestWork(_or(rank_of(st.request_id), st.rank),
                            output_tokens_left(st.max_tokens, st.num_prompt_tokens, st.num_sent_tokens, max_len))
                for st in self._streams.values() if not st.is_finished]
        return fill_decode_work(report, work, engine_free_slots(self.engine))

    def _stats(self) -> dict:
        load = self._load()
        stats = self._transfer_stats()
        stats.update(num_streams=len(self._streams), num_unfinished_requests=self._num_unfinished(),
                     num_kv_blocks_used=load.num_kv_blocks_used, num_kv_blocks_total=load.num_kv_blocks_total,
                     num_running_requests=load.num_running_requests, num_quarantined=self.core.num_quarantined)
        if self.kv_store is not None:  # the store's counters and per-class figures (`kvstore_*`)
            stats.update(self.kv_store.health_stats(),
                         kvstore_conversation_blocks_saved_total=self.core.num_conversation_blocks_saved)
        if self.engine.spec is not None:  # speculative decoding: acceptance figures (`spec_decode_*`)
            stats.update(self.engine.spec.metrics.health_stats())
        return stats

    def _load_and_hashes(self) -> tuple[loadbalancer_pb2.LoadReport, None]:
        return self._load(), None

    def _close(self) -> None:
        super()._close()
        if self.kv_store is not None:
            self.kv_store.close()  # bounded wait for queued writes


class DecodeServicer(ShellServicer, decode_pb2_grpc.DecodeServicer):
    """`deepinfer.v1.Decode` over a `DecodeWorker` (Abort, Health, Drain: `ShellServicer`)."""

    def Reserve(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            w.check_accepting()
            if not rid:
                raise InvalidRequestError("request_id must be set", field="request_id")
            if len(request.image_embeddings) != len(request.images):
                raise InvalidRequestError(f"{len(request.images)} images but {len(request.image_embeddings)} "
                                          "image_embeddings; encode every image on the vision stage first",
                                          field="image_embeddings")
            images = [(ref, EmbeddingSource.from_proto(emb))
                      for ref, emb in zip(request.images, request.image_embeddings)]
            if request.num_kv_tokens and request.num_kv_tokens != len(request.prompt_token_ids):
                raise InvalidRequestError("num_kv_tokens must equal the prompt length", field="num_kv_tokens")
            num_original = (request.num_original_prompt_tokens if request.HasField("num_original_prompt_tokens")
                            else None)
            check_num_original_prompt_tokens(num_original, len(request.prompt_token_ids))
            params = sampling_params_from_proto(request.sampling_params)
            lease_s = request.lease_ms / 1000 if request.lease_ms else w.config.kv_lease_s
            deadline = time.monotonic() + request.deadline_ms / 1000 if request.deadline_ms else None
            now_unix = time.time()
            reservation = w.loop.call(partial(w._reserve, rid, list(request.prompt_token_ids), params, lease_s,
                                              deadline, images, request.kv_traffic_class, request.is_conversation,
                                              request.rank if request.HasField("rank") else None, num_original),
                                      LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            return decode_pb2.ReserveResponse(request_id=rid, error=_error(e))
        agent = w.agent_infos[reservation.peer]  # the agent of the rank whose pools hold the KV
        return decode_pb2.ReserveResponse(
            request_id=rid, agent_name=agent.name, agent_metadata=agent.metadata, agent_layout=agent.layout,
            block_ids=reservation.block_ids, block_size=w.block_size, transfer_id=reservation.transfer_id,
            lease_deadline_unix_ms=int((now_unix + lease_s) * 1000), state_slot=reservation.state_slot)

    def Start(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            st = w.loop.call(partial(w._attach, rid, request.transfer_id), LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            yield decode_pb2.TokenChunk(request_id=rid, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                        error=_error(e))
            return
        context.add_callback(lambda: st.is_finished or w.loop.post(partial(w._abort, rid, "start stream ended")))
        # the first token came from the prefill (its logprobs too): they lead the first chunk's (`token_chunk`)
        first_logprobs = request.first_token_logprobs if request.HasField("first_token_logprobs") else None
        try:
            for chunk in queue_items(st.chunks, context):
                if first_logprobs is not None and chunk.token_ids:
                    if len(chunk.logprobs) < len(chunk.token_ids):
                        rest = list(chunk.logprobs)
                        del chunk.logprobs[:]
                        chunk.logprobs.extend([first_logprobs, *rest])
                    first_logprobs = None
                if chunk.finish_reason:
                    chunk.usage.cached_prompt_tokens = request.num_cached_prompt_tokens
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            if not st.is_finished:  # the stream ended early (client gone): free the request
                w.loop.post(partial(w._abort, rid, "start stream ended"))


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _error(e: BaseException) -> common_pb2.Error:
    """The in-band `Error` of a refused or failed call (`serving.errors`' table)."""
    return error_of(e, loop_name="decode engine loop")


def serve_decode(config: DecodeWorkerConfig) -> DecodeWorker:
    """Blocks until a decode instance serves on `config.host:port` and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached.
    """
    return serve_worker(DecodeWorker, config)
