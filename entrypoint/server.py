"""The token-level entrypoint: the `deepinfer.v1.Entrypoint` gRPC service and the P/D handshake.

```python
server = serve_entrypoint(EntrypointConfig(model=path, prefill_lb_address=p_lb, decode_lb_address=d_lb))
Client(server.address).generate([5, 6, 7], max_tokens=8, temperature=0.0)
```

One `Generate` call (DESIGN.md §1):

1. Validate (`validate_request`) against the model's vocabulary and context length: empty prompt,
   out-of-vocabulary ids, bad sampling params -> INVALID_ARGUMENT before any stage works.
   Images: vision balancer `Pick` (image-hash affinity) -> `Vision.Encode`: a bad image is refused
   (INVALID_ARGUMENT) before any other stage works; otherwise each image's placeholder is replaced
   by its image tokens (`expand_image_placeholders`), the context length checked again, and the
   embeddings' descriptors ride with the decode reservation and the prefill request (D and P each
   READ them over NIXL: P to prefill, D to recompute image positions itself, in bounded replay or
   after a preemption); the vision hold is released once the prefill answered. A prefill that
   reports the embeddings lost (their vision instance died) has them encoded again elsewhere and
   is retried. Text-only requests skip the stage.
2. Decode balancer `Pick` -> `Decode.Reserve` on D: blocks for the prompt's KV, the transfer id,
   D's agent name, metadata and layout, and the lease deadline.
3. Prefill balancer `Pick` (prefix-aware: the prompt's chained block hashes) -> `Prefill.Prefill` on
   P with D's reservation as the destination; P answers once the KV landed on D, with the first token.
4. `Decode.Start` on D: its `TokenChunk`s are streamed back as `GenerateResponse` deltas; the last
   carries finish_reason and usage (with P's cached prompt tokens).

A full or draining instance (RESOURCE_EXHAUSTED / UNAVAILABLE before any work), or a decode instance
that cannot be reached for Reserve, is excluded and the stage picked again, up to `max_attempts`
instances. A prefill or decode instance lost mid-request (it died, or stopped answering) moves the
request to another prefill -> decode pair, prompt plus the tokens already streamed, up to
`migration_limit` times (`entrypoint.migration`); the failed attempt is aborted first, and D
quarantines the reservation a lost P may still write into until its lease ends (frees it at once
when P's process is certainly gone). A stage that just lost an instance (vision included) makes requests
finding none usable wait for one (a restart), bounded by their deadline and `outage_wait_s`; so do picks while a
stage's balancer cannot be reached (killed and restarting on its address: the instances re-register
on their next heartbeat), instead of failing.
Failures end the call with the gRPC status the wire `Error` maps to (`serving.errors`); a stage
without a healthy instance gives UNAVAILABLE naming the stage. The client cancelling the call,
`deadline_ms` (or the call's own deadline) running out, or `Abort` cancel the stage calls in flight
and abort the request on P, then on D. `Abort` ends the stream with a last message whose
finish_reason is ABORT.

NOTE (abort order): P first, then D, so D frees the reserved blocks after P has stopped (or
finished) its WRITE into them, as far as P can tell; see the lease NOTE in `kv_transfer`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import grpc

from deepinfer.engine.cache.block_pool import hash_block_tokens
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.images import IMAGE_TOKEN_ID
from deepinfer.engine.latency import LatencyHistograms
from deepinfer.engine.sampling import SamplingParams
from deepinfer.entrypoint.config import EntrypointConfig
from deepinfer.entrypoint.migration import (
    OUTAGE_POLL_S,
    DecodeLiveness,
    DecodeLost,
    MigrationStats,
    StageLiveness,
    StageMembership,
    StageOutages,
    run_migrating,
)
from deepinfer.protos import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    entrypoint_pb2,
    entrypoint_pb2_grpc,
    loadbalancer_pb2,
    loadbalancer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    vision_pb2,
    vision_pb2_grpc,
)
from deepinfer.protos.convert import sampling_params_from_proto
from deepinfer.protos.metadata import ERROR_FIELD_METADATA_KEY, STATS_METADATA_KEY
from deepinfer.serving.auth import add_port, secure_channel, server_interceptors
from deepinfer.serving.errors import QUARANTINE_FIELD, RETRYABLE_ERRORS, STALE_RESERVATION_FIELD, status_of
from deepinfer.serving.loop import MAX_DEADLINE_S, call_time_remaining
from deepinfer.serving.membership import BALANCER_CHANNEL_OPTIONS

logger = logging.getLogger("entrypoint")

QUARANTINE_POLL_S = 0.25
"""How often a request whose decode instances are full of quarantined reservations tries to reserve again."""
DECODE_FULL_POLL_S = (0.05, 0.5)
"""A request that found every decode instance (rank) full tries to pick and reserve again after the first delay,
doubling up to the second: a freed slot is taken soon, while many waiters do not flood the balancer with picks (its
view of the slots changes at the decode instances' heartbeats)."""

ABORT_RPC_REASON = "Abort RPC"
"""The abort reason of requests aborted by the Entrypoint's Abort call."""

NOMINAL_IMAGE_TOKENS = 184
"""Image tokens a vision pick counts per image (a small image's; the exact count comes from preprocessing)."""

"""In-band errors after which another instance of the stage is tried (nothing was done yet)."""


# ---------------------------------------------------------------------------------------- validation


def validate_request(request: entrypoint_pb2.GenerateRequest, vocab_size: int, max_model_len: int,
                     has_vision: bool = False) -> SamplingParams:
    """The request's engine `SamplingParams`; raises `InvalidRequestError` naming the field on bad input.

    Pure: checks the prompt against the vocabulary and context length, the sampling params
    (`SamplingParams` validation), and refuses what the disaggregated path does not serve yet.
    """
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("the prompt is empty; send at least one token id", field="prompt_token_ids")
    for i, token_id in enumerate(prompt):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"prompt token id {token_id} at position {i} is outside the vocabulary "
                                      f"[0, {vocab_size})", field="prompt_token_ids")
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(f"the prompt has {len(prompt)} tokens but the context length is {max_model_len}; "
                                  "shorten it", field="prompt_token_ids")
    if request.images:
        if not has_vision:
            raise InvalidRequestError("image prompts need the vision stage: this entrypoint has no vision balancer "
                                      "(--vision-lb-address) or the model has no vision tower", field="images")
        end = 0
        for i, ref in enumerate(request.images):
            if not ref.descriptor:
                raise InvalidRequestError(f"image {i} has an empty descriptor", field="images")
            if ref.offset < end or ref.num_tokens < 1 or ref.offset + ref.num_tokens > len(prompt):
                raise InvalidRequestError(f"image {i} covers prompt positions [{ref.offset}, {ref.offset + ref.num_tokens})"
                                          f", which overlap another image or leave the prompt ({len(prompt)} tokens); "
                                          "images must be in prompt order, each on its own placeholder", field="images")
            end = ref.offset + ref.num_tokens
    if request.HasField("num_original_prompt_tokens"):
        n = request.num_original_prompt_tokens
        if not 0 < n <= len(prompt):
            raise InvalidRequestError(f"num_original_prompt_tokens must be in [1, {len(prompt)}] (the prompt length of "
                                      f"the request this one continues), got {n}; leave it unset for a request that "
                                      "continues none", field="num_original_prompt_tokens")
        if any(ref.offset + ref.num_tokens > n for ref in request.images):
            raise InvalidRequestError(f"an image lies after the first num_original_prompt_tokens ({n}) prompt tokens; "
                                      "a continuation's images are those of its original prompt",
                                      field="num_original_prompt_tokens")
    params = sampling_params_from_proto(request.sampling_params)
    params.validate_against_vocab(vocab_size)
    if params.n != 1:
        raise InvalidRequestError("n > 1 is not served by the entrypoint yet; send n requests (seed + i each)",
                                  field="n")
    if params.prompt_logprobs is not None:  # NOTE: sampled-token logprobs are served (prefill + decode carry them)
        raise InvalidRequestError("prompt_logprobs is not served by the disaggregated path yet; leave it unset",
                                  field="prompt_logprobs")
    if params.max_tokens is not None and len(prompt) + params.max_tokens > max_model_len and not (
            request.images and request.is_max_tokens_default):
        raise InvalidRequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                  f"context length ({max_model_len})", field="max_tokens")
    return params


def expanded_num_original_prompt_tokens(request: entrypoint_pb2.GenerateRequest, prompt: list[int]) -> int | None:
    """A continuation's original prompt length (`GenerateRequest.num_original_prompt_tokens`) in the positions of
    `prompt`, the request's prompt with its images' placeholders expanded (`expand_image_placeholders`), as the
    prefill and decode stages get it; None when the request continues none. NOTE: its images lie inside the
    original prompt (`validate_request`), so the expansion lengthens the original part by all of it."""
    if not request.HasField("num_original_prompt_tokens"):
        return None
    return request.num_original_prompt_tokens + len(prompt) - len(request.prompt_token_ids)


def expand_image_placeholders(prompt_token_ids: list[int], images, num_tokens: list[int], content_hashes: list[str],
                              image_token_id: int = IMAGE_TOKEN_ID) -> tuple[list[int], list[common_pb2.ImageRef]]:
    """The prompt with each image's placeholder span replaced by `num_tokens[i]` x `image_token_id`
    (the model's, 129264 by default), and the images' refs at their new offsets (content hash and
    token count filled in)."""
    out: list[int] = []
    refs: list[common_pb2.ImageRef] = []
    pos = 0
    for ref, n, content_hash in zip(images, num_tokens, content_hashes):
        out.extend(prompt_token_ids[pos:ref.offset])
        refs.append(common_pb2.ImageRef(content_hash=content_hash, offset=len(out), num_tokens=n))
        out.extend([image_token_id] * n)
        pos = ref.offset + ref.num_tokens
    out.extend(prompt_token_ids[pos:])
    return out, refs


def image_pick_keys(images) -> list[int]:
    """The vision balancer's affinity keys of a request's images: the content hash when the client
    gave one, else the SHA-256 of the source descriptor (first 8 bytes, little-endian), the keys a
    vision instance reports for the images it holds."""
    keys = []
    for ref in images:
        digest = bytes.fromhex(ref.content_hash) if ref.content_hash else hashlib.sha256(ref.descriptor).digest()
        keys.append(int.from_bytes(digest[:8], "little"))
    return keys


def prompt_block_hashes(prompt_token_ids: list[int], block_size: int, images=()) -> list[int]:
    """Chained prefix hashes of the prompt's full blocks (`engine.cache.block_pool`), for prefix-aware picks.

    `images` (ImageRefs at their expanded offsets): a block overlapping an image also hashes its content
    hash, as the engine's scheduler does (`Request.extra_keys_for_block`)."""
    hashes: list[int] = []
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        end = start + block_size
        extra = tuple(r.content_hash for r in images if r.offset < end and r.offset + r.num_tokens > start)
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, prompt_token_ids[start:end], extra))
    return hashes


# ---------------------------------------------------------------------------------------- phase latencies


PHASE_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class PhaseTimes(LatencyHistograms):
    """Latency histograms of each request's phases here, for Health's stats (the HTTP front exports them
    as `deepinfer_entrypoint_phase_seconds{phase}`): `queue` (accepted -> prefill call sent: images,
    decode pick and reservation, prefill pick), `prefill` (prefill call -> answered: the prefill's own queue,
    its compute and the KV write landing on decode), `first_decode` (-> decode's first chunk). Thread-safe
    (`engine.latency.LatencyHistograms`, the workers' histograms' shape)."""

    def __init__(self) -> None:
        super().__init__(PHASE_BUCKETS_S)


# ---------------------------------------------------------------------------------------- one request


class _Failed(Exception):
    """Ends a Generate call with a gRPC status."""

    def __init__(self, status: grpc.StatusCode, message: str, field: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.field = field

    @classmethod
    def of_error(cls, error: common_pb2.Error, where: str) -> _Failed:
        status = status_of(error.code)
        return cls(status, f"{where}: {error.message}", error.field)


class _Cancelled(Exception):
    """A stage call was cancelled because the request was aborted (client gone, Abort RPC)."""


class _Request:
    """One Generate call in flight: the stage calls to cancel and the instances to abort on.

    Touched by the handler thread and by whoever aborts it (gRPC callback, Abort RPC): `lock` guards it.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.lock = threading.Lock()
        self.prefill: tuple[str, prefill_pb2_grpc.PrefillStub] | None = None
        """(instance id, stub) while P may hold the request."""
        self.decode: tuple[str, decode_pb2_grpc.DecodeStub] | None = None
        self.decode_rank: int | None = None
        """The rank of the picked decode instance the decode balancer chose (multi-rank instances), else None."""
        """(instance id, stub) while D may hold the request."""
        self.vision: tuple[str, vision_pb2_grpc.VisionStub] | None = None
        """(instance id, stub) while V may hold the request's embeddings."""
        self.vision_address = ""
        """The address of the vision instance in `vision` (marked lost at it when it loses the embeddings)."""
        self.revivable_ids: set[str] = set()
        """Instances this request's picks excluded because they were lost (not because they were full): a
        pick that finds no other instance takes them again once they answer (`_revive_excluded`)."""
        self.calls: list = []
        self.abort_reason: str | None = None
        self.is_done = False
        self.usage = common_pb2.Usage()
        """What the request used so far (the handler thread updates it)."""
        self.lost_instance_ids: list[str] = []
        """Instances lost by the last failed attempt, excluded from the next picks (`entrypoint.migration`)."""
        self.lost_decode_id: str | None = None
        """Set by `DecodeLiveness` when the decode instance stopped answering (its stream is cancelled)."""
        self.prefill_address = ""
        """The address of the prefill instance in `prefill` (a fresh probe tells whether its process is gone)."""
        self.lost_prefill_id: str | None = None
        """Set by the prefill `StageLiveness` when the prefill instance stopped answering (its call is cancelled)."""
        self.num_resumed_tokens = 0
        """Tokens at the end of the prompt that are the client's output (a migrated request's continuation)."""

    def add_call(self, call) -> None:
        """Track a cancellable stage call; cancels it at once when the request is already aborted."""
        with self.lock:
            self.calls.append(call)
            is_aborted = self.abort_reason is not None
        if is_aborted:
            call.cancel()

    def abort(self, reason: str, rpc_timeout_s: float) -> bool:
        """Cancel the stage calls in flight and abort the request on P, then on D (in a daemon thread).

        False (and nothing happens) when the request already finished or was aborted.
        """
        with self.lock:
            if self.is_done or self.abort_reason is not None:
                return False
            self.abort_reason = reason
            calls, stages = list(self.calls), [s for s in (self.vision, self.prefill, self.decode) if s is not None]
        for call in calls:
            call.cancel()
        threading.Thread(target=self._abort_stages, args=(stages, reason, rpc_timeout_s),
                         name="entrypoint-abort", daemon=True).start()
        return True

    def _abort_stages(self, stages, reason: str, rpc_timeout_s: float, writer_gone: bool = False) -> None:
        for instance_id, stub in stages:
            try:
                stub.Abort(common_pb2.AbortRequest(request_id=self.request_id, reason=reason, writer_gone=writer_gone),
                           timeout=rpc_timeout_s)
            except grpc.RpcError as e:
                logger.warning("aborting %s on %s failed: %s", self.request_id, instance_id, e.code().name)
            except ValueError:  # the entrypoint is shutting down: its channels are closed
                logger.info("not aborting %s on %s: the entrypoint stopped", self.request_id, instance_id)


# ---------------------------------------------------------------------------------------- service


class EntrypointServicer(entrypoint_pb2_grpc.EntrypointServicer):
    """`deepinfer.v1.Entrypoint`: validates, runs the P/D handshake and streams the decode output."""

    def __init__(self, config: EntrypointConfig, instance_id: str, vocab_size: int, max_model_len: int) -> None:
        self.config = config
        self.instance_id = instance_id
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.image_token_id = IMAGE_TOKEN_ID
        """The model's image position id (config.json `image_token_id`)."""
        self._channels: dict[str, grpc.Channel] = {}
        self._old_channels: list[grpc.Channel] = []
        """Channels replaced after their instance came back (their calls may still run; closed at the end)."""
        self._lock = threading.Lock()
        self._inflight: dict[str, _Request] = {}
        for address in (config.prefill_lb_address, config.decode_lb_address, config.vision_lb_address):
            if address:  # reconnect within a second of a balancer restart (serving.membership)
                self._channels[address] = secure_channel(address, options=_LOCAL_POOL + BALANCER_CHANNEL_OPTIONS)
        self.prefill_lb = loadbalancer_pb2_grpc.LoadBalancerStub(self._channel(config.prefill_lb_address))
        self.decode_lb = loadbalancer_pb2_grpc.LoadBalancerStub(self._channel(config.decode_lb_address))
        self.vision_lb = (loadbalancer_pb2_grpc.LoadBalancerStub(self._channel(config.vision_lb_address))
                          if config.vision_lb_address else None)
        self.migration_stats = MigrationStats()
        self.phase_times = PhaseTimes()
        self.model_path: str | None = None
        """The resolved checkpoint (its tokenizer recovers a migrated request's text); None = none."""
        self._tokenizer = None
        self.outages = StageOutages(config.outage_wait_s)
        self.liveness = DecodeLiveness(self.decode_lb, config.liveness_interval_s, config.liveness_probe_timeout_s,
                                       on_lost=lambda iid: self.outages.mark_lost("decode", iid),
                                       on_balancer_unreachable=lambda: self.outages.mark_out("decode"))
        self.prefill_liveness = StageLiveness(self.prefill_lb, config.liveness_interval_s,
                                              config.liveness_probe_timeout_s, stage="prefill",
                                              on_lost=lambda iid: self.outages.mark_lost("prefill", iid),
                                              on_balancer_unreachable=lambda: self.outages.mark_out("prefill"))
        # a vision instance killed between two (short) Encode calls is noticed too: its requests then wait
        self.vision_membership = (StageMembership(self.vision_lb, "vision", self.outages,
                                                  lambda address: self._probe("vision", address),
                                                  config.liveness_interval_s)
                                  if self.vision_lb is not None else None)

    def close(self) -> None:
        self.liveness.close()
        self.prefill_liveness.close()
        if self.vision_membership is not None:
            self.vision_membership.close()
        with self._lock:
            channels, self._channels = list(self._channels.values()) + self._old_channels, {}
            self._old_channels = []
        for channel in channels:
            channel.close()

    def _new_detokenizer(self, prompt: list[int], skip_special_tokens: bool):
        """The engine's incremental detokenizer of an output after `prompt`, as a decode instance makes
        its text (`entrypoint.migration.TextAcrossMigration`); the tokenizer loads on first use."""
        from deepinfer.engine.sampling.stop import IncrementalDetokenizer
        from deepinfer.engine.tokenizer import load_tokenizer

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.model_path)
            tokenizer = self._tokenizer
        return IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = secure_channel(address, options=_LOCAL_POOL)
            return channel

    # ------------------------------------------------------------------ Generate

    def Generate(self, request, context):
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        try:
            validate_request(request, self.vocab_size, self.max_model_len, has_vision=self.vision_lb is not None)
        except InvalidRequestError as e:
            _abort_call(context, _Failed(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field or ""))
        timeouts = [t for t in (request.deadline_ms / 1000 or None, call_time_remaining(context)) if t is not None]
        deadline = time.monotonic() + min(timeouts) if timeouts else None
        req = _Request(rid)
        with self._lock:
            if rid in self._inflight:
                req = None
            else:
                self._inflight[rid] = req
        if req is None:
            _abort_call(context, _Failed(grpc.StatusCode.INVALID_ARGUMENT, f"request_id {rid!r} is already in flight; "
                                         "use a unique id or leave it empty", "request_id"))
        if not context.add_callback(lambda: req.abort("client disconnected", self.config.rpc_timeout_s)):
            req.abort("client disconnected", self.config.rpc_timeout_s)
        try:
            yield from run_migrating(self._generate, req, request, deadline, limit=self.config.migration_limit,
                                     rpc_timeout_s=self.config.rpc_timeout_s, stats=self.migration_stats,
                                     new_detokenizer=self._new_detokenizer if self.model_path is not None else None)
        except _Cancelled:
            if req.abort_reason == ABORT_RPC_REASON:
                yield entrypoint_pb2.GenerateResponse(
                    request_id=rid, finish_reason=common_pb2.FINISH_REASON_ABORT, usage=req.usage,
                    error=common_pb2.Error(code=common_pb2.ERROR_CODE_ABORTED, message="aborted by an Abort call"))
        except _Failed as e:
            req.abort(f"failed: {e}", self.config.rpc_timeout_s)
            _abort_call(context, e)
        finally:
            self.liveness.unwatch(req)
            self.prefill_liveness.unwatch(req)
            req.abort("generate call ended", self.config.rpc_timeout_s)  # no-op unless it ended abnormally
            with req.lock:
                req.is_done = True
            with self._lock:
                self._inflight.pop(rid, None)

    def _generate(self, req: _Request, request, deadline: float | None) -> Iterator[entrypoint_pb2.GenerateResponse]:
        """Blocks on each stage in turn (reserve on D, prefill on P, start D) and yields D's deltas."""
        rid = req.request_id
        t_start = time.monotonic()  # phase latencies (`PhaseTimes`)
        prompt = list(request.prompt_token_ids)
        sampling = request.sampling_params

        def deadline_ms() -> int:
            return 0 if deadline is None else min(max(1, int((deadline - time.monotonic()) * 1000)), int(MAX_DEADLINE_S * 1000))

        images, image_embeddings = [], []
        if request.images:
            # a vision instance was lost (SIGKILL, restarting under its id): wait for one, as for P and D
            self._await_stage(req, "vision", self.vision_lb, deadline)
            if req.vision is not None:
                # an earlier attempt, migrated before its prefill answered, still holds the images on its vision
                # instance: release them first (not in the background), or Encode would find the id held there
                self._release_images(req, wait=True)
            prompt, sampling, images, image_embeddings = self._encode_images(req, request, deadline, deadline_ms)
        req.usage.prompt_tokens = len(prompt) - req.num_resumed_tokens
        num_original = expanded_num_original_prompt_tokens(request, prompt)
        original = {"num_original_prompt_tokens": num_original} if num_original is not None else {}
        # a stage that just lost an instance: wait for one to serve before holding blocks on decode
        self._await_stage(req, "prefill", self.prefill_lb, deadline)
        self._await_stage(req, "decode", self.decode_lb, deadline)

        reserve, d_stub = None, None
        excluded: list[str] = self._still_lost(req.lost_instance_ids)
        quarantine_wait_until = None
        full_poll_s = DECODE_FULL_POLL_S[0]
        last_refusal = ""  # why the last decode instance (or balancer) tried had no room: the wait's log line
        # the decode work the request brings (the `decode_work` balancer policy): the output tokens it may still make
        num_output_tokens = (sampling.max_tokens if sampling.HasField("max_tokens")
                             else max(0, self.max_model_len - len(prompt)))
        while True:
            # NOTE: when every decode instance tried is full only because aborted reservations sit in quarantine
            # (their leases end soon: fault recovery, not load), an accepted request waits for that capacity,
            # bounded by its deadline and `outage_wait_s`, instead of failing. So does a request that finds every
            # decode instance (rank) full with running requests (load: they finish and free their slots and blocks),
            # bounded by its deadline, or `outage_wait_s` without one.
            quarantine_wait = quarantine_full = full_wait = excluded_full = False
            for attempt in range(self.config.max_attempts):
                try:
                    d_inst = self._pick(req, "decode", self.decode_lb, loadbalancer_pb2.PickRequest(
                        request_id=rid, stage=common_pb2.STAGE_DECODE, num_prompt_tokens=len(prompt),
                        num_output_tokens=num_output_tokens, exclude_instance_ids=excluded), deadline)
                except _Failed as e:
                    last_refusal = f"decode balancer: {e}"
                    # the instances left were excluded for being full of quarantined reservations: wait for them
                    if quarantine_full and self._may_wait_for_quarantine(req, deadline):
                        quarantine_wait = True
                        break
                    # every decode instance (rank) left is full, or those tried refused for being full: wait for room
                    if ((e.status == grpc.StatusCode.RESOURCE_EXHAUSTED or excluded_full)
                            and self._may_wait_for_quarantine(req, deadline)):
                        full_wait = True
                        break
                    raise
                d_stub = decode_pb2_grpc.DecodeStub(self._channel(d_inst.address))
                with req.lock:
                    req.decode = (d_inst.instance_id, d_stub)
                is_last = attempt + 1 == self.config.max_attempts
                req.lost_decode_id = None
                self.liveness.watch(req, d_inst.instance_id, d_stub)  # a hung instance's Reserve is cancelled
                try:
                    reserve = self._unary(req, d_stub.Reserve, decode_pb2.ReserveRequest(
                        request_id=rid, prompt_token_ids=prompt, sampling_params=sampling, num_kv_tokens=len(prompt),
                        deadline_ms=deadline_ms(), lease_ms=self.config.kv_lease_ms,
                        images=images, image_embeddings=image_embeddings, kv_traffic_class=request.kv_traffic_class,
                        is_conversation=request.is_conversation, **original,
                        **({"rank": req.decode_rank} if req.decode_rank is not None else {})),
                        deadline, f"reserving KV on decode instance {d_inst.instance_id}")
                except _Cancelled:
                    if req.lost_decode_id != d_inst.instance_id or req.abort_reason is not None:
                        raise
                    # it hung while reserving (missed heartbeats, no answer to a probe: `DecodeLiveness`), which
                    # would hold the request for as long as it hangs: skip it like a dead one. The reservation it
                    # may still make when it wakes is aborted in the background (or ends with its lease).
                    with req.lock:
                        lost, req.decode = req.decode, None
                    threading.Thread(target=req._abort_stages, args=([lost], "the decode instance hung while reserving",
                                                                     self.config.rpc_timeout_s),
                                     name="entrypoint-abort-lost", daemon=True).start()
                    failed = _Failed(grpc.StatusCode.UNAVAILABLE, f"decode instance {d_inst.instance_id} stopped "
                                     "answering while reserving KV (missed heartbeats, no answer to a Health probe)")
                    if is_last:
                        raise failed from None
                    logger.warning("%s: skipping decode instance %s: %s", rid, d_inst.instance_id, failed)
                    excluded.append(d_inst.instance_id)
                    continue
                except _Failed as e:
                    # NOTE: an unreachable instance (e.g. dead, not yet expired at its balancer) is skipped
                    if e.status == grpc.StatusCode.UNAVAILABLE:
                        self.outages.mark_lost("decode", d_inst.instance_id, d_inst.address)
                    if e.status != grpc.StatusCode.UNAVAILABLE or is_last:
                        raise
                    logger.warning("%s: skipping decode instance %s: %s", rid, d_inst.instance_id, e)
                    with req.lock:
                        req.decode = None
                    excluded.append(d_inst.instance_id)
                    continue
                finally:
                    self.liveness.unwatch(req)
                if not reserve.error.code:
                    break
                if (reserve.error.code == common_pb2.ERROR_CODE_UNAVAILABLE and not is_last
                        and reserve.error.field == STALE_RESERVATION_FIELD):
                    # an earlier attempt of this request still holds a reservation there (its Abort went to the
                    # instance while we had lost it, in a daemon thread): the instance answers now, so abort it
                    # synchronously (its blocks are quarantined as usual) and reserve there again
                    logger.info("%s: aborting an earlier attempt's reservation on decode instance %s", rid,
                                d_inst.instance_id)
                    req._abort_stages([req.decode], "superseded by a new attempt of the same request",
                                      self.config.rpc_timeout_s)
                    with req.lock:
                        req.decode = None
                    continue
                with req.lock:
                    req.decode = None
                last_refusal = f"decode instance {d_inst.instance_id}: {reserve.error.message}"
                if (reserve.error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
                        and reserve.error.field == QUARANTINE_FIELD):
                    quarantine_full = True
                    if is_last and self._may_wait_for_quarantine(req, deadline):
                        quarantine_wait = True
                        break
                elif (reserve.error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED and is_last
                      and self._may_wait_for_quarantine(req, deadline)):
                    full_wait = True  # full with running requests (the balancer's view was behind): wait for room
                    break
                if reserve.error.code not in RETRYABLE_ERRORS or is_last:
                    raise _Failed.of_error(reserve.error, f"decode instance {d_inst.instance_id} refused the reservation")
                if _is_images_lost(reserve.error):
                    prompt, images, image_embeddings = self._encode_again(req, request, prompt, deadline, deadline_ms,
                                                                          reserve.error)
                    continue
                excluded_full |= reserve.error.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
                excluded.append(d_inst.instance_id)

            if not quarantine_wait and not full_wait:
                break
            if quarantine_wait_until is None:
                quarantine_wait_until = time.monotonic() + self.config.outage_wait_s
                if full_wait and deadline is not None:
                    quarantine_wait_until = deadline
                logger.info("%s: every decode instance is full%s; waiting (%s)", rid,
                            "" if full_wait else " of quarantined reservations", last_refusal)
            poll_s = full_poll_s if full_wait else QUARANTINE_POLL_S
            if full_wait:
                full_poll_s = min(2 * full_poll_s, DECODE_FULL_POLL_S[1])
            if time.monotonic() + poll_s >= quarantine_wait_until:
                why = "full" if full_wait else "aborted reservations held their capacity"
                raise _Failed(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {rid!r}: no decode instance had room "
                              f"in time ({why})")
            time.sleep(poll_s)
            if req.abort_reason is not None:
                raise _Cancelled()
            excluded = self._still_lost(req.lost_instance_ids)

        destination = prefill_pb2.KVDestination(
            decode_instance_id=req.decode[0], agent_name=reserve.agent_name, agent_metadata=reserve.agent_metadata,
            agent_layout=reserve.agent_layout, block_ids=reserve.block_ids, block_size=reserve.block_size,
            transfer_id=reserve.transfer_id, lease_deadline_unix_ms=reserve.lease_deadline_unix_ms)
        if reserve.HasField("state_slot"):
            destination.state_slot = reserve.state_slot
        hashes = prompt_block_hashes(prompt, reserve.block_size, images)
        excluded = self._still_lost(req.lost_instance_ids)
        for attempt in range(self.config.max_attempts):
            p_inst = self._pick(req, "prefill", self.prefill_lb, loadbalancer_pb2.PickRequest(
                request_id=rid, stage=common_pb2.STAGE_PREFILL, prompt_block_hashes=hashes,
                num_prompt_tokens=len(prompt), exclude_instance_ids=excluded), deadline)
            p_stub = prefill_pb2_grpc.PrefillStub(self._channel(p_inst.address))
            with req.lock:
                req.prefill = (p_inst.instance_id, p_stub)
                req.prefill_address = p_inst.address
            req.lost_prefill_id = None
            self.prefill_liveness.watch(req, p_inst.instance_id, p_stub)
            t_prefill = time.monotonic()
            try:
                prefilled = self._unary(req, p_stub.Prefill, prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling_params=sampling, destination=destination,
                    num_kv_tokens=len(prompt), deadline_ms=deadline_ms(), images=images,
                    image_embeddings=image_embeddings, kv_traffic_class=request.kv_traffic_class, **original),
                    deadline, "prefilling")
            except _Cancelled:
                if req.lost_prefill_id != p_inst.instance_id or req.abort_reason is not None:
                    raise
                raise _Failed(grpc.StatusCode.UNAVAILABLE, f"prefill instance {p_inst.instance_id} stopped "
                              "answering (missed heartbeats, no answer to a Health probe)") from None
            except _Failed as e:
                if e.status == grpc.StatusCode.UNAVAILABLE:  # it died mid-call (or its link broke)
                    self.outages.mark_lost("prefill", p_inst.instance_id, p_inst.address)
                raise
            finally:
                self.prefill_liveness.unwatch(req)
            with req.lock:
                req.prefill = None
            if not prefilled.error.code:
                self._release_images(req)
                break
            if prefilled.error.code == common_pb2.ERROR_CODE_UNAVAILABLE and prefilled.error.field == "destination":
                self.outages.mark_lost("decode", req.decode[0], d_inst.address)
                raise DecodeLost(req.decode[0], _Failed.of_error(prefilled.error, f"prefill instance "
                                                                 f"{p_inst.instance_id} could not write the KV"))
            if prefilled.error.code not in RETRYABLE_ERRORS or attempt + 1 == self.config.max_attempts:
                raise _Failed.of_error(prefilled.error, f"prefill instance {p_inst.instance_id} failed")
            if _is_images_lost(prefilled.error):
                # nothing was computed or written to D: encode again on another vision instance and retry
                prompt, images, image_embeddings = self._encode_again(req, request, prompt, deadline, deadline_ms,
                                                                      prefilled.error)
                continue
            excluded.append(p_inst.instance_id)

        req.usage.cached_prompt_tokens = prefilled.num_cached_prompt_tokens
        t_prefilled = time.monotonic()
        self.phase_times.observe("queue", t_prefill - t_start)
        self.phase_times.observe("prefill", t_prefilled - t_prefill)
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        stream = d_stub.Start(decode_pb2.StartRequest(
            request_id=rid, transfer_id=reserve.transfer_id,  # the first token rides the KV transfer notice
            num_cached_prompt_tokens=prefilled.num_cached_prompt_tokens,
            first_token_logprobs=prefilled.first_token_logprobs if prefilled.HasField("first_token_logprobs") else None),
            timeout=timeout)
        req.add_call(stream)
        self.liveness.watch(req, req.decode[0], d_stub)
        is_first = True
        try:
            for chunk in stream:
                # an abort on D (drain timeout, another caller) ends the stream in-band; failures and
                # D's deadline end the call with their status
                if chunk.error.code and (chunk.finish_reason != common_pb2.FINISH_REASON_ABORT
                                         or chunk.error.code == common_pb2.ERROR_CODE_DEADLINE_EXCEEDED):
                    raise _Failed.of_error(chunk.error, f"decode instance {req.decode[0]} failed")
                if is_first:
                    self.phase_times.observe("first_decode", time.monotonic() - t_prefilled)
                req.usage.completion_tokens += len(chunk.token_ids)
                response = entrypoint_pb2.GenerateResponse(
                    request_id=rid, token_ids=chunk.token_ids, text=chunk.text, finish_reason=chunk.finish_reason,
                    logprobs=chunk.logprobs)
                if chunk.error.code:
                    response.error.CopyFrom(chunk.error)
                if is_first and not chunk.finish_reason:
                    response.usage.CopyFrom(req.usage)  # prompt and cached prompt tokens are final by now
                if chunk.finish_reason:
                    response.usage.CopyFrom(chunk.usage)
                    if chunk.HasField("stop_token_id"):
                        response.stop_token_id = chunk.stop_token_id
                    elif chunk.HasField("stop_str"):
                        response.stop_str = chunk.stop_str
                    with req.lock:
                        req.is_done = True
                yield response
                is_first = False
                if chunk.finish_reason:
                    return
        except grpc.RpcError as e:
            failed = self._translate(req, e, "decoding")
            if isinstance(failed, _Failed) and (e.code() == grpc.StatusCode.UNAVAILABLE
                                                or req.lost_decode_id == req.decode[0]):
                self.outages.mark_lost("decode", req.decode[0], d_inst.address)
                raise DecodeLost(req.decode[0], failed) from None
            raise failed from None
        raise _Failed(grpc.StatusCode.INTERNAL, f"decode instance {req.decode[0]} ended the stream of {rid!r} "
                      "without a finish_reason")

    def _encode_images(self, req: _Request, request, deadline: float | None, deadline_ms, exclude=()):
        """Blocks until a vision instance encoded the request's images; returns the expanded prompt, the
        (possibly lowered) sampling params, the images' refs and their embeddings' descriptors."""
        rid = req.request_id
        keys = image_pick_keys(request.images)
        excluded: list[str] = [e for e in exclude if e]
        for attempt in range(self.config.max_attempts):
            v_inst = self._pick(req, "vision", self.vision_lb, loadbalancer_pb2.PickRequest(
                request_id=rid, stage=common_pb2.STAGE_VISION, prompt_block_hashes=keys,
                num_prompt_tokens=len(keys) * NOMINAL_IMAGE_TOKENS, exclude_instance_ids=excluded), deadline)
            v_stub = vision_pb2_grpc.VisionStub(self._channel(v_inst.address))
            with req.lock:
                req.vision = (v_inst.instance_id, v_stub)
                req.vision_address = v_inst.address
            is_last = attempt + 1 == self.config.max_attempts
            try:
                encoded = self._unary(req, v_stub.Encode, vision_pb2.EncodeRequest(
                    request_id=rid, images=request.images, lease_ms=self.config.kv_lease_ms,
                    deadline_ms=deadline_ms()), deadline, f"encoding images on vision instance {v_inst.instance_id}")
            except _Failed as e:
                if e.status == grpc.StatusCode.UNAVAILABLE:  # it died mid-call (no embeddings held): the stage
                    # is out until it (restarted under its id) or another answers; later picks wait for that
                    self.outages.mark_lost("vision", v_inst.instance_id, v_inst.address)
                    req.revivable_ids.add(v_inst.instance_id)
                if e.status != grpc.StatusCode.UNAVAILABLE or is_last:
                    raise
                logger.warning("%s: skipping vision instance %s: %s", rid, v_inst.instance_id, e)
                with req.lock:
                    req.vision = None
                excluded.append(v_inst.instance_id)
                continue
            if not encoded.error.code:
                break
            with req.lock:
                req.vision = None
            if encoded.error.code not in RETRYABLE_ERRORS or is_last:
                raise _Failed.of_error(encoded.error, "the request's images cannot be used"
                                       if encoded.error.code == common_pb2.ERROR_CODE_INVALID_REQUEST
                                       else f"vision instance {v_inst.instance_id} failed")
            excluded.append(v_inst.instance_id)
        embeddings = list(encoded.embeddings)
        prompt, refs = expand_image_placeholders(list(request.prompt_token_ids), request.images,
                                                 [e.num_tokens for e in embeddings],
                                                 [e.content_hash for e in embeddings], self.image_token_id)
        sampling = request.sampling_params
        if len(prompt) >= self.max_model_len:
            raise _Failed(grpc.StatusCode.INVALID_ARGUMENT, f"the prompt has {len(prompt)} tokens with its images' "
                          f"{sum(e.num_tokens for e in embeddings)} image tokens but the context length is "
                          f"{self.max_model_len}; send fewer or smaller images or a shorter prompt", "images")
        if sampling.HasField("max_tokens") and len(prompt) + sampling.max_tokens > self.max_model_len:
            if not request.is_max_tokens_default:
                raise _Failed(grpc.StatusCode.INVALID_ARGUMENT, f"prompt ({len(prompt)} tokens with image tokens) + "
                              f"max_tokens ({sampling.max_tokens}) exceeds the context length ({self.max_model_len})",
                              "max_tokens")
            lowered = type(sampling)()
            lowered.CopyFrom(sampling)
            lowered.max_tokens = self.max_model_len - len(prompt)
            sampling = lowered
        return prompt, sampling, refs, embeddings

    def _encode_again(self, req: _Request, request, prompt: list[int], deadline: float | None, deadline_ms,
                      error: common_pb2.Error):
        """Blocks while the images are encoded again, on another vision instance than the one that lost
        them (it died or dropped the hold); returns the prompt, image refs and embeddings to retry with."""
        lost = req.vision[0] if req.vision else ""
        logger.warning("%s: %s; encoding the images again", req.request_id, error.message)
        if lost:  # it died (or dropped the hold): usable again once it answers a probe (restarted under its id)
            self.outages.mark_lost("vision", lost, req.vision_address)
            req.revivable_ids.add(lost)
        self._release_images(req)
        again, _, images, image_embeddings = self._encode_images(req, request, deadline, deadline_ms, exclude=[lost])
        if again != prompt:
            raise _Failed(grpc.StatusCode.INTERNAL, "the images encoded again gave other image token counts")
        return again, images, image_embeddings

    def _release_images(self, req: _Request, wait: bool = False) -> None:
        """Drop the vision instance's hold on the request's embeddings (in a daemon thread, best effort;
        `wait`: in this thread, bounded by `rpc_timeout_s`)."""
        with req.lock:
            vision, req.vision = req.vision, None
        if vision is None:
            return

        def release() -> None:
            try:
                vision[1].Release(vision_pb2.ReleaseRequest(request_id=req.request_id),
                                  timeout=self.config.rpc_timeout_s)
            except grpc.RpcError as e:
                logger.warning("releasing %s on %s failed: %s", req.request_id, vision[0], e.code().name)

        if wait:
            release()
            return
        threading.Thread(target=release, name="entrypoint-release", daemon=True).start()

    def _pick(self, req: _Request, stage: str, stub, pick: loadbalancer_pb2.PickRequest, deadline: float | None):
        """The balancer's pick, skipping lost instances that do not answer yet; while the stage is out
        (`StageOutages`) a pick that finds no instance waits for one, bounded by the deadline."""
        while True:
            timeout = self.config.rpc_timeout_s
            if deadline is not None:
                timeout = min(timeout, max(0.001, deadline - time.monotonic()))
            call = stub.Pick.future(pick, timeout=timeout)
            req.add_call(call)
            try:
                picked = call.result()
                instance = picked.instance
            except grpc.FutureCancelledError:
                raise _Cancelled() from None
            except grpc.RpcError as e:
                code = e.code()
                is_own_deadline = deadline is not None and time.monotonic() >= deadline - 0.01
                if ((code == grpc.StatusCode.DEADLINE_EXCEEDED and not is_own_deadline)
                        or (code == grpc.StatusCode.UNAVAILABLE and not self._balancer_answers(stub))):
                    # the balancer itself is gone (killed, restarting, its link cut): the stage is out,
                    # the pick waits for it (and its instances' re-registration) within the deadline
                    if self.outages.wait_until(stage) is None:
                        logger.warning("%s: the %s balancer does not answer (%s); requests wait for it",
                                       req.request_id, stage, code.name)
                    self.outages.mark_out(stage)
                    code = grpc.StatusCode.UNAVAILABLE
                if code == grpc.StatusCode.UNAVAILABLE:
                    if self._revive_excluded(req, stage, stub, pick) or self._wait_for_outage(req, stage, deadline):
                        continue
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE):
                    # RESOURCE_EXHAUSTED: every instance is full now (a decode pick waits for room); OUT_OF_RANGE:
                    # none could ever take the request (it needs more KV than a pool holds), so it fails at once
                    address = getattr(self.config, f"{stage}_lb_address")
                    raise _Failed(code, f"no {stage} instance can take the request (balancer {address}): "
                                  f"{e.details()}") from None
                raise self._translate(req, e, f"picking a {stage} instance") from None
            if self._is_usable(stage, instance):
                if stage == "decode":  # the (instance, rank) of a rank-aware decode balancer; Reserve passes it on
                    req.decode_rank = picked.rank if picked.HasField("rank") else None
                return instance
            # a lost instance its balancer still lists (its heartbeats not timed out yet): pick again
            pick.exclude_instance_ids.append(instance.instance_id)
            req.revivable_ids.add(instance.instance_id)

    def _balancer_answers(self, lb) -> bool:
        """Whether the balancer behind `lb` answers a ListInstances call now (a refused Pick may be its
        own answer: no instance can take the request)."""
        try:
            lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=self.config.liveness_probe_timeout_s)
            return True
        except grpc.RpcError:
            return False

    def _still_lost(self, instance_ids: list[str]) -> list[str]:
        """Those of `instance_ids` (lost by the request's last attempt) that did not answer a probe since."""
        return [i for i in instance_ids if self.outages.is_known_lost(i)]

    def _probe(self, stage: str, address: str) -> bool:
        """Whether the `stage` instance at `address` answers a Health call now, over a new connection;
        when it does, later calls to `address` get a new channel too.

        NOTE: a channel whose connection broke fails calls at once while it backs off from reconnecting
        (gRPC's backoff grows to minutes), so an instance restarted on the same address would be refused
        by the old channel; gRPC shares connections between channels unless a local pool is asked for."""
        stub_class = {"prefill": prefill_pb2_grpc.PrefillStub, "decode": decode_pb2_grpc.DecodeStub,
                      "vision": vision_pb2_grpc.VisionStub}[stage]
        channel = secure_channel(address, options=_LOCAL_POOL)
        try:
            stub_class(channel).Health(common_pb2.HealthRequest(), timeout=self.config.liveness_probe_timeout_s)
        except grpc.RpcError:
            channel.close()
            return False
        with self._lock:
            old = self._channels.get(address)
            self._channels[address] = channel
            if old is not None:
                self._old_channels.append(old)
        return True

    def _is_usable(self, stage: str, instance) -> bool:
        return self.outages.is_usable(instance.instance_id, instance.address,
                                      lambda: self._probe(stage, instance.address))

    def _usable_instances(self, stage: str, lb) -> list:
        """The stage's healthy, non-draining instances that are not lost ones still silent; [] when its
        balancer cannot be reached."""
        try:
            listed = lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=self.config.rpc_timeout_s)
        except grpc.RpcError:
            return []
        return [i for i in listed.instances if i.load.is_healthy and not i.load.is_draining
                and self._is_usable(stage, i)]

    def _revive_excluded(self, req: _Request, stage: str, lb, pick: loadbalancer_pb2.PickRequest) -> bool:
        """Drop from the pick's exclusions the instances lost by the request's last attempt, or excluded
        by its picks for being lost, that serve again (restarted under their id, a hung one back); True
        when any was dropped."""
        lost = {i for i in pick.exclude_instance_ids if i in req.lost_instance_ids or i in req.revivable_ids}
        if not lost:  # excluded for being full or draining: stays excluded
            return False
        usable = {i.instance_id for i in self._usable_instances(stage, lb)}
        kept = [i for i in pick.exclude_instance_ids if i not in lost or i not in usable]
        if len(kept) == len(pick.exclude_instance_ids):
            return False
        del pick.exclude_instance_ids[:]
        pick.exclude_instance_ids.extend(kept)
        return True

    def _wait_for_outage(self, req: _Request, stage: str, deadline: float | None) -> bool:
        """Sleeps one poll when `stage` is out and the request has time left; False (no sleep) otherwise."""
        until = self.outages.wait_until(stage)
        if until is None or (deadline is not None and time.monotonic() + OUTAGE_POLL_S >= deadline):
            return False
        time.sleep(OUTAGE_POLL_S)
        if req.abort_reason is not None:
            raise _Cancelled()
        return True

    @staticmethod
    def _may_wait_for_quarantine(req: _Request, deadline: float | None) -> bool:
        """Whether a request refused by every decode instance (full, or its capacity quarantined) may wait and try
        again: it was not aborted and its deadline leaves room for a poll and a reservation."""
        if req.abort_reason is not None:
            return False
        return deadline is None or deadline - time.monotonic() > 2 * QUARANTINE_POLL_S

    def _await_stage(self, req: _Request, stage: str, lb, deadline: float | None) -> None:
        """While `stage` is out (`StageOutages`), blocks until one of its instances is usable, the
        outage window ends or the deadline is near (then the pick answers)."""
        since = None
        while self.outages.wait_until(stage) is not None and not self._usable_instances(stage, lb):
            if since is None:
                since = time.monotonic()
                logger.info("%s: waiting for a %s instance to serve (the stage lost one)", req.request_id, stage)
            if not self._wait_for_outage(req, stage, deadline):
                logger.warning("%s: no %s instance came back in time", req.request_id, stage)
                return
        if since is not None:
            logger.info("%s: a %s instance serves again after %.1f s", req.request_id, stage, time.monotonic() - since)

    def _unary(self, req: _Request, method, message, deadline: float | None, what: str):
        timeout = None if deadline is None else max(0.001, deadline - time.monotonic())
        call = method.future(message, timeout=timeout)
        req.add_call(call)
        try:
            return call.result()
        except grpc.FutureCancelledError:
            raise _Cancelled() from None
        except grpc.RpcError as e:
            raise self._translate(req, e, what) from None

    @staticmethod
    def _translate(req: _Request, e: grpc.RpcError, what: str) -> Exception:
        if e.code() == grpc.StatusCode.CANCELLED and req.abort_reason is not None:
            return _Cancelled()
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return _Failed(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {req.request_id!r} ran out of time while {what}")
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            return _Failed(grpc.StatusCode.UNAVAILABLE, f"a stage instance became unreachable while {what}: "
                           f"{e.details()}")
        return _Failed(grpc.StatusCode.INTERNAL, f"{what} failed: {e.code().name} {e.details()}")

    # ------------------------------------------------------------------ Abort, Health

    def Abort(self, request, context):
        with self._lock:
            req = self._inflight.get(request.request_id)
        was_found = req is not None and req.abort(ABORT_RPC_REASON, self.config.rpc_timeout_s)
        return common_pb2.AbortResponse(was_found=was_found)

    def Health(self, request, context):
        """Healthy when prefill and decode can serve. The vision stage only serves image requests: with
        none of it healthy the entrypoint stays healthy (text flows) and says so as `degraded` (the
        message and the stats' `degraded` list) rather than taking every request off this entrypoint."""
        counts, problems, degraded = {}, [], []
        lbs = (("vision", self.vision_lb),) if self.vision_lb is not None else ()
        for stage, stub in (*lbs, ("prefill", self.prefill_lb), ("decode", self.decode_lb)):
            found = problems if stage != "vision" else degraded
            try:
                listed = stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=self.config.rpc_timeout_s)
                counts[stage] = sum(i.load.is_healthy and not i.load.is_draining for i in listed.instances)
                if not counts[stage]:
                    found.append(f"no healthy {stage} instance")
            except grpc.RpcError as e:
                found.append(f"{stage} balancer unreachable: {e.code().name}")
        with self._lock:
            num_inflight = len(self._inflight)
        stats = {"num_inflight_requests": num_inflight, **{f"num_{s}_instances": n for s, n in counts.items()},
                 **self.migration_stats.as_dict(), "phase_seconds": self.phase_times.as_dict()}
        if degraded:
            stats["degraded"] = [f"{d} (image requests fail until one serves)" for d in degraded]
        context.set_trailing_metadata(((STATS_METADATA_KEY, json.dumps(stats)),))
        message = "; ".join(problems + [f"degraded: {d}" for d in stats.get("degraded", ())])
        return common_pb2.HealthResponse(is_healthy=not problems, instance_id=self.instance_id, message=message)


_LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]
"""Channel option: its own connection (see `EntrypointServicer._probe`)."""


def _is_images_lost(error: common_pb2.Error) -> bool:
    """A stage could not read the image embeddings (in-band UNAVAILABLE on field image_embeddings)."""
    return error.code == common_pb2.ERROR_CODE_UNAVAILABLE and error.field == "image_embeddings"


def _abort_call(context, e: _Failed) -> None:
    """End the call with `e`'s status (raises)."""
    if e.field:
        context.set_trailing_metadata(((ERROR_FIELD_METADATA_KEY, e.field),))
    context.abort(e.status, str(e))


# ---------------------------------------------------------------------------------------- process


class EntrypointServer:
    """A running entrypoint (see `serve_entrypoint`)."""

    def __init__(self, config: EntrypointConfig) -> None:
        if not config.prefill_lb_address or not config.decode_lb_address:
            raise ValueError("the entrypoint needs prefill_lb_address and decode_lb_address (--prefill-lb-address, "
                             "--decode-lb-address)")
        from deepinfer.engine.hub import resolve_model
        from deepinfer.engine.loader import read_checkpoint_config

        # NOTE: the loader's own check: the entrypoint accepts exactly the checkpoints the workers load
        model_config, _ = read_checkpoint_config(resolve_model(config.model, config.revision))
        self.config = config
        self.instance_id = config.instance_id or f"entrypoint-{uuid.uuid4().hex[:8]}"
        max_model_len = config.max_model_len or min(model_config.max_position_embeddings, 8192)
        self.servicer = EntrypointServicer(config, self.instance_id, model_config.vocab_size, max_model_len)
        if model_config.image_token_id is not None:
            self.servicer.image_token_id = model_config.image_token_id
        self.servicer.model_path = str(resolve_model(config.model, config.revision))
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(
            max_workers=config.max_rpc_threads, thread_name_prefix="entrypoint-rpc"),
            interceptors=server_interceptors())  # the cluster secret (serving.auth)
        entrypoint_pb2_grpc.add_EntrypointServicer_to_server(self.servicer, self.server)
        self.port = add_port(self.server, f"{config.host}:{config.port}")  # TLS when set (serving.auth)
        if self.port == 0:
            raise RuntimeError(f"cannot bind the entrypoint to {config.host}:{config.port}")
        self.address = f"{config.advertise_host or config.host}:{self.port}"
        self._stopped = threading.Event()

    def start(self) -> None:
        self.server.start()
        logger.info("entrypoint %s serving on %s (prefill balancer %s, decode balancer %s)", self.instance_id,
                    self.address, self.config.prefill_lb_address, self.config.decode_lb_address)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until stopped; False on timeout."""
        return self._stopped.wait(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        """Blocks until the server stopped (in-flight calls get `grace_s`, then are cancelled and aborted)."""
        if self._stopped.is_set():
            return
        self.server.stop(grace_s).wait()
        self.servicer.close()
        self._stopped.set()


def serve_entrypoint(config: EntrypointConfig) -> EntrypointServer:
    """Blocks until the entrypoint serves on `config.host:port`; returns its handle.

    Raises ValueError for a missing balancer address, RuntimeError if the port cannot be bound.
    """
    server = EntrypointServer(config)
    server.start()
    return server
