"""CUDA graphs for pure-decode steps: capture once per batch-size bucket, then replay.

A decode step of a V4 model launches thousands of small kernels; at small batches the host spends
longer launching them than the GPU spends running them. A CUDA graph records one step's kernels once
and replays them with a single launch. The graph reads its inputs from fixed ("static") device
buffers, so a replay first copies the step's inputs into them.

How a step gets here (`engine.model_runner.ModelRunner`):

1. `prepare` pads a pure-decode batch of B rows to the smallest bucket `>= B` with dummy rows (state
   slot `cache.dummy_slot`, block table `[cache.dummy_block]`, position 0, token 0; their outputs are
   never read) and builds the step's `AttentionMetadata` for the padded batch, once.
2. `run` hands the batch to `CudaGraphRunner.run`. The graph inputs are the batch's `input_ids`,
   `positions` and every tensor of its metadata, found by walking dataclasses, dicts, tuples and lists
   (`flatten`). Their *structure* — the nesting, every tensor's shape, dtype and device, and every
   host value (ints, bools, None) — must equal the structure recorded at capture; then the tensors are
   `copy_`-ed into the static ones and the graph replays. Any difference (a host int that changed, a
   shape that grew) means the captured kernels would compute something else: the step then runs
   eagerly and `stats["eager_fallbacks"]` counts it. A backend whose decode metadata depends only on
   the batch size and the cache geometry (`cuda_graph_safe = True`) never falls back.
3. The graph covers the forward up to the final hidden states, a static buffer that the next replay
   overwrites: `run` gathers the rows of `batch.logits_indices` out of it and computes their logits
   eagerly (`model.compute_logits`: the LM head, one GEMM). Keeping the head outside keeps the static
   buffers small (`[bucket, hidden]`, not `[bucket, vocab]` float32 per bucket) and skips the dummy rows.

Graphs are used only when the device is CUDA, `enforce_eager` is off, the cache has a dummy slot and
block, and every backend the model holds (each module's `backend` attribute: the attention backend,
every MoE layer's backend) declares `cuda_graph_safe = True`: a backend that reads a device value on
the host (`.tolist()`, `.item()`) or sizes a tensor from one cannot be captured. Prefill and mixed
steps always run eagerly.

Capture: `capture_dummy` (start-up, the engine's way) records a bucket from an all-dummy batch after
one eager warm-up run of it, which touches only the dummy slot and block (masked by a graph-safe
backend); `run` captures a bucket it has not seen from the step's own inputs (the eager warm-up run
*is* that step, so its results are returned; the capture itself executes nothing). All graphs share one memory pool: at most one graph
runs at a time (one executor thread), and every graph's output is copied out before the next replay,
so a later capture may reuse the pool memory of an earlier graph's intermediates.

NOTE: a capture runs while no other thread issues device work on the capture stream; the mode is
"thread_local" so that the engine thread may keep preparing the next step on the default stream.

Speculative verify steps (`VerifyGraphRunner`, used by `engine.spec_decode.SpecDecoding`, whose steps do not go
through `ModelRunner.run`): a pure verify step is padded to a key `(B_pad, N_pad, blocks_pad)`; the graph builds the
static verify metadata itself (`engine.spec_decode.verify_rows.static_verify_metadata_from`) from a few per-request
inputs the host copies in (positions, new tokens, slots, state starts, block tables: one transfer), then
outputs the final hidden states and the pre-`hc_head` streams (the MTP drafter's input), whose real rows
are gathered out. See the class docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk, host_to_device

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
"""Bucket sizes of decode batches captured as graphs (those up to `max_num_seqs`, plus `max_num_seqs`)."""


def graph_batch_sizes(max_num_seqs: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The buckets for an instance of `max_num_seqs`: `sizes` (default `DEFAULT_BATCH_SIZES`) up to
    `max_num_seqs`, plus `max_num_seqs` itself so that every decode batch has a bucket; sorted."""
    sizes = DEFAULT_BATCH_SIZES if sizes is None else tuple(sizes)
    if any(int(s) <= 0 for s in sizes):
        raise ValueError(f"cuda_graph_batch_sizes must be positive; got {list(sizes)}")
    return tuple(sorted({int(s) for s in sizes if s <= max_num_seqs} | {max_num_seqs}))


def graph_blockers(model: nn.Module, cache, device: torch.device | str) -> list[str]:
    """Why the model cannot run decode steps as CUDA graphs (empty: it can).

    Checks the device, the cache's dummy slot and block, and the `cuda_graph_safe` flag of every
    distinct backend object a module of the model holds as `backend` (attention and MoE backends).
    """
    reasons = []
    if torch.device(device).type != "cuda":
        reasons.append(f"device {device} is not CUDA")
    for attr in ("dummy_slot", "dummy_block"):
        if getattr(cache, attr, None) is None:
            reasons.append(f"the cache has no {attr}")
    seen: set[int] = set()
    for module in model.modules():
        backend = module.__dict__.get("backend")
        if backend is None or id(backend) in seen or isinstance(backend, nn.Module):
            continue
        seen.add(id(backend))
        if not getattr(backend, "cuda_graph_safe", False):
            name = f"{type(backend).__name__} ({getattr(backend, 'name', '') or '?'})"
            if not any(name in r for r in reasons):
                reasons.append(f"backend {name} is not cuda_graph_safe")
    return reasons


# --------------------------------------------------------------------------- graph inputs


class UnsupportedLeaf(TypeError):
    """A graph input holds an object whose equality cannot stand for its effect on the step."""


_HOST_VALUES = (int, float, bool, str, bytes, type(None), slice, torch.dtype, torch.device)


def flatten(obj, tensors: list[torch.Tensor] | None = None, memo: dict[int, int] | None = None):
    """`(structure, tensors)`: the tensors of `obj` in a fixed walk order, and a hashable description of
    everything else (types, dataclass field names, dict keys, host values, each tensor's shape, dtype,
    device, and which leaves are one and the same tensor).

    Two inputs with equal structures differ only in their tensors' values, so a graph captured for one
    computes the other once the tensors are copied in. Raises `UnsupportedLeaf` for any other object.
    """
    tensors = [] if tensors is None else tensors
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) in memo:
            return ("alias", memo[id(obj)]), tensors
        memo[id(obj)] = len(tensors)
        tensors.append(obj)
        return ("t", tuple(obj.shape), obj.dtype, obj.device), tensors
    if isinstance(obj, _HOST_VALUES):
        return ("v", type(obj), obj), tensors
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = tuple((f.name, flatten(getattr(obj, f.name), tensors, memo)[0]) for f in dataclasses.fields(obj))
        return ("dc", type(obj), fields), tensors
    if isinstance(obj, dict):
        return ("d", tuple((k, flatten(v, tensors, memo)[0]) for k, v in obj.items())), tensors
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(flatten(v, tensors, memo)[0] for v in obj)), tensors
    raise UnsupportedLeaf(f"cannot use a {type(obj).__name__} as a CUDA-graph input")


def clone_tensors(obj, memo: dict[int, torch.Tensor] | None = None):
    """A copy of `obj` (as `flatten` walks it) whose tensors are fresh clones, aliases kept as aliases."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.clone()
        return memo[id(obj)]
    if isinstance(obj, _HOST_VALUES):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, clone_tensors(getattr(obj, f.name), memo))
        return new
    if isinstance(obj, dict):
        return {k: clone_tensors(v, memo) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(clone_tensors(v, memo) for v in obj)
    if isinstance(obj, list):
        return [clone_tensors(v, memo) for v in obj]
    raise UnsupportedLeaf(f"cannot use a {type(obj).__name__} as a CUDA-graph input")


def graph_inputs(batch: ForwardBatch) -> tuple:
    """What a captured decode step reads that changes between steps: ids, positions and the metadata."""
    return (batch.input_ids, batch.positions, batch.attn_metadata)


# --------------------------------------------------------------------------- the runner


@dataclass
class CapturedStep:
    """One bucket's graph and the static buffers it reads and writes."""

    graph: torch.cuda.CUDAGraph
    structure: tuple
    """`flatten(graph_inputs(batch))[0]` of the captured batch."""
    static_tensors: list[torch.Tensor]
    """The graph's input buffers, in `flatten` order."""
    hidden: torch.Tensor  # [bucket, hidden] final hidden states, overwritten by every replay


class CudaGraphRunner:
    """Captures and replays pure-decode steps of `model` over `cache`, one graph per bucket size.

    `model(batch, cache)` is the forward (final hidden states `[T, H]`, the cache updated) and
    `model.compute_logits(hidden)` the LM head (float32 logits), as `DeepseekV4ForCausalLM` has them.
    `run(batch)` returns the logits of a replay, or None when the batch must run eagerly (not a
    padded pure-decode batch of a bucket size, or a structure that differs from the capture).
    """

    def __init__(self, model: nn.Module, cache, batch_sizes: Sequence[int]) -> None:
        self.model = model
        self.cache = cache
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.graphs: dict[int, CapturedStep] = {}
        self.pool = None
        """The memory pool every graph of this runner allocates from (created at the first capture)."""
        self.stats = {"captures": 0, "replays": 0, "eager_fallbacks": 0}
        """Captures made; steps replayed; eligible steps that ran eagerly because their structure
        differed from the capture (a non-zero count means a backend's metadata is not graph-stable)."""
        self._keep_shapes_off_eager_routes(self.batch_sizes[-1] if self.batch_sizes else 0)

    def _runs_eagerly(self, key) -> bool:
        """Whether a step of `key` runs eagerly, counted in `stats`: None (not eligible: `eager_steps`) or a new key
        past `max_graphs` (also `over_cap`); the lazily capturing runners' check."""
        if key is not None and (key in self.graphs or len(self.graphs) < self.max_graphs):
            return False
        self.stats["eager_steps"] += 1
        if key is not None:
            self.stats["over_cap"] += 1
        return True

    def _keep_shapes_off_eager_routes(self, max_tokens: int) -> None:
        """A graph's eager warm-up and fallbacks must compute its replays' bits: no size-chosen eager-only route
        (the MoE `_grouped_mm` route) for a step of at most `max_tokens` tokens."""
        from deepinfer.engine.moe.triton_backend import keep_graph_shapes_off_grouped_mm

        keep_graph_shapes_off_grouped_mm(self.model, max_tokens)

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket holding `num_rows` decode rows, or None (too many: run eagerly)."""
        for size in self.batch_sizes:
            if size >= num_rows:
                return size
        return None

    def dummy_chunk(self) -> SeqChunk:
        """A padding decode row: the cache's dummy slot and block, position 0, token 0 (outputs never read)."""
        return SeqChunk(self.cache.dummy_slot, [self.cache.dummy_block], 0, 1)

    def pad(self, token_ids: list[list[int]], seqs: list[SeqChunk], size: int) -> tuple[list[list[int]], list[SeqChunk]]:
        """`(token_ids, seqs)` extended with dummy rows (token 0) to `size` rows."""
        extra = size - len(seqs)
        return token_ids + [[0]] * extra, seqs + [self.dummy_chunk() for _ in range(extra)]

    def is_eligible(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a pure-decode batch of a bucket size without input embeddings."""
        meta = batch.attn_metadata
        return (meta is not None and meta.is_pure_decode and batch.input_embeds is None
                and batch.num_tokens in self.batch_sizes)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Blocks while the step replays (or is captured); float32 logits of `batch.logits_indices` (all real
        rows when None), or None when the step must run eagerly."""
        if not self.is_eligible(batch):
            return None
        try:
            structure, tensors = flatten(graph_inputs(batch))
        except UnsupportedLeaf:
            self.stats["eager_fallbacks"] += 1
            return None
        step = self.graphs.get(batch.num_tokens)
        if step is None:
            return self._logits(self.capture(batch), batch)
        if not self._replay(step, structure, tensors):
            return None
        return self._logits(step.hidden, batch)

    def _replay(self, step: CapturedStep | CapturedVerifyStep, structure: tuple, tensors: list[torch.Tensor]) -> bool:
        """Copies a step's input tensors (`flatten(graph_inputs(...))` of it: `structure`, `tensors`) into `step`'s
        static ones and replays its graph (its outputs land in `step`'s buffers); False, nothing copied and
        `stats["eager_fallbacks"]` counted, when `structure` differs from the capture's (run the step eagerly)."""
        if structure != step.structure:
            self.stats["eager_fallbacks"] += 1
            return False
        for dst, src in zip(step.static_tensors, tensors):
            dst.copy_(src, non_blocking=True)
        step.graph.replay()
        self.stats["replays"] += 1
        return True

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the wanted rows (`logits_indices`, else every real row), gathered out of `hidden`
        first (a replay's static buffer: the next replay overwrites it)."""
        if batch.logits_indices is None:
            rows = hidden[:batch.num_tokens - batch.num_dummy_rows].clone()
        else:
            rows = hidden.index_select(0, batch.logits_indices)
        return self.model.compute_logits(rows)

    def capture_dummy(self, size: int) -> None:
        """Blocks while bucket `size` is captured from an all-dummy batch (start-up; touches no request's state)."""
        if size in self.graphs:
            return
        ids, seqs = self.pad([], [], size)
        batch = ForwardBatch.build(ids, seqs, device=self.cache.device)
        batch.num_dummy_rows = size
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        if not self.is_eligible(batch):
            raise RuntimeError(f"an all-dummy batch of {size} rows is not a pure-decode batch")
        self.capture(batch)

    @torch.inference_mode()
    def capture(self, batch: ForwardBatch) -> torch.Tensor:
        """Blocks while `batch` runs eagerly (the warm-up: the step itself) and its bucket is captured;
        returns that eager run's final hidden states of every row `[bucket, hidden]`."""
        structure, tensors = flatten(graph_inputs(batch))
        static_tensors = [t.clone() for t in tensors]  # outside the graph pool: never reused by a capture
        memo = {id(t): s for t, s in zip(tensors, static_tensors)}
        input_ids, positions, meta = clone_tensors(graph_inputs(batch), memo)
        static = copy.copy(batch)
        static.input_ids, static.positions, static.attn_metadata = input_ids, positions, meta
        static.logits_indices = None  # the forward does not read it; callers select rows after the replay
        eager = self.model(static, self.cache)  # warm-up (kernel compilation, library handles)
        graph, hidden = self.record(lambda: self.model(static, self.cache))
        self.graphs[batch.num_tokens] = CapturedStep(graph, structure, static_tensors, hidden)
        self.stats["captures"] += 1
        return eager

    def record_or_disable(self, fn, key, what: str):
        """`record(fn)`, or None with these graphs turned off (`disabled` says why, `stats["capture_failures"]`, a
        warning) when the capture raises. NOTE: a capture records kernels without running them, so the step's eager
        run before it stands; an op that cannot be captured (or a graph pool out of memory) turns the runner's
        graphs off rather than failing the engine (the lazily capturing runners: verify and drafting steps)."""
        try:
            return self.record(fn)
        except RuntimeError as e:
            self.disabled = f"{type(e).__name__}: {e}"
            self.stats["capture_failures"] += 1
            logger.warning("%s CUDA graphs are off (capturing key %s failed; those steps run eagerly): %s", what, key,
                           self.disabled)
            return None

    def record(self, fn) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Blocks while `fn`'s device work is captured (not run) into a new graph in the runner's pool;
        returns the graph and `fn`'s output (the buffer each replay rewrites)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        return graph, out


# --------------------------------------------------------------------------- speculative verify steps


@dataclass
class CapturedVerifyStep:
    """One verify key's graph and its buffers."""

    graph: torch.cuda.CUDAGraph
    structure: tuple
    static_tensors: list[torch.Tensor]
    """The graph's inputs: `verify_rows.StaticVerifyInputs.tensors()` of the padded step (the metadata is computed
    from them inside the graph)."""
    hidden: torch.Tensor  # [B_pad * N_pad, hidden] final hidden states, overwritten by every replay
    streams: torch.Tensor  # [B_pad * N_pad, hc, hidden] the pre-`hc_head` streams (the MTP drafter's input)
    ids: torch.Tensor | None = None
    """[B_pad * N_pad] the padded step's token ids (the real ones scattered in before each replay)."""


class VerifyGraphRunner(CudaGraphRunner):
    """Captures and replays speculative verify steps (`engine.spec_decode`), one graph per key
    `(B_pad, N_pad, blocks_pad)`.

    A verify step of B requests, request r computing `1 + L_r` tokens (its last token and its drafts), is padded
    to `B_pad` = the smallest decode bucket `>= B` requests of `N_pad = 1 + max_r L_r` queries each (padding
    queries and requests mirror real ones: `verify_rows.static_verify_metadata`), so the graph computes
    `B_pad * N_pad` tokens. `N_pad` is the step's own widest chunk, not `1 + num_draft_tokens`: the confidence
    schedule often verifies fewer drafts than drafted, and a shorter key then computes fewer tokens; a key
    costs one capture (lazily, at its first step). The key holds the pair, not the product `B_pad * N_pad`
    (8 x 2 and 4 x 4 are different shapes), and `blocks_pad`, the compressed-entry blocks per request the static
    metadata gathers, a power of two (`key`): at most `len(buckets) * (1 + num_draft_tokens) *
    (1 + log2(max_blocks_per_seq))` graphs, of which a workload meets the few its batch sizes and lengths reach.

    A step is *eligible* when it is a pure verify step (every request of the batch samples and computes exactly
    its `1 + L_r` tokens: no prefill or replay chunk, no image rows) whose requests fit a bucket; a step of
    plain decodes (every `L_r = 0`) is one with `N_pad = 1`. Others run eagerly, counted in
    `stats["eager_steps"]`. The metadata is computed inside the graph from the step's per-request inputs
    (`run`), so a replay's host work does not grow with the metadata (measured on the CPU with no-op replays,
    the built-in model: ~2.6 ms less host time a verify step at batch 1, ~7.5 ms at 16; BENCHMARKS.md).

    `run(batch, is_pure_verify)` returns `(hidden, streams)` of the batch's own flat rows (gathered out of the
    static buffers, so the next replay overwrites nothing handed out), or None: run it eagerly. As for decode
    steps, the LM head stays outside the graph (the caller computes the logits of the verified rows).
    """

    MAX_GRAPHS = 32
    """Default cap on captured keys (`max_graphs`)."""

    def __init__(self, model: nn.Module, cache, batch_sizes: Sequence[int], max_queries: int,
                 max_graphs: int | None = None) -> None:
        super().__init__(model, cache, batch_sizes)
        self.max_queries = max_queries
        self._keep_shapes_off_eager_routes(self.batch_sizes[-1] * max_queries if self.batch_sizes else 0)
        """`1 + num_draft_tokens`: the widest verify chunk."""
        self.max_graphs = self.MAX_GRAPHS if max_graphs is None else max_graphs
        """At most this many keys are captured; a step of another key then runs eagerly (`stats["over_cap"]`).
        NOTE: each captured key keeps its static inputs (the dense `visible` [B_pad, N_pad, C] and `entry_rows`
        [B_pad, C] of the static metadata, C = `blocks_pad * entries_per_block`) and outputs outside the shared
        pool, which the start-up memory plan (`engine.fit`) does not count; keys are captured during serving,
        so the cap bounds that memory (and the first-step capture stalls) whatever the workload meets."""
        self.graphs: dict[tuple[int, int, int], CapturedVerifyStep] = {}  # type: ignore[assignment]
        self.stats.update(eager_steps=0, over_cap=0, capture_failures=0)
        self.disabled: str | None = None
        """Why verify graphs were turned off (a capture failed: the step kept its eager results, later steps run
        eagerly), or None."""

    def key(self, batch: ForwardBatch) -> tuple[int, int, int] | None:
        """`(B_pad, N_pad, blocks_pad)` of a pure verify `batch`, or None (too many requests, tokens or blocks: eager).

        `blocks_pad`: the blocks of compressed entries the longest request needs, rounded up to a power of two
        (at most `cache.max_blocks_per_seq`): the static metadata gathers every request's entries densely, so
        sizing them by the whole `max_model_len` would make a long-context instance's short steps gather (and
        hold in the graph pool) up to `max_model_len / rate` entries per request and layer."""
        num_queries = max(s.num_new_tokens for s in batch.seqs)
        size = self.bucket(len(batch.seqs))
        if size is None or num_queries > self.max_queries:
            return None
        bs, bound = self.cache.block_size, self.cache.max_blocks_per_seq
        need = max(-(-(s.num_computed_tokens + s.num_new_tokens) // bs) for s in batch.seqs)
        if need > bound:
            return None
        return size, num_queries, min(1 << (need - 1).bit_length(), bound)

    def pad_verify(self, batch: ForwardBatch, key: tuple[int, int, int]) -> tuple[ForwardBatch, torch.Tensor]:
        """The padded batch of `key` (its static verify metadata attached) and `real_rows` [T]: the padded row of
        each of `batch`'s flat rows (no device value is read: the ids are scattered on the device)."""
        from deepinfer.engine.spec_decode.verify_rows import static_verify_metadata  # spec_decode imports this module

        size, N, max_blocks = key
        device = batch.input_ids.device
        real = [b * N + i for b, s in enumerate(batch.seqs) for i in range(s.num_new_tokens)]
        real_rows = host_to_device(torch.tensor(real, dtype=torch.long), device)
        ids = torch.zeros(size * N, dtype=torch.long, device=device)
        ids[real_rows] = batch.input_ids
        first = batch.seqs[0]
        seqs = ([SeqChunk(s.slot, s.block_table, s.num_computed_tokens, N, s.state_start, s.num_frozen_tokens)
                 for s in batch.seqs] + [SeqChunk(first.slot, [], 0, N)] * (size - len(batch.seqs)))
        padded = ForwardBatch(input_ids=ids, seqs=seqs)
        inner = getattr(self.model, "model", self.model)
        rope_fns = {"main": inner.rotary_main, "compress": inner.rotary_compress}
        padded.attn_metadata = static_verify_metadata(batch.seqs, size, N, padded.positions, inner.layer_specs,
                                                      rope_fns, self.cache, max_blocks)
        return padded, real_rows

    @torch.inference_mode()
    def run(self, batch: ForwardBatch, is_pure_verify: bool = True):  # type: ignore[override]
        """Blocks while the verify step replays (or is captured); `(hidden [T, H], streams [T, hc, H])` of `batch`'s
        rows, or None when the step must run eagerly (see the class docstring).

        Host work a step: the metadata's few inputs (`verify_rows.static_verify_inputs`: per request its position,
        new tokens, slot, state start, frozen tokens, block table) and the real rows' padded indices, moved in one
        transfer and copied into the graph's buffers; the graph computes the metadata itself
        (`static_verify_metadata_from`), then the step."""
        from deepinfer.engine.spec_decode.verify_rows import packed_to_device, static_verify_inputs

        if not is_pure_verify or batch.input_embeds is not None or batch.num_dummy_rows or not batch.seqs:
            self.stats["eager_steps"] += 1
            return None
        key = self.key(batch) if self.disabled is None else None
        if self._runs_eagerly(key):
            return None
        size, N, max_blocks = key
        inner = getattr(self.model, "model", self.model)
        inputs = static_verify_inputs(batch.seqs, size, N, inner.layer_specs, self.cache, max_blocks).tensors()
        real = torch.tensor([b * N + i for b, s in enumerate(batch.seqs) for i in range(s.num_new_tokens)])
        *inputs, real_rows = packed_to_device(inputs + [real], batch.input_ids.device)  # one transfer
        step = self.graphs.get(key)
        if step is None:
            hidden, streams = self.capture_verify_from(batch, key, inputs, real_rows)
        else:
            for dst, src in zip(step.static_tensors, inputs, strict=True):
                dst.copy_(src, non_blocking=True)
            step.ids.zero_()
            step.ids[real_rows] = batch.input_ids
            step.graph.replay()
            self.stats["replays"] += 1
            hidden, streams = step.hidden, step.streams
        return hidden.index_select(0, real_rows), streams.index_select(0, real_rows)

    def capture_verify_from(self, batch: ForwardBatch, key: tuple[int, int, int], inputs: list[torch.Tensor],
                            real_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks while the step runs eagerly (the warm-up: the step itself) and `key` is captured, the metadata
        built inside the graph from `inputs`' buffers; returns that eager run's `(hidden, streams)` of every padded
        row."""
        from deepinfer.engine.spec_decode.verify_rows import StaticVerifyInputs, static_verify_metadata_from

        size, N, max_blocks = key
        static_tensors = [t.clone() for t in inputs]  # outside the graph pool: never reused by a capture
        ids = torch.zeros(size * N, dtype=torch.long, device=batch.input_ids.device)
        ids[real_rows] = batch.input_ids
        inner = getattr(self.model, "model", self.model)
        specs, rope_fns = inner.layer_specs, {"main": inner.rotary_main, "compress": inner.rotary_compress}
        static = copy.copy(batch)
        static.input_ids, static.logits_indices, static.num_dummy_rows = ids, None, 0

        def forward():
            meta = static_verify_metadata_from(StaticVerifyInputs.of(static_tensors), N, specs, rope_fns,
                                               self.cache.block_size, max_blocks)
            static.positions, static.attn_metadata = meta.positions, meta
            return self.model(static, self.cache, meta, return_streams=True)

        eager = forward()  # warm-up (kernel compilation, library handles): the step's own results
        recorded = self.record_or_disable(forward, key, "verify")
        if recorded is None:
            return eager
        graph, (hidden, streams) = recorded
        self.graphs[key] = CapturedVerifyStep(graph, key, static_tensors, hidden, streams, ids)
        self.stats["captures"] += 1
        return eager

    def capture_dummy(self, size: int) -> None:
        """Not for verify steps: they are captured lazily, from real steps (padding mirrors a real request's
        writes, so there is no all-padding batch to capture from)."""
        raise NotImplementedError("verify graphs are captured by their first step (VerifyGraphRunner.run)")
