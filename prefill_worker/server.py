"""The prefill instance's process shell: the `deepinfer.v1.Prefill` gRPC service around a `PrefillCore`.

```python
worker = serve_prefill(PrefillWorkerConfig(model=path, lb_address="127.0.0.1:7001", loopback_ucx=True))
print(worker.address)   # host:port, registered with the prefill balancer
worker.wait()           # until Drain finished or stop()
```

Threads: one engine loop (`serving.loop.EngineLoop`) owns the core, the engine and the NIXL agent; gRPC
handlers post work to it and wait on a per-request future; a heartbeat thread reports the load to
the prefill balancer. A `Prefill` call:

1. validates the request (bad sampling params, block size, destination -> an in-band `Error`);
2. on the loop thread: connects to the decode agent if it is new (`add_peer` with the destination's
   `agent_metadata` + `agent_layout`, a serialized `KVLayout`; peers are cached by name and metadata digest), then
   `core.submit` (an image prompt first READs its embeddings from the vision instance holding them,
   `PrefillCore` step 0; lost embeddings are an in-band UNAVAILABLE on field `image_embeddings`);
3. the loop's `core.step()` prefills, samples the first token and WRITEs the KV into the decode
   instance's reserved blocks; once NIXL reports the WRITE done the future resolves and the call
   answers with the first token.

A cancelled call, its deadline (`deadline_ms` or the gRPC deadline) or `Abort` aborts the request.
The WRITE never starts or runs past the destination's lease deadline minus `kv_lease_margin_s`.
`Health`, `Abort` and `Drain` are the shared ones of `serving.shell` (`Health`'s trailing stats carry
the load report and the kv_transfer counters, `KVTransferAgent.stats()`); refusals map to the wire
through `serving.errors`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import time
from concurrent.futures import Future
from functools import partial

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.scheduler import check_num_original_prompt_tokens
from deepinfer.kv_transfer.agent import layout_from_wire
from deepinfer.kv_transfer.embeddings import EmbeddingSource, HolderUnreachable
from deepinfer.prefill_worker.config import PrefillWorkerConfig
from deepinfer.prefill_worker.core import (
    ImageInput,
    KVDestination,
    NoRoomForEmbeddings,
    PrefillCore,
    PrefillDone,
    PrefillWork,
    StillSending,
)
from deepinfer.protos import common_pb2, loadbalancer_pb2, prefill_pb2, prefill_pb2_grpc
from deepinfer.protos.convert import sampling_params_from_proto, token_logprobs_to_proto
from deepinfer.serving.admission import AdmissionLimit
from deepinfer.serving.errors import Aborted, Refused, error_of
from deepinfer.serving.loop import LoopMode, call_time_remaining
from deepinfer.serving.shell import EngineShell, ShellServicer, serve_worker

PREFILL_REFUSALS = (
    (HolderUnreachable, common_pb2.ERROR_CODE_UNAVAILABLE, "image_embeddings"),  # retryable: encode again elsewhere
    (NoRoomForEmbeddings, common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, ""),
    (StillSending, common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED, "request_id"),  # retryable: another instance or later
)
"""This stage's rows of the refusal table (`serving.errors`), checked before the shared ones."""


TRAFFIC_CLASS_METADATA_KEY = "deepinfer-traffic-class"
"""gRPC metadata key of a Prefill call naming the request's KV store traffic class (agent, chat, ...)."""


@dataclasses.dataclass
class _Waiter:
    """A Prefill call waiting for its request (loop-thread state)."""

    fut: Future
    num_prompt_tokens: int


class PrefillWorker(EngineShell):
    """A running prefill instance: engine loop, gRPC server and balancer membership (see `serve_prefill`)."""

    stage_name = "prefill"
    stage = common_pb2.STAGE_PREFILL
    drain_linger_s = 0.5
    # NOTE: the entrypoint does not retry a Prefill call that failed at the transport (it may have
    # written into the decode's blocks), so a Pick answered just before the draining heartbeat must
    # meet an open port (an in-band UNAVAILABLE is retried) during a graceful scale-down.

    def __init__(self, config: PrefillWorkerConfig) -> None:
        # NOTE: the state regions are always registered, so this instance serves decode instances of
        # either bounded-state mode; each destination says whether it wants the state. Image embeddings
        # arrive by NIXL READ from vision instances into a buffer of our own (`emb_agent`).
        super().__init__(config, send_state=True)
        self.kv_store = _open_kv_store(config, self.logger)
        self.core = PrefillCore(self.engine, self.agent, self.emb_agent, store=self.kv_store)
        # loop-thread state
        self._waiters: dict[str, _Waiter] = {}
        self._peer_digests: dict[str, bytes] = {}
        self.admission = AdmissionLimit(config.max_queued_requests, self.stage_name, self.instance_id)
        self._bind(prefill_pb2_grpc.add_PrefillServicer_to_server, PrefillServicer(self))

    # ------------------------------------------------------------------ loop thread

    def _num_unfinished(self) -> int:
        return len(self._waiters) + self.core.num_inflight

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

    def _close(self) -> None:
        super()._close()
        if self.kv_store is not None:
            self.kv_store.close()  # bounded wait for queued writes

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
                        regions = layout_from_wire(layout)  # a serialized deepinfer.v1.KVLayout
                    except Exception as e:
                        raise Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"destination.agent_layout is not a "
                                      f"KVLayout: {e}", "destination.agent_layout") from None
                    try:
                        self.agent.add_peer(peer, metadata, regions)
                    except ValueError as e:
                        raise Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"cannot connect to decode agent "
                                      f"{peer!r}: {e}", "destination") from None
                    except Exception as e:  # NIXL / UCX cannot reach it (e.g. NIXL_ERR_BACKEND "destination is
                        # unreachable": the decode died, maybe right after a restart): the entrypoint migrates
                        raise Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"cannot reach decode agent {peer!r}: "
                                      f"{type(e).__name__}: {e}", "destination") from None
                    self._peer_digests[peer] = digest
                    self.logger.info("connected to decode agent %s", peer)
            elif peer not in self._peer_digests:
                raise Refused(common_pb2.ERROR_CODE_INVALID_REQUEST, f"decode agent {peer!r} is unknown here and the "
                              "destination carries no agent_metadata to connect to it", "destination.agent_metadata")
            if work.request_id in self._waiters:
                raise InvalidRequestError(f"request id {work.request_id!r} is already being prefilled here",
                                          field="request_id")
            queued = [w.num_prompt_tokens for w in self._queued()]
            self.admission.check(len(queued), sum(queued))  # bounded queue: RESOURCE_EXHAUSTED past it
            self.core.submit(work)
        except Exception as e:
            fut.set_exception(e)
            return
        self._waiters[work.request_id] = _Waiter(fut, len(work.prompt_token_ids))

    def _abort(self, request_id: str, reason: str) -> bool:
        waiter = self._waiters.pop(request_id, None)
        self.core.abort(request_id)
        if waiter is not None:
            self.logger.info("aborted %s: %s", request_id, reason)
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
        return self._kv_load(num_queued_prefill_tokens=sum(w.num_prompt_tokens for w in self._queued()),
                             num_waiting_requests=self.engine.num_waiting_requests)

    def _load_and_hashes(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int]]:
        return self._load(), self.engine.cached_block_hashes()

    def _stats(self) -> dict:
        load = self._load()
        stats = self._transfer_stats()
        stats.update(num_inflight_requests=self.core.num_inflight, num_kv_blocks_used=load.num_kv_blocks_used,
                     num_kv_blocks_total=load.num_kv_blocks_total,
                     num_queued_prefill_tokens=load.num_queued_prefill_tokens, num_peers=len(self._peer_digests))
        if self.kv_store is not None:
            stats.update(self.kv_store.health_stats())  # incl. per-class figures (the HTTP front's /metrics)
        return stats


class PrefillServicer(ShellServicer, prefill_pb2_grpc.PrefillServicer):
    """`deepinfer.v1.Prefill` over a `PrefillWorker` (Abort, Health, Drain: `ShellServicer`)."""

    def Prefill(self, request, context):
        w = self.worker
        rid = request.request_id
        try:
            work, metadata, layout = self._work(request)
        except (Refused, InvalidRequestError) as e:
            return _refusal(rid, e)
        # the KV store's traffic class (TTL): PrefillRequest.kv_traffic_class (else the older call metadata)
        work.traffic_class = (request.kv_traffic_class
                              or dict(context.invocation_metadata() or ()).get(TRAFFIC_CLASS_METADATA_KEY) or None)
        fut: Future = Future()
        task = w.loop.post(partial(w._admit, work, metadata, layout, fut))
        task.add_done_callback(lambda t: t.exception() is None or fut.done() or fut.set_exception(t.exception()))
        context.add_callback(lambda: fut.done() or w.loop.post(partial(w._abort, rid, "prefill call ended")))
        timeouts = [t for t in (call_time_remaining(context), request.deadline_ms / 1000 or None) if t is not None]
        try:
            done: PrefillDone = fut.result(min(timeouts) if timeouts else None)
        except concurrent.futures.TimeoutError:
            w.loop.post(partial(w._abort, rid, "deadline"))
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
                                         f"request {rid!r} did not finish its prefill before its deadline"))
        except Exception as e:
            return _refusal(rid, e)
        if done.is_images_lost:  # retryable: the entrypoint encodes the images again elsewhere
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_UNAVAILABLE, done.error, "image_embeddings"))
        if done.is_destination_lost:  # retryable: the entrypoint migrates the request to another decode
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_UNAVAILABLE, done.error, "destination"))
        if done.error:
            return _refusal(rid, Refused(common_pb2.ERROR_CODE_INTERNAL, done.error))
        return prefill_pb2.PrefillResponse(
            request_id=rid, first_token_id=done.first_token_id, num_kv_tokens=done.num_kv_tokens,
            first_token_logprobs=(token_logprobs_to_proto(done.first_token_logprobs)
                                  if done.first_token_logprobs is not None else None),
            num_cached_prompt_tokens=done.num_cached_tokens, transfer_id=work.destination.transfer_id)

    def _work(self, request) -> tuple[PrefillWork, bytes, bytes]:
        w = self.worker
        w.check_accepting()
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
                raise Refused(common_pb2.ERROR_CODE_DEADLINE_EXCEEDED,
                              "the decode reservation's lease has (almost) run out; reserve again")
            send_deadline = time.monotonic() + lease_s
        destination = KVDestination(dest.agent_name, list(dest.block_ids), dest.transfer_id, lease_s, send_deadline,
                                    dest.state_slot if dest.HasField("state_slot") else None)
        num_original = request.num_original_prompt_tokens if request.HasField("num_original_prompt_tokens") else None
        check_num_original_prompt_tokens(num_original, len(request.prompt_token_ids))
        work = PrefillWork(request.request_id, list(request.prompt_token_ids), params, destination, images,
                           num_original_prompt_tokens=num_original)
        return work, bytes(dest.agent_metadata), bytes(dest.agent_layout)


def _open_kv_store(config: PrefillWorkerConfig, logger):
    """The configured persistent KV store, or None (off, or it cannot be opened: logged, served without it)."""
    store_config = config.kv_store_config()
    if store_config is None:
        return None
    from deepinfer.kvstore import open_store

    try:
        return open_store(store_config)
    except Exception as e:  # a store that is down costs hits, never the instance
        logger.error("the %s KV store cannot be opened (serving without it): %s", store_config.backend, e)
        return None


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


def _refusal(request_id: str, e: BaseException) -> prefill_pb2.PrefillResponse:
    """The in-band answer of a refused or failed Prefill call (`serving.errors`' table + PREFILL_REFUSALS)."""
    return prefill_pb2.PrefillResponse(request_id=request_id,
                                       error=error_of(e, request_id=request_id, extra=PREFILL_REFUSALS))


def serve_prefill(config: PrefillWorkerConfig) -> PrefillWorker:
    """Blocks until a prefill instance serves on `config.host:port` and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached.
    """
    return serve_worker(PrefillWorker, config)
