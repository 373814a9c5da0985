"""The speculative step: verify the drafts in one target forward, accept, roll back, draft again.

`SpecDecoding` is what the engine holds when `EngineConfig.speculative` is set (chosen once, at
construction). Its `prepare` turns the engine's `PreparedStep` into a `SpecPreparedStep` (logits at
every verified position, what the drafter needs per request), and its `executor` (`SpecExecutor`, an
in-process `engine.executor.Executor`) runs it:

1. snapshot the main cache's ring rows the drafts' positions will overwrite (`RingRollback`);
2. one target forward over the ragged batch (each verifying request is a `1 + L`-token chunk), with
   the pre-`hc_head` streams kept, and the logits of every verified position;
3. sample every verified position (`Sampler.sample` over the expanded rows the engine built) and keep
   the accepted prefix (`acceptance.num_accepted`);
4. restore the rows of the rejected positions;
5. the MTP drafter's committed pass and chained drafts (`MTPDrafter.propose`).

The `SpecStepResult` carries, per sampling request, the list of tokens it emits (`1 + accepted`),
their logprobs, and the next drafts; the engine hands the drafts to the scheduler
(`Request.spec_token_ids`), which verifies them with the request's next decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from deepinfer.engine.attention.base import AttentionBackend
from deepinfer.engine.cuda_graph import VerifyGraphRunner, graph_batch_sizes, graph_blockers
from deepinfer.engine.executor import Executor, PreparedStep, StepResult, resolve_async_scheduling
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.scheduler import SchedulerOutput
from deepinfer.engine.spec_decode.acceptance import num_accepted
from deepinfer.engine.spec_decode.confidence import load_confidence_head
from deepinfer.engine.spec_decode.config import check_verify_floor
from deepinfer.engine.spec_decode.draft_graph import DraftGraphRunner
from deepinfer.engine.spec_decode.mtp_drafter import DraftSeq, MTPDrafter
from deepinfer.engine.spec_decode.rollback import RingRollback
from deepinfer.engine.spec_decode.step_cost import StepCostTable
from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks
from deepinfer.engine.spec_decode.verify_schedule import choose_verify_lengths


@dataclass
class SpecDecodeMetrics:
    """Counters of speculative decoding since the engine started (`as_dict` adds the derived rates)."""

    num_draft_tokens: int
    """Drafts proposed per request per step (k)."""
    num_steps: int = 0
    """Steps that verified at least one draft."""
    num_verifications: int = 0
    """Request-steps that verified at least one draft."""
    num_verified_tokens: int = 0
    """Target positions computed by those verifications (last token + drafts)."""
    num_verified_drafts: int = 0
    num_accepted_drafts: int = 0
    num_emitted_tokens: int = 0
    """Tokens those verifications produced (accepted drafts + one sampled token each)."""
    num_proposed_drafts: int = 0
    """Drafts the drafter proposed (including those never verified: caps, finished requests)."""
    num_imported_drafts: int = 0
    """Drafts handed over with imported KV (a speculative prefill instance's first block) and queued for the
    request's first decode step (`Engine.commit_kv`)."""
    verified_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.verified_per_position = [0] * self.num_draft_tokens
        self.accepted_per_position = [0] * self.num_draft_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verifications += 1
        self.num_verified_tokens += 1 + num_drafts
        self.num_verified_drafts += num_drafts
        self.num_accepted_drafts += num_accepted
        self.num_emitted_tokens += 1 + num_accepted
        for j in range(num_drafts):
            self.verified_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    def as_dict(self) -> dict:
        """The counters plus `acceptance_rate` (accepted / verified drafts), `acceptance_rate_per_position`,
        `mean_accepted_length` (tokens emitted per verification, the sampled one included) and
        `verified_tokens_per_step`."""
        d = {k: (list(v) if isinstance(v, list) else v) for k, v in self.__dict__.items()}
        d["acceptance_rate"] = self.num_accepted_drafts / max(self.num_verified_drafts, 1)
        d["acceptance_rate_per_position"] = [a / max(v, 1) for a, v in
                                             zip(self.accepted_per_position, self.verified_per_position)]
        d["mean_accepted_length"] = self.num_emitted_tokens / max(self.num_verifications, 1)
        d["verified_tokens_per_step"] = self.num_verified_tokens / max(self.num_steps, 1)
        return d

    def health_stats(self) -> dict:
        """The figures under Prometheus-style names (`spec_decode_*`, counters ending in `_total`), as a worker's
        Health stats carry them (the HTTP front exports the scalar ones per instance: `entrypoint.http.metrics`)."""
        d = self.as_dict()
        out = {"spec_decode_num_draft_tokens": self.num_draft_tokens}
        for name in ("steps", "verifications", "verified_tokens", "verified_drafts", "accepted_drafts",
                     "emitted_tokens", "proposed_drafts", "imported_drafts"):
            out[f"spec_decode_{name}_total"] = d[f"num_{name}"]
        for name in ("acceptance_rate", "mean_accepted_length", "verified_tokens_per_step",
                     "acceptance_rate_per_position"):
            out[f"spec_decode_{name}"] = d[name]
        return out


@dataclass
class _Verify:
    """One sampling request of the step."""

    seq_idx: int
    """Its index in `batch.seqs`."""
    first_row: int
    """Its first row in the sampling batch (one row per verified position)."""
    drafts: list[int]
    """The drafts it verifies (possibly none)."""


@dataclass
class SpecPreparedStep(PreparedStep):
    """A `PreparedStep` plus what verification and drafting need (snapshotted on the engine's thread)."""

    verify: list[_Verify] = field(default_factory=list)
    """Per sampling request, in `sampling_req_ids` order."""
    next_token_ids: list[int | None] = field(default_factory=list)
    """Per seq of the batch: the known token after its chunk, None for sampling requests."""
    mtp_state_starts: list[int] = field(default_factory=list)
    """Per seq: the first position its MTP slot holds a key for (this life)."""
    wants_drafts: list[bool] = field(default_factory=list)
    """Per seq: propose drafts for it (a sampling request of the engine; a constrained one's drafts are trimmed
    to what its grammar allows when the engine hands them to the scheduler)."""


@dataclass
class SpecStepResult(StepResult):
    """`token_ids[i]` / `logprobs[i]` are lists (the tokens request i emits); plus the next drafts."""

    draft_token_ids: list[list[int]] = field(default_factory=list)
    """Per sampling request: its drafts for the next step (empty when it wants none)."""
    draft_probs: list[list[float]] = field(default_factory=list)
    """Per sampling request: the MTP's probability of each draft (a confidence estimate)."""
    draft_features: list[torch.Tensor | None] = field(default_factory=list)
    """Per sampling request: its drafts' confidence features [k, num_features] when the drafter keeps them
    (`MTPDrafter.keep_features`), else None (before any scheduler trim)."""


@dataclass
class _Verified:
    """What `SpecDecoding.verify_local` leaves for `draft_local`."""

    token_ids: list[list[int]]
    logprobs: list[list]
    streams: torch.Tensor
    """[T, hc, H] the target's pre-`hc_head` streams of the step (the drafter's input)."""
    model_s: float
    sample_s: float


@dataclass
class LocalSpecResult:
    """What `SpecDecoding.run_local` produced for its share of a step, per entry of its `verify` list (picklable
    once the features are on the host: a rank ships it to rank 0)."""

    token_ids: list[list[int]]
    """The tokens each request emits (`1 + accepted`); empty when the step samples nothing."""
    logprobs: list[list]
    draft_token_ids: list[list[int]]
    """Each request's drafts for the next step, before the verify schedule (empty when it wants none)."""
    draft_probs: list[list[float]]
    draft_features: list[torch.Tensor | None]
    model_s: float
    sample_s: float


class SpecDecoding:
    """The engine's speculative-decoding state: drafter, rollback, metrics and the executor."""

    def __init__(self, model, cache, sampler, num_slots: int, num_draft_tokens: int, method: str = "mtp",
                 verify_schedule: str = "full", verify_floor: int = 1, batched_verify: bool | None = None,
                 model_dir=None, cost_table: StepCostTable | None = None) -> None:
        if method not in ("mtp", "dspark"):
            raise ValueError(f"unknown speculative method {method!r}; known: mtp, dspark")
        if verify_schedule not in ("full", "confidence"):
            raise ValueError(f"unknown verify_schedule {verify_schedule!r}; known: full, confidence")
        check_verify_floor(verify_floor, verify_schedule)
        self.verify_schedule = verify_schedule
        """"full": every request verifies all its drafts; "confidence": `verify_schedule.choose_verify_lengths`
        over the drafts' confidences picks a prefix per request (at least `verify_floor` drafts)."""
        self.verify_floor = verify_floor
        """1: every request verifies at least one draft per step; 0: one whose drafts are unlikely to pay verifies
        none (its step is a plain decode; the drafter still runs, so it drafts again next step)."""
        self.cost_table = cost_table
        """The profiled step costs the confidence schedule trades against (`step_cost`); None = linear stand-in."""
        backend = next((m.backend for m in model.modules() if isinstance(getattr(m, "backend", None),
                                                                       AttentionBackend)), None)
        supported = getattr(backend, "supports_verify_rows", False)
        if batched_verify and not supported:
            raise ValueError(f"the {type(backend).__name__} attention backend has no batched verify path; "
                             "leave batched_verify unset")
        self.batched_verify = supported if batched_verify is None else batched_verify
        """Run the verify chunks as one batch (`verify_rows`) rather than as per-request prefill chunks
        (same results within float rounding); None at construction = when the attention backend can."""
        self.model = model
        self.cache = cache
        self.sampler = sampler
        if method == "dspark":  # DeepSeek-V4.1's DSpark stages, their own confidence head (`dspark_drafter`)
            from deepinfer.engine.spec_decode.dspark_drafter import DSparkDrafter, V41Rollback

            self.drafter = DSparkDrafter(model, num_slots, num_draft_tokens, cache=cache)  # its rings: slot state
            self.confidence_head = None
            self.rollback = V41Rollback(cache, model)
        else:
            self.drafter = MTPDrafter(model, num_slots, num_draft_tokens)
            weight = model.model.embed_tokens.weight
            self.confidence_head = (load_confidence_head(model_dir, model.config.hidden_size, weight.device)
                                    if verify_schedule == "confidence" else None)
            self.drafter.keep_features = self.confidence_head is not None
            self.rollback = RingRollback(cache)
        """The checkpoint's confidence head (`confidence`), or None: the drafts' MTP probabilities (DSpark: its own
        head's sigmoid) are the confidences."""
        if num_draft_tokens > self.rollback.max_positions_per_slot:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} is more than this model's smallest state ring allows "
                f"({self.rollback.max_positions_per_slot}: rejected drafts must not overwrite live rows); lower it")
        self.num_draft_tokens = num_draft_tokens
        self.metrics = SpecDecodeMetrics(num_draft_tokens)
        self.executor: Executor = SpecExecutor(self)
        """Runs the engine's steps: `SpecExecutor` in one process; `make_executor` swaps in the multi-rank one."""
        self.graphs: VerifyGraphRunner | None = None
        """CUDA graphs of pure verify steps (`engine.cuda_graph.VerifyGraphRunner`), set by `make_executor` when the
        device, the backends and the config allow them (`verify_graph_blockers`); None: every step eager."""
        self.verify_graph_blockers: list[str] = ["not set up (make_executor)"]
        """Why verify steps run eagerly (empty: they run as CUDA graphs)."""
        self._mtp_state_start: dict[str, int] = {}

    def make_executor(self, config, runner) -> Executor:
        """The executor the engine runs speculative steps on (`config`: its `EngineConfig`), chosen once:
        `SpecExecutor` in one process, or with `expert_parallel_size > 1` the multi-rank executor, each rank
        verifying and drafting its own requests (`engine.distributed.spec`; this object is rank 0's share).

        Async scheduling (`async_scheduling`, on by default on CUDA): `SpecExecutor` with `overlap_drafting`, one
        sync point per step (the next step is scheduled once this step's accepted lengths and drafts are known).
        With expert_parallel_size > 1 the multi-rank executor does the same over the ranks (the tokens come back
        before the drafts, `engine.distributed.spec`)."""
        self.verify_graph_blockers = self._verify_graph_blockers(config)
        if not self.verify_graph_blockers:
            sizes = graph_batch_sizes(config.max_num_seqs, config.cuda_graph_batch_sizes)
            self.graphs = VerifyGraphRunner(self.model, self.cache, sizes, 1 + self.num_draft_tokens)
            runner.defer_verify_metadata = True  # the ragged metadata of a pure verify step would go unused
            # the drafting too: k eager MTP forwards were most of a graphed verify step's host time
            self.drafter.graphs = DraftGraphRunner(self.drafter, sizes, 1 + self.num_draft_tokens)
        if config.expert_parallel_size > 1:
            from deepinfer.engine.distributed.executor import MultiRankExecutor

            self.executor = MultiRankExecutor.from_config(config, runner, self.sampler, spec=self)
        elif resolve_async_scheduling(config.async_scheduling, config.device):
            self.executor = SpecExecutor(self, overlap_drafting=True)
        return self.executor

    def _verify_graph_blockers(self, config) -> list[str]:
        """Why this engine's verify steps cannot run as CUDA graphs (empty: they can): `enforce_eager`, expert
        parallelism (the multi-rank executor runs its ranks' forwards), a drafter other than the MTP layer (V4.1's
        DSpark verifies through V4.1's own attention), no batched verify path (the batch-invariant backend), and
        `cuda_graph.graph_blockers` (a CUDA device; every backend the model holds graph-safe)."""
        reasons = ["enforce_eager"] if config.enforce_eager else []
        if config.expert_parallel_size > 1:
            reasons.append("expert_parallel_size > 1")
        if not isinstance(self.drafter, MTPDrafter):
            reasons.append(f"the {type(self.drafter).__name__} drafter")
        if not self.batched_verify:
            reasons.append("no batched verify path (supports_verify_rows)")
        return reasons + graph_blockers(self.model, self.cache, self.cache.device)

    def prepare(self, step: PreparedStep, out: SchedulerOutput, token_ids_of: dict[str, list[int]],
                first_rows: list[int], wants_drafts: Callable[[str], bool]) -> SpecPreparedStep:
        """Extend the engine's step: logits at every verified position, the drafter's inputs.

        `token_ids_of[req_id]`: the request's known tokens followed by its scheduled drafts;
        `first_rows[i]`: sampling request i's first row in `step.sampling_batch`.
        """
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self._mtp_state_start.pop(rid, None)
        in_slot = getattr(self.drafter, "is_state_in_slot", False)
        for n in out.scheduled_new_reqs:  # an imported slot brings a drafter whose state is in it (DSpark) its rows
            use_imported = in_slot and n.state_start is not None
            self._mtp_state_start[n.req_id] = n.state_start if use_imported else n.num_computed_tokens
        batch: ForwardBatch = step.batch
        order = [n.req_id for n in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_running_reqs]
        # NOTE: a pure-decode batch may end in CUDA-graph padding seqs (one dummy row each): not requests
        if len(order) != len(batch.seqs) - batch.num_dummy_rows:
            raise RuntimeError("the batch's requests do not match the scheduler output")
        seq_of = {rid: i for i, rid in enumerate(order)}
        sampling = set(out.sampling_req_ids)
        verify, logits_rows = [], []
        for rid, first in zip(out.sampling_req_ids, first_rows, strict=True):
            i = seq_of[rid]
            drafts = out.scheduled_spec_token_ids.get(rid, [])
            last = batch.starts[i] + batch.seqs[i].num_new_tokens - 1
            logits_rows.extend(range(last - len(drafts), last + 1))
            verify.append(_Verify(i, first, list(drafts)))
        batch.logits_indices = torch.tensor(logits_rows, dtype=torch.long, device=batch.input_ids.device)
        next_ids = []
        for rid, s in zip(order, batch.seqs):  # the padding seqs, if any, are left out
            end = s.num_computed_tokens + s.num_new_tokens
            next_ids.append(None if rid in sampling else token_ids_of[rid][end])
        return SpecPreparedStep(
            batch=batch, sampling_batch=step.sampling_batch, verify=verify, next_token_ids=next_ids,
            mtp_state_starts=[self._mtp_state_start[rid] for rid in order],
            wants_drafts=[rid in sampling and wants_drafts(rid) for rid in order],
        )

    def run(self, step: SpecPreparedStep) -> SpecStepResult:
        """Blocks for one speculative step (see the module docstring): `run_local` over the whole batch, then
        `finish` (metrics and the verify schedule)."""
        return self.finish(step.verify, self.run_local(step))

    def run_local(self, step: SpecPreparedStep) -> LocalSpecResult:
        """Blocks for the per-request part of a step (steps 1-5 of the module docstring) over `step`'s batch:
        the whole batch in one process, or a rank's share of it with expert parallelism (the same code on every
        rank, SPMD: `engine.distributed.spec`). Per entry of `step.verify`: the tokens it emits, their logprobs,
        and its drafts for the next step (all of them: the verify schedule is `finish`'s, over the whole batch)."""
        return self.draft_local(step, self.verify_local(step))

    @torch.inference_mode()
    def verify_local(self, step: SpecPreparedStep) -> _Verified:
        """Blocks for steps 1-4 (snapshot, target forward, sampling and acceptance, rollback): the tokens."""
        batch, model = step.batch, self.model
        t0 = time.perf_counter()
        pairs = [(batch.seqs[v.seq_idx].slot, batch.seqs[v.seq_idx].num_computed_tokens + j)
                 for v in step.verify for j in range(1, len(v.drafts) + 1)]
        snap = self.rollback.snapshot([s for s, _ in pairs], [p for _, p in pairs], batch=batch)
        replayed = None
        if self.graphs is not None:  # a pure verify step: every request samples its `1 + L` positions
            is_pure = len(step.verify) == len(batch.seqs) and all(
                batch.seqs[v.seq_idx].num_new_tokens == 1 + len(v.drafts) for v in step.verify)
            replayed = self.graphs.run(batch, is_pure)
        if replayed is not None:
            hidden, streams = replayed
        else:
            meta = batch.attn_metadata if batch.attn_metadata is not None else model.build_attention_metadata(
                batch, self.cache)
            verifying = {v.seq_idx for v in step.verify if v.drafts}
            if self.batched_verify and len(verifying) > 1:  # one chunk alone gains nothing from the padding
                batch_verify_chunks(meta, verifying)
            hidden, streams = model(batch, self.cache, meta, return_streams=True)  # [T, H], [T, hc, H]
        logits = model.compute_logits(hidden[batch.logits_indices])  # [num_rows, vocab]
        t1 = time.perf_counter()
        token_ids: list[list[int]] = []
        logprobs: list[list] = []
        rejected: list[bool] = []
        if step.sampling_batch is not None:
            sampled = self.sampler.sample(logits, step.sampling_batch)
            ids, lps = sampled.sampled_token_ids.tolist(), sampled.request_logprobs()
            for v in step.verify:
                L = len(v.drafts)
                rows = ids[v.first_row:v.first_row + L + 1]
                m = num_accepted(rows, v.drafts)
                token_ids.append(rows[:m + 1])
                logprobs.append(lps[v.first_row:v.first_row + m + 1])
                rejected.extend(j > m for j in range(1, L + 1))
        self.rollback.restore(snap, rejected)
        return _Verified(token_ids, logprobs, streams, t1 - t0, time.perf_counter() - t1)

    @torch.inference_mode()
    def draft_local(self, step: SpecPreparedStep, verified: _Verified) -> LocalSpecResult:
        """Blocks for step 5 (the drafter's committed pass and chained drafts) after `verify_local`."""
        t0 = time.perf_counter()
        seq_ids, seqs = self._draft_seqs(step, verified.token_ids)
        drafts, probs, feats = self.drafter.propose(verified.streams, seqs)
        at = {i: n for n, i in enumerate(seq_ids)}
        return LocalSpecResult(
            verified.token_ids, verified.logprobs,
            draft_token_ids=[drafts[at[v.seq_idx]] if v.seq_idx in at else [] for v in step.verify],
            draft_probs=[probs[at[v.seq_idx]] if v.seq_idx in at else [] for v in step.verify],
            draft_features=[feats[at[v.seq_idx]] if v.seq_idx in at else None for v in step.verify],
            model_s=verified.model_s + time.perf_counter() - t0, sample_s=verified.sample_s)

    def finish(self, verify: list[_Verify], local: LocalSpecResult) -> SpecStepResult:
        """The step's result from the per-request part of every request (`verify` and `local` in the step's
        sampling order): records the metrics and trims each request's next drafts to the verify schedule.

        NOTE: one process decides the schedule (the engine's: rank 0 of an expert-parallel instance) over the
        whole batch, so every rank verifies what it decided: the trimmed drafts reach the scheduler, and the
        next step's plan carries them to the ranks."""
        token_ids = local.token_ids
        if token_ids:
            for v, toks in zip(verify, token_ids, strict=True):
                if v.drafts:
                    self.metrics.record(len(v.drafts), len(toks) - 1)
            if any(v.drafts for v in verify):
                self.metrics.num_steps += 1
        per_req_drafts, per_req_probs, per_req_feats = local.draft_token_ids, local.draft_probs, local.draft_features
        if self.verify_schedule == "confidence":
            confidences = per_req_probs
            if self.confidence_head is not None and any(f is not None for f in per_req_feats):
                weight = self.model.model.embed_tokens.weight
                have = [f.to(weight.device) for f in per_req_feats if f is not None]
                c = self.confidence_head(torch.cat(have)).tolist()
                confidences, n = [], 0
                for f in per_req_feats:
                    m = 0 if f is None else f.shape[0]
                    confidences.append(c[n:n + m])
                    n += m
            lengths = choose_verify_lengths(confidences, floor=self.verify_floor, cost_table=self.cost_table)
            per_req_drafts = [d[:n] for d, n in zip(per_req_drafts, lengths)]
        self.metrics.num_proposed_drafts += sum(len(d) for d in per_req_drafts)
        return SpecStepResult(token_ids, local.logprobs, local.model_s, local.sample_s,
                              draft_token_ids=per_req_drafts, draft_probs=per_req_probs,
                              draft_features=per_req_feats)

    @staticmethod
    def _draft_seqs(step: SpecPreparedStep, emitted: list[list[int]]) -> tuple[list[int], list[DraftSeq]]:
        """The committed pass: per seq, the positions whose next token is known after acceptance
        (the seqs' indices in the batch, and their `DraftSeq`s)."""
        batch = step.batch
        emitted_of = {v.seq_idx: (len(v.drafts), toks) for v, toks in zip(step.verify, emitted)}
        seq_ids, out = [], []
        input_ids = batch.input_ids.tolist()  # NOTE: one device read for the batch (a read per seq syncs per seq)
        for i, s in enumerate(batch.seqs[:len(step.next_token_ids)]):
            a = batch.starts[i]
            chunk = input_ids[a:a + s.num_new_tokens]
            if i in emitted_of:
                num_drafts, toks = emitted_of[i]
                c = s.num_new_tokens - num_drafts + len(toks) - 1  # up to the last accepted draft
                nxt = chunk[1:c] + [toks[-1]]
            elif step.next_token_ids[i] is None:
                continue  # a sampling request without a result (no sampling batch): nothing committed
            else:
                c, nxt = s.num_new_tokens, chunk[1:] + [step.next_token_ids[i]]
            seq_ids.append(i)
            out.append(DraftSeq(s.slot, s.num_computed_tokens, list(range(a, a + c)), nxt,
                                step.mtp_state_starts[i], step.wants_drafts[i]))
        return seq_ids, out


class PendingSpecStepResult(SpecStepResult):
    """A `SpecStepResult` whose tokens are known and whose drafts are still being computed (`SpecExecutor` with
    `overlap_drafting`): reading `draft_token_ids`, `draft_probs` or `draft_features` blocks until the drafter has
    finished (and raises its exception, if it failed). NOTE: `model_s` covers the verification only."""

    def __init__(self, token_ids: list, logprobs: list, model_s: float, sample_s: float,
                 drafts: Future[SpecStepResult]) -> None:
        StepResult.__init__(self, token_ids, logprobs, model_s, sample_s)
        self._drafts = drafts

    @property
    def draft_token_ids(self) -> list[list[int]]:  # type: ignore[override]
        return self._drafts.result().draft_token_ids

    @property
    def draft_probs(self) -> list[list[float]]:  # type: ignore[override]
        return self._drafts.result().draft_probs

    @property
    def draft_features(self) -> list[torch.Tensor | None]:  # type: ignore[override]
        return self._drafts.result().draft_features


class SpecExecutor(Executor):
    """Runs speculative steps for an engine in one process (`max_inflight = 1`).

    Synchronous (`overlap_drafting=False`): the whole step runs inline in `submit`.

    Async scheduling (`overlap_drafting=True`, `EngineConfig.async_scheduling=True`): `submit` runs the
    verification inline (forward, sampling, acceptance, rollback) and returns a future that is done once the
    step's tokens are known; the drafter (and the verify schedule) run on a worker thread meanwhile, so the
    engine's postprocessing of those tokens (stop checks, detokenization, grammar, the scheduler's update)
    overlaps the drafting. The result's draft fields block (`PendingSpecStepResult`); the engine reads them
    last, and schedules the next step after that.

    NOTE: that read is the step's one sync point, and it is needed: the next step's schedule depends on this
    step's accepted lengths (`num_computed_tokens` moves back over rejected drafts, and the request may have
    finished inside the accepted block) and its drafts (the width of each verify chunk), so the next step cannot
    be scheduled before they are known without scheduling against placeholders and fixing the batch up later
    (positions, blocks and the verify chunk's tokens). Steps therefore do not overlap each other here, as they
    do on the threaded executor without speculation.
    """

    max_inflight = 1

    def __init__(self, spec: SpecDecoding, overlap_drafting: bool = False) -> None:
        super().__init__(None, spec.sampler)
        self.spec = spec
        self._is_closed = False
        self._pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-drafter")
                      if overlap_drafting else None)

    @property
    def overlap_drafting(self) -> bool:
        """Whether the drafter runs on a worker thread while the engine postprocesses the step (async scheduling)."""
        return self._pool is not None

    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Blocks while the step runs (its verification only, with `overlap_drafting`); returns a future that
        is already done."""
        if self._is_closed:
            raise RuntimeError("the executor is closed; create a new Engine")
        if not isinstance(step, SpecPreparedStep):
            raise TypeError("SpecExecutor runs SpecPreparedStep (SpecDecoding.prepare)")
        fut: Future[StepResult] = Future()
        try:
            if self._pool is None:
                fut.set_result(self.spec.run(step))
            else:
                verified = self.spec.verify_local(step)
                spec = self.spec
                drafts = self._pool.submit(lambda: spec.finish(step.verify, spec.draft_local(step, verified)))
                fut.set_result(PendingSpecStepResult(verified.token_ids, verified.logprobs, verified.model_s,
                                                     verified.sample_s, drafts))
        except Exception as e:  # delivered by fut.result(), as the other executors do
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        """Blocks until a drafting still running has finished; idempotent."""
        self._is_closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
