"""The prefill instance's process shell: the `deepinfer.v1.Prefill` gRPC service around a `PrefillCore`.

```python
worker = serve_prefill(PrefillWorkerConfig(model=path, lb_address="127.0.0.1:7001", loopback_ucx=True))
print(worker.address)   # host:port, registered with the prefill balancer
worker.wait()           # until Drain finished or stop()
```

Threads: one engine loop (`shell.EngineLoop`) owns the core, the engine and the NIXL agent; gRPC
handlers post work to it and wait on a per-request future; a heartbeat thread reports the load to
the prefill balancer. A `Prefill` call:

1. validates the request (bad sampling params, block size, destination -> an in-band `Error`);
2. on the loop thread: connects to the decode agent if it is new (`add_peer` with the destination's
   `agent_metadata` + JSON `agent_layout`; peers are cached by name and metadata digest), then
   `core.submit` (an image prompt first READs its embeddings from the vision instance holding them,
   `PrefillCore` step 0; lost embeddings are an in-band UNAVAILABLE on field `image_embeddings`);
3. the loop's `core.step()` prefills, samples the first token and WRITEs the KV into the decode
   instance's reserved blocks; once NIXL reports the WRITE done the future resolves and the call
   answers with the first token.

A cancelled call, its deadline (`deadline_ms` or the gRPC deadline) or `Abort` aborts the request.
The WRITE never starts or runs past the destination's lease deadline minus `kv_lease_margin_s`.
`Health` reports liveness and, in the trailing metadata `deepinfer-stats-json`, the load report
and the kv_transfer counters (`KVTransferAgent.stats()`). `Drain` stops taking requests, lets those
in flight finish (or aborts them after its timeout), deregisters and stops the process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from functools import partial

import grpc

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.worker_shell import (
    Aborted,
    EngineLoop,
    LoadReporter,
    LoopMode,
    call_time_remaining,
    health_response,
)
from kv_transfer import LOOPBACK_UCX_ENV, KVTransferAgent
from kv_transfer.embeddings import EmbeddingAgent, EmbeddingSource, HolderUnreachable
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.core import ImageInput, KVDestination, NoRoomForEmbeddings, PrefillCore, PrefillDone, PrefillWork
from protos import common_pb2, loadbalancer_pb2, prefill_pb2, prefill_pb2_grpc
from protos.convert import sampling_params_from_proto

logger = logging.getLogger("prefill_worker")

LOOP_CALL_TIMEOUT_S = 5.0
"""How long Health, Abort and heartbeats wait for the engine loop before calling it stuck."""

DRAIN_LINGER_S = 0.5
"""A draining instance keeps its port open at least this long after the drain began, refusing new
requests in-band (UNAVAILABLE, which the entrypoint retries on another instance).

NOTE: a Pick the balancer answered just before the draining heartbeat reached it must not meet a
closed port: the entrypoint does not retry a Prefill call that failed at the transport (it may
have written into the decode's blocks), so the request would fail during a graceful scale-down."""


@dataclasses.dataclass
class _Waiter:
    """A Prefill call waiting for its request (loop-thread state)."""

    fut: Future
    num_prompt_tokens: int


class _Refused(Exception):
    """A request refused before it reached the core; becomes the response's in-band `Error`."""

    def __init__(self, code: int, message: str, field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.field = field


class PrefillWorker:
    """A running prefill instance: engine loop, gRPC server and balancer membership (see `serve_prefill`)."""

    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        self.instance_id = config.instance_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.agent_name = config.agent_name or self.instance_id
        self.engine = Engine(config.engine_config())
        # NOTE: the state regions are always registered, so this instance serves decode instances of
        # either bounded-state mode; each destination says whether it wants the state.
        self.agent = KVTransferAgent(self.agent_name, self.engine.cache, send_state=True,
                                     ucx_env=LOOPBACK_UCX_ENV if config.loopback_ucx else None)
        # image embeddings arrive by NIXL READ from vision instances into a buffer of our own
        self.emb_agent = None
        if self.engine.model_config.vision is not None:
            self.emb_agent = EmbeddingAgent(f"{self.agent_name}-emb", config.embedding_rows,
                                            self.engine.model_config.hidden_size,
                                            self.engine.model.model.embed_tokens.weight.dtype, config.device,
                                            ucx_env=LOOPBACK_UCX_ENV if config.loopback_ucx else None)
        self.core = PrefillCore(self.engine, self.agent, self.emb_agent)
        self.block_size = self.engine.kv_manager.block_pool.block_size
        self.num_blocks = self.engine.kv_manager.num_blocks
        # loop-thread state
        self._waiters: dict[str, _Waiter] = {}
        self._peer_digests: dict[str, bytes] = {}
        self.loop = EngineLoop("prefill_worker-loop", self._step, self._mode, on_fatal=self._on_fatal)
        self.is_draining = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._is_stopping = False
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_rpc_threads, thread_name_prefix="prefill_worker-rpc"))
        prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(self), self.server)
        self.port = self.server.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise RuntimeError(f"cannot bind the prefill server to {config.host}:{config.port}")
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self.reporter: LoadReporter | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Blocks until serving and registered with the balancer (when `lb_address` is set)."""
        self.loop.start()
        self.server.start()
        if self.config.lb_address:
            registration = loadbalancer_pb2.RegisterRequest(
                instance_id=self.instance_id, stage=common_pb2.STAGE_PREFILL, address=self.address,
                kv_agent_name=self.agent_name, kv_agent_metadata=self.agent.metadata(),
                datacenter=self.config.datacenter, block_size=self.block_size)
            self.reporter = LoadReporter(self.config.lb_address, registration, self._collect_load,
                                         interval_s=self.config.heartbeat_interval_s, logger_name="prefill_worker")
            self.reporter.start()
        logger.info("prefill instance %s serving on %s (agent %s, %d blocks of %d tokens)", self.instance_id,
                    self.address, self.agent_name, self.num_blocks, self.block_size)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the instance stopped (drained or `stop()`); False on timeout."""
        return self._stopped.wait(timeout)

    def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking requests; finish those in flight (abort them after `timeout_s`), then stop.

        Returns at once with the number of unfinished requests; `wait()` for the end.
        """
        with self._lock:
            was_draining, self.is_draining = self.is_draining, True
        num_unfinished = self.loop.call(lambda: len(self._waiters) + self.core.num_inflight, LOOP_CALL_TIMEOUT_S)
        if not was_draining:
            logger.info("draining (%d unfinished requests)", num_unfinished)
            if self.reporter is not None:
                self.reporter.report_now()
            threading.Thread(target=self._finish_drain, args=(timeout_s,), name="prefill_worker-drain",
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
        logger.info("prefill instance %s stopped", self.instance_id)
        self._stopped.set()

    def _finish_drain(self, timeout_s: float | None) -> None:
        linger_until = time.monotonic() + DRAIN_LINGER_S
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.loop.is_alive:
            try:
                left = self.loop.call(lambda: len(self._waiters) + self.core.num_inflight, LOOP_CALL_TIMEOUT_S)
            except Exception:
                break
            if not left:
                break
            if deadline is not None and time.monotonic() >= deadline:
                self.loop.call(self._abort_all, LOOP_CALL_TIMEOUT_S)
                deadline = None
            time.sleep(0.02)
        time.sleep(max(0.0, linger_until - time.monotonic()))
        self.stop()

    # ------------------------------------------------------------------ loop thread

    def _step(self) -> None:
        had_queued = self._has_queued()
        for done in self.core.step():
            waiter = self._waiters.pop(done.request_id, None)
            if waiter is not None and not waiter.fut.done():
                waiter.fut.set_result(done)
        if had_queued and self.reporter is not None and not self._has_queued():
            # NOTE: the last prefill still to compute just finished here: report now. Until the next
            # heartbeat the balancer would keep the queued tokens of a report taken mid-prefill (or of
            # its own picks) and send this cache's prefix hits elsewhere.
            self.reporter.report_now()

    def _queued(self):
        """The waiters whose prefill is not computed yet. A request whose KV is being written to decode
        is no queued work: a slow (cross-datacenter) link must not make an idle instance look busy."""
        return (w for rid, w in self._waiters.items() if not self.core.is_sending(rid))

    def _has_queued(self) -> bool:
        """Per loop step: stops at the first queued waiter."""
        return next(self._queued(), None) is not None

    def _num_queued_tokens(self) -> int:
        return sum(w.num_prompt_tokens for w in self._queued())

    def _mode(self) -> LoopMode:
        if self.engine.has_unfinished_requests():
            return LoopMode.COMPUTE
        return LoopMode.POLL if (self.core.num_inflight or self.core.num_reading or self.agent.num_inflight_sends) \
            else LoopMode.IDLE

    def _admit(self, work: PrefillWork, metadata: bytes, layout: bytes, fut: Future) -> None:
        try:
            peer = work.destination.peer
            if metadata:
                digest = hashlib.sha256(metadata + b"\0" + layout).digest()
                if self._peer_digests.get(peer) != digest:
                    try:
                        regions = json.loads(layout) if layout else {}
                    except ValueError as e:
                        raise _Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"destination.agent_layout is not JSON: "
                                       f"{e}", "destination.agent_layout") from None
                    try:
                        self.agent.add_peer(peer, metadata, regions)
                    except ValueError as e:
                        raise _Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"cannot connect to decode agent "
                                       f"{peer!r}: {e}", "destination") from None
                    self._peer_digests[peer] = digest
                    logger.info("connected to decode agent %s", peer)
            elif peer not in self._peer_digests:
                raise _Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"decode agent {peer!r} is unknown here and the "
                               "destination carries no agent_metadata to connect to it", "destination.agent_metadata")
            if work.request_id in self._waiters:
                raise InvalidRequestError(f"request id {work.request_id!r} is already being prefilled here",
                                          field="request_id")
            self.core.submit(work)
        except Exception as e:
            fut.set_exception(e)
            return
        self._waiters[work.request_id] = _Waiter(fut, len(work.prompt_token_ids))

    def _abort(self, request_id: str, reason: str) -> bool:
        waiter = self._waiters.pop(request_id, None)
        self.core.abort(request_id)
        if waiter is not None:
            logger.info("aborted %s: %s", request_id, reason)
            if not waiter.fut.done():
                waiter.fut.set_exception(Aborted(reason))
        return waiter is not None

    def _abort_all(self) -> None:
        for request_id in list(self._waiters):
            self._abort(request_id, "drain timeout")

    def _on_fatal(self, exc: BaseException) -> None:
        for waiter in self._waiters.values():
            if not waiter.fut.done():
                waiter.fut.set_exception(RuntimeError(f"the prefill engine failed: {exc}"))
        self._waiters.clear()

    def _load(self) -> loadbalancer_pb2.LoadReport:
        manager = self.engine.kv_manager
        return loadbalancer_pb2.LoadReport(
            num_queued_prefill_tokens=self._num_queued_tokens(),
            num_running_requests=self.engine.scheduler.num_running,
            num_waiting_requests=self.engine.scheduler.num_waiting,
            num_kv_blocks_used=manager.num_blocks - manager.num_free_blocks,
            num_kv_blocks_total=manager.num_blocks,
            is_healthy=self.loop.error is None,
            is_draining=self.is_draining,
        )

    def _load_and_hashes(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int]]:
        pool = self.engine.kv_manager.block_pool
        hashes = frozenset(h for h in map(pool.block_hash, range(pool.num_blocks)) if h is not None)
        return self._load(), hashes

    def _stats(self) -> dict:
        load = self._load()
        stats = {k: v for k, v in self.agent.stats().items() if not isinstance(v, list)}
        if self.emb_agent is not None:
            stats.update(self.emb_agent.stats())
        stats.update(num_inflight_requests=self.core.num_inflight, num_kv_blocks_used=load.num_kv_blocks_used,
                     num_kv_blocks_total=load.num_kv_blocks_total,
                     num_queued_prefill_tokens=load.num_queued_prefill_tokens, num_peers=len(self._peer_digests))
        return stats

    # ------------------------------------------------------------------ other threads

    def _collect_load(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int] | None]:
        if not self.loop.is_alive:
            return loadbalancer_pb2.LoadReport(is_healthy=False, is_draining=self.is_draining), None
        return self.loop.call(self._load_and_hashes, LOOP_CALL_TIMEOUT_S)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """`deepinfer.v1.Prefill` over a `PrefillWorker` (handlers never touch the core themselves)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def Prefill(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            work, metadata, layout = self._work(request)
        except (_Refused, InvalidRequestError) as e:
            return _refusal(rid, e)
        fut: Future = Future()
        task = w.loop.post(partial(w._admit, work, metadata, layout, fut))
        task.add_done_callback(lambda t: t.exception() is None or fut.done() or fut.set_exception(t.exception()))
        context.add_callback(lambda: fut.done() or w.loop.post(partial(w._abort, rid, "prefill call ended")))
        timeouts = [t for t in (call_time_remaining(context), request.deadline_ms / 1000 or None) if t is not None]
        try:
            done: PrefillDone = fut.result(min(timeouts) if timeouts else None)
        except concurrent.futures.TimeoutError:
            w.loop.post(partial(w._abort, rid, "deadline"))
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
                                          f"request {rid!r} did not finish its prefill before its deadline"))
        except Aborted as e:
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_ABORTED, f"request {rid!r} was aborted: {e}"))
        except (_Refused, InvalidRequestError) as e:
            return _refusal(rid, e)
        except HolderUnreachable as e:  # retryable: the entrypoint encodes the images again elsewhere
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_UNAVAILABLE, str(e), "image_embeddings"))
        except NoRoomForEmbeddings as e:
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, str(e)))
        except Exception as e:
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_INTERNAL, str(e)))
        if done.is_images_lost:  # retryable: the entrypoint encodes the images again elsewhere
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_UNAVAILABLE, done.error, "image_embeddings"))
        if done.error:
            return _refusal(rid, _Refused(common_pb2.ERROR_CODE_INTERNAL, done.error))
        return prefill_pb2.PrefillResponse(
            request_id=rid, first_token_id=done.first_token_id, num_kv_tokens=done.num_kv_tokens,
            num_cached_prompt_tokens=done.num_cached_tokens, transfer_id=work.destination.transfer_id)

    def _work(self, request) -> tuple[PrefillWork, bytes, bytes]:
        w = self.worker
        if w.is_draining:
            raise _Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"prefill instance {w.instance_id} is draining")
        if not w.loop.is_alive:
            raise _Refused(common_pb2.ERROR_CODE_UNAVAILABLE,
                           f"prefill instance {w.instance_id} is unhealthy: {w.loop.error or 'stopped'}")
        if not request.request_id:
            raise InvalidRequestError("request_id must be set", field="request_id")
        images = _image_inputs(request, len(request.prompt_token_ids)) if request.images else []
        if images and w.emb_agent is None:
            raise InvalidRequestError("this prefill instance's model has no vision tower; it cannot take images",
                                      field="images")
        params = sampling_params_from_proto(request.sampling_params)
        dest = request.destination
        if not (dest.agent_name and dest.block_ids and dest.transfer_id):
            raise InvalidRequestError("destination needs agent_name, block_ids and transfer_id (from Decode.Reserve)",
                                      field="destination")
        if dest.block_size != w.block_size:
            raise InvalidRequestError(
                f"destination block_size {dest.block_size} differs from this instance's {w.block_size}; run prefill "
                "and decode with the same model and cache config", field="destination.block_size")
        if request.num_kv_tokens and request.num_kv_tokens != len(request.prompt_token_ids):
            raise InvalidRequestError("num_kv_tokens must equal the prompt length", field="num_kv_tokens")
        lease_s, send_deadline = 30.0, None
        if dest.lease_deadline_unix_ms:
            lease_s = dest.lease_deadline_unix_ms / 1000 - time.time() - w.config.kv_lease_margin_s
            if lease_s <= 0:
                raise _Refused(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
                               "the decode reservation's lease has (almost) run out; reserve again")
            send_deadline = time.monotonic() + lease_s
        destination = KVDestination(dest.agent_name, list(dest.block_ids), dest.transfer_id, lease_s, send_deadline,
                                    dest.state_slot if dest.HasField("state_slot") else None)
        work = PrefillWork(request.request_id, list(request.prompt_token_ids), params, destination, images)
        return work, bytes(dest.agent_metadata), bytes(dest.agent_layout)

    def Abort(self, request, context):
        try:
            was_found = self.worker.loop.call(partial(self.worker._abort, request.request_id,
                                                      request.reason or "Abort RPC"), LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the prefill engine loop did not answer: {e}")
        return common_pb2.AbortResponse(was_found=was_found)

    def Health(self, request, context):
        return health_response(self.worker, context, common_pb2.STAGE_PREFILL, "engine loop", LOOP_CALL_TIMEOUT_S)

    def Drain(self, request, context):
        num_unfinished = self.worker.drain(request.timeout_ms / 1000 if request.timeout_ms else None)
        return common_pb2.DrainResponse(num_unfinished_requests=num_unfinished)


def _image_inputs(request, num_prompt_tokens: int) -> list[ImageInput]:
    """The request's images with their embeddings' sources; InvalidRequestError when they do not pair up."""
    if len(request.image_embeddings) != len(request.images):
        raise InvalidRequestError(f"{len(request.images)} images but {len(request.image_embeddings)} image_embeddings; "
                                  "encode every image on the vision stage first", field="image_embeddings")
    out = []
    for i, (ref, emb) in enumerate(zip(request.images, request.image_embeddings)):
        if emb.num_tokens != ref.num_tokens or ref.offset + ref.num_tokens > num_prompt_tokens or not emb.num_bytes:
            raise InvalidRequestError(f"image {i}: span [{ref.offset}, {ref.offset + ref.num_tokens}) and its "
                                      f"{emb.num_tokens} embedding rows do not fit the prompt", field="images")
        source = EmbeddingSource(emb.agent_name, bytes(emb.agent_metadata), emb.addr, emb.num_bytes, emb.num_tokens,
                                 emb.hidden_size, emb.dtype, emb.mem_type or "DRAM", emb.dev_id)
        out.append(ImageInput(ref.offset, ref.num_tokens, ref.content_hash or emb.content_hash, source))
    return out


def _refusal(request_id: str, e: _Refused | InvalidRequestError) -> prefill_pb2.PrefillResponse:
    if isinstance(e, InvalidRequestError):
        error = common_pb2.Error(code=common_pb2.ERROR_CODE_INVALID_REQUEST, message=str(e), field=e.field or "")
    else:
        error = common_pb2.Error(code=e.code, message=str(e), field=e.field)
    return prefill_pb2.PrefillResponse(request_id=request_id, error=error)


def serve_prefill(config: PrefillWorkerConfig) -> PrefillWorker:
    """Blocks until a prefill instance serves on `config.host:port` and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached.
    """
    worker = PrefillWorker(config)
    try:
        worker.start()
    except BaseException:
        worker.stop(grace_s=0)
        raise
    return worker
