"""The vision instance's pure core: batch images across requests, encode them, keep the embeddings in
NIXL-registered rows (a content-hash LRU cache), hold them for the prefill to read.

No sockets: the gRPC shell (`server.py`) resolves a request's images (fetch + preprocess, through
`engine.images.ImageResolver`) on its handler thread, then hands them to `submit` on the loop
thread and waits for the `EncodeDone` that `step()` returns. One request's life here:

1. `submit(request_id, images, lease_s)`: each image is looked up by content hash; a cached one
   (its rows still in the buffer) is a hit and costs nothing; the others queue, deduplicated
   across requests (two requests with one new image encode it once).
2. `step()` encodes up to `max_batch_images` queued images in one `encode` call (images of equal
   size share a ViT forward), writes each image's rows into rows allocated in the agent's buffer
   (evicting least recently used, unreferenced entries when full) and finishes every request whose
   images are all in place: `EncodeDone` with one `EmbeddingSource` per image.
3. The request holds its entries (they are neither evicted nor moved) until `release` (the prefill
   read them), `abort`, or its lease ends (`step()` drops expired holds).

Counters (`stats()`): `vision_images_total` (images asked for), `vision_images_encoded_total`,
`vision_cache_hits_total` (images served from the cache, in-flight duplicates included),
`vision_encode_batches_total`, `vision_encode_seconds_sum`, `vision_cache_evictions_total`; gauges
`vision_cache_entries`, `vision_pending_images`, `vision_pending_image_tokens`, `vision_held_requests`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.engine.images import ResolvedImage
from deepinfer.kv_transfer.embeddings import EmbeddingAgent, EmbeddingSource

EncodeFn = Callable[[list[ResolvedImage]], list[torch.Tensor]]
"""Blocks while encoding: preprocessed images -> one `[num_tokens, hidden]` tensor each, in order."""


@dataclass
class EncodeDone:
    """The outcome of one request on this instance."""

    request_id: str
    sources: list[EmbeddingSource] = field(default_factory=list)
    """One per image, in request order."""
    is_cached: list[bool] = field(default_factory=list)
    """Per image: found in the cache (not encoded for this request)."""
    lease_deadline: float = 0.0
    """`clock()` time the hold ends."""
    error: str | None = None


@dataclass
class _Entry:
    """One image's rows in the buffer."""

    start: int
    num_rows: int


@dataclass
class _Request:
    request_id: str
    hashes: list[str]
    is_cached: list[bool]
    lease_s: float
    deadline: float | None = None
    """Set once every image is in place (the hold's lease runs from then)."""


class VisionCore:
    """Encoder + embedding buffer + cache of one vision instance (rank 0 of its group). Not thread-safe."""

    def __init__(self, encode: EncodeFn, agent: EmbeddingAgent, *, max_batch_images: int = 8,
                 clock: Callable[[], float] = time.monotonic,
                 check_image: Callable[[ResolvedImage], None] | None = None) -> None:
        self.encode = encode
        self.check_image = check_image
        """Raises ValueError for an image the tower cannot encode as resolved (`tower_image_check`); None: all can."""
        self.agent = agent
        self.max_batch_images = max_batch_images
        self._clock = clock
        self._metadata = agent.metadata()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU order: oldest first
        self._queue: OrderedDict[str, ResolvedImage] = OrderedDict()  # hash -> image waiting for its encode
        self._waiting: dict[str, _Request] = {}  # requests with an image not yet in place
        self._held: dict[str, _Request] = {}  # requests answered, holding their entries
        self._counters = {
            "vision_images_total": 0,
            "vision_images_encoded_total": 0,
            "vision_cache_hits_total": 0,
            "vision_encode_batches_total": 0,
            "vision_encode_seconds_sum": 0.0,
            "vision_cache_evictions_total": 0,
        }

    # ------------------------------------------------------------------ requests

    def submit(self, request_id: str, images: Sequence[ResolvedImage], lease_s: float) -> None:
        """Queue a request's (resolved) images; raises ValueError for a duplicate id or an image
        larger than the whole buffer."""
        if request_id in self._waiting or request_id in self._held:
            raise ValueError(f"request id {request_id!r} is already held here")
        for im in images:
            if im.num_tokens > self.agent.allocator.num_rows:
                raise ValueError(f"an image of {im.num_tokens} tokens does not fit the embedding buffer "
                                 f"({self.agent.allocator.num_rows} rows); start the instance with more rows")
            if self.check_image is not None:
                self.check_image(im)
        req = _Request(request_id, [im.content_hash for im in images], [], lease_s)
        self._counters["vision_images_total"] += len(images)
        for im in images:
            is_hit = im.content_hash in self._entries or im.content_hash in self._queue
            if im.content_hash in self._entries:
                self._entries.move_to_end(im.content_hash)
            elif not is_hit:
                self._queue[im.content_hash] = im
            req.is_cached.append(is_hit)
            self._counters["vision_cache_hits_total"] += is_hit
        self._waiting[request_id] = req

    def release(self, request_id: str) -> bool:
        """Drop a request's hold (answered or not); False if it held nothing here."""
        req = self._held.pop(request_id, None) or self._waiting.pop(request_id, None)
        if req is None:
            return False
        if req.deadline is None:  # never answered: drop queued images nobody else waits for
            wanted = {h for r in self._waiting.values() for h in r.hashes}
            for h in set(req.hashes) - wanted:
                self._queue.pop(h, None)
        for tid in self._transfer_ids(req):
            self.agent.forget_expected_read(tid)
        return True

    abort = release

    @property
    def num_pending_images(self) -> int:
        return len(self._queue)

    @property
    def num_pending_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self._queue.values())

    @property
    def num_requests(self) -> int:
        """Requests waiting for an encode or holding embeddings."""
        return len(self._waiting) + len(self._held)

    def has_work(self) -> bool:
        return bool(self._queue) or any(self._is_ready(r) for r in self._waiting.values())

    def cached_hashes(self) -> list[str]:
        """Content hashes whose embeddings are in the buffer (oldest use first)."""
        return list(self._entries)

    def pending_hashes(self) -> list[str]:
        """Content hashes queued for encoding."""
        return list(self._queue)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EncodeDone]:
        """Encode one batch of queued images (if any), finish the requests now complete, expire holds."""
        done: list[EncodeDone] = []
        batch = self._take_batch()
        if batch:
            t0 = time.perf_counter()
            embeds = self.encode(batch)
            self._counters["vision_encode_seconds_sum"] += time.perf_counter() - t0
            self._counters["vision_encode_batches_total"] += 1
            for im, emb in zip(batch, embeds):
                self._store(im, emb)
        for rid, req in list(self._waiting.items()):
            if self._is_ready(req):
                del self._waiting[rid]
                done.append(self._answer(req))
        if self._queue and not batch and not self._held:
            # NOTE: the queue head does not fit and no hold will end: the waiting requests pin the buffer
            # (their cached images) among themselves; fail the ones waiting for the head so others can run
            head = next(iter(self._queue))
            for rid, req in list(self._waiting.items()):
                if head in req.hashes:
                    self.release(rid)
                    done.append(EncodeDone(rid, error="the embedding buffer cannot hold this request's images "
                                           "with those of the requests in flight; retry later"))
        now = self._clock()
        for rid, req in list(self._held.items()):
            if req.deadline is not None and now >= req.deadline:
                self.release(rid)
        self.agent.poll()
        return done

    def _take_batch(self) -> list[ResolvedImage]:
        """Up to `max_batch_images` queued images that fit in the buffer now (evicting LRU entries)."""
        batch: list[ResolvedImage] = []
        for h, im in list(self._queue.items()):
            if len(batch) >= self.max_batch_images:
                break
            start = self._alloc(im.num_tokens)
            if start is None:
                break  # the buffer is full of held entries: wait for releases
            del self._queue[h]
            self._entries[h] = _Entry(start, im.num_tokens)
            batch.append(im)
        return batch

    def _alloc(self, num_rows: int) -> int | None:
        start = self.agent.allocator.alloc(num_rows)
        if start is not None:
            return start
        # NOTE: an entry is referenced while a waiting or held request names it; only others are evicted
        referenced = {h for r in (*self._waiting.values(), *self._held.values()) for h in r.hashes}
        while start is None:
            victim = next((h for h in self._entries if h not in referenced), None)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            self.agent.allocator.free(entry.start, entry.num_rows)
            self._counters["vision_cache_evictions_total"] += 1
            start = self.agent.allocator.alloc(num_rows)
        return start

    def _store(self, im: ResolvedImage, emb: torch.Tensor) -> None:
        entry = self._entries[im.content_hash]
        if tuple(emb.shape) != (im.num_tokens, self.agent.hidden_size):
            raise RuntimeError(f"the tower gave {tuple(emb.shape)} embeddings for an image of {im.num_tokens} tokens "
                               f"(hidden {self.agent.hidden_size})")
        self.agent.rows(entry.start, entry.num_rows).copy_(emb)
        self._counters["vision_images_encoded_total"] += 1

    def _is_ready(self, req: _Request) -> bool:
        return all(h in self._entries and h not in self._queue for h in req.hashes)

    def _answer(self, req: _Request) -> EncodeDone:
        req.deadline = self._clock() + req.lease_s
        self._held[req.request_id] = req
        sources = []
        for i, h in enumerate(req.hashes):
            entry = self._entries[h]
            self._entries.move_to_end(h)
            src = self.agent.descriptor(entry.start, entry.num_rows, self._metadata)
            sources.append(src)
            self.agent.expect_read(f"{req.request_id}/{i}", src.num_bytes)
        return EncodeDone(req.request_id, sources, list(req.is_cached), req.deadline)

    @staticmethod
    def _transfer_ids(req: _Request) -> list[str]:
        return [f"{req.request_id}/{i}" for i in range(len(req.hashes))]

    def stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = dict(self._counters)
        out.update(vision_cache_entries=len(self._entries), vision_pending_images=self.num_pending_images,
                   vision_pending_image_tokens=self.num_pending_image_tokens, vision_held_requests=len(self._held),
                   vision_waiting_requests=len(self._waiting))
        out.update(self.agent.stats())
        return out



def tower_encoder(tower) -> EncodeFn:
    """The `EncodeFn` of a vision tower: recipe's preprocessed images -> the tower's input -> `tower.encode`
    (equal sizes share a forward). V4's `engine.models.vision.VisionTower` takes padded pixels
    (`preprocess_pixels`); V4.1's `engine.models.vision_v41.V41VisionTower` has its own `preprocess` (its resize
    plan and patches) and `image_token_count`, which must agree with recipe's count (`ResolvedImage.num_tokens`, the
    positions the entrypoint expanded): `tower_image_check` refuses a disagreement at `submit`."""
    prep = getattr(tower, "preprocess", None)
    if prep is None:
        from deepinfer.engine.models.vision import preprocess_pixels

        def prep(info):
            return preprocess_pixels(info, tower.config)

    def encode(images: list[ResolvedImage]) -> list[torch.Tensor]:
        return tower.encode([prep(im.info) for im in images])

    return encode


def tower_image_check(tower) -> Callable[[ResolvedImage], None] | None:
    """`VisionCore`'s `check_image` for a tower with its own token count (V4.1's `image_token_count`): raises
    ValueError (a refusal of the request) when it disagrees with recipe's count; None for a tower without one."""
    count = getattr(tower, "image_token_count", None)
    if count is None:
        return None

    def check(im: ResolvedImage) -> None:
        n = count(im.info.width, im.info.height)
        if n != im.num_tokens:
            raise ValueError(f"a {im.info.width}x{im.info.height} image: recipe's V4.1 specification counts "
                             f"{im.num_tokens} image tokens, the tower's resize plan {n}; this image size is not served")

    return check
