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
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from deepinfer.engine.attention.base import AttentionBackend
from deepinfer.engine.executor import Executor, PreparedStep, StepResult
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.scheduler import SchedulerOutput
from deepinfer.engine.spec_decode.acceptance import num_accepted
from deepinfer.engine.spec_decode.confidence import load_confidence_head
from deepinfer.engine.spec_decode.config import check_verify_floor
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


class SpecDecoding:
    """The engine's speculative-decoding state: drafter, rollback, metrics and the executor."""

    def __init__(self, model, cache, sampler, num_slots: int, num_draft_tokens: int, method: str = "mtp",
                 verify_schedule: str = "full", verify_floor: int = 1, batched_verify: bool | None = None,
                 model_dir=None, cost_table: StepCostTable | None = None) -> None:
        if method != "mtp":
            raise ValueError(f"unknown speculative method {method!r}; known: mtp")
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
        self.drafter = MTPDrafter(model, num_slots, num_draft_tokens)
        weight = model.model.embed_tokens.weight
        self.confidence_head = (load_confidence_head(model_dir, model.config.hidden_size, weight.device)
                                if verify_schedule == "confidence" else None)
        """The checkpoint's confidence head (`confidence`), or None: the drafts' MTP probabilities are the confidences."""
        self.drafter.keep_features = self.confidence_head is not None
        self.rollback = RingRollback(cache)
        if num_draft_tokens > self.rollback.max_positions_per_slot:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} is more than this model's smallest state ring allows "
                f"({self.rollback.max_positions_per_slot}: rejected drafts must not overwrite live rows); lower it")
        self.num_draft_tokens = num_draft_tokens
        self.metrics = SpecDecodeMetrics(num_draft_tokens)
        self.executor = SpecExecutor(self)
        self._mtp_state_start: dict[str, int] = {}

    def prepare(self, step: PreparedStep, out: SchedulerOutput, token_ids_of: dict[str, list[int]],
                first_rows: list[int], wants_drafts: Callable[[str], bool]) -> SpecPreparedStep:
        """Extend the engine's step: logits at every verified position, the drafter's inputs.

        `token_ids_of[req_id]`: the request's known tokens followed by its scheduled drafts;
        `first_rows[i]`: sampling request i's first row in `step.sampling_batch`.
        """
        for rid in out.finished_req_ids + out.preempted_req_ids:
            self._mtp_state_start.pop(rid, None)
        for n in out.scheduled_new_reqs:
            self._mtp_state_start[n.req_id] = n.num_computed_tokens
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

    @torch.inference_mode()
    def run(self, step: SpecPreparedStep) -> SpecStepResult:
        """Blocks for one speculative step (see the module docstring)."""
        batch, model = step.batch, self.model
        t0 = time.perf_counter()
        pairs = [(batch.seqs[v.seq_idx].slot, batch.seqs[v.seq_idx].num_computed_tokens + j)
                 for v in step.verify for j in range(1, len(v.drafts) + 1)]
        snap = self.rollback.snapshot([s for s, _ in pairs], [p for _, p in pairs])
        meta = batch.attn_metadata if batch.attn_metadata is not None else model.build_attention_metadata(batch,
                                                                                                       self.cache)
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
                if L:
                    self.metrics.record(L, m)
            if any(v.drafts for v in step.verify):
                self.metrics.num_steps += 1
        self.rollback.restore(snap, rejected)
        t2 = time.perf_counter()
        seq_ids, seqs = self._draft_seqs(step, token_ids)
        drafts, probs, feats = self.drafter.propose(streams, seqs)
        at = {i: n for n, i in enumerate(seq_ids)}
        per_req_drafts = [drafts[at[v.seq_idx]] if v.seq_idx in at else [] for v in step.verify]
        per_req_probs = [probs[at[v.seq_idx]] if v.seq_idx in at else [] for v in step.verify]
        per_req_feats = [feats[at[v.seq_idx]] if v.seq_idx in at else None for v in step.verify]
        if self.verify_schedule == "confidence":
            confidences = per_req_probs
            if self.confidence_head is not None and any(f is not None for f in per_req_feats):
                have = [f for f in per_req_feats if f is not None]
                c = self.confidence_head(torch.cat(have)).tolist()
                confidences, n = [], 0
                for f in per_req_feats:
                    m = 0 if f is None else f.shape[0]
                    confidences.append(c[n:n + m])
                    n += m
            lengths = choose_verify_lengths(confidences, floor=self.verify_floor, cost_table=self.cost_table)
            per_req_drafts = [d[:n] for d, n in zip(per_req_drafts, lengths)]
        self.metrics.num_proposed_drafts += sum(len(d) for d in per_req_drafts)
        return SpecStepResult(token_ids, logprobs, t1 - t0 + time.perf_counter() - t2, t2 - t1,
                              draft_token_ids=per_req_drafts, draft_probs=per_req_probs,
                              draft_features=per_req_feats)

    @staticmethod
    def _draft_seqs(step: SpecPreparedStep, emitted: list[list[int]]) -> tuple[list[int], list[DraftSeq]]:
        """The committed pass: per seq, the positions whose next token is known after acceptance
        (the seqs' indices in the batch, and their `DraftSeq`s)."""
        batch = step.batch
        emitted_of = {v.seq_idx: (len(v.drafts), toks) for v, toks in zip(step.verify, emitted)}
        seq_ids, out = [], []
        for i, s in enumerate(batch.seqs[:len(step.next_token_ids)]):
            a = batch.starts[i]
            chunk = batch.input_ids[a:a + s.num_new_tokens].tolist()
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


class SpecExecutor(Executor):
    """Runs speculative steps inline on the caller's thread (`max_inflight = 1`; async scheduling is refused)."""

    max_inflight = 1

    def __init__(self, spec: SpecDecoding) -> None:
        super().__init__(None, spec.sampler)
        self.spec = spec
        self._is_closed = False

    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Blocks while the step runs; returns a future that is already done."""
        if self._is_closed:
            raise RuntimeError("the executor is closed; create a new Engine")
        if not isinstance(step, SpecPreparedStep):
            raise TypeError("SpecExecutor runs SpecPreparedStep (SpecDecoding.prepare)")
        fut: Future[StepResult] = Future()
        try:
            fut.set_result(self.spec.run(step))
        except Exception as e:  # delivered by fut.result(), as the other executors do
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        self._is_closed = True
