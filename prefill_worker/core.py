"""The prefill instance's pure core: prefill, sample the first token, push the KV to decode.

No sockets: the gRPC shell (`server.py`) feeds `submit` and drains `step()`'s events. One
request's life here:

0. A prompt with images first READs each image's embeddings from its vision instance's registered
   memory into rows of this instance's `EmbeddingAgent` (`kv_transfer.embeddings`; transfer id
   `{request_id}/{i}`, the id the vision instance expects); once all READs are done the rows are
   copied out and freed, and the request goes on as below with `ImageSpan(embeds=...)`s. A failed
   READ fails the request before any compute.
1. `submit(PrefillWork)`: the engine queues the prompt with `max_tokens=1` and `hold_kv=True`
   (plus `hold_state=True` when the destination names a state slot).
2. `step()` runs engine steps; when the first token is sampled the request finishes in the engine
   but its blocks stay held, and the core posts one NIXL WRITE of those blocks into the decode
   instance's reserved blocks (`KVTransferAgent.send_blocks`), and the bounded state into its
   reserved slot when it named one, the notification carrying the first token.
3. When the agent reports the WRITE finished (or failed, or its lease ran out) the hold is dropped
   and a `PrefillDone` event (with the first token, or an error) is returned.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace

from engine.engine import Engine
from engine.sampling import SamplingParams
from kv_transfer import KVTransferAgent
from kv_transfer.embeddings import EmbeddingAgent, EmbeddingSource


@dataclass
class KVDestination:
    """Where the decode instance wants the KV."""

    peer: str
    """Decode agent name (added with `KVTransferAgent.add_peer`)."""
    block_ids: list[int]
    """Reserved destination blocks, in table order."""
    transfer_id: str
    lease_s: float = 30.0
    """Seconds the WRITE may take before it is failed (shorter than the decode side's lease)."""
    send_deadline: float | None = None
    """`time.monotonic()` after which the WRITE must neither start nor run (the decode lease minus a
    margin); caps `lease_s` at send time. None = only `lease_s` bounds it."""
    state_slot: int | None = None
    """The decode side's reserved bounded-state slot: the state after the prompt is written there
    too (no replay on decode). None = decode rebuilds the state by bounded replay."""


class NoRoomForEmbeddings(ValueError):
    """The embedding buffer has no free run of rows for an image right now (retry later or elsewhere)."""


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
    num_bytes: int = 0
    extra: dict = field(default_factory=dict)


class PrefillCore:
    """Engine + KV transfer agent of one prefill instance (rank 0 of its group)."""

    def __init__(self, engine: Engine, agent: KVTransferAgent, emb_agent: EmbeddingAgent | None = None) -> None:
        self.engine = engine
        self.agent = agent
        self.emb_agent = emb_agent
        self._reqs: dict[str, _Inflight] = {}
        self._by_transfer: dict[str, str] = {}
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
            raise ValueError(f"request id {rid!r} is already being prefilled here")
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
        with_state = work.destination.state_slot is not None
        if with_state and not self.agent.send_state:
            raise ValueError("the destination wants the bounded state but this instance's agent does not "
                             "register it (KVTransferAgent(send_state=True))")
        self.engine.add_request(work.request_id, {"prompt_token_ids": work.prompt_token_ids}, params,
                                hold_kv=True, hold_state=with_state, **({"images": spans} if spans else {}))
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
                from engine.multimodal import ImageSpan

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
        inflight = self._reqs.get(request_id)
        if inflight is not None and inflight.work.destination.transfer_id in self._by_transfer:
            return  # the agent reports the send; the hold is dropped then
        self._reqs.pop(request_id, None)
        self.engine.abort_request(request_id)

    def is_sending(self, request_id: str) -> bool:
        """Whether the request's prefill is computed and its KV is on its way to decode (the WRITE
        posted, its completion not yet reported)."""
        inflight = self._reqs.get(request_id)
        return inflight is not None and inflight.work.destination.transfer_id in self._by_transfer

    @property
    def num_inflight(self) -> int:
        return len(self._reqs) + sum(not r.is_aborted for r in self._reading.values())

    def step(self) -> list[PrefillDone]:
        """One engine step plus transfer progress; returns the requests that are done here."""
        done: list[PrefillDone] = self._poll_reads() if self._reading else []
        if self.engine.has_unfinished_requests():
            for out in self.engine.step():
                inflight = self._reqs.get(out.request_id)
                if inflight is None:
                    continue
                if out.error:
                    done.append(PrefillDone(out.request_id, error=out.error))
                    self._finish(out.request_id)
                    continue
                if not out.outputs[0].token_ids or out.kv_block_ids is None:
                    continue
                inflight.first_token_id = out.outputs[0].token_ids[0]
                inflight.num_cached_tokens = out.num_cached_tokens
                dest = inflight.work.destination
                n = len(dest.block_ids)
                src = out.kv_block_ids[:n]
                if len(src) < n:
                    done.append(PrefillDone(out.request_id, error=f"destination has {n} blocks, prompt KV has {len(src)}"))
                    self._finish(out.request_id)
                    continue
                lease_s = dest.lease_s
                if dest.send_deadline is not None:
                    lease_s = min(lease_s, dest.send_deadline - time.monotonic())
                    if lease_s <= 0:
                        done.append(PrefillDone(out.request_id, error="the decode reservation's lease ran out "
                                                "before the KV was ready to send"))
                        self._finish(out.request_id)
                        continue
                notify = json.dumps({"first_token_id": inflight.first_token_id}).encode()
                try:
                    slots = {}
                    if dest.state_slot is not None:
                        slots = {"src_slot": out.kv_state_slot, "dst_slot": dest.state_slot}
                    inflight.num_bytes = self.agent.send_blocks(dest.transfer_id, dest.peer, src, dest.block_ids,
                                                                notify, lease_s=lease_s, **slots)
                except ValueError as e:
                    done.append(PrefillDone(out.request_id, error=f"KV transfer refused: {e}"))
                    self._finish(out.request_id)
                    continue
                self._by_transfer[dest.transfer_id] = out.request_id
        ev = self.agent.poll()
        for tid in ev.sent_ids:
            rid = self._by_transfer.pop(tid, None)
            inflight = self._reqs.get(rid)
            if inflight is not None:
                done.append(PrefillDone(rid, inflight.first_token_id, inflight.num_cached_tokens,
                                        len(inflight.work.prompt_token_ids), inflight.num_bytes))
                self._finish(rid)
        for tid in ev.send_failed_ids:
            rid = self._by_transfer.pop(tid, None)
            if rid in self._reqs:
                done.append(PrefillDone(rid, error="KV transfer to the decode instance failed"))
                self._finish(rid)
        return done

    def _finish(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        self.engine.release_kv(request_id)
        self.engine.abort_request(request_id)
