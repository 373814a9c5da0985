"""The decode instance's process shell: the `deepinfer.v1.Decode` gRPC service around a `DecodeCore`.

```python
worker = serve_decode(DecodeWorkerConfig(model=path, lb_address="127.0.0.1:7002", loopback_ucx=True))
print(worker.address)   # host:port, registered with the decode balancer
worker.wait()           # until Drain finished or stop()
```

Threads: one engine loop (`shell.EngineLoop`) owns the core, the engine and the NIXL agent; gRPC
handlers post work to it; a heartbeat thread reports the load to the decode balancer. A request:

1. `Reserve`: on the loop thread, `core.reserve` takes blocks for the prompt's KV and expects the
   transfer; the answer carries the block ids, the transfer id, the lease deadline, and what a
   prefill needs to connect: the agent name, `agent_metadata` and `agent_layout` (JSON of
   `KVTransferAgent.pool_layout()`). Refusals (bad params, no room, draining) are in-band `Error`s.
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

`Health` reports liveness and, in the trailing metadata `deepinfer-stats-json`, the load report
and the kv_transfer counters. `Drain` stops taking reservations, lets those in flight finish (or
aborts them after its timeout), deregisters and stops the process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
import time
import uuid
from functools import partial

import grpc

from decode_worker.config import DecodeWorkerConfig
from decode_worker.core import DecodeCore, DecodeFailed
from engine.cache.block_pool import NoFreeBlocksError, NoFreeSlotsError
from engine.engine import Engine, RequestOutput
from engine.errors import InvalidRequestError
from engine.worker_shell import EngineLoop, LoadReporter, LoopMode, health_response
from kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from kv_transfer.embeddings import EmbeddingAgent, EmbeddingSource
from protos import common_pb2, decode_pb2, decode_pb2_grpc, loadbalancer_pb2
from protos.convert import sampling_params_from_proto

logger = logging.getLogger("decode_worker")

LOOP_CALL_TIMEOUT_S = 5.0
"""How long handlers and heartbeats wait for the engine loop before calling it stuck."""

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
"""Engine finish reasons -> wire."""


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
    chunks: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    is_started: bool = False
    is_finished: bool = False
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


class _Refused(Exception):
    """A request refused or failed here; becomes an in-band `Error`."""

    def __init__(self, code: int, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.field = field

    @classmethod
    def of(cls, e: Exception) -> _Refused:
        if isinstance(e, _Refused):
            return e
        if isinstance(e, InvalidRequestError):
            return cls(common_pb2.ERROR_CODE_INVALID_REQUEST, str(e), e.field or "")
        if isinstance(e, concurrent.futures.TimeoutError):
            return cls(common_pb2.ERROR_CODE_UNAVAILABLE, "the decode engine loop did not answer in time")
        return cls(common_pb2.ERROR_CODE_INTERNAL, f"{type(e).__name__}: {e}")

    def to_proto(self) -> common_pb2.Error:
        return common_pb2.Error(code=self.code, message=str(self), field=self.field)


class DecodeWorker:
    """A running decode instance: engine loop, gRPC server and balancer membership (see `serve_decode`)."""

    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.agent_name = config.agent_name or self.instance_id
        self.engine = Engine(config.engine_config())
        self.agent = KVTransferAgent(self.agent_name, self.engine.cache, send_state=config.bounded_state == "send",
                                     ucx_env=LOOPBACK_UCX_ENV if config.loopback_ucx else None)
        # NOTE: read once here, before the loop owns the agent; neither changes during its life.
        self.agent_metadata = self.agent.metadata()
        self.agent_layout = json.dumps(self.agent.pool_layout(), sort_keys=True).encode()
        self.core = DecodeCore(self.engine, self.agent, self.agent_name)
        # image prompts: the embeddings are READ (during Reserve) from the vision instance holding them
        self.emb_agent = None
        if self.engine.model_config.vision is not None:
            self.emb_agent = EmbeddingAgent(f"{self.agent_name}-emb", config.embedding_rows,
                                            self.engine.model_config.hidden_size,
                                            self.engine.model.model.embed_tokens.weight.dtype, config.device,
                                            ucx_env=LOOPBACK_UCX_ENV if config.loopback_ucx else None)
        self.block_size = self.engine.kv_manager.block_pool.block_size
        self._streams: dict[str, _Stream] = {}  # loop-thread state
        self.loop = EngineLoop("decode_worker-loop", self._step, self._mode, on_fatal=self._on_fatal)
        self.is_draining = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._is_stopping = False
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_rpc_threads, thread_name_prefix="decode_worker-rpc"))
        decode_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(self), self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise RuntimeError(f"cannot bind the decode server to {config.host}:{config.port}")
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.reporter: LoadReporter | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Blocks until serving and registered with the balancer (when `lb_address` is set)."""
        self.loop.start()
        self.server.start()
        if self.config.lb_address:
            registration = loadbalancer_pb2.RegisterRequest(
                instance_id=self.instance_id, stage=common_pb2.STAGE_DECODE, address=self.address,
                kv_agent_name=self.agent_name, kv_agent_metadata=self.agent_metadata,
                datacenter=self.config.datacenter, block_size=self.block_size)
            self.reporter = LoadReporter(self.config.lb_address, registration, self._collect_load,
                                         interval_s=self.config.heartbeat_interval_s, logger_name="decode_worker")
            self.reporter.start()
        logger.info("decode instance %s serving on %s (agent %s, %d blocks of %d tokens)", self.instance_id,
                    self.address, self.agent_name, self.engine.kv_manager.num_blocks, self.block_size)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the instance stopped (drained or `stop()`); False on timeout."""
        return self._stopped.wait(timeout)

    def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking reservations; finish those in flight (abort them after `timeout_s`), then stop.

        Returns at once with the number of unfinished requests; `wait()` for the end.
        """
        with self._lock:
            was_draining, self.is_draining = self.is_draining, True
        num_unfinished = self.loop.call(self._num_unfinished, LOOP_CALL_TIMEOUT_S)
        if not was_draining:
            logger.info("draining (%d unfinished requests)", num_unfinished)
            if self.reporter is not None:
                self.reporter.report_now()
            threading.Thread(target=self._finish_drain, args=(timeout_s,), name="decode_worker-drain",
                             daemon=True).start()
        return num_unfinished

    def stop(self, grace_s: float = 1.0) -> None:
        """Blocks until stopped: deregisters, stops the server (answering in-flight calls for `grace_s`),
        the loop and the NIXL agent. Idempotent."""
        with self._lock:
            if self._is_stopping:
                return
            self._is_stopping = True
        if self.reporter is not None:
            self.reporter.stop(deregister=True)
        self.server.stop(grace_s).wait()
        self.loop.stop()
        self.agent.close()
        if self.emb_agent is not None:
            self.emb_agent.close()
        logger.info("decode instance %s stopped", self.instance_id)
        self._stopped.set()

    def _finish_drain(self, timeout_s: float | None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.loop.is_alive:
            try:
                left = self.loop.call(self._num_unfinished, LOOP_CALL_TIMEOUT_S)
            except Exception:
                break
            if not left:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.loop.call(self._abort_all, LOOP_CALL_TIMEOUT_S)
                deadline = None
            time.sleep(0.02)
        self.stop()

    # ------------------------------------------------------------------ loop thread

    def _num_unfinished(self) -> int:
        return sum(not st.is_finished for st in self._streams.values())

    def _reserve(self, request_id: str, prompt_token_ids: list[int], params, lease_s: float,
                 deadline: float | None, images=()):
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} already holds a reservation here",
                                      field="request_id")
        manager = self.engine.kv_manager
        num_needed = manager.num_blocks_for(len(prompt_token_ids))
        if num_needed > manager.num_free_blocks:
            raise _Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED,
                           f"decode instance {self.instance_id} has {manager.num_free_blocks} free KV blocks, the "
                           f"prompt needs {num_needed}; retry later or on another instance")
        spans = None
        if images:
            from engine.multimodal import ImageSpan

            if self.emb_agent is None:
                raise InvalidRequestError("this decode instance's model has no vision tower; it cannot take images",
                                          field="images")
            try:  # NOTE: blocks the loop for the READs (a few ms; bounded by EMBEDDING_READ_TIMEOUT_S)
                embeds = self.emb_agent.read_now(request_id, [src for _, src in images], EMBEDDING_READ_TIMEOUT_S)
            except RuntimeError as e:  # the holder is gone or too slow: the entrypoint encodes again
                raise _Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"decode instance {self.instance_id}: {e}",
                               "image_embeddings") from None
            except ValueError as e:
                raise _Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, f"decode instance {self.instance_id}: {e}") \
                    from None
            spans = [ImageSpan(ref.offset, ref.num_tokens, ref.content_hash, embeds=emb)
                     for (ref, _), emb in zip(images, embeds)]
        try:
            reservation = self.core.reserve(request_id, prompt_token_ids, params, lease_s=lease_s, images=spans)
        except (NoFreeBlocksError, NoFreeSlotsError) as e:
            self.engine.abort_request(request_id)
            raise _Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, str(e)) from None
        self._streams[request_id] = _Stream(request_id, reservation.transfer_id, len(prompt_token_ids),
                                            time.monotonic() + lease_s, deadline)
        return reservation

    def _attach(self, request_id: str, transfer_id: str) -> _Stream:
        st = self._streams.get(request_id)
        if st is None:
            raise _Refused(common_pb2.ERROR_CODE_NOT_FOUND, f"request {request_id!r} holds no reservation on decode "
                           f"instance {self.instance_id} (never reserved, aborted, or its lease ran out)")
        if transfer_id and transfer_id != st.transfer_id:
            raise _Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"transfer_id {transfer_id!r} is not this "
                           f"reservation's ({st.transfer_id!r})", "transfer_id")
        if st.is_started:
            raise _Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"request {request_id!r} was already started",
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
                self._emit(st, decode_pb2.TokenChunk(
                    request_id=st.request_id, finish_reason=common_pb2.FINISH_REASON_ERROR,
                    usage=common_pb2.Usage(prompt_tokens=st.num_prompt_tokens),
                    error=common_pb2.Error(code=common_pb2.ERROR_CODE_DEADLINE_EXCEEDED, message=ev.error)))
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
        co = out.outputs[0]
        new_token_ids = co.token_ids[st.num_sent_tokens:]
        text = co.text[st.num_sent_chars:]
        st.num_sent_tokens, st.num_sent_chars = len(co.token_ids), len(co.text)
        chunk = decode_pb2.TokenChunk(request_id=st.request_id, token_ids=new_token_ids, text=text)
        if out.error:
            chunk.finish_reason = common_pb2.FINISH_REASON_ERROR
            chunk.error.CopyFrom(common_pb2.Error(code=common_pb2.ERROR_CODE_INTERNAL, message=out.error))
        elif out.finished:
            chunk.finish_reason = FINISH_REASONS.get(co.finish_reason, common_pb2.FINISH_REASON_STOP)
            if isinstance(co.stop_reason, int):
                chunk.stop_token_id = co.stop_reason
            elif isinstance(co.stop_reason, str):
                chunk.stop_str = co.stop_reason
        elif not new_token_ids and not text:
            return None
        if chunk.finish_reason:
            chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=st.num_prompt_tokens,
                                                  completion_tokens=len(co.token_ids)))
        return chunk

    def _emit(self, st: _Stream, chunk: decode_pb2.TokenChunk) -> None:
        st.chunks.put(chunk)
        if chunk.finish_reason:
            st.is_finished = True
            if st.is_started:
                self._streams.pop(st.request_id, None)

    def _abort(self, request_id: str, reason: str, code: int = common_pb2.ERROR_CODE_ABORTED) -> bool:
        st = self._streams.get(request_id)
        self.core.abort(request_id)
        if st is None or st.is_finished:
            return False
        logger.info("aborted %s: %s", request_id, reason)
        self._emit(st, decode_pb2.TokenChunk(
            request_id=request_id, finish_reason=common_pb2.FINISH_REASON_ABORT,
            usage=common_pb2.Usage(prompt_tokens=st.num_prompt_tokens, completion_tokens=st.num_sent_tokens),
            error=common_pb2.Error(code=code, message=f"request {request_id!r} was aborted: {reason}")))
        if not st.is_started:
            self._streams.pop(request_id, None)
        return True

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self._abort(request_id, "drain timeout")

    def _on_fatal(self, exc: BaseException) -> None:
        for st in list(self._streams.values()):
            if not st.is_finished:
                self._emit(st, decode_pb2.TokenChunk(
                    request_id=st.request_id, finish_reason=common_pb2.FINISH_REASON_ERROR,
                    error=common_pb2.Error(code=common_pb2.ERROR_CODE_INTERNAL,
                                           message=f"the decode engine failed: {exc}")))
        self._streams.clear()

    def _mode(self) -> LoopMode:
        if self.engine.scheduler.has_unfinished_requests():
            return LoopMode.COMPUTE
        return LoopMode.POLL if self.agent.num_pending_recvs else LoopMode.IDLE

    def _load(self) -> loadbalancer_pb2.LoadReport:
        manager = self.engine.kv_manager
        return loadbalancer_pb2.LoadReport(
            num_running_requests=self.engine.scheduler.num_running,
            num_waiting_requests=self.engine.scheduler.num_waiting + self.agent.num_pending_recvs,
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks_total=manager.num_blocks,
            is_healthy=self.loop.error is None,
            is_draining=self.is_draining,
        )

    def _stats(self) -> dict:
        load = self._load()
        stats = {k: v for k, v in self.agent.stats().items() if not isinstance(v, list)}
        if self.emb_agent is not None:
            stats.update(self.emb_agent.stats())
        stats.update(num_streams=len(self._streams), num_unfinished_requests=self._num_unfinished(),
                     num_kv_blocks_used=load.num_kv_blocks_used, num_kv_blocks_total=load.num_kv_blocks_total,
                     num_running_requests=load.num_running_requests)
        return stats

    # ------------------------------------------------------------------ other threads

    def _collect_load(self) -> tuple[loadbalancer_pb2.LoadReport, None]:
        if not self.loop.is_alive:
            return loadbalancer_pb2.LoadReport(is_healthy=False, is_draining=self.is_draining), None
        return self.loop.call(self._load, LOOP_CALL_TIMEOUT_S), None


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    """`deepinfer.v1.Decode` over a `DecodeWorker` (handlers never touch the core themselves)."""

    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    def Reserve(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            if w.is_draining:
                raise _Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"decode instance {w.instance_id} is draining")
            if not w.loop.is_alive:
                raise _Refused(common_pb2.ERROR_CODE_UNAVAILABLE,
                               f"decode instance {w.instance_id} is unhealthy: {w.loop.error or 'stopped'}")
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
            params = sampling_params_from_proto(request.sampling_params)
            lease_s = request.lease_ms / 1000 if request.lease_ms else w.config.kv_lease_s
            deadline = time.monotonic() + request.deadline_ms / 1000 if request.deadline_ms else None
            now_unix = time.time()
            reservation = w.loop.call(partial(w._reserve, rid, list(request.prompt_token_ids), params, lease_s,
                                              deadline, images), LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            return decode_pb2.ReserveResponse(request_id=rid, error=_Refused.of(e).to_proto())
        return decode_pb2.ReserveResponse(
            request_id=rid, agent_name=w.agent_name, agent_metadata=w.agent_metadata, agent_layout=w.agent_layout,
            block_ids=reservation.block_ids, block_size=w.block_size, transfer_id=reservation.transfer_id,
            lease_deadline_unix_ms=int((now_unix + lease_s) * 1000), state_slot=reservation.state_slot)

    def Start(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            st = w.loop.call(partial(w._attach, rid, request.transfer_id), LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            yield decode_pb2.TokenChunk(request_id=rid, finish_reason=common_pb2.FINISH_REASON_ERROR,
                                        error=_Refused.of(e).to_proto())
            return
        context.add_callback(lambda: st.is_finished or w.loop.post(partial(w._abort, rid, "start stream ended")))
        try:
            while True:
                try:
                    chunk = st.chunks.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if chunk.finish_reason:
                    chunk.usage.cached_prompt_tokens = request.num_cached_prompt_tokens
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            if not st.is_finished:  # the stream ended early (client gone): free the request
                w.loop.post(partial(w._abort, rid, "start stream ended"))

    def Abort(self, request, context):
        w = self.worker
        try:
            was_found = w.loop.call(partial(w._abort, request.request_id, request.reason or "Abort RPC"),
                                    LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the decode engine loop did not answer: {e}")
        return common_pb2.AbortResponse(was_found=was_found)

    def Health(self, request, context):
        return health_response(self.worker, context, common_pb2.STAGE_DECODE, "engine loop", LOOP_CALL_TIMEOUT_S)

    def Drain(self, request, context):
        num_unfinished = self.worker.drain(request.timeout_ms / 1000 if request.timeout_ms else None)
        return common_pb2.DrainResponse(num_unfinished_requests=num_unfinished)


def serve_decode(config: DecodeWorkerConfig) -> DecodeWorker:
    """Blocks until a decode instance serves on `config.host:port` and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached.
    """
    worker = DecodeWorker(config)
    try:
        worker.start()
    except BaseException:
        worker.stop(grace_s=0)
        raise
    return worker
