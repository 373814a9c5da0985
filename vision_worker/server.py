"""The vision instance's process shell: the `deepinfer.v1.Vision` gRPC service around a `VisionCore`.

```python
worker = serve_vision(VisionWorkerConfig(model=path, lb_address="127.0.0.1:7003", loopback_ucx=True))
print(worker.address)   # host:port, registered with the vision balancer
worker.wait()           # until Drain finished or stop()
```

Threads: gRPC handlers resolve a request's images (fetch through the allow-listed fetcher, decode,
preprocess: `engine.images.ImageResolver`, recipe's native code) on their own thread, so a slow
download never stalls encoding; one encode loop (`EngineLoop`) owns the core, the tower and the
NIXL agent and encodes images in batches across requests; a heartbeat thread reports the load
(pending image tokens) and the cached image hashes (for the balancer's image-hash affinity).

An `Encode` call: resolve (a bad image -> in-band ERROR_CODE_INVALID_REQUEST, nothing encoded) ->
`core.submit` -> wait for the `EncodeDone` -> one `ImageEmbeddings` descriptor per image. The
embeddings stay held until `Release`, `Abort` or the lease. `Health` (its trailing stats: the core's
and the NIXL counters), `Abort` and `Drain` are the shared ones of `serving.shell`; refusals map to the
wire through `serving.errors`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from concurrent.futures import Future
from functools import partial

import grpc

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.images import ImageResolver, ImageUrlPolicy, image_source
from deepinfer.kv_transfer.embeddings import EmbeddingAgent
from deepinfer.protos import common_pb2, loadbalancer_pb2, vision_pb2, vision_pb2_grpc
from deepinfer.serving.errors import Aborted, Refused, error_of
from deepinfer.serving.loop import LoopMode, call_time_remaining
from deepinfer.serving.shell import LOOP_CALL_TIMEOUT_S, ShellServicer, WorkerShell, serve_worker
from deepinfer.vision_worker.config import VisionWorkerConfig
from deepinfer.vision_worker.core import EncodeDone, VisionCore, tower_encoder, tower_image_check

VISION_REFUSALS = ((ValueError, common_pb2.ERROR_CODE_INVALID_REQUEST, "images"),)
"""This stage's rows of the refusal table (`serving.errors`): an image the core cannot take is bad input."""


def image_hash_key(content_hash: str) -> int:
    """The balancer's 64-bit key of an image content hash: its first 8 bytes, little-endian (as
    prefix-cache block hashes are), so heartbeats carry cached images like cached blocks."""
    return int.from_bytes(bytes.fromhex(content_hash[:16]), "little")


def descriptor_key(descriptor: bytes) -> int:
    """The balancer's key of an image source: SHA-256 of its `ImageRef.descriptor`, first 8 bytes,
    little-endian (what the entrypoint picks with before the content hash is known)."""
    return int.from_bytes(hashlib.sha256(bytes(descriptor)).digest()[:8], "little")


class VisionWorker(WorkerShell):
    """A running vision instance: encode loop, gRPC server and balancer membership (see `serve_vision`)."""

    stage_name = "vision"
    stage = common_pb2.STAGE_VISION
    loop_name = "encode loop"
    drain_linger_s = 0.5

    def __init__(self, config: VisionWorkerConfig) -> None:
        from deepinfer.engine.hub import resolve_model
        from deepinfer.engine.loader import load_vision_tower

        super().__init__(config)
        self.tower = load_vision_tower(resolve_model(config.model, config.revision), config.dtype, config.device)
        self.agent = EmbeddingAgent(self.agent_name, config.embedding_rows, self.tower.lm_hidden_size,
                                    self.tower.dtype, config.device, ucx_env=self.ucx_env)
        self.core = VisionCore(tower_encoder(self.tower), self.agent, max_batch_images=config.max_batch_images,
                               check_image=tower_image_check(self.tower))
        hosts = [h for h in config.image_url_allowed_hosts.split(",") if h.strip()]
        self.resolver = ImageResolver(ImageUrlPolicy(hosts), config.limits())
        # loop-thread state
        self._waiters: dict[str, Future] = {}
        self._num_resolving = 0  # Encode calls resolving images (handler threads), under _lock
        self._source_keys: dict[str, set[int]] = {}  # content hash -> descriptor keys seen for it, under _lock
        self._bind(vision_pb2_grpc.add_VisionServicer_to_server, VisionServicer(self))

    def _registration_fields(self) -> dict:
        return dict(kv_agent_name=self.agent_name)

    def _describe(self) -> str:
        return f"agent {self.agent_name}, {self.config.embedding_rows} embedding rows of {self.tower.lm_hidden_size}"

    def _close(self) -> None:
        self.agent.close()

    def _num_unfinished(self) -> int:
        return self.core.num_requests + self._num_resolving

    def _on_drain_timeout(self) -> bool:
        return False  # stop now: held embeddings end with the process

    # ------------------------------------------------------------------ loop thread

    def _step(self) -> None:
        had_pending = self.core.num_pending_image_tokens > 0
        for done in self.core.step():
            fut = self._waiters.pop(done.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(done)
        if had_pending and self.core.num_pending_image_tokens == 0 and self.reporter is not None:
            # NOTE: as the prefill worker: report the emptied queue (and the newly cached images) now
            self.reporter.report_now()

    def _mode(self) -> LoopMode:
        if self.core.has_work():
            return LoopMode.COMPUTE
        return LoopMode.POLL if self.core.num_requests else LoopMode.IDLE

    def _admit(self, request_id: str, images, lease_s: float, fut: Future, source_keys: list[int]) -> None:
        try:
            self.core.submit(request_id, images, lease_s)
        except Exception as e:
            fut.set_exception(e)
            return
        self._waiters[request_id] = fut
        with self._lock:
            for im, key in zip(images, source_keys):
                self._source_keys.setdefault(im.content_hash, set()).add(key)

    def _abort(self, request_id: str, reason: str) -> bool:
        fut = self._waiters.pop(request_id, None)
        was_found = self.core.abort(request_id)
        if fut is not None:
            self.logger.info("aborted %s: %s", request_id, reason)
            if not fut.done():
                fut.set_exception(Aborted(reason))
        return was_found

    def _on_fatal(self, exc: BaseException) -> None:
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"the vision encoder failed: {exc}"))
        self._waiters.clear()

    def _load(self) -> loadbalancer_pb2.LoadReport:
        # NOTE: vision instances report pending image tokens in num_queued_prefill_tokens (the stage's queued work)
        return loadbalancer_pb2.LoadReport(
            num_queued_prefill_tokens=self.core.num_pending_image_tokens,
            num_running_requests=self.core.num_requests, num_waiting_requests=self._num_resolving,
            is_healthy=self.loop.error is None, is_draining=self.is_draining)

    def _load_and_hashes(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int]]:
        """The load and the keys of the cached images: content-hash keys and the descriptor keys of the
        sources that resolved to them (forgotten with their entries)."""
        cached = set(self.core.cached_hashes())
        with self._lock:
            known = set(cached) | set(self.core.pending_hashes())
            self._source_keys = {h: k for h, k in self._source_keys.items() if h in known}
            source_keys = {k for h, keys in self._source_keys.items() if h in cached for k in keys}
        return self._load(), frozenset(map(image_hash_key, cached)) | source_keys

    def _stats(self) -> dict:
        stats = self.core.stats()
        stats.update(num_resolving_requests=self._num_resolving)
        return stats


class VisionServicer(ShellServicer, vision_pb2_grpc.VisionServicer):
    """`deepinfer.v1.Vision` over a `VisionWorker` (Abort, Health, Drain: `ShellServicer`)."""

    def Encode(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            w.check_accepting()
            if not rid:
                raise InvalidRequestError("request_id must be set", field="request_id")
            if not request.images:
                raise InvalidRequestError("the request has no images", field="images")
            with w._lock:
                w._num_resolving += 1
            try:
                images = w.resolver.resolve([image_source(ref.descriptor) for ref in request.images])
            finally:
                with w._lock:
                    w._num_resolving -= 1
        except (Refused, InvalidRequestError) as e:
            return _refusal(rid, e, extra=())
        lease_s = request.lease_ms / 1000 if request.lease_ms else w.config.lease_s
        fut: Future = Future()
        keys = [descriptor_key(ref.descriptor) for ref in request.images]
        task = w.loop.post(partial(w._admit, rid, images, lease_s, fut, keys))
        task.add_done_callback(lambda t: t.exception() is None or fut.done() or fut.set_exception(t.exception()))
        timeouts = [t for t in (call_time_remaining(context), request.deadline_ms / 1000 or None) if t is not None]
        try:
            done: EncodeDone = fut.result(min(timeouts) if timeouts else None)
        except concurrent.futures.TimeoutError:
            w.loop.post(partial(w._abort, rid, "deadline"))
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
                                         f"request {rid!r} was not encoded before its deadline"))
        except Exception as e:
            return _refusal(rid, e)
        if done.error:
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, done.error))
        if not context.is_active():  # the caller is gone: nobody will release the hold
            w.loop.post(partial(w._abort, rid, "encode call ended"))
        reply = vision_pb2.EncodeResponse(
            request_id=rid, lease_deadline_unix_ms=int((time.time() + done.lease_deadline - time.monotonic()) * 1000))
        for im, src, is_cached in zip(images, done.sources, done.is_cached):
            reply.embeddings.add(content_hash=im.content_hash, num_tokens=src.num_rows, agent_name=src.agent_name,
                                 agent_metadata=src.agent_metadata, addr=src.addr, num_bytes=src.num_bytes,
                                 mem_type=src.mem_type, dev_id=src.dev_id, hidden_size=src.hidden_size,
                                 dtype=src.dtype, is_cached=is_cached)
        return reply

    def Release(self, request, context):
        try:
            was_found = self.worker.loop.call(partial(self.worker.core.release, request.request_id),
                                              LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the vision encode loop did not answer: {e}")
        return vision_pb2.ReleaseResponse(was_found=was_found)


def _refusal(request_id: str, e: BaseException, extra=VISION_REFUSALS) -> vision_pb2.EncodeResponse:
    """The in-band answer of a refused or failed Encode call (`serving.errors`' table + `extra`)."""
    return vision_pb2.EncodeResponse(request_id=request_id, error=error_of(e, request_id=request_id,
                                                                           loop_name="vision encode loop", extra=extra))


def serve_vision(config: VisionWorkerConfig) -> VisionWorker:
    """Blocks until a vision instance serves on `config.host:port` and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached, and
    `CheckpointError` when the checkpoint has no vision tower.
    """
    return serve_worker(VisionWorker, config)
