"""The prefill instance's pure core: prefill, sample the first token, push the KV to decode.

No sockets: the gRPC shell (`server.py`) feeds `submit` and drains `step()`'s events. One
request's life here:

0. A prompt with images first READs each image's embeddings from its vision instance's registered
   memory into rows of this instance's `EmbeddingAgent` (`kv_transfer.embeddings`; transfer id
   `{request_id}/{i}`, the id the vision instance expects); once all READs are done the rows are
   copied out and freed, and the request goes on as below with `ImageSpan(embeds=...)`s. A failed
   READ fails the request before any compute.
1. `submit(PrefillWork)`: the destination is registered with the engine's KV connector
   (`kv_transfer.PDConnector.expect_save`) and the engine queues the prompt with `max_tokens=1`.
2. `step()` runs engine steps; when the first token is sampled the engine pins the prompt's
   blocks (and its bounded-state slot when the destination names one) past the request's end and
   the connector posts one NIXL WRITE of them into the decode instance's reserved blocks, the
   notification carrying the first token (`KVTransferNotice`, the one channel for it).
3. When the connector reports the WRITE finished (or failed, or its lease ran out) the engine
   drops the pin and a `PrefillDone` event (with the first token, or an error) is returned.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from deepinfer.engine.engine import Engine
from deepinfer.engine.kv_connector.store_connector import StoreConnector
from deepinfer.engine.sampling import SamplingParams
from deepinfer.kv_transfer import KVTransferAgent
from deepinfer.kv_transfer.embeddings import EmbeddingAgent, EmbeddingSource
from deepinfer.kv_transfer.pd_connector import KVDestination, PDConnector
from deepinfer.kvstore import KVStore

__all__ = ["ImageInput", "KVDestination", "NoRoomForEmbeddings", "PrefillCore", "PrefillDone", "PrefillWork",
           "StillSending"]


class NoRoomForEmbeddings(ValueError):
    """The embedding buffer has no free run of rows for an image right now (retry later or elsewhere)."""


class StillSending(ValueError):
    """A request id arrived again while this instance still holds an earlier attempt of it: an aborted attempt
    whose KV WRITE is still in flight (`abort` keeps it until the connector reports the send). The new attempt
    may succeed on another instance, or here once the send is reported (retryable, not an internal error; seen
    in the chaos test: a retry reached the same prefill right after the entrypoint gave up on the first try)."""


@dataclass
class ImageInput:
    """One image of the prompt: its span in the prompt ids and where its embeddings wait."""

    offset: int
    """Position of its first image token."""
    num_tokens: int
    """Image tokens (= embedding rows)."""
    content_hash: str
    """Hex content hash (keys the prefix hash of the blocks it covers)."""
    source: EmbeddingSource
    """The vision instance's rows holding its embeddings."""


@dataclass
class PrefillWork:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    destination: KVDestination
    images: list[ImageInput] = field(default_factory=list)
    traffic_class: str | None = None
    """The KV store's traffic class (its TTL: agent, chat, ...); None = the store's default class."""
    num_original_prompt_tokens: int | None = None
    """A continuation's original prompt length (`Engine.add_request`'s; the decode side gets the same), else None."""


@dataclass
class PrefillDone:
    """The outcome of one request on this instance."""

    request_id: str
    first_token_id: int | None = None
    num_cached_tokens: int = 0
    num_kv_tokens: int = 0
    num_bytes: int = 0
    error: str | None = None
    is_images_lost: bool = False
    """The error is a failed READ of image embeddings (their vision instance is gone or its hold
    ended): nothing was computed or written, so the request may be encoded again and retried."""
    is_destination_lost: bool = False
    """The error is a failed WRITE of the KV to the decode reservation (its instance died, or the lease
    ran out): the entrypoint moves the request to another decode instance (`entrypoint.migration`)."""
    first_token_logprobs: object | None = None
    """The engine's `TokenLogprobs` of the first token when the request asked for logprobs."""


@dataclass
class _Reading:
    """A request whose image embeddings are being READ (not yet in the engine)."""

    work: PrefillWork
    starts: list[int | None]
    """Local first row per image (None: its READ reported and its rows were freed)."""
    pending: set[str]
    error: str | None = None
    is_aborted: bool = False


@dataclass
class _Inflight:
    work: PrefillWork
    first_token_id: int | None = None
    num_cached_tokens: int = 0
    first_token_logprobs: object | None = None


class PrefillCore:
    """Engine + KV transfer agent of one prefill instance (rank 0 of its group): protocol glue around
    the engine's KV connector (`kv_transfer.PDConnector`), which does the sending."""

    def __init__(self, engine: Engine, agent: KVTransferAgent, emb_agent: EmbeddingAgent | None = None,
                 store: KVStore | None = None) -> None:
        """`store`: the persistent KV store (`kvstore`); its connector runs beside the P/D one: a local prefix
        miss loads the longest stored prefix, and each computed prompt's full blocks are written to it."""
        self.engine = engine
        self.agent = agent
        self.emb_agent = emb_agent
        self.connector = PDConnector(agent)
        if store is not None and engine.config.expert_parallel_size > 1:
            # NOTE: the store connector addresses one pool; a multi-rank instance's KV lives in per-rank pools
            # (`KVConnector.serves_ranks`): served without the store rather than refused
            logging.getLogger("deepinfer.kvstore").warning(
                "prefill instance with expert_parallel_size=%d: the KV store is not used (per-rank KV pools)",
                engine.config.expert_parallel_size)
            store = None
        self.store_connector = (StoreConnector.for_engine(engine, store, primary=self.connector) if store is not None
                                else None)
        engine.set_kv_connector(self.store_connector or self.connector)
        self._reqs: dict[str, _Inflight] = {}
        self._num_bytes: dict[str, int] = {}  # bytes each posted WRITE moves, by request id
        self._reading: dict[str, _Reading] = {}
        self._by_read: dict[str, tuple[str, int]] = {}  # read transfer id -> (request id, image index)

    def submit(self, work: PrefillWork) -> None:
        """Queue a prefill; raises InvalidRequestError before any compute on bad input, ValueError when
        the images' embeddings cannot be read (no embedding agent, no room, unknown holder)."""
        if work.images:
            self._start_reads(work)
            return
        self._add(work)

    def _start_reads(self, work: PrefillWork) -> None:
        emb = self.emb_agent
        if emb is None:
            raise ValueError("this prefill instance has no embedding agent (its model has no vision tower)")
        rid = work.request_id
        if rid in self._reading or rid in self._reqs:
            raise StillSending(f"request id {rid!r} is already being prefilled here (an earlier attempt)")
        reading = _Reading(work, [], set())
        try:
            for i, image in enumerate(work.images):
                start = emb.allocator.alloc(image.num_tokens)
                if start is None:
                    raise NoRoomForEmbeddings(
                        f"no room for {image.num_tokens} embedding rows of image {i} ({emb.allocator.num_free_rows} "
                        f"of {emb.allocator.num_rows} free); retry later, or start prefill with more --embedding-rows")
                reading.starts.append(start)
                emb.connect(image.source.agent_name, image.source.agent_metadata)
                tid = f"{rid}/{i}"
                emb.read(tid, image.source, start)
                reading.pending.add(tid)
                self._by_read[tid] = (rid, i)
        except Exception:
            for i, start in enumerate(reading.starts):  # rows of READs not posted are free at once
                if f"{rid}/{i}" not in reading.pending and start is not None:
                    emb.allocator.free(start, work.images[i].num_tokens)
                    reading.starts[i] = None
            if reading.pending:
                reading.is_aborted = True
                self._reading[rid] = reading
            raise
        self._reading[rid] = reading

    def _add(self, work: PrefillWork, spans=None) -> None:
        params = replace(work.params, max_tokens=1, min_tokens=0, n=1)
        if work.request_id in self._reqs:
            raise StillSending(f"request id {work.request_id!r}: an earlier attempt of it is still sending its KV "
                               "from this instance; retry elsewhere or once that send is reported")
        self.connector.expect_save(work.request_id, work.destination)
        if self.store_connector is not None:
            self.store_connector.set_traffic_class(work.request_id, work.traffic_class)
        try:
            self.engine.add_request(work.request_id, {"prompt_token_ids": work.prompt_token_ids}, params,
                                    num_original_prompt_tokens=work.num_original_prompt_tokens,
                                    **({"images": spans} if spans else {}))
        except BaseException:
            self.connector.forget_save(work.request_id)
            raise
        self._reqs[work.request_id] = _Inflight(work)

    def _poll_reads(self) -> list[PrefillDone]:
        """READ progress: requests whose embeddings all arrived go to the engine; failures end them."""
        done: list[PrefillDone] = []
        emb = self.emb_agent
        ev = emb.poll()
        for tid, is_ok in [(t, True) for t in ev.done_ids] + [(t, False) for t in ev.failed_ids]:
            rid, i = self._by_read.pop(tid, (None, 0))
            reading = self._reading.get(rid)
            if reading is None:
                continue
            reading.pending.discard(tid)
            if not is_ok and reading.error is None:
                reading.error = (f"reading the embeddings of image {i} from vision agent "
                                 f"{reading.work.images[i].source.agent_name!r} failed")
            if reading.pending:
                continue
            del self._reading[rid]
            work = reading.work
            spans = None
            if reading.error is None and not reading.is_aborted:
                from deepinfer.engine.multimodal import ImageSpan

                spans = [ImageSpan(im.offset, im.num_tokens, im.content_hash,
                                   embeds=emb.rows(start, im.num_tokens).clone())
                         for im, start in zip(work.images, reading.starts)]
            for im, start in zip(work.images, reading.starts):
                if start is not None:
                    emb.allocator.free(start, im.num_tokens)
            if reading.is_aborted:
                continue
            if reading.error is not None:
                done.append(PrefillDone(rid, error=reading.error, is_images_lost=True))
                continue
            try:
                self._add(work, spans)
            except Exception as e:
                done.append(PrefillDone(rid, error=f"the prompt with its images was refused: {e}"))
        return done

    @property
    def num_reading(self) -> int:
        """Requests whose image embeddings are still being read."""
        return len(self._reading)

    def abort(self, request_id: str) -> None:
        """Forget a request; its blocks are released (a WRITE in flight finishes or fails first)."""
        reading = self._reading.get(request_id)
        if reading is not None:
            reading.is_aborted = True  # its rows are freed once its READs reported
            return
        if self.connector.is_saving(request_id):
            return  # the connector reports the send; the pin is dropped then
        self._reqs.pop(request_id, None)
        self.engine.abort_request(request_id)
        self.connector.forget_save(request_id)

    def is_sending(self, request_id: str) -> bool:
        """Whether the request's prefill is computed and its KV is on its way to decode (the WRITE
        posted, its completion not yet reported)."""
        return request_id in self._reqs and self.connector.is_saving(request_id)

    @property
    def num_inflight(self) -> int:
        return len(self._reqs) + sum(not r.is_aborted for r in self._reading.values())

    def step(self) -> list[PrefillDone]:
        """Transfer progress, then one engine step; returns the requests that are done here."""
        done: list[PrefillDone] = self._poll_reads() if self._reading else []
        res = self.engine.poll_kv_connector()  # finished sends drop their pins in the engine
        for rid in res.saved:
            inflight = self._reqs.get(rid)
            if inflight is not None:
                done.append(PrefillDone(rid, inflight.first_token_id, inflight.num_cached_tokens,
                                        len(inflight.work.prompt_token_ids), self._num_bytes.pop(rid, 0),
                                        first_token_logprobs=inflight.first_token_logprobs))
                self._finish(rid)
        for rid, error in res.save_failed.items():
            self._num_bytes.pop(rid, None)
            if rid in self._reqs:
                done.append(PrefillDone(rid, error=error, is_destination_lost=True))
                self._finish(rid)
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                inflight = self._reqs.get(out.request_id)
                if inflight is None:
                    continue
                if out.error:
                    done.append(PrefillDone(out.request_id, error=out.error))
                    self._finish(out.request_id)
                    continue
                if out.outputs[0].token_ids and inflight.first_token_id is None:
                    # the engine pinned the prompt's blocks and the connector posted the WRITE
                    inflight.first_token_id = out.outputs[0].token_ids[0]
                    inflight.first_token_logprobs = (out.outputs[0].logprobs or [None])[0]
                    inflight.num_cached_tokens = out.num_cached_tokens
                    self._num_bytes[out.request_id] = self.connector.num_bytes_sent(out.request_id)
        return done

    def _finish(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.engine.abort_request(request_id)
        self.connector.forget_save(request_id)
