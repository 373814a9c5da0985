"""Speculative decoding: MTP drafts verified in one target forward, lossless, off by default.

Turned on by `EngineConfig.speculative = "mtp"` with `num_draft_tokens = k` (default 3; `LLM(model,
speculative="mtp", num_draft_tokens=3)`, the decode worker's `--speculative mtp --num-draft-tokens 3`; the
older `speculative_tokens=k` / `speculative_method` are aliases, `config`); the engine then holds a
`SpecDecoding` (picked once, at construction) whose executor runs every step. DeepSeek-V4.1 drafts with its
DSpark stages instead (`speculative="dspark"`: `dspark_drafter`, one block per step, confidences from the stages'
own head, and `V41Rollback` for V4.1's short state rings); the rest of the step is the same.

A step (see `executor`): every running decode carries the drafts its previous step proposed
(`Request.spec_token_ids`; the scheduler trims them to `max_tokens`, `max_model_len` and the budget)
and is computed as a `1 + L`-token chunk; the target's logits at all `1 + L` positions are sampled
(one sampling row per position, each after its own logits processors) and the longest prefix of
drafts that equals the sampled tokens is accepted, plus the sampled token after it (`acceptance`);
then the MTP layer drafts `k` tokens for the next step (`mtp_drafter`).

Rejected drafts leave no trace (`rollback`, whose docstring has the argument):

* **Window ring and compressor buffers** (per-slot rings, position `p` in row `p % ring_len`): the
  rows the draft positions will overwrite are copied before the forward and the rows of rejected
  positions are written back after acceptance. With `L + 1 <= ring_len` (checked at construction:
  `max_draft_tokens`, 7 for a CSA rate of 4) the positions of one verification hit distinct rows, so
  this restores exactly the non-speculative state.
* **Compressed entries** (paged pools): a rejected position `q` that ends window `w` writes entry `w`
  of its request's own block (allocated for the verification; never a shared prefix block, which
  only covers positions before `p`). Entry `w` is visible to a query at position `t` only when
  `(w + 1) * rate <= t + 1`, i.e. `t >= q`, and the first later step that reaches position `q`
  recomputes and rewrites entry `w` (the backends write a step's new entries before they read any)
  before any query of position `>= q` reads it. Blocks enter the prefix cache only once every
  position they cover is accepted (`Scheduler.update_from_output` rolls `num_computed_tokens` back).
* **The drafter's own window ring**: its committed pass runs over accepted positions only; the
  chained draft positions are snapshotted and restored the same way.

**Verify chunks as one batch** (`verify_rows`): with an attention backend that has the path
(`supports_verify_rows`: the torch backend; not the batch-invariant one), the step's verify chunks leave the per-request prefill
path and are attended together, `N = max(1 + L)` queries per request (same results within float32
rounding; `SpecDecoding.batched_verify`).

**Disaggregated decode** (`decode_worker --speculative mtp`): the first draft needs the MTP
layer's window over the prompt's last positions, i.e. the target's pre-`hc_head` streams there. The
decode instance rebuilds it by the bounded replay it already knows: with speculation its bounded
state is not sent (`DecodeWorkerConfig.bounded_state` resolves to "replay"), the tail of the prompt is
recomputed over the transferred compressed entries, and the committed pass runs over the replayed
positions like over any chunk, so the drafter's window comes out exactly as on an engine that
computed the whole prompt (`drafter_replay_tokens` bounds the replay; V4's `exact_replay_tokens`
already covers it). A prefill instance with speculation on (`prefill_worker --speculative mtp`; `deepinfer up
--speculative mtp` sets both stages) drafts the first block after token 1, as an offline engine would, and
sends it in the transfer notice after the first token (`KVTransferNotice.draft_token_ids`,
`KVConnector.start_save(draft_token_ids=...)`); `Engine.commit_kv` queues those drafts (at most
`num_draft_tokens`, those a structured-output constraint allows; `SpecDecodeMetrics.num_imported_drafts`),
the bounded replay then stops before token 1, and the request's first decode step computes token 1 with the
drafts and verifies them. Without it (or from a non-speculative prefill) that step verifies nothing.
DSpark (`speculative="dspark"`, V4.1) needs no replay: its window rings are per-slot cache state (`dspark_keys`)
sent with the slot, so the decode's bounded state defaults to "send" (`dspark_drafter`'s docstring).

Greedy outputs equal non-speculative ones token for token; seeded sampled outputs too (the same
per-position noise, `acceptance`). `verify_schedule = "confidence"` verifies a prefix of each
request's drafts chosen over the batch (`verify_schedule`): confidences from the checkpoint's
confidence head (`confidence`, `confidence_head.safetensors`; the built-in model ships one) or, without
one, the drafts' MTP probabilities; step costs from a profiled table (`step_cost`,
`EngineConfig.verify_cost_table`; a CPU table ships, elsewhere a linear stand-in until one is
profiled); `verify_floor` (1, or 0: a request whose drafts are unlikely to pay verifies none that step)
is the least each request verifies.

**Structured outputs**: a constrained request drafts like any other. Its verify row `j` is masked as
after its drafts `1 .. j`, which the matcher accepts tentatively and rolls back
(`GrammarState.fill_verify_bitmask`); the matcher then advances over the accepted tokens only. Drafts
the grammar rejects are trimmed when they are handed to the scheduler (they could never be accepted),
and a verified block is cut after the token that completes the constraint (`ignore_eos` included).

**Multi-rank instances** (`expert_parallel_size > 1`, `engine.distributed.spec`): each rank verifies and drafts its
own requests with the same `SpecDecoding.run_local` (SPMD; its ring rows rolled back on a rejection; a rank without
requests joins the target's MoE collectives with zero rows); rank 0 merges the ranks' tokens and drafts and decides
the verify schedule over the whole batch (`SpecDecoding.finish`), and the next step's plan carries it. The MTP
layer's experts are whole on every rank (its MoE runs locally).

**Async scheduling** (`async_scheduling=True`, the default on CUDA; one process): `SpecExecutor(overlap_drafting)`
verifies inline and drafts on a worker thread while the engine postprocesses the step's tokens; the next step is
scheduled once its drafts are known, one sync point per step (`SpecExecutor`'s docstring says why steps do not
overlap each other). With `expert_parallel_size > 1` the same over the ranks: each rank hands rank 0 its tokens
right after its verification and drafts after it (`engine.distributed.spec`).

**CUDA graphs** (`SpecDecoding.graphs`, `engine.cuda_graph.VerifyGraphRunner`): a pure verify step (every request
samples its `1 + L` positions) is padded to `(B_pad, N_pad = 1 + max L, blocks_pad)` and replayed from a graph captured once per
key, the graph computing the static verify metadata itself (`verify_rows.static_verify_metadata_from`); other steps
run eagerly. With them, the
MTP drafter's whole drafting (committed pass, draft 1, the `k - 1` chained steps and their ring rollback) replays
as one graph per `(B_pad, N_pad)` (`draft_graph.DraftGraphRunner`, `MTPDrafter.graphs`): eager, those `k` MTP
forwards were most of a speculative step's host time. Off with `enforce_eager`, expert parallelism, DSpark, or a
backend that is not graph-safe (docs/DESIGN.md section 8).
"""

from deepinfer.engine.spec_decode.acceptance import expand_bitmask, expand_verify_rows, num_accepted, rejection_sample
from deepinfer.engine.spec_decode.confidence import ConfidenceHead, confidence_features, load_confidence_head
from deepinfer.engine.spec_decode.executor import (
    SpecDecodeMetrics,
    SpecDecoding,
    SpecExecutor,
    SpecPreparedStep,
    SpecStepResult,
)
from deepinfer.engine.spec_decode.mtp_drafter import MTPDrafter, drafter_replay_tokens
from deepinfer.engine.spec_decode.rollback import RingRollback, max_draft_tokens
from deepinfer.engine.spec_decode.step_cost import StepCostTable, load_cost_table, profile_step_cost
from deepinfer.engine.spec_decode.verify_rows import VerifyRows, batch_verify_chunks
from deepinfer.engine.spec_decode.verify_schedule import choose_verify_lengths, survival, top_k_prefixes

__all__ = [
    "ConfidenceHead",
    "MTPDrafter",
    "RingRollback",
    "SpecDecodeMetrics",
    "SpecDecoding",
    "SpecExecutor",
    "SpecPreparedStep",
    "SpecStepResult",
    "StepCostTable",
    "VerifyRows",
    "batch_verify_chunks",
    "choose_verify_lengths",
    "confidence_features",
    "drafter_replay_tokens",
    "expand_bitmask",
    "expand_verify_rows",
    "load_confidence_head",
    "load_cost_table",
    "max_draft_tokens",
    "num_accepted",
    "profile_step_cost",
    "rejection_sample",
    "survival",
    "top_k_prefixes",
]
