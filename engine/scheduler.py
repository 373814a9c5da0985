"""Continuous-batching scheduler: which requests run in the next step, and with how many tokens.

Pure Python over `KVCacheManager` (block tables) and `StateSlotPool` (bounded-state slots); no
model, no tensors. The engine drives it as `schedule()` -> run the model -> `update_from_output()`.

Policy, per step, under a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`):

1. Decode first: every running request with exactly one token to compute gets it.
2. Running partial prefills (chunked prompts, and recomputes after preemption) get chunks next.
3. Waiting requests are admitted in FCFS order or by `(priority, arrival)` (smaller `priority`
   first). A waiting request first looks up its prefix in the cache and starts at the hit; with a
   `replay_tokens_fn` it steps back that many tokens (bounded replay, DESIGN.md §4) but keeps the
   hit blocks: the recomputed tokens rebuild the per-request bounded state, while the compressed
   entries of the hit stay read-only (`NewRequestData.num_cached_tokens` tells the model runner
   where they end; the first replayed tokens are not exact at every layer, so they must never
   overwrite shared entries). A request whose KV was imported (`KVCacheManager.import_blocks`)
   is added with `num_computed_tokens` set and starts there, minus the replay.

A step samples a token for a request exactly when it computes the request's last known token
(`sampling_req_ids`); a request in the middle of a prefill or recompute produces nothing. EOS, stop
strings and stop tokens are the engine's business (it reports them to `update_from_output`); the
scheduler itself only enforces the hard caps `max_tokens` and `max_model_len` (FINISHED_LENGTH).

Preemption: when a running request needs a block and none is free, the running request with the
largest `(priority, arrival)` key (the latest arrival under FCFS) is preempted: its blocks and slot
are freed, its `num_computed_tokens` reset to 0, and it goes back to the front of the waiting queue
to recompute prompt plus outputs later (its prefix may still be cached). A request that would need
more blocks than the whole pool holds is finished with FINISHED_ERROR and a message, so the
scheduler never loops. Waiting requests never preempt running ones.

Async scheduling: `schedule()` for step N+1 may run before `update_from_output()` of step N.
`schedule()` advances `num_computed_tokens` as soon as it schedules tokens, and every step that
samples for a request adds an output *placeholder* (`num_output_placeholders`): the request then
counts one more token than it knows, so step N+1 can schedule the decode of the token step N is
still sampling. The engine fills that input from its on-device sampled tokens; `update_from_output`
replaces the placeholder with the real token. Rules that keep this correct:

* `update_from_output` must be called once per non-empty output, in schedule order;
* a waiting (preempted) request is not re-admitted while it has placeholders: its recompute needs
  every token id;
* requests at their `max_tokens` / `max_model_len` counting placeholders are not scheduled again;
* blocks are registered in the prefix cache only up to what the reported step computed, and not
  at all if the request was preempted since.

NOTE: with one step in flight, a request finished or preempted at update N may still be written by
step N+1 on the device; its freed blocks and slot can only be reused by step N+2 or later, which
runs after N+1 in stream order. The engine must keep that order (one device stream per instance).
Synchronous engines call `schedule()` and `update_from_output()` alternately and never see a
placeholder.

Speculative decoding (`engine.spec_decode`, synchronous engines only): the engine leaves a running
request's draft tokens in `Request.spec_token_ids`; its next decode then computes its last token plus
those drafts (trimmed so that accepting all of them plus one more token stays within `max_tokens`
and `max_model_len`, and within the step's budget) and samples one token per computed position.
`update_from_output` takes 1 + (accepted drafts) tokens for it and moves `num_computed_tokens` back
over the rejected drafts (their cache rows were already rolled back by the step's run).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.engine.cache.block_pool import KVCacheManager, StateSlotPool
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.multimodal import ImageSpan
from deepinfer.engine.sampling.params import SamplingParams

# ---------------------------------------------------------------------------------------- config


class SchedulerConfig(BaseModel):
    """Batching limits and the admission policy of one engine instance."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_num_batched_tokens: int = Field(8192, gt=0)
    """Token budget of one step (decode tokens plus prefill chunks)."""
    max_num_seqs: int = Field(256, gt=0)
    """Most requests running at once."""
    max_model_len: int = Field(65536, gt=1)
    """Longest sequence (prompt plus output) a request may reach."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Admission order of waiting requests: arrival order, or smallest `priority` first then arrival."""

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a prompt must fit one step, but max_num_batched_tokens="
                f"{self.max_num_batched_tokens} < max_model_len={self.max_model_len}; raise "
                "max_num_batched_tokens to at least max_model_len or set enable_chunked_prefill=True."
            )
        return self


# ---------------------------------------------------------------------------------------- request


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; every FINISHED_* value is terminal."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        """Whether the status is terminal."""
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length", "abort" or "error" for finished statuses, else None."""
        return _FINISH_REASONS.get(self)

    @classmethod
    def from_finish_reason(cls, reason: str | RequestStatus) -> RequestStatus:
        """The finished status of a reason string ("stop", "length", "abort", "error")."""
        if isinstance(reason, RequestStatus):
            if not reason.is_finished:
                raise ValueError(f"{reason.name} is not a finished status")
            return reason
        for status, name in _FINISH_REASONS.items():
            if name == reason:
                return status
        raise ValueError(f"unknown finish reason {reason!r}; use one of {sorted(_FINISH_REASONS.values())}")


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def check_num_original_prompt_tokens(value, num_prompt_tokens: int) -> None:
    """Refuse (InvalidRequestError) a continuation's original prompt length that is not an int in
    `[1, num_prompt_tokens]` (`Request.num_original_prompt_tokens`); None passes (not a continuation)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= num_prompt_tokens:
        raise InvalidRequestError(
            f"num_original_prompt_tokens must be an int in [1, {num_prompt_tokens}] (the prompt length of the request "
            f"this one continues; the rest of the prompt is what it generated), got {value!r}; leave it unset for a "
            "request that continues none", field="num_original_prompt_tokens")


@dataclass(eq=False)
class Request:
    """One sequence as the scheduler sees it (a child of an `n > 1` request is its own Request)."""

    req_id: str
    prompt_token_ids: list[int]
    """Token ids of the prompt (image placeholders included)."""
    max_tokens: int | None = None
    """Cap on output tokens; None means up to `max_model_len`."""
    priority: int = 0
    """Smaller runs first under the "priority" policy."""
    arrival_time: float = field(default_factory=time.monotonic)
    """`time.monotonic()` when the request arrived; breaks priority ties and picks preemption victims."""
    sampling_params: SamplingParams | None = None
    """Carried for the engine; the scheduler does not read it."""
    image_spans: tuple[ImageSpan, ...] = ()
    """Image placeholders in the prompt; their content hashes key the prefix hash of blocks they touch."""
    output_token_ids: list[int] = field(default_factory=list)
    """Sampled tokens so far (only `append_output_token_ids` changes them)."""
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache or scheduled to be written by a step already handed out."""
    status: RequestStatus = RequestStatus.WAITING
    num_output_placeholders: int = 0
    """Tokens being sampled by steps in flight, whose values are not known yet (async scheduling)."""
    num_preemptions: int = 0
    """Times the request was preempted."""
    error_message: str | None = None
    """Why the request finished with FINISHED_ERROR."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify with the request's next decode (speculative decoding; set by the engine,
    consumed by the next `schedule()`)."""
    imported_state_start: int | None = None
    """Set when the request's bounded state was written from outside into the state slot it already
    holds (prefill -> decode with the state sent): it is admitted on that slot with no bounded
    replay, its sliding window valid from this position on. Cleared at admission."""
    num_original_prompt_tokens: int | None = None
    """Set when the request continues an earlier one (a migration's or a restart's continuation): the length of
    that request's prompt, the rest of `prompt_token_ids` being tokens it generated. What a model fixes by the
    prompt alone (V4.1's decoder-side bounded replay tail start) uses it, so the continuation computes what the
    uninterrupted request would have. None: the whole prompt is the original (`num_replay_prompt_tokens`)."""
    all_token_ids: list[int] = field(init=False)
    """Prompt followed by the outputs so far (kept in sync by `append_output_token_ids`)."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = list(self.output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_replay_prompt_tokens(self) -> int:
        """The prompt length that fixes V4.1's decoder-replay tail start (`SeqChunk.num_prompt_tokens`): the
        original prompt's for a continuation (`num_original_prompt_tokens`), else this prompt's."""
        n = self.num_original_prompt_tokens
        return self.num_prompt_tokens if n is None else n

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus outputs (placeholders not included)."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those still being sampled."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def append_output_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append sampled tokens to the outputs."""
        token_ids = list(token_ids)
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def extra_keys_for_block(self, start: int, end: int) -> tuple[str, ...]:
        """Content hashes of the images whose placeholders overlap token positions `[start, end)`."""
        return tuple(s.content_hash for s in self.image_spans if s.offset < end and s.offset + s.num_tokens > start)


# ---------------------------------------------------------------------------------------- output


@dataclass
class NewRequestData:
    """A request the model runner has not seen in its current life (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]
    """Every known token (prompt, plus outputs for a resumed request)."""
    block_ids: list[int]
    num_computed_tokens: int
    """Tokens already in the cache: the position of the first scheduled token."""
    state_slot_id: int
    is_resumed: bool
    sampling_params: SamplingParams | None = None
    num_cached_tokens: int = 0
    """Prefix-hit (or imported) tokens whose compressed entries are already in `block_ids`; tokens
    from `num_computed_tokens` up to this are a bounded replay and must not rewrite those entries."""
    state_start: int | None = None
    """First position the slot's bounded state is valid from; None = `num_computed_tokens` (the
    state is built from there). Set for requests whose state was imported."""
    image_spans: tuple[ImageSpan, ...] = ()
    """The request's images (positions and input embeddings), for the steps that compute them."""
    num_prompt_tokens: int | None = None
    """Length of the request's original prompt (`Request.num_replay_prompt_tokens`; `SeqChunk.num_prompt_tokens`:
    V4.1's decoder-side bounded replay)."""


@dataclass
class RunningRequestData:
    """A request the model runner already tracks, scheduled again."""

    req_id: str
    new_block_ids: list[int]
    """Blocks appended to its table by this step."""
    num_computed_tokens: int
    """Position of the first scheduled token."""


@dataclass
class SchedulerOutput:
    """What one step computes; the engine turns it into a model batch."""

    step_id: int
    """Increasing id; `update_from_output` checks steps come back in this order."""
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    """New and resumed requests, in admission order."""
    scheduled_running_reqs: list[RunningRequestData] = field(default_factory=list)
    """Requests the runner already tracks: decodes first, then prefill chunks."""
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens per scheduled request."""
    total_num_scheduled_tokens: int = 0
    """Sum of `num_scheduled_tokens`; at most `max_num_batched_tokens`."""
    sampling_req_ids: list[str] = field(default_factory=list)
    """Requests this step samples a token for (it computes their last known token)."""
    preempted_req_ids: list[str] = field(default_factory=list)
    """Requests preempted while building this step; the runner drops their state."""
    scheduled_spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    """Requests that verify draft tokens in this step: their drafts, computed after the last known token
    (the request's scheduled tokens are that token plus these)."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests finished (any reason) since the previous output; the runner drops their state."""
    error_messages: dict[str, str] = field(default_factory=dict)
    """Requests this step finished with FINISHED_ERROR, and why (also in `finished_req_ids`)."""


class _Scheduled(NamedTuple):
    """Scheduler-side record of one request in a step in flight."""

    req: Request
    num_preemptions: int
    num_computed_tokens_after: int
    is_sampling: bool
    num_spec_tokens: int = 0


# ---------------------------------------------------------------------------------------- scheduler


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching, preemption and async scheduling.

    See the module docstring for the policy. `replay_tokens_fn(num_hit_tokens)` returns how many
    tokens before a prefix hit (or an imported KV boundary) to recompute; None means none.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        state_slot_pool: StateSlotPool,
        replay_tokens_fn: Callable[[int], int] | None = None,
    ) -> None:
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.state_slot_pool = state_slot_pool
        self.replay_tokens_fn = replay_tokens_fn
        self.requests: dict[str, Request] = {}
        """Live (unfinished) requests by id."""
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        """Running requests in admission order."""
        self.num_preemptions = 0
        self._arrival_seq: dict[str, int] = {}
        self._seq_counter = itertools.count()
        self._step_counter = itertools.count()
        self._inflight: deque[tuple[int, dict[str, _Scheduled]]] = deque()
        self._finished_req_ids: list[str] = []
        self._error_messages: dict[str, str] = {}

    # ------------------------------------------------------------------ requests in and out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    def add_request(self, req: Request) -> None:
        """Queue a request; refuses (InvalidRequestError) one that could never run."""
        if req.req_id in self.requests:
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use", field="req_id")
        if req.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", field="prompt")
        max_len = self.config.max_model_len
        if req.num_tokens >= max_len:
            raise InvalidRequestError(
                f"the prompt has {req.num_tokens} tokens but max_model_len is {max_len}; shorten it to at most "
                f"{max_len - 1} tokens so at least one can be generated",
                field="prompt",
            )
        if req.max_tokens is not None and req.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be at least 1; got {req.max_tokens}", field="max_tokens")
        check_num_original_prompt_tokens(req.num_original_prompt_tokens, req.num_prompt_tokens)
        kv = self.kv_cache_manager
        if kv.num_blocks_for(req.num_tokens) > kv.num_blocks:
            raise InvalidRequestError(
                f"the prompt needs {kv.num_blocks_for(req.num_tokens)} cache blocks but this instance has "
                f"{kv.num_blocks}; shorten the prompt or give the instance more cache",
                field="prompt",
            )
        if req.num_computed_tokens and kv.num_blocks_held(req) * kv.block_size < req.num_computed_tokens:
            raise ValueError(
                f"request {req.req_id} claims {req.num_computed_tokens} computed tokens but holds too few blocks; "
                "reserve them with KVCacheManager.import_blocks first"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        self._arrival_seq[req.req_id] = next(self._seq_counter)
        self.waiting.append(req)

    def abort_request(self, req_id: str) -> bool:
        """Finish a live request as FINISHED_ABORTED, freeing what it holds; False if unknown or finished."""
        req = self.requests.get(req_id)
        if req is None:
            return False
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def get_request(self, req_id: str) -> Request | None:
        """A live request by id."""
        return self.requests.get(req_id)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's requests and token counts (see the module docstring)."""
        step = _StepBuilder(self.config.max_num_batched_tokens)
        running_at_start = list(self.running.values())

        # 1. decode first; 2. running partial prefills
        for is_decode_phase in (True, False):
            for req in running_at_start:
                if step.budget == 0:
                    break
                if req.req_id not in self.running or req.req_id in step.num_tokens:
                    continue  # preempted or errored while building this step
                num_remaining = self._num_tokens_to_schedule(req)
                if num_remaining == 0 or (num_remaining == 1) != is_decode_phase:
                    continue
                num_new = min(num_remaining, step.budget)
                if num_new < num_remaining and not self.config.enable_chunked_prefill:
                    continue
                spec = self._spec_tokens_to_verify(req, step.budget) if is_decode_phase else []
                if req.spec_token_ids and not is_decode_phase and num_new == num_remaining:
                    num_new -= 1  # drafts handed over with imported KV, a chunked replay: as in `_admit_waiting`
                num_new += len(spec)
                num_blocks_before = self.kv_cache_manager.num_blocks_held(req)
                if self._allocate_or_preempt(req, num_new, step):
                    step.add_running(req, num_new, num_blocks_before)
                    if spec:
                        step.spec_token_ids[req.req_id] = spec

        # 3. waiting requests
        if step.budget > 0:
            self._admit_waiting(step)

        return self._finalize(step)

    def _num_tokens_to_schedule(self, req: Request) -> int:
        """Tokens the request could compute now (0 when it only awaits a finish)."""
        num_total = req.num_tokens_with_placeholders
        at_cap = num_total >= self.config.max_model_len or (
            req.max_tokens is not None and req.num_output_tokens + req.num_output_placeholders >= req.max_tokens
        )
        if at_cap:
            # NOTE: only output tokens bring a request to its cap (prompts are shorter than
            # max_model_len), and the last sampled token needs no KV: nothing left to compute.
            return 0
        return num_total - req.num_computed_tokens

    def _spec_tokens_to_verify(self, req: Request, budget: int) -> list[int]:
        """The request's drafts this decode verifies: at most `budget - 1`, and few enough that accepting
        all of them plus the token sampled after them stays within `max_tokens` and `max_model_len`."""
        num = min(len(req.spec_token_ids), budget - 1,
                  self.config.max_model_len - req.num_tokens_with_placeholders - 1)
        if req.max_tokens is not None:
            num = min(num, req.max_tokens - req.num_output_tokens - req.num_output_placeholders - 1)
        return list(req.spec_token_ids[:num]) if num > 0 else []

    def _allocate_or_preempt(self, req: Request, num_new_tokens: int, step: _StepBuilder) -> bool:
        """Allocate blocks for a running request, preempting others as needed; False if it cannot run."""
        kv = self.kv_cache_manager
        num_needed = kv.num_blocks_for(req.num_computed_tokens + num_new_tokens)
        if num_needed > kv.num_blocks:
            self._finish_with_error(
                req,
                f"request needs {num_needed} cache blocks of {kv.block_size} tokens to continue, but the "
                f"cache has {kv.num_blocks}; give the instance more cache or lower max_model_len / max_tokens",
            )
            return False
        while not kv.allocate_slots(req, num_new_tokens):
            victim = self._pick_victim(req)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _pick_victim(self, req: Request) -> Request:
        """The running request to preempt so that `req` can grow: among those whose blocks free room for it
        (`KVCacheManager.shares_pool`: every request, except across the ranks of a multi-rank instance)."""
        candidates = [r for r in self.running.values() if self.kv_cache_manager.shares_pool(r, req)]
        if self.config.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time, self._arrival_seq[r.req_id]))
        return max(candidates, key=lambda r: (r.arrival_time, self._arrival_seq[r.req_id]))

    def _preempt(self, req: Request, step: _StepBuilder) -> None:
        del self.running[req.req_id]
        self.kv_cache_manager.free(req)
        self.state_slot_pool.free(req.req_id)
        step.unschedule(req.req_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        step.preempted_req_ids.append(req.req_id)

    def _admit_waiting(self, step: _StepBuilder) -> None:
        kv = self.kv_cache_manager
        if self.config.policy == "priority":
            candidates = sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time, self._arrival_seq[r.req_id]))
        else:
            candidates = list(self.waiting)
        admitted: set[str] = set()
        for req in candidates:
            if step.budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            held_slot = self.state_slot_pool.get_slot_id(req.req_id)  # imported bounded state
            if held_slot is None and self.state_slot_pool.num_free_slots == 0:
                break
            if req.req_id in step.preempted_req_ids or req.num_output_placeholders:
                continue  # just preempted, or a token of it is still being sampled
            if kv.num_blocks_for(req.num_tokens) > kv.num_blocks:
                self._finish_with_error(
                    req,
                    f"request needs {kv.num_blocks_for(req.num_tokens)} cache blocks to resume, but the cache has "
                    f"{kv.num_blocks}; give the instance more cache or lower max_model_len / max_tokens",
                )
                continue
            if kv.num_blocks_held(req):  # KV imported from outside
                hit_block_ids: list[int] = []
                num_hit_tokens = req.num_computed_tokens
                kv.cache_full_blocks(req, num_hit_tokens)
            else:
                hit_block_ids, num_hit_tokens = kv.get_computed_blocks(req)
            num_replay = 0
            if num_hit_tokens and self.replay_tokens_fn is not None and held_slot is None:
                num_replay = min(max(int(self.replay_tokens_fn(num_hit_tokens)), 0), num_hit_tokens)
            num_computed = num_hit_tokens - num_replay
            num_remaining = req.num_tokens - num_computed
            num_new = min(num_remaining, step.budget)
            if num_new < num_remaining and not self.config.enable_chunked_prefill:
                break
            if req.spec_token_ids and num_new == num_remaining > 1:  # drafts handed over with imported KV:
                num_new -= 1  # its last token is computed with them by its next (verifying) decode step
            if not kv.allocate_slots(req, num_new, hit_block_ids, num_computed_tokens=num_computed):
                break  # NOTE: strict order; waiting requests never preempt running ones
            is_resumed = req.status == RequestStatus.PREEMPTED
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            slot_id = held_slot if held_slot is not None else self.state_slot_pool.allocate(req.req_id)
            state_start, req.imported_state_start = req.imported_state_start, None
            self.running[req.req_id] = req
            admitted.add(req.req_id)
            step.add_new(req, num_new, slot_id, is_resumed, kv.get_block_ids(req), num_hit_tokens, state_start)
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.req_id not in admitted)

    def _finalize(self, step: _StepBuilder) -> SchedulerOutput:
        out = SchedulerOutput(step_id=next(self._step_counter))
        kv = self.kv_cache_manager
        record: dict[str, _Scheduled] = {}
        for req_id, num_new in step.num_tokens.items():
            req = self.requests[req_id]
            start = req.num_computed_tokens
            if req_id in step.new_reqs:
                slot_id, is_resumed, block_ids, num_cached, state_start = step.new_reqs[req_id]
                out.scheduled_new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        token_ids=list(req.all_token_ids),
                        block_ids=block_ids,
                        num_computed_tokens=start,
                        state_slot_id=slot_id,
                        is_resumed=is_resumed,
                        sampling_params=req.sampling_params,
                        num_cached_tokens=num_cached,
                        state_start=state_start,
                        image_spans=req.image_spans,
                        num_prompt_tokens=req.num_replay_prompt_tokens,
                    )
                )
            else:
                out.scheduled_running_reqs.append(
                    RunningRequestData(
                        req_id=req_id,
                        new_block_ids=kv.get_block_ids(req, step.num_blocks_before[req_id]),
                        num_computed_tokens=start,
                    )
                )
            req.num_computed_tokens = start + num_new
            spec = step.spec_token_ids.get(req_id, [])
            is_sampling = req.num_computed_tokens - len(spec) == req.num_tokens_with_placeholders
            if req.spec_token_ids and (spec or is_sampling):
                # consumed: the engine proposes new drafts after this step (a chunk that samples nothing, e.g. the
                # bounded replay of imported KV, keeps the drafts handed over with it for the next step)
                req.spec_token_ids = []
            if is_sampling:
                req.num_output_placeholders += 1
                out.sampling_req_ids.append(req_id)
            if spec:
                out.scheduled_spec_token_ids[req_id] = spec
            record[req_id] = _Scheduled(req, req.num_preemptions, req.num_computed_tokens, is_sampling, len(spec))
        out.num_scheduled_tokens = dict(step.num_tokens)
        out.total_num_scheduled_tokens = sum(step.num_tokens.values())
        out.preempted_req_ids = [r for r in step.preempted_req_ids if r in self.requests]
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        out.error_messages, self._error_messages = self._error_messages, {}
        if record:
            self._inflight.append((out.step_id, record))
        return out

    # ------------------------------------------------------------------ update

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        new_token_ids: Mapping[str, Sequence[int]],
        finished: Mapping[str, str | RequestStatus] | None = None,
    ) -> list[Request]:
        """Apply a step's results: append sampled tokens, register full blocks, finish requests.

        `new_token_ids` has one token per sampling request; `finished` maps req_id to a finish reason
        ("stop", "length", "abort", "error") the engine decided (EOS, stop strings, ...). Requests
        that reach `max_tokens` or `max_model_len` are finished here as "length" anyway. Results for
        requests aborted meanwhile are ignored. Returns the requests finished by this call.
        """
        finished = dict(finished or {})
        record: dict[str, _Scheduled] = {}
        if scheduler_output.total_num_scheduled_tokens:
            if not self._inflight or self._inflight[0][0] != scheduler_output.step_id:
                expected = self._inflight[0][0] if self._inflight else None
                raise ValueError(
                    f"update_from_output got step {scheduler_output.step_id} but the oldest step in flight is "
                    f"{expected}; report every non-empty step once, in schedule order"
                )
            record = self._inflight[0][1]
        for req_id, token_ids in new_token_ids.items():
            entry = record.get(req_id)
            max_num = 1 + entry.num_spec_tokens if entry is not None and entry.is_sampling else 0
            if len(token_ids) > max_num:
                raise ValueError(
                    f"step {scheduler_output.step_id} got {len(token_ids)} token(s) for request {req_id}, which "
                    f"{'samples none' if max_num == 0 else f'samples at most {max_num}'} in that step"
                )
        reasons = {req_id: RequestStatus.from_finish_reason(r) for req_id, r in finished.items()}
        for req_id, entry in record.items():
            is_live = self.requests.get(req_id) is entry.req
            if entry.is_sampling and is_live and not new_token_ids.get(req_id) and req_id not in reasons:
                raise ValueError(f"step {scheduler_output.step_id} sampled request {req_id} but got no token for it")
        if record:
            self._inflight.popleft()

        newly_finished: list[Request] = []
        for req_id, entry in record.items():
            req = entry.req
            if self.requests.get(req_id) is not req:
                reasons.pop(req_id, None)
                continue  # finished or aborted meanwhile (its id may even have been reused)
            token_ids = new_token_ids.get(req_id, ())
            if entry.is_sampling:
                req.num_output_placeholders -= 1
                req.append_output_token_ids(token_ids)
            num_computed_after = entry.num_computed_tokens_after
            is_same_life = req.status == RequestStatus.RUNNING and req.num_preemptions == entry.num_preemptions
            if entry.num_spec_tokens and token_ids:
                # rejected drafts: their positions count as not computed (the run rolled their state back)
                num_rejected = entry.num_spec_tokens - (len(token_ids) - 1)
                num_computed_after -= num_rejected
                if is_same_life:
                    req.num_computed_tokens -= num_rejected
            if is_same_life:
                self.kv_cache_manager.cache_full_blocks(req, min(num_computed_after, req.num_tokens))
            status = reasons.pop(req_id, None)
            if status is None and token_ids and self._reached_length_cap(req):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self._finish(req, status)
                newly_finished.append(req)
        for req_id, status in reasons.items():  # finishes for requests not in this step
            req = self.requests.get(req_id)
            if req is not None:
                self._finish(req, status)
                newly_finished.append(req)
        return newly_finished

    def _reached_length_cap(self, req: Request) -> bool:
        return req.num_tokens >= self.config.max_model_len or (
            req.max_tokens is not None and req.num_output_tokens >= req.max_tokens
        )

    # ------------------------------------------------------------------ finishing

    def _finish_with_error(self, req: Request, message: str) -> None:
        req.error_message = message
        self._error_messages[req.req_id] = message
        self._finish(req, RequestStatus.FINISHED_ERROR)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            del self.running[req.req_id]
        else:
            self.waiting.remove(req)
        self.kv_cache_manager.free(req)
        self.state_slot_pool.free(req.req_id)
        req.status = status
        del self.requests[req.req_id]
        self._arrival_seq.pop(req.req_id, None)
        self._finished_req_ids.append(req.req_id)


class _StepBuilder:
    """Mutable state of one `schedule()` call."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.num_tokens: dict[str, int] = {}
        self.num_blocks_before: dict[str, int] = {}
        self.new_reqs: dict[str, tuple[int, bool, list[int]]] = {}
        self.preempted_req_ids: list[str] = []
        self.spec_token_ids: dict[str, list[int]] = {}

    def add_running(self, req: Request, num_new_tokens: int, num_blocks_before: int) -> None:
        self.num_tokens[req.req_id] = num_new_tokens
        self.num_blocks_before[req.req_id] = num_blocks_before
        self.budget -= num_new_tokens

    def add_new(
        self, req: Request, num_new_tokens: int, slot_id: int, is_resumed: bool, block_ids: list[int],
        num_cached_tokens: int = 0, state_start: int | None = None,
    ) -> None:
        self.num_tokens[req.req_id] = num_new_tokens
        self.new_reqs[req.req_id] = (slot_id, is_resumed, block_ids, num_cached_tokens, state_start)
        self.budget -= num_new_tokens

    def unschedule(self, req_id: str) -> None:
        num_new_tokens = self.num_tokens.pop(req_id, 0)
        self.num_blocks_before.pop(req_id, None)
        self.new_reqs.pop(req_id, None)
        self.spec_token_ids.pop(req_id, None)
        self.budget += num_new_tokens
