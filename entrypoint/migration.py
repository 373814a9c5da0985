"""Request migration: no accepted request is lost when its decode (or prefill) instance dies or hangs.

```python
stream = run_migrating(servicer._generate, req, request, deadline, limit=3, rpc_timeout_s=10.0)
for response in stream: ...   # the client's stream, across as many prefill -> decode pairs as it took
```

When the instance serving a request is lost, the entrypoint re-submits the request to another
prefill -> decode pair as its *continuation*: the prompt followed by every token the client has
already received, with `max_tokens` / `min_tokens` lowered by that count (`continuation`). The
new pair's first token is the token after the last one the client saw, so the client's stream goes
on with no duplicated and no missing token:

- Greedy output equals an uninterrupted run: the continuation's prefill computes exactly the KV an
  uninterrupted decode would hold (DESIGN.md §7, disaggregation does not change a greedy output).
  The continuation names the client's prompt length (`num_original_prompt_tokens`): what a model
  fixes by the prompt alone keeps it (DeepSeek-V4.1's decoder-side bounded replay starts its tail at
  the original prompt's last window), so in batch-invariant mode the continuation's tokens and
  logprobs are the uninterrupted run's bit for bit.
- Seeded sampling stays reproducible: the sampler's noise is a pure function of (seed, position of
  the token being sampled) (`engine.sampling.sampler`), and the continuation keeps every position.
- Repetition penalty counts prompt and output tokens alike, so moving the output into the prompt
  keeps it exact. Presence / frequency penalties (output tokens only) and structured output (the
  grammar's state) are not: such a request is migrated only while it has streamed nothing yet;
  afterwards the failure is reported with its cause (`not_migratable_reason`).

What counts as lost (`is_lost`): the decode stream broke with UNAVAILABLE (the process died, its
connection reset), a `StageLiveness` check found the decode or prefill instance serving the request
gone (missed heartbeats at its balancer and no answer to a direct Health probe: SIGSTOP, a stuck
kernel), or a stage call failed with UNAVAILABLE before any token (a prefill instance died mid-call,
no instance serves the stage for a moment: the retry waits `RETRY_BACKOFF_S` and picks again,
bounded by the limit and the request's deadline). Each migration costs one of `--migration-limit`
(default 3) tries.

Queued work survives a restart (`StageOutages`): once a stage lost an instance, requests that find
no usable instance of it (none listed, or only lost ones that do not answer a Health probe yet) wait
for one, bounded by their deadline and `--outage-wait-s`, before reserving anything on decode; a
restarted instance (same id, new port) is used as soon as it answers. Waiting costs no migration.
The vision stage is covered too: an `Encode` that fails UNAVAILABLE (no embeddings held yet) or
embeddings lost before the prefill / decode read them mark its instance lost, and `StageMembership`
notices one that left its balancer's listing between two calls without draining; a stage that never
had an instance (or drained its last) still fails image requests at once.
A stage whose *balancer* cannot be reached (killed, restarting on the same address) is out too
(`StageOutages.mark_out`): picks wait for it, and for its instances to re-register on their next
heartbeat (`serving.membership`), within the same bounds, instead of failing the request.

Before a retry the attempt's stages are aborted: a reachable instance synchronously (so a retry on
the same instance finds the request id free; a decode instance quarantines the aborted reservation's
blocks until its lease ends, so a late WRITE of the lost prefill cannot land in blocks reused by
others), the lost one in a daemon thread (it may never answer). When the lost prefill's process is
certainly gone (its port refuses connections, `is_process_gone`), no WRITE of it can land: the abort
says so (`AbortRequest.writer_gone`) and decode frees the reservation after a one-second grace (bytes still
in flight) instead of at lease end. A hung decode instance that comes
back is *fenced*: the entrypoint cancelled its Start stream, so on SIGCONT its gRPC server sees the
cancellation and aborts the request there (its blocks are freed, its stale stream goes nowhere), and
it re-registers with its balancer on its next heartbeat (`serving.membership`), rejoining clean.

Usage stays right: `prompt_tokens` is the client's prompt, `completion_tokens` every token the
client received, `cached_prompt_tokens` the first prefill's prefix-cache hit. Text stays right
(`TextAcrossMigration`): what a lost decode held back (a possible stop-string start, a split UTF-8
character) is recomputed with the tokenizer and sent, and stop strings spanning the migration point
are found here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from deepinfer.engine.sampling.stop import check_stop_strings, stop_hold_back_len
from deepinfer.protos import common_pb2, entrypoint_pb2, loadbalancer_pb2, prefill_pb2_grpc
from deepinfer.serving.auth import secure_channel

logger = logging.getLogger("entrypoint.migration")

RETRY_BACKOFF_S = 0.5
"""Wait before re-picking after a failure that lost no identified instance (none serves the stage now)."""
OUTAGE_POLL_S = 0.25
"""How often a request waiting for a stage to come back looks at its balancer again."""
WRITER_GONE_REASON = "writer gone: "
"""Prefix of the (logged) reason of an Abort sent with `writer_gone=True`: the prefill writing into the
request's reservation on decode is dead (its process no longer exists)."""


class DecodeLost(Exception):
    """The decode instance serving a request died or stopped answering mid-request.

    `failed` is the exception that ends the call if the request cannot be migrated."""

    def __init__(self, instance_id: str, failed: Exception) -> None:
        super().__init__(f"decode instance {instance_id} was lost: {failed}")
        self.instance_id = instance_id
        self.failed = failed


def not_migratable_reason(sampling: common_pb2.SamplingParams) -> str | None:
    """Why a request that already streamed tokens cannot continue exactly elsewhere; None = it can."""
    if sampling.presence_penalty or sampling.frequency_penalty:
        return "presence / frequency penalties count only output tokens, which a continuation would see as prompt"
    if sampling.structured_output.WhichOneof("constraint") is not None:
        return "structured output's grammar state cannot be carried to another instance"
    return None


def continuation(request: entrypoint_pb2.GenerateRequest,
                 generated_token_ids: list[int]) -> entrypoint_pb2.GenerateRequest | None:
    """The request that continues `request` after the client received `generated_token_ids`:
    prompt + those tokens, `max_tokens` and `min_tokens` lowered by their count, and
    `num_original_prompt_tokens` the client's prompt length (kept when `request` is itself a continuation).

    None when nothing is left to generate (`max_tokens` reached); the caller ends the stream with
    finish_reason LENGTH. Images keep their offsets (the generated tokens follow the whole prompt).
    """
    out = entrypoint_pb2.GenerateRequest()
    out.CopyFrom(request)
    n = len(generated_token_ids)
    if n == 0:
        return out
    if not request.HasField("num_original_prompt_tokens"):
        out.num_original_prompt_tokens = len(request.prompt_token_ids)
    out.prompt_token_ids.extend(generated_token_ids)
    sampling = out.sampling_params
    if sampling.HasField("max_tokens"):
        if sampling.max_tokens - n <= 0:
            return None
        sampling.max_tokens -= n
    sampling.min_tokens = max(0, sampling.min_tokens - n)
    return out


def is_lost(e: Exception) -> bool:
    """A failure after which the request may complete on another instance (see the module docstring)."""
    return isinstance(e, DecodeLost) or getattr(e, "status", None) == grpc.StatusCode.UNAVAILABLE


class MigrationStats:
    """Counters of one entrypoint (thread-safe), for its Health stats."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.num_migrations_total = 0
        self.num_migrated_requests_total = 0
        self.num_not_migrated_total = 0

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        with self._lock:
            return {"num_migrations_total": self.num_migrations_total,
                    "num_migrated_requests_total": self.num_migrated_requests_total,
                    "num_not_migrated_total": self.num_not_migrated_total}


class TextAcrossMigration:
    """The client's text across migrations (`run_migrating`): what it received, the text a lost decode
    instance held back, and the request's stop strings where they may span the migration point.

    A decode instance streams a token's text only once it cannot be the start of a stop string (and
    not while it ends mid UTF-8 character), so when it is lost some tokens the client received may
    have text it never sent; and a continuation's decode sees the streamed tokens as prompt, so it
    would miss a stop string that starts before the migration point, and its text for the new tokens
    may differ from an uninterrupted run's where the migration point splits a character. So after
    the first migration the text is made here, as the engine makes it (`new_detokenizer(prompt,
    skip_special_tokens)`: the engine's `IncrementalDetokenizer` over the client's prompt, fed token
    by token): the part of the received tokens' text the client lacks is sent with the next
    response, the continuation's own text is replaced, and the stop strings are applied here (the
    continuation goes without them) as the engine's `StopChecker` does: once more than `min_tokens`
    tokens were generated, text cut before the stop (after it with `include_stop_str_in_output`), an
    EOS / stop token's text dropped unless included, trailing text that may start a stop string held
    back. Without `new_detokenizer` (no tokenizer at the entrypoint) text passes through unchanged.
    """

    def __init__(self, sampling: common_pb2.SamplingParams, new_detokenizer: Callable | None) -> None:
        self.stops = list(sampling.stop)
        self.include_stop = sampling.include_stop_str_in_output
        self.min_tokens = sampling.min_tokens
        self.skip_special_tokens = sampling.skip_special_tokens if sampling.HasField("skip_special_tokens") else True
        self.new_detokenizer = new_detokenizer
        self.detokenizer = None
        """The entrypoint's detokenizer of the output, from the first migration on."""
        self.sent = ""
        """Text the client received."""
        self.pending = ""
        """Text of received tokens not sent yet (held back by a lost decode instance, or here)."""
        self.is_checking_stops = False
        """The stop strings are checked here (the continuation goes without them)."""

    def on_migrate(self, prompt: list[int], generated: list[int], current: entrypoint_pb2.GenerateRequest) -> None:
        """Before `current` (the continuation after `generated`) is sent: recover the held-back text and
        take the text and the stop strings over."""
        if self.new_detokenizer is None:
            return
        if self.detokenizer is None:
            try:
                detokenizer = self.new_detokenizer(prompt, self.skip_special_tokens)
                full = "".join(detokenizer.append([t]) for t in generated)
            except Exception as e:  # text recovery is best effort: the tokens are what matters
                logger.warning("cannot recompute the streamed text after a migration: %s", e)
                return
            if not full.startswith(self.sent):
                logger.warning("the streamed text is not the tokens' text; the continuation's text is passed on")
                return
            self.detokenizer, self.pending = detokenizer, full[len(self.sent):]
        if self.stops:
            self.is_checking_stops = True
            del current.sampling_params.stop[:]

    def on_response(self, response: entrypoint_pb2.GenerateResponse, num_generated: int) -> bool:
        """Rewrite `response` for the client (`num_generated`: tokens before it); True when a stop string
        ended the request here (`response` is then the stream's last: its tokens up to the one that
        completed the stop, finish_reason STOP, stop_str set)."""
        if self.detokenizer is None:
            self.sent += response.text
            return False
        tokens = list(response.token_ids)
        ends_on_stop_token = (response.finish_reason == common_pb2.FINISH_REASON_STOP
                              and response.HasField("stop_token_id") and not self.include_stop)
        unsent = self.pending
        for i, token in enumerate(tokens):
            if ends_on_stop_token and i + 1 == len(tokens):
                break  # an EOS / stop token's text is not output
            delta = self.detokenizer.append([token])
            unsent += delta
            if not (delta and self.is_checking_stops and num_generated + i + 1 > self.min_tokens):
                continue
            stop, cut = check_stop_strings(self.sent + unsent, len(delta), self.stops, self.include_stop)
            if stop is not None:
                del response.token_ids[i + 1:]
                if len(response.logprobs) > i + 1:
                    del response.logprobs[i + 1:]
                response.text = cut[len(self.sent):]
                self.sent, self.pending = self.sent + response.text, ""
                response.finish_reason = common_pb2.FINISH_REASON_STOP
                response.stop_str = stop
                return True
        hold = 0
        if self.is_checking_stops and not response.finish_reason:
            hold = min(len(unsent), stop_hold_back_len(self.sent + unsent, self.stops))
        response.text = unsent[:len(unsent) - hold]
        self.pending = unsent[len(unsent) - hold:]
        self.sent += response.text
        return False


def run_migrating(generate: Callable, req, request: entrypoint_pb2.GenerateRequest, deadline: float | None, *,
                  limit: int, rpc_timeout_s: float, stats: MigrationStats | None = None,
                  new_detokenizer: Callable | None = None,
                  ) -> Iterator[entrypoint_pb2.GenerateResponse]:
    """Blocks on `generate(req, request, deadline)` (the servicer's one-pair request path) and yields
    its responses; when the pair is lost, yields on from a continuation on another pair, up to
    `limit` times. Raises what `generate` raised when the request cannot be migrated.

    `req` is the servicer's per-call state (`entrypoint.server._Request`): its `prefill` / `decode`
    (instance id, stub) name the attempt's instances, `lost_instance_ids` are excluded from later
    picks, `num_resumed_tokens` (prompt tokens that are the client's output) keeps `usage` right.
    `new_detokenizer(prompt, skip_special_tokens)`: the engine's incremental detokenizer, to recover
    what a lost decode held back and check stop strings across the migration point
    (`TextAcrossMigration`).
    A stop string found here ends the stream; the caller then aborts the pair still decoding
    (`req` is left not done).
    """
    generated: list[int] = []
    num_responses = 0
    first_cached: int | None = None
    num_prompt_tokens: int | None = None
    current = request
    text = TextAcrossMigration(request.sampling_params, new_detokenizer)
    for attempt in range(limit + 1):
        try:
            for response in generate(req, current, deadline):
                if num_prompt_tokens is None:
                    num_prompt_tokens = req.usage.prompt_tokens
                if first_cached is None:
                    first_cached = req.usage.cached_prompt_tokens
                if attempt:
                    _fix_usage(response, num_responses, num_prompt_tokens, first_cached,
                               len(generated) + len(response.token_ids))
                is_stopped_here = text.on_response(response, len(generated))
                generated.extend(response.token_ids)
                num_responses += 1
                if is_stopped_here:
                    response.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=num_prompt_tokens, completion_tokens=len(generated),
                        cached_prompt_tokens=min(first_cached or 0, num_prompt_tokens)))
                    yield response
                    if stats is not None:
                        stats.add(num_migrated_requests_total=1)
                    return
                yield response
            if attempt and stats is not None:
                stats.add(num_migrated_requests_total=1)
            return
        except Exception as e:
            if not is_lost(e) or req.abort_reason is not None:
                raise
            failed = e.failed if isinstance(e, DecodeLost) else e
            reason = not_migratable_reason(request.sampling_params) if generated else None
            if reason is None and attempt == limit:
                reason = f"the migration limit ({limit}) is reached"
            if reason is None and deadline is not None and time.monotonic() >= deadline:
                reason = "its deadline ran out"
            lost = _release_attempt(req, e, rpc_timeout_s)
            if reason is not None:
                logger.warning("%s: %s; not migrated: %s", req.request_id, failed, reason)
                if stats is not None:
                    stats.add(num_not_migrated_total=1)
                raise failed from None
            logger.warning("%s: %s; migrating with %d tokens streamed (migration %d of at most %d)",
                           req.request_id, failed, len(generated), attempt + 1, limit)
            if stats is not None:
                stats.add(num_migrations_total=1)
            if lost is None:
                time.sleep(RETRY_BACKOFF_S)
            current = continuation(request, generated)
            if current is None:  # the client already has max_tokens tokens: only the finish was lost
                last = _finished(req, num_prompt_tokens or len(request.prompt_token_ids), first_cached, generated)
                text.on_migrate(list(request.prompt_token_ids), generated, entrypoint_pb2.GenerateRequest())
                last.text, text.pending = text.pending, ""  # what the lost decode held back
                yield last
                return
            text.on_migrate(list(request.prompt_token_ids), generated, current)
            req.num_resumed_tokens = len(generated)
            req.usage.completion_tokens = len(generated)


def _fix_usage(response, num_responses: int, num_prompt_tokens: int, first_cached: int | None,
               num_completion_tokens: int) -> None:
    """A continuation's response as the client's stream would carry it: usage on the first response
    of the whole stream and on the last only, counting the client's prompt and all its tokens."""
    if not response.HasField("usage"):
        return
    if num_responses and not response.finish_reason:
        response.ClearField("usage")
        return
    response.usage.prompt_tokens = num_prompt_tokens
    response.usage.completion_tokens = num_completion_tokens
    cached = response.usage.cached_prompt_tokens if first_cached is None else first_cached
    response.usage.cached_prompt_tokens = min(cached, num_prompt_tokens)


def _finished(req, num_prompt_tokens: int, first_cached: int | None, generated: list[int]):
    with req.lock:
        req.is_done = True
    return entrypoint_pb2.GenerateResponse(
        request_id=req.request_id, finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=len(generated),
                               cached_prompt_tokens=min(first_cached or 0, num_prompt_tokens)))


def _release_attempt(req, e: Exception, rpc_timeout_s: float) -> str | None:
    """Abort the failed attempt on its stages (prefill first, then decode); returns the lost instance's id.

    The lost instance is excluded from later picks and aborted in a daemon thread (it may never
    answer); the others are aborted before the retry, so the request id is free on them again."""
    with req.lock:
        prefill, decode, req.prefill, req.decode = req.prefill, req.decode, None, None
        req.calls = []
    if isinstance(e, DecodeLost):
        lost = e.instance_id
    elif prefill is not None:
        lost = prefill[0]  # the prefill call itself failed
    else:
        lost = None
    stages = [s for s in (prefill, decode) if s is not None]
    # NOTE: only the last attempt's loss is excluded: an instance restarted under the same id serves again
    req.lost_instance_ids = [lost] if lost is not None else []
    reachable = [s for s in stages if s[0] != lost]
    gone = [s for s in stages if s[0] == lost]
    reason = f"migrated: {e}"
    address = getattr(req, "prefill_address", "")
    if prefill is not None and lost == prefill[0] and decode is not None and (
            is_address_gone(address) if address else is_process_gone(prefill[1])):
        # the prefill that was to WRITE into D's reservation no longer exists: D frees it now rather
        # than quarantining it until its lease ends (the restarted or other prefill needs the room)
        req._abort_stages([decode], f"{WRITER_GONE_REASON}prefill instance {prefill[0]} is gone; {reason}",
                          rpc_timeout_s, writer_gone=True)
        reachable = [s for s in reachable if s is not decode]
    if reachable:
        req._abort_stages(reachable, reason, rpc_timeout_s)
    if gone:
        threading.Thread(target=req._abort_stages, args=(gone, reason, rpc_timeout_s),
                         name="entrypoint-abort-lost", daemon=True).start()
    return lost


def is_process_gone(stub, timeout_s: float = 0.5) -> bool:
    """Whether the instance behind `stub` certainly no longer runs: a Health probe is refused at the
    connection (nothing listens on its port: the process died or restarted elsewhere). A probe that
    times out (a hung process, a cut link) proves nothing: the instance may still write."""
    try:
        stub.Health(common_pb2.HealthRequest(), timeout=timeout_s)
        return False
    except grpc.RpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (e.details() or "").lower()
    except AttributeError:  # a stub without Health (tests' fakes): unknown
        return False


def is_address_gone(address: str, timeout_s: float = 0.5) -> bool:
    """`is_process_gone` over a fresh connection to `address`: a channel whose calls just broke answers
    with the error that broke them (a reset) while it backs off, not with the refusal of a new connect.
    NOTE: gRPC shares subchannels between channels to the same address; a local pool gives a new one."""
    channel = secure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        return is_process_gone(prefill_pb2_grpc.PrefillStub(channel), timeout_s)  # any service: refused is refused
    finally:
        channel.close()


class StageOutages:
    """The stages that lost an instance recently, and those instances (thread-safe).

    A stage instance whose call broke (UNAVAILABLE at the transport, missed heartbeats) marks its
    stage *out* for `wait_s`. While a stage is out, a request that finds no usable instance of it
    waits (polling the balancer every `OUTAGE_POLL_S`, bounded by its deadline and the outage window)
    instead of failing at once: queued work survives a restart (the Ray launcher restarts a dead
    worker ~15 s later; a balancer keeps listing a dead instance until its heartbeats time out). A
    stage nobody saw fail (drained away, never started) still answers UNAVAILABLE at once.

    A lost instance is *usable* again once a Health probe at the address its balancer lists now is
    answered (a restarted process under the same id, or the hung one back: it rejoins clean, its stale
    streams were cancelled). Probe results are cached per address for `OUTAGE_POLL_S`, so a burst of
    waiting requests costs one probe per poll.
    """

    def __init__(self, wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s = wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._lost_at: dict[str, float] = {}  # stage -> when it last lost an instance
        self._lost: dict[str, str] = {}  # instance id -> the address it was lost at
        self._probes: dict[str, tuple[float, bool]] = {}  # address -> (when, answered)

    def mark_out(self, stage: str) -> None:
        """`stage` is out with no instance lost: its balancer cannot be reached (it died or restarts;
        a restarted balancer knows no instance until their next heartbeats re-register them).

        NOTE: unlike `mark_lost` it does not extend an outage already marked: callers mark on every
        failed poll, and a balancer that stays away must not keep requests waiting past `wait_s`."""
        with self._lock:
            now = self._clock()
            lost_at = self._lost_at.get(stage)
            if lost_at is None or now >= lost_at + self.wait_s:
                self._lost_at[stage] = now

    def mark_lost(self, stage: str, instance_id: str, address: str = "") -> None:
        with self._lock:
            self._lost_at[stage] = self._clock()
            self._lost[instance_id] = address
            self._probes.pop(address, None)

    def wait_until(self, stage: str) -> float | None:
        """The clock time until which requests wait for `stage`; None = it is not out."""
        with self._lock:
            lost_at = self._lost_at.get(stage)
        if lost_at is None or self._clock() >= lost_at + self.wait_s:
            return None
        return lost_at + self.wait_s

    def is_known_lost(self, instance_id: str) -> bool:
        with self._lock:
            return instance_id in self._lost

    def is_usable(self, instance_id: str, address: str, probe: Callable[[], bool]) -> bool:
        """False while `instance_id` is a lost instance that does not answer at `address`."""
        with self._lock:
            if instance_id not in self._lost:
                return True
            cached = self._probes.get(address)
        if cached is not None and self._clock() - cached[0] < OUTAGE_POLL_S:
            answered = cached[1]
        else:
            answered = probe()
            with self._lock:
                self._probes[address] = (self._clock(), answered)
        if answered:
            with self._lock:
                self._lost.pop(instance_id, None)
        return answered


class StageLiveness:
    """Finds `stage` instances (decode, prefill) that stopped answering while they serve requests (a
    thread, polling).

    Every `interval_s`, while any request is watched, it lists the stage balancer's instances; an
    instance missing there (its heartbeats stopped for the balancer's timeout, or it deregistered)
    is probed with a direct Health call (`probe_timeout_s`); when that fails too, every request
    watched on it is marked lost (`req.lost_<stage>_id`) and its calls cancelled, so its stage call
    ends and `run_migrating` moves it. A balancer that cannot be reached marks nothing (it may be
    restarting). `on_lost(instance_id)` is called once per instance found lost;
    `on_balancer_unreachable()` each time the balancer cannot be reached.
    """

    def __init__(self, lb, interval_s: float = 0.5, probe_timeout_s: float = 1.0, stage: str = "decode",
                 on_lost: Callable[[str], None] | None = None,
                 on_balancer_unreachable: Callable[[], None] | None = None) -> None:
        self.lb = lb
        self.on_balancer_unreachable = on_balancer_unreachable
        self.stage = stage
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._watched: dict[object, tuple[str, object]] = {}  # req -> (instance id, stub)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"entrypoint-{stage}-liveness", daemon=True)
        self._thread.start()

    def watch(self, req, instance_id: str, stub) -> None:
        with self._lock:
            self._watched[req] = (instance_id, stub)

    def unwatch(self, req) -> None:
        with self._lock:
            self._watched.pop(req, None)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                watched = dict(self._watched)
            if not watched:
                continue
            try:
                listed = self.lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(),
                                               timeout=max(self.interval_s, 1.0))
            except grpc.RpcError as e:
                if (e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                        and self.on_balancer_unreachable is not None):
                    self.on_balancer_unreachable()
                continue
            present = {i.instance_id for i in listed.instances}
            missing: dict[str, object] = {}
            for instance_id, stub in watched.values():
                if instance_id not in present:
                    missing[instance_id] = stub
            for instance_id, stub in missing.items():
                if self._answers(stub):
                    continue
                logger.warning("%s instance %s missed its heartbeats and does not answer: migrating its "
                               "requests", self.stage, instance_id)
                if self.on_lost is not None:
                    self.on_lost(instance_id)
                for req, (iid, _) in watched.items():
                    if iid == instance_id:
                        self._mark_lost(req, instance_id)

    def _answers(self, stub) -> bool:
        try:
            stub.Health(common_pb2.HealthRequest(), timeout=self.probe_timeout_s)
            return True
        except grpc.RpcError:
            return False

    def _mark_lost(self, req, instance_id: str) -> None:
        with req.lock:
            current = getattr(req, self.stage)
            if current is None or current[0] != instance_id or req.is_done:
                return
            setattr(req, f"lost_{self.stage}_id", instance_id)
            calls = list(req.calls)
        for call in calls:
            call.cancel()
        self.unwatch(req)


class StageMembership:
    """Finds instances of `stage` that vanished from its balancer's listing without draining (a thread,
    polling every `interval_s` whether or not requests run), and marks each lost in `outages` when
    `probe(address)` gets no answer either: the stage is then *out* (`StageOutages`) and requests that
    find no instance wait for the restart instead of failing at once.

    `StageLiveness` notices a loss only on instances serving a request; for a stage of one instance that
    serves short calls (vision: `Encode` is over in milliseconds) the instance can die between calls and
    its heartbeats time out before any request picks it, and the stage would then look like one that
    never had an instance. A drained instance (listed as draining, then deregistered) or one that still
    answers is not lost; a balancer that cannot be reached changes nothing (its restart lists nothing
    until the heartbeats re-register the instances).
    """

    def __init__(self, lb, stage: str, outages: StageOutages, probe: Callable[[str], bool],
                 interval_s: float = 0.5) -> None:
        self.lb = lb
        self.stage = stage
        self.outages = outages
        self.probe = probe
        self.interval_s = interval_s
        self._listed: dict[str, tuple[str, bool]] = {}  # instance id -> (address, draining) at the last poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"entrypoint-{stage}-membership", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> list[str]:
        """One look at the listing; returns the instances marked lost."""
        try:
            listed = self.lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=max(self.interval_s, 1.0))
        except grpc.RpcError:
            return []
        now = {i.instance_id: (i.address, i.load.is_draining) for i in listed.instances}
        lost = []
        for instance_id, (address, was_draining) in self._listed.items():
            if instance_id in now or was_draining or self.probe(address):
                continue
            logger.warning("%s instance %s left its balancer's listing without draining and does not answer: "
                           "requests wait for it (or another) to serve", self.stage, instance_id)
            self.outages.mark_lost(self.stage, instance_id, address)
            lost.append(instance_id)
        self._listed = now
        return lost


class DecodeLiveness(StageLiveness):
    """`StageLiveness` of the decode stage (hung decode instances: SIGSTOP, a stuck kernel)."""

    def __init__(self, decode_lb, interval_s: float = 0.5, probe_timeout_s: float = 1.0,
                 on_lost: Callable[[str], None] | None = None,
                 on_balancer_unreachable: Callable[[], None] | None = None) -> None:
        super().__init__(decode_lb, interval_s, probe_timeout_s, "decode", on_lost, on_balancer_unreachable)
