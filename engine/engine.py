"""The engine core: requests in, incremental outputs out, one `step()` at a time.

`Engine` is what every model-running stage drives (offline `LLM`, prefill and decode workers):
`add_request` validates and queues, `step` runs schedule → model → sample → stop checks and
returns the outputs that changed, `abort_request` frees a request anywhere in its life.

A step reads as: `scheduler.schedule()` → `_prepare` → `executor.submit()` (model forward +
sampling, `engine.executor`) → `StopChecker.append()` → `scheduler.update_from_output()`. The
executor, chosen once at construction, decides how many steps overlap (`Executor.max_inflight`);
`step` drives every executor with the same code.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.engine.cache.block_pool import BlockPool, KVCacheManager, StateSlotPool
from deepinfer.engine.cache.kv_cache import compressed_bytes_per_token, make_kv_cache
from deepinfer.engine.cache.layout import default_block_size, exact_replay_tokens
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.executor import PreparedStep, StepResult, executor_name, make_executor
from deepinfer.engine.kv_connector import KVLoadSpec, KVSaveSpec
from deepinfer.engine.kv_connector.engine_side import ExternalKVMixin
from deepinfer.engine.latency import LatencyHistograms
from deepinfer.engine.model_runner import ModelRunner
from deepinfer.engine.multimodal import ImageSpan
from deepinfer.engine.sampling import IncrementalDetokenizer, Sampler, SamplingBatch, SamplingParams
from deepinfer.engine.sampling.sampler import TokenLogprobs, compute_logprobs
from deepinfer.engine.sampling.stop import StopChecker
from deepinfer.engine.scheduler import (
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    check_num_original_prompt_tokens,
)
from deepinfer.engine.structured_output import GrammarCompiler, GrammarState, allocate_bitmask


class EngineConfig(BaseModel):
    """Everything an engine instance needs to start (frozen, validated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id (`engine.hub.resolve_model`); None means the built-in default model."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `model` is a repo id; None = main."""
    dtype: str = "float32"
    """Weights and cache dtype: float32 or bfloat16."""
    device: str = "cpu"
    """torch device (cpu, cuda, cuda:1, ...)."""
    max_model_len: int | None = Field(None, gt=1)
    """Longest prompt + output; None = min(config.max_position_embeddings, 8192)."""
    block_size: int | None = Field(None, gt=0)
    """Tokens per cache block; None = the least common multiple of the compress rates, at least 64."""
    num_blocks: int | None = Field(None, gt=0)
    """Cache blocks; None = enough for max_num_seqs sequences of max_model_len, capped by memory."""
    max_num_seqs: int = Field(64, gt=0)
    """Most running requests per step."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """Token budget per step."""
    enable_prefix_caching: bool = True
    """Reuse cached full blocks of shared prefixes."""
    policy: str = "fcfs"
    """Admission policy: fcfs or priority."""
    seed: int | None = 0
    """Seed of the sampler's generator for unseeded requests (None: nondeterministic)."""
    async_scheduling: bool | None = None
    """Overlap scheduling and output processing with the model run (a worker thread: the `threaded` executor);
    None = on for CUDA devices, off on the CPU. With `speculative`: the drafter overlaps output processing, one sync
    point per step (`spec_decode.SpecExecutor`). With `expert_parallel_size > 1`: the multi-rank executor's rounds run
    on a worker thread of rank 0 (`engine.distributed.executor`)."""
    executor: str | None = None
    """Executor by registry name (`engine.executor.EXECUTORS`: inprocess, threaded); None = picked from
    async_scheduling (threaded when on, else inprocess). An explicit name must agree with async_scheduling."""
    replay_tokens: int | None = Field(None, ge=0)
    """Tokens recomputed before a prefix hit to rebuild the bounded state; None = the exact minimum
    (`exact_replay_tokens`). Smaller values are refused: they would change outputs."""
    attention_backend: str = "auto"
    """Attention backend by registry name (`engine.attention.attention_backend_names()`), or "auto": the fused
    "triton" backend on a CUDA device (its decode kernels over static metadata, CUDA-graph safe; in batch-invariant
    mode its invariant variant), "torch" on the CPU and for DeepSeek-V4.1 (its own paged attention); resolved by
    `Engine` once the checkpoint is read (`resolve_backends`), so `Engine.config` holds the name that runs."""
    moe_backend: str = "auto"
    """MoE backend by registry name (`engine.moe.moe_backend_names()`), or "auto": "triton" (grouped GEMMs over the
    routed experts, float / FP8 / FP4; in batch-invariant mode one tile config) on a CUDA device for DeepSeek-V4,
    "torch" on the CPU and for DeepSeek-V4.1 (`resolve_backends` says why)."""
    fp8_activations: Literal["bf16", "fp8"] = "bf16"
    """Activations of the FP8 linears: "bf16" as they come (matches transformers), or "fp8" per token per 128
    channels with power-of-two scales as the official DeepSeek reference (`engine.quant.act_quant`)."""
    indexer_numerics: Literal["transformers", "reference"] = "transformers"
    """The lightning indexer's queries and compressed keys: "transformers" as they come (matches transformers), or
    "reference": Hadamard-rotated and FP4-simulated (blocks of 32, power-of-two scales) after their RoPE, as the
    official DeepSeek reference (`engine.attention.indexer_quant`)."""
    batch_invariant: bool = False
    """Batch-invariant numerics: a request's logits, logprobs and seeded samples are bit-identical whatever shares
    its batch, however its prompt is chunked or cached, on prefill or decode (`engine.batch_invariant`; slower).
    Refused at start-up, naming the op, with a backend or device that cannot give it."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs for decode steps (`engine.cuda_graph`)."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Decode batch sizes captured as CUDA graphs (a batch runs padded to the next one); None = 1, 2, 4, 8,
    16, 24, 32, 48, 64, 96, 128, ... up to max_num_seqs (which is always one)."""

    speculative: Literal["mtp", "dspark"] | None = None
    """Speculative decoding (`engine.spec_decode`; lossless): None = off, "mtp" = the checkpoint's
    multi-token-prediction layer drafts `num_draft_tokens` per request per step, verified in the next one (DeepSeek-V4);
    "dspark" = DeepSeek-V4.1's DSpark stages draft a block per step (`spec_decode.dspark_drafter`; "mtp" is refused
    for V4.1, "dspark" for V4).
    Canonical name; the aliases `speculative_tokens=K` (K > 0: "mtp" with K drafts, 0: off) and `speculative_method`
    are still accepted when they agree (`engine.spec_decode.config`)."""
    num_draft_tokens: int = Field(3, ge=1)
    """Drafts proposed per request per step with `speculative` on; at most the model's smallest state ring minus
    one (checked when the engine starts)."""
    verify_schedule: Literal["full", "confidence"] = "full"
    """Drafts verified per request (speculative decoding): "full" all of them, "confidence" a prefix chosen over
    the whole batch from the drafts' confidences (`engine.spec_decode.verify_schedule`)."""
    verify_floor: int = Field(1, ge=0, le=1)
    """Drafts every request verifies at least under the "confidence" schedule: 1, or 0 (a request whose drafts are
    unlikely to be accepted then verifies none that step); 0 needs verify_schedule="confidence"."""
    verify_cost_table: str | None = None
    """Step-cost table (JSON, `benchmarks/speculative.py --profile-cost`) of the "confidence" schedule; None = the
    table shipped for the CPU (`spec_decode.step_cost`) on a CPU device, the linear stand-in elsewhere; "linear" =
    the linear stand-in."""
    expert_parallel_size: int = Field(1, ge=1)
    """Ranks of the instance (`engine.distributed`): attention data-parallel over the ranks, routed experts split
    over them (expert parallelism); 1 = one process (today's engine). With N > 1 the engine's process is rank 0 and
    starts N - 1 rank processes (gloo on the CPU, NCCL on GPUs); prefix caching is then off."""
    rank_group_address: str = ""
    """With expert_parallel_size > 1: "host:port" where the instance's ranks meet (rank 0 hosts the rendezvous
    there: its node's IP and a free port, picked by the launcher); "" = loopback and a free port (one node)."""
    local_ranks: int | None = Field(None, ge=1)
    """With expert_parallel_size > 1: how many ranks run on this node (ranks 0..local_ranks-1; this process starts
    1..local_ranks-1); the others are started on their nodes by node-slice actors (`deploy.rank_slice`) and join
    the same group at `rank_group_address`. None = all of them here (one node)."""
    num_redundant_experts: int = Field(0, ge=0)
    """Extra replicas of hot routed experts per MoE layer (EPLB, `engine.moe.eplb`), with expert_parallel_size > 1;
    n_routed_experts + num_redundant_experts must divide by expert_parallel_size."""
    eplb_interval_steps: int = Field(0, ge=0)
    """Re-place the experts (EPLB) from the loads measured over the last this-many steps; 0 = never by itself."""
    v41_decoder_replay: bool = True
    """DeepSeek-V4.1 only: decoder-side bounded replay, the layers after the last KV source computed only over each
    prompt's last `sliding_window` tokens (and what follows), as DeepSeek's production does: about half a long
    prompt's prefill; not exact (the first tail tokens see a window cut at the tail's start in those layers).
    False: every layer over every token (`engine.models.deepseek_v41`, docs/V4_1.md §12). Ignored for V4."""
    engram_placement: Literal["auto", "device", "pinned_host"] = "auto"
    """DeepSeek-V4.1 only: where the FP8 Engram tables live (`engine.quant.engram`): "device" memory, or "pinned_host"
    memory gathered from over PCIe; "auto" = the fit check decides (`engine.fit`: the device when the tables there
    still leave room for max_num_seqs sequences of max_model_len, always on a CPU engine). Ignored for V4."""

    @model_validator(mode="before")
    @classmethod
    def _speculative_aliases(cls, data):
        from deepinfer.engine.spec_decode.config import resolve_speculative_fields

        return resolve_speculative_fields(data)  # speculative_tokens / speculative_method -> the canonical fields

    @property
    def speculative_tokens(self) -> int:
        """Drafts per request per step, 0 when speculative decoding is off (the alias, read-only)."""
        return self.num_draft_tokens if self.speculative is not None else 0

    @property
    def speculative_method(self) -> str | None:
        """The drafter (`speculative`; the alias, read-only)."""
        return self.speculative

    @model_validator(mode="after")
    def _check_choices(self) -> EngineConfig:
        if self.speculative is not None and self.executor not in (None, "inprocess", "multirank"):
            # NOTE: supported: one process or expert_parallel_size > 1 (each rank verifies and drafts its own
            # requests, `engine.distributed.spec`), async_scheduling on or off (`spec_decode.SpecExecutor`)
            raise ValueError(f"speculative decoding runs steps on its own executor (spec_decode.SpecExecutor, or the "
                             f"multi-rank one with expert_parallel_size > 1), not {self.executor!r}; leave executor "
                             "unset, or turn it off (speculative=None; the alias speculative_tokens=0)")
        from deepinfer.engine.spec_decode.config import check_verify_floor

        check_verify_floor(self.verify_floor, self.verify_schedule)
        if self.expert_parallel_size > 1:
            from deepinfer.engine.distributed import check_config as check_multi_rank

            check_multi_rank(self)  # raises ValueError saying how to fix it
        else:
            executor_name(self.executor, self.async_scheduling, self.device)  # raises ValueError saying how to fix it
        from deepinfer.engine.attention import get_attention_backend
        from deepinfer.engine.moe import get_moe_backend

        if self.attention_backend != AUTO:
            get_attention_backend(self.attention_backend)  # raises ValueError listing the known names
        if self.moe_backend != AUTO:
            get_moe_backend(self.moe_backend)
        if self.batch_invariant:
            from deepinfer.engine.batch_invariant import check_config

            # "auto" may resolve to torch (the CPU, V4.1: `resolve_backends`), always accepted; on CUDA to "triton",
            # accepted there too
            check_config(_or_torch(self.attention_backend), _or_torch(self.moe_backend), self.device)
        return self


@dataclass
class CompletionOutput:
    """One sequence's output so far (vLLM's shape)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step: its prompt and its `n` sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    error: str | None = None
    finished: bool = False
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """Tokens added to each sequence by the last step (streaming deltas)."""
    new_text: dict[int, str] = field(default_factory=dict)
    """Text added to each sequence by the last step."""
    kv_block_ids: list[int] | None = None
    """For requests pinned for a save (`hold_kv`, or the KV connector's): the pinned blocks with the
    prompt's compressed KV."""
    kv_state_slot: int | None = None
    """For `hold_state` requests: the held state slot with the bounded state after the prompt."""


@dataclass
class _Seq:
    """Engine-side state of one sequence (a scheduler Request)."""

    parent: _Parent
    index: int
    params: SamplingParams
    stop: StopChecker
    req: Request | None = None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the sequence."""
    save: KVSaveSpec | None = None
    """Pin the KV blocks (and with `with_state` the slot) after the first sampled token, for a save
    (`hold_kv` by hand, or the KV connector's), until it is released (`engine.kv_connector`)."""
    pinned_block_ids: list[int] | None = None
    pinned_slot: int | None = None
    grammar: GrammarState | None = None
    """The structured-output matcher when the params carry a constraint."""


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    outputs: list[CompletionOutput]
    seqs: list[_Seq] = field(default_factory=list)
    pending_children: list[_Seq] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None
    image_spans: tuple[ImageSpan, ...] = ()
    num_original_prompt_tokens: int | None = None
    """A continuation's original prompt length (`add_request`), else None."""
    queued_at: float | None = None
    """time.monotonic() when the first sequence entered the scheduler (after its KV load, if any)."""
    scheduled_at: float | None = None
    """time.monotonic() of its first scheduling (`Engine.latency`'s queue and prefill times)."""


@dataclass
class _InflightStep:
    """A step submitted to the executor and not yet postprocessed."""

    out: SchedulerOutput
    touched: set[str]
    """Request ids whose outputs changed at scheduling (errors), reported with this step's outputs."""
    result: Future[StepResult]


AUTO = "auto"
"""`EngineConfig.attention_backend` / `moe_backend`: pick for the device and the model (`resolve_backends`)."""


def _or_torch(name: str) -> str:
    return "torch" if name == AUTO else name


def resolve_backends(config: EngineConfig, model_config) -> EngineConfig:
    """`config` with "auto" backends replaced by names (a copy; `config` itself when nothing is "auto").

    On a CUDA device (with triton installed), for DeepSeek-V4: the "triton" attention and MoE backends — the fused
    kernels, CUDA-graph safe, that the GPU benchmarks measure (BENCHMARKS.md); in batch-invariant mode the mode swaps
    them for its fixed-tiling variants (`engine.batch_invariant`; its GPU tests passed on an H100 on 2026-12-05, and
    it costs 18-33% of the throughput where the torch path cost 97%). Elsewhere the "torch" references: on the CPU
    they are the faster choice and the oracle; DeepSeek-V4.1 runs its own paged attention (which takes "torch")
    and keeps the "torch" MoE backend too, because "triton" there turns on its static-decode CUDA graphs
    (docs/V4_1.md §16), which score every `max_model_len / ratio` index key a row and have not run on a GPU: an
    explicit `moe_backend="triton"` opts in."""
    from deepinfer.engine.config import V41Config
    from deepinfer.kernels import mhc  # noqa: F401 - any kernels module: tells whether triton imports

    fast = str(config.device).startswith("cuda") and mhc.triton is not None and not isinstance(model_config, V41Config)
    update = {}
    if config.attention_backend == AUTO:
        update["attention_backend"] = "triton" if fast else "torch"
    if config.moe_backend == AUTO:
        update["moe_backend"] = "triton" if fast else "torch"
    return config.model_copy(update=update) if update else config


def default_model_path() -> Path:
    """The built-in default checkpoint (the demo model)."""
    from deepinfer.engine.builtin_model import builtin_model_path

    return builtin_model_path()


class Engine(ExternalKVMixin):
    """The pure engine core (no sockets): `add_request` / `abort_request` / `step`."""

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        from deepinfer.engine.fit import check_fit
        from deepinfer.engine.hub import resolve_model
        from deepinfer.engine.loader import load_checkpoint, read_checkpoint_config
        from deepinfer.engine.models.deepseek_v4_weights import parse_dtype
        from deepinfer.engine.tokenizer import load_tokenizer

        config = config or EngineConfig(**kwargs)
        self.config = config
        path = resolve_model(config.model, config.revision)  # a repo id: the cached (or downloaded) snapshot
        self.model_path = path
        """The checkpoint directory this engine serves (the built-in demo model's when none was given; a
        repo id's snapshot in the Hugging Face cache)."""
        mc, _ = read_checkpoint_config(path)
        config = resolve_backends(config, mc)  # "auto" backends -> names, for the device and the model
        self.config = config
        from deepinfer.engine.spec_decode.config import check_drafter_for_model

        check_drafter_for_model(config.speculative, mc)  # "dspark" is V4.1's, "mtp" V4's
        # NOTE: batch_invariant works for DeepSeek-V4.1 too (`engine.batch_invariant._enable_v41`)
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 8192)
        block_size = config.block_size or default_block_size(mc.compress_rates.values())  # the layout decides
        self.fit = check_fit(path, mc, dtype=parse_dtype(config.dtype), device=config.device,
                             max_model_len=self.max_model_len, block_size=block_size,
                             max_num_seqs=config.max_num_seqs, num_blocks=config.num_blocks,
                             expert_parallel_size=config.expert_parallel_size,
                             num_redundant_experts=config.num_redundant_experts,
                             engram_placement=config.engram_placement, speculative=config.speculative)
        """The start-up memory plan (`engine.fit`): checked before loading; refuses a model that cannot fit. With
        `speculative`: the drafter's state per slot, and the MTP layers whole on every expert-parallel rank (below)."""
        ep_kwargs = {}
        if config.expert_parallel_size > 1:  # rank 0 of an instance: its routed experts only (`engine.distributed`)
            from deepinfer.engine.distributed.expert_parallel import rank_load_kwargs

            ep_kwargs = rank_load_kwargs(mc, config.expert_parallel_size, 0, config.num_redundant_experts,
                                         config.batch_invariant, load_mtp=config.speculative is not None)
        self.model, self.model_config = load_checkpoint(path, dtype=config.dtype, device=config.device,
                                                       attention_backend=config.attention_backend,
                                                       moe_backend=config.moe_backend,
                                                       fp8_activations=config.fp8_activations,
                                                       indexer_numerics=config.indexer_numerics,
                                                       engram_placement=self.fit.engram_placement, **ep_kwargs)
        if config.batch_invariant:
            from deepinfer.engine.batch_invariant import enable_batch_invariant

            enable_batch_invariant(self.model)  # once: invariant backends and the model's numerics mode
        if hasattr(self.model, "decoder_replay"):  # DeepSeek-V4.1 (`deepseek_v41.DeepseekV41ForCausalLM`)
            self.model.decoder_replay = config.v41_decoder_replay
        mc = self.model_config
        self.tokenizer = load_tokenizer(path)
        self.replay_tokens = exact_replay_tokens(mc)
        # NOTE: a multi-rank instance has one block pool per rank; a block id carries its rank, so a prefix hit
        # names KV of the rank the request then runs on (`engine.distributed.kv_pools`)
        self._prefix_caching = config.enable_prefix_caching
        if config.replay_tokens is not None:
            if config.replay_tokens < self.replay_tokens:
                raise ValueError(
                    f"replay_tokens={config.replay_tokens} is below the exact minimum {self.replay_tokens} for this "
                    "model (num_layers * (sliding_window - 1) + 2 * max compress rate); raise it or leave it unset"
                )
            self.replay_tokens = config.replay_tokens
        elif config.speculative is not None:  # the replay rebuilds the MTP drafter's window too (`engine.spec_decode`)
            from deepinfer.engine.spec_decode import drafter_replay_tokens

            self.replay_tokens = max(self.replay_tokens, drafter_replay_tokens(mc))
        blocks_per_seq = -(-self.max_model_len // block_size)
        # NOTE: `fit.num_slots` is max_num_seqs, or a rank's share of them with expert_parallel_size > 1 (each rank's
        # cache holds only its requests' blocks and state slots)
        num_blocks = config.num_blocks or min(blocks_per_seq * self.fit.num_slots, 1 << 16, self.fit.max_num_blocks)
        embed = getattr(self.model, "embed", None) or self.model.model.embed_tokens  # V4.1's is top level
        dtype = embed.weight.dtype
        # V4's cache, or V4.1's (only KV sources own compressed pools: `engine.cache.v41`)
        self.cache = make_kv_cache(mc, num_blocks, block_size, self.fit.num_slots, dtype=dtype, device=config.device,
                                   max_model_len=self.max_model_len)
        if config.expert_parallel_size > 1:  # `num_blocks` per rank; each rank's cache holds its requests' KV only
            from deepinfer.engine.distributed.kv_pools import RankedBlockPool, RankedKVCacheManager, RankedStateSlotPool

            self.slots = RankedStateSlotPool(config.max_num_seqs, config.expert_parallel_size)
            self.kv_manager = RankedKVCacheManager(
                RankedBlockPool(config.expert_parallel_size, num_blocks, block_size, self._prefix_caching), self.slots)
        else:
            self.kv_manager = KVCacheManager(BlockPool(num_blocks, block_size, self._prefix_caching))
            self.slots = StateSlotPool(config.max_num_seqs)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                policy=config.policy,
            ),
            self.kv_manager,
            self.slots,
            replay_tokens_fn=lambda hit: self.replay_tokens,
        )
        # NOTE: speculative steps run their own forward (`engine.spec_decode`): the runner's decode graphs stay off,
        # pure verify steps replay graphs of their own (`SpecDecoding.graphs`, set up in `make_executor`)
        self.runner = ModelRunner(self.model, self.cache, enforce_eager=config.enforce_eager or config.speculative is not None
                                  or config.expert_parallel_size > 1,
                                  cuda_graph_batch_sizes=config.cuda_graph_batch_sizes, max_num_seqs=config.max_num_seqs)
        self.runner.capture_cuda_graphs()  # decode buckets, when the model and device allow graphs
        encoder = getattr(self.model, "image_encoder", None)  # V4.1's tower (its `vision` is the bare ViT)
        self.vision = encoder if encoder is not None else getattr(self.model, "vision", None)
        """The model's `VisionTower` (encodes images given without embeddings), or None: text only."""
        self.sampler = Sampler(seed=config.seed)
        self.eos_token_ids = tuple(mc.eos_token_ids)
        self.grammar_compiler = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        """Compiles (and caches) structured-output constraints against this model's tokenizer."""
        self._parents: dict[str, _Parent] = {}
        self._seqs: dict[str, _Seq] = {}
        self._ids = itertools.count()
        self.num_computed_tokens_total = 0
        """Tokens the model computed since start (prefix hits excluded)."""
        self.bytes_per_token = compressed_bytes_per_token(mc, dtype)
        self.timings = {"schedule": 0.0, "model": 0.0, "sample": 0.0, "steps": 0, "tokens": 0}
        """Seconds spent scheduling, in the model and sampling; steps run; tokens computed (replay included)."""
        self.latency = LatencyHistograms()
        """Per-request and per-step latency histograms (`engine.latency`), exported by the serving workers:
        `queue` (entered the scheduler -> first scheduled; after the KV load on a decode instance), `prefill` (first
        scheduled -> first token sampled: the prompt's compute, every chunk; on instances that compute it) and
        `step` (one engine step's schedule + model + sample time)."""
        self._step_seconds_seen = 0.0
        self.prefix_cache_tokens = {"queried": 0, "hit": 0}
        """Prompt tokens of requests scheduled since start, and those served from the prefix cache (hit / queried:
        the instance's prefix-cache hit rate)."""
        self.spec = None
        """Speculative decoding (`engine.spec_decode.SpecDecoding`: drafter, rollback, metrics), or None when off."""
        if config.speculative is not None:
            from deepinfer.engine.spec_decode import SpecDecoding
            from deepinfer.engine.spec_decode.step_cost import load_cost_table

            # NOTE: the drafter's slots are the cache's (a rank's share of them with expert_parallel_size > 1)
            self.spec = SpecDecoding(self.model, self.cache, self.sampler, self.cache.num_slots,
                                     config.num_draft_tokens, config.speculative, config.verify_schedule,
                                     verify_floor=config.verify_floor, model_dir=path,
                                     cost_table=load_cost_table(config.verify_cost_table, config.device))
        self.executor = (self.spec.make_executor(config, self.runner) if self.spec is not None
                         else make_executor(config, self.runner, self.sampler))
        """Runs each prepared step (model forward + sampling); chosen once, here (`engine.executor`)."""
        self._inflight: deque[_InflightStep] = deque()
        """Steps submitted to the executor and not yet postprocessed, oldest first (at most `max_inflight`)."""
        self._init_external_kv()  # KV from / to outside: the connector, loads, pins (`engine.kv_connector`)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        hold_kv: bool = False,
        hold_state: bool = False,
        images: Sequence[ImageSpan] | None = None,
        num_original_prompt_tokens: int | None = None,
        _kv_load: KVLoadSpec | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (naming the field) on bad input.

        `num_original_prompt_tokens`: the request continues an earlier one (after a decode restart or a
        migration: that request's prompt followed by the k tokens it generated, with k fewer to make), and this is
        that prompt's length, in `[1, len(prompt)]`. What the model fixes by the prompt alone keeps the original:
        DeepSeek-V4.1's decoder-side bounded replay starts its tail at `num_original_prompt_tokens - sliding_window`
        as the uninterrupted request did, so with `batch_invariant=True` the continuation's tokens and logprobs are
        the uninterrupted run's bit for bit. V4 computes nothing from where a prompt ends: it accepts and ignores
        it. None: the whole prompt is the original.

        `images`: the prompt's images (`engine.multimodal.ImageSpan`, sorted by offset), each over
        positions of the prompt ids that hold `image_token_id`, with `embeds` [num_tokens, hidden]
        or an `image` the model's vision tower encodes here (blocking) before the request is queued.

        `hold_kv=True` (prefill instances): from its first sampled token on, the request's KV blocks
        stay referenced, even after it finishes, until `release_kv` (or `abort_request`); the
        output's `kv_block_ids` names them. `hold_state=True` (with `hold_kv`) also keeps the
        request's bounded-state slot, as it is after the prompt, until `release_kv`; the output's
        `kv_state_slot` names it. With a KV connector (`set_kv_connector`), it decides the same for
        every n = 1 request (`KVConnector.get_load` / `get_save`).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", field="params")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        text, ids = self._tokenize(prompt)
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", field="prompt")
        check_num_original_prompt_tokens(num_original_prompt_tokens, len(ids))
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})", field="prompt_token_ids"
            )
        params.validate_against_vocab(vocab)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}", field="prompt"
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len})",
                field="max_tokens",
            )
        if params.structured_output is not None:
            self.grammar_compiler.compile(params.structured_output)  # refuses a bad constraint before any compute
        spans = tuple(self.encode_images(self._check_images(ids, images))) if images else ()
        parent = _Parent(request_id, text, ids, params, priority,
                         [CompletionOutput(index=i) for i in range(params.n)], image_spans=spans,
                         num_original_prompt_tokens=num_original_prompt_tokens)
        for i in range(params.n):
            child = params.for_child(i) if params.n > 1 else params
            det = IncrementalDetokenizer(self.tokenizer, ids, child.skip_special_tokens)
            stop = StopChecker(child, det, eos_token_ids=self.eos_token_ids, num_prompt_tokens=len(ids),
                               max_model_len=self.max_model_len)
            grammar = self.grammar_compiler.new_state(child.structured_output) if child.structured_output else None
            parent.seqs.append(_Seq(parent, i, child, stop, logprobs=[] if child.logprobs is not None else None,
                                    grammar=grammar))
        if params.prompt_logprobs is not None and self.config.expert_parallel_size > 1:
            raise InvalidRequestError("prompt_logprobs is not supported with expert_parallel_size > 1 yet",
                                      field="prompt_logprobs")
        if params.prompt_logprobs is not None:
            # NOTE: computed by a separate scratch pass over the prompt (not inside the batched
            # prefill), so it costs one extra prompt forward for the requests that ask for it.
            parent.prompt_logprobs = self.prompt_logprobs(ids, params.prompt_logprobs, spans)
        load, parent.seqs[0].save = self._kv_specs(request_id, ids, params, hold_kv, hold_state, _kv_load)
        self._parents[request_id] = parent
        # NOTE: with n > 1 the first sequence runs alone until its prompt is cached; the others then
        # start from the cached prefix blocks (shared copy-free) instead of recomputing the prompt.
        share = params.n > 1 and self._prefix_caching
        first = parent.seqs[:1] if share else parent.seqs
        parent.pending_children = parent.seqs[1:] if share else []
        for seq in first:
            self._submit(seq, load)
        return request_id

    def _check_images(self, ids: list[int], images: Sequence[ImageSpan]) -> list[ImageSpan]:
        """Validate a request's image spans against its prompt ids (no compute)."""
        if self.vision is None:
            raise InvalidRequestError(
                "this model has no vision tower (its config.json has no vision_config); send text only",
                field="images")
        hidden, image_id = self.model_config.hidden_size, self.model_config.image_token_id
        spans, end = list(images), 0
        for i, span in enumerate(spans):
            if not isinstance(span, ImageSpan):
                raise InvalidRequestError(f"images[{i}] must be an ImageSpan, got {type(span).__name__}", field="images")
            if span.num_tokens <= 0 or span.offset < end or span.end > len(ids):
                raise InvalidRequestError(
                    f"images[{i}] covers positions [{span.offset}, {span.end}); spans must be non-empty, sorted, "
                    f"disjoint and inside the prompt ({len(ids)} tokens)", field="images")
            if any(t != image_id for t in ids[span.offset:span.end]):
                raise InvalidRequestError(
                    f"images[{i}] covers positions [{span.offset}, {span.end}) that do not all hold the image "
                    f"token {image_id}; expand each image placeholder into its image tokens first "
                    "(engine.multimodal.expand_image_placeholders)", field="images")
            if not isinstance(span.content_hash, str) or not span.content_hash:
                raise InvalidRequestError(f"images[{i}] needs a content_hash", field="images")
            if span.embeds is not None:
                if tuple(span.embeds.shape) != (span.num_tokens, hidden):
                    raise InvalidRequestError(
                        f"images[{i}].embeds has shape {tuple(span.embeds.shape)}; expected "
                        f"({span.num_tokens}, {hidden})", field="images")
            elif span.image is None:
                raise InvalidRequestError(f"images[{i}] has neither embeds nor an image to encode", field="images")
            else:
                from deepinfer.engine.models.vision import image_token_count

                count = getattr(self.vision, "image_token_count", image_token_count)  # the tower's own plan if any
                n = count(int(span.image.width), int(span.image.height))
                if n != span.num_tokens:
                    raise InvalidRequestError(
                        f"images[{i}] is {span.image.width}x{span.image.height} = {n} image tokens but its span has "
                        f"{span.num_tokens}", field="images")
            end = span.end
        return spans

    def encode_images(self, images: Sequence[ImageSpan]) -> list[ImageSpan]:
        """Blocks while encoding: `images` with `embeds` filled in (model dtype and device) by the model's
        vision tower where they carry only an `image`; images of equal size share a forward. Given
        embeddings are copied (the engine keeps them for the request's life: recompute after preemption).

        Raises `InvalidRequestError` when the model has no vision tower or an image does not decode.
        """
        from deepinfer.engine.models.vision import preprocess_pixels

        if self.vision is None and any(s.embeds is None for s in images):
            raise InvalidRequestError("this model has no vision tower (its config.json has no vision_config)",
                                      field="images")
        todo = [i for i, s in enumerate(images) if s.embeds is None]
        pixels = []
        prep = getattr(self.vision, "preprocess", None) or (lambda im: preprocess_pixels(im, self.vision.config))
        for i in todo:
            try:
                pixels.append(prep(images[i].image))
            except InvalidRequestError as e:
                raise InvalidRequestError(f"images[{i}]: {e}", field="images") from None
        encoded = dict(zip(todo, self.vision.encode(pixels))) if todo else {}
        embed = self.model.embed if hasattr(self.model, "embed") else self.model.model.embed_tokens  # V4.1 : V4
        dtype, device = embed.weight.dtype, self.runner.device
        out = []
        for i, span in enumerate(images):
            if i in encoded:
                emb = encoded[i].to(device=device, dtype=dtype)
            else:  # NOTE: a private copy: the caller may reuse its buffer (e.g. transfer rows) at once
                emb = span.embeds.to(device=device, dtype=dtype, copy=True)
            out.append(replace(span, embeds=emb))
        return out

    def _submit(self, seq: _Seq, load: KVLoadSpec | None = None) -> None:
        """Hand a sequence to the scheduler, or (`load`) reserve its imported prefix and wait for it."""
        p = seq.parent
        rid = p.request_id if len(p.seqs) == 1 else f"{p.request_id}#{seq.index}"
        seq.req = Request(rid, p.prompt_token_ids, max_tokens=seq.params.max_tokens, priority=p.priority,
                          sampling_params=seq.params, arrival_time=time.monotonic(), image_spans=p.image_spans,
                          num_original_prompt_tokens=p.num_original_prompt_tokens)
        self._seqs[rid] = seq
        if load is None:
            p.queued_at = p.queued_at or time.monotonic()
            self.scheduler.add_request(seq.req)
            return
        try:
            self._start_kv_load(seq, load)
        except Exception:
            self.abort_request(p.request_id)  # reserves nothing: blocks, slot and the connector's load go
            raise

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise InvalidRequestError("prompt_token_ids must be a list of ints", field="prompt_token_ids")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", field="prompt")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}", field="prompt")

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its sequences) wherever it is; frees its blocks and slot.

        A pending load's blocks may stay quarantined, and a save's pinned blocks stay pinned, while
        the KV connector still uses them (`KVConnector.abort_load` / `abort_save`).
        """
        self._abort_kv_save(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for seq in parent.seqs:
            if seq.req is not None:
                if not self._abort_kv_load(seq):
                    self.scheduler.abort_request(seq.req.req_id)
                self._seqs.pop(seq.req.req_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished or a step is still in flight (`step()` has outputs left to give)."""
        return bool(self._parents) or bool(self._inflight)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def wait_steps_in_flight(self) -> None:
        """Blocks until every step submitted so far has run on the device (its outputs still wait for `step()`).

        For a writer outside this engine's stream order: blocks and a state slot just reserved for a KV load may
        have been freed by a request that a step still in flight writes (async scheduling: the scheduler's NOTE
        on reuse), which only later steps of this engine are ordered after. A prefill's NIXL WRITE into them
        (`decode_worker.DecodeCore.reserve`) must not start before that step ended. On a CUDA device the device
        is synchronised too: a step without sampling rows queues its work without a host sync. Costs at most
        one step's wait, once per reservation; nothing when no step is in flight on the CPU."""
        from concurrent.futures import wait

        wait([inflight.result for inflight in self._inflight])
        if torch.device(self.config.device).type == "cuda":
            torch.cuda.synchronize(self.config.device)

    def speculative_stats(self) -> dict | None:
        """Speculative decoding's counters and rates since start (acceptance rate overall and per draft position,
        mean accepted length, verified tokens per step; `spec_decode.SpecDecodeMetrics.as_dict`); None when off."""
        return None if self.spec is None else self.spec.metrics.as_dict()

    def shutdown(self) -> None:
        """Blocks until the step in flight (if any) has run, then stops the executor (its worker thread).

        Idempotent. Call it once no thread steps the engine any more; `step()` afterwards raises
        RuntimeError. Outputs of a step still in flight are dropped.
        """
        self.executor.close()
        self._inflight.clear()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Blocks for one model step; returns outputs of requests that progressed or finished.

        The same code drives every executor: schedule (overlapping the steps in flight), prepare with
        the tokens the steps in flight sampled, submit to the executor; then postprocess (stop checks,
        detokenization, scheduler update) the oldest steps until fewer than `executor.max_inflight`
        remain, or all of them when there was nothing new to run. With the in-process executor that
        is the step just run. With the threaded one (`async_scheduling`), step N+1 is scheduled
        while step N's model runs on a worker thread, and step N is postprocessed while step N+1
        runs; the returned outputs then lag one step behind the device.

        A failure in the model run is raised here; the engine is then unusable (discard it).
        """
        out, touched = self._schedule()  # overlaps with the model runs in flight
        has_work = bool(out.total_num_scheduled_tokens)
        if has_work:
            step = self._prepare(out, self._inflight_token_ids())
            self._inflight.append(_InflightStep(out, touched, self.executor.submit(step)))
        outputs: list[RequestOutput] = []
        while self._inflight and (len(self._inflight) >= self.executor.max_inflight or not has_work):
            done = self._inflight.popleft()
            # overlaps with the model runs still in flight
            outputs += self._postprocess(done.out, done.result.result(), done.touched)
        if not has_work:
            outputs += self._postprocess(out, None, touched)
        return outputs

    def _inflight_token_ids(self) -> dict[str, list[int]]:
        """Blocks until the steps in flight have sampled; per request, the tokens they sampled, oldest
        first (not yet applied by `update_from_output`: the scheduler holds placeholders for them)."""
        pending: dict[str, list[int]] = {}
        for inflight in self._inflight:
            for rid, tok in zip(inflight.out.sampling_req_ids, inflight.result.result().token_ids):
                pending.setdefault(rid, []).append(tok)
        return pending

    def _schedule(self):
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        hits = {n.req_id: n.num_cached_tokens for n in out.scheduled_new_reqs}
        self.runner.update_states(out, hits)
        touched: set[str] = set()
        for n in out.scheduled_new_reqs:
            seq = self._seqs.get(n.req_id)
            if seq is not None and not n.is_resumed and seq.index == 0:
                seq.parent.num_cached_tokens = hits.get(n.req_id, 0)
                if seq.parent.scheduled_at is None:
                    seq.parent.scheduled_at = time.monotonic()
                    self.prefix_cache_tokens["queried"] += len(seq.parent.prompt_token_ids)
                    self.prefix_cache_tokens["hit"] += seq.parent.num_cached_tokens
                    if seq.parent.queued_at is not None:
                        self.latency.observe("queue", seq.parent.scheduled_at - seq.parent.queued_at)
        for req_id, msg in out.error_messages.items():
            seq = self._seqs.get(req_id)
            if seq is not None:
                seq.parent.error = msg
                seq.parent.outputs[seq.index].finish_reason = "error"
                touched.add(seq.parent.request_id)
        self.timings["schedule"] += time.perf_counter() - t0
        self.timings["tokens"] += out.total_num_scheduled_tokens
        return out, touched

    def _prepare(self, out: SchedulerOutput, pending: dict[str, list[int]]) -> PreparedStep:
        """Snapshot everything the step needs (engine thread): the model batch and the sampling batch.

        `pending[req_id]` are tokens sampled by steps still in flight whose updates have not been
        applied yet (an overlapping executor): they are the request's newest tokens.
        """
        token_ids_of = {}
        for rid in out.num_scheduled_tokens:
            req = self.scheduler.get_request(rid)
            ids = req.all_token_ids
            token_ids_of[rid] = ids + pending[rid] if rid in pending else ids
            if rid in out.scheduled_spec_token_ids:  # speculative decoding: the drafts it verifies follow
                token_ids_of[rid] = token_ids_of[rid] + out.scheduled_spec_token_ids[rid]
        batch = self.runner.prepare(out, token_ids_of)
        sbatch = None
        if out.sampling_req_ids:
            params, outs, prompts = [], [], []
            for rid in out.sampling_req_ids:
                req = self.scheduler.get_request(rid)
                params.append(req.sampling_params)
                outs.append(req.output_token_ids + pending[rid] if rid in pending else req.output_token_ids)
                prompts.append(req.prompt_token_ids)
            if out.scheduled_spec_token_ids:  # one sampling row per verified position (`engine.spec_decode`)
                from deepinfer.engine.spec_decode import expand_verify_rows

                drafts = [out.scheduled_spec_token_ids.get(rid, []) for rid in out.sampling_req_ids]
                bitmask_outs = outs
                params, outs, prompts, first_rows = expand_verify_rows(params, outs, prompts, drafts)
                bitmask = self._grammar_bitmask(out.sampling_req_ids, bitmask_outs, drafts, first_rows, len(params))
            else:
                first_rows = list(range(len(params)))
                bitmask = self._grammar_bitmask(out.sampling_req_ids, outs)
            sbatch = SamplingBatch.build(params, outs, prompts, device=self.runner.device,
                                         eos_token_ids=self.eos_token_ids)
            sbatch.token_bitmask, sbatch.token_bitmask_row_ids = bitmask
        self.num_computed_tokens_total += out.total_num_scheduled_tokens
        if self.spec is not None:
            return self.spec.prepare(PreparedStep(batch, sbatch), out, token_ids_of,
                                     first_rows if out.sampling_req_ids else [],
                                     lambda rid: rid in self._seqs)
        return PreparedStep(batch, sbatch)

    def _grammar_bitmask(self, sampling_req_ids: list[str], output_token_ids: list[list[int]],
                         drafts: list[list[int]] | None = None, first_rows: list[int] | None = None,
                         num_rows: int | None = None):
        """The step's structured-output bitmask `[num_rows, ceil(vocab / 32)]` and the rows it constrains,
        or `(None, None)` without constraints.

        Each constrained request's matcher first catches up with its outputs (`output_token_ids[i]`,
        the token still being sampled by the previous step included), then writes its allowed tokens.
        With speculative decoding (`drafts[i]` verified from row `first_rows[i]` of `num_rows`), row `j`
        of a request is masked as after its drafts `1 .. j`, accepted tentatively and rolled back
        (`GrammarState.fill_verify_bitmask`).
        """
        bitmask = None
        row_ids: list[int] = []
        for i, rid in enumerate(sampling_req_ids):
            seq = self._seqs.get(rid)
            if seq is None or seq.grammar is None:
                continue
            if bitmask is None:
                bitmask = allocate_bitmask(len(sampling_req_ids) if num_rows is None else num_rows,
                                           self.model_config.vocab_size)
            grammar = seq.grammar
            # a terminated or failed matcher leaves its row unconstrained: the request ends at this update
            if grammar.advance_to(output_token_ids[i]) and not grammar.is_terminated:
                if drafts is None:
                    grammar.fill_bitmask(bitmask, i)
                    row_ids.append(i)
                else:
                    row_ids += grammar.fill_verify_bitmask(bitmask, first_rows[i], drafts[i])
        return (bitmask, row_ids) if row_ids else (None, None)

    def _advance_grammar(self, seq: _Seq, output_token_ids: list[int]) -> str | None:
        """Feed a sequence's new outputs to its matcher; the finish reason this forces, if any.

        "stop" when the constraint terminated (complete and EOS accepted, even with `ignore_eos`);
        "error" (with the request's error set) when a token violates the constraint, which only a
        token sampled without it can do.
        """
        grammar = seq.grammar
        if grammar is None:
            return None
        if not grammar.advance_to(output_token_ids):
            seq.parent.error = (f"output token {grammar.rejected_token_id} violates the request's structured_output "
                                f"constraint ({seq.params.structured_output.kind})")
            return "error"
        return "stop" if grammar.is_terminated else None

    def _postprocess(self, out: SchedulerOutput, result: StepResult | None, touched: set[str]) -> list[RequestOutput]:
        """Stop checks and detokenization of a finished step, scheduler update, outputs."""
        new_tokens: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        deltas: dict[str, tuple[list[int], str]] = {}
        if result is not None:
            self.timings["model"] += result.model_s
            self.timings["sample"] += result.sample_s
            # NOTE: read only when a save needs them: with async scheduling they may still be drafting
            # (`spec_decode.PendingSpecStepResult`), and reading blocks until they are done
            drafts_of = None
            for rid, tok, lp in zip(out.sampling_req_ids, result.token_ids, result.logprobs):
                seq = self._seqs.get(rid)
                # a list with speculative decoding (the tokens a verification emits), else one token
                toks, lps = (tok, lp) if isinstance(tok, list) else ([tok], [lp])
                new_tokens[rid] = toks
                if seq is None or seq.req.is_finished or seq.stop.is_finished:
                    continue  # finished (stop string, abort) while this step was in flight
                if seq.save is not None and seq.pinned_block_ids is None:
                    # the blocks (and slot) outlive the request until saved; its drafts go along (speculative decoding)
                    if drafts_of is None:
                        drafts_of = dict(zip(out.sampling_req_ids, getattr(result, "draft_token_ids", ())))
                    self._pin_for_save(seq, toks, drafts_of.get(rid, ()))
                if len(toks) > 1 and seq.grammar is not None:  # a verified block: nothing after what completes it
                    n, terminated = seq.grammar.count_acceptable(toks)
                    if terminated:
                        toks, lps = toks[:n], (lps[:n] if lps is not None else None)
                upd = seq.stop.append(toks)
                accepted = toks[: upd.num_accepted_tokens]
                if seq.logprobs is not None and lp is not None and accepted:
                    seq.logprobs.extend(lps[: len(accepted)])
                deltas[rid] = (accepted, upd.text_delta)
                grammar_finish = self._advance_grammar(seq, seq.req.output_token_ids + accepted)
                if upd.finish_reason is not None:
                    reason = upd.finish_reason
                    finished[rid] = str(reason.value if hasattr(reason, "value") else reason)
                    seq.stop_reason = upd.stop_reason
                elif grammar_finish is not None:
                    finished[rid] = grammar_finish
        t0 = time.perf_counter()
        done = self.scheduler.update_from_output(out, new_tokens, finished)
        for rid, drafts in zip(out.sampling_req_ids, getattr(result, "draft_token_ids", ())):
            req = self.scheduler.get_request(rid)  # speculative decoding: verified with the next decode
            seq = self._seqs.get(rid)
            if drafts and req is not None and seq is not None and seq.grammar is not None:
                # a structured-output request: the drafts its constraint allows (the matcher holds the accepted
                # outputs); one it rejects could never be accepted
                drafts = drafts[:seq.grammar.count_acceptable(drafts)[0]]
            if req is not None and drafts:
                req.spec_token_ids = drafts
        self.timings["schedule"] += time.perf_counter() - t0
        self.timings["steps"] += 1
        # NOTE: with an overlapping executor the next step's scheduling may already be counted; the sum is exact
        spent = self.timings["schedule"] + self.timings["model"] + self.timings["sample"]
        self.latency.observe("step", spent - self._step_seconds_seen)
        self._step_seconds_seen = spent
        for rid, (toks, text) in deltas.items():
            seq = self._seqs[rid]
            co = seq.parent.outputs[seq.index]
            if seq.index == 0 and not co.token_ids and toks and seq.parent.scheduled_at is not None:
                self.latency.observe("prefill", time.monotonic() - seq.parent.scheduled_at)
            co.token_ids.extend(toks)
            co.text += text
            if seq.logprobs is not None:
                co.logprobs = seq.logprobs
            touched.add(seq.parent.request_id)
        for req in done:
            seq = self._seqs.get(req.req_id)
            if seq is None:
                continue
            co = seq.parent.outputs[seq.index]
            co.finish_reason = req.finish_reason
            co.stop_reason = seq.stop_reason
            if req.error_message:
                seq.parent.error = req.error_message
            touched.add(seq.parent.request_id)
        # n > 1: start the remaining sequences once the first has its prompt cached
        for parent in list(self._parents.values()):
            if parent.pending_children:
                first = parent.seqs[0].req
                if first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished:
                    for seq in parent.pending_children:
                        self._submit(seq)
                    parent.pending_children = []
        results = []
        for pid in touched:
            parent = self._parents.get(pid)
            if parent is None:
                continue
            ro = self._make_output(parent, deltas)
            results.append(ro)
            if ro.finished:
                for seq in parent.seqs:
                    if seq.req is not None:
                        self._seqs.pop(seq.req.req_id, None)
                del self._parents[pid]
        return results

    def _make_output(self, parent: _Parent, deltas) -> RequestOutput:
        finished = all(o.finish_reason is not None for o in parent.outputs) or parent.error is not None
        new_ids, new_text = {}, {}
        for seq in parent.seqs:
            if seq.req is not None and seq.req.req_id in deltas:
                new_ids[seq.index], new_text[seq.index] = deltas[seq.req.req_id]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[CompletionOutput(o.index, o.text, list(o.token_ids), o.logprobs, o.finish_reason, o.stop_reason)
                     for o in parent.outputs],
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
            finished=finished,
            new_token_ids=new_ids,
            new_text=new_text,
            kv_block_ids=parent.seqs[0].pinned_block_ids,
            kv_state_slot=parent.seqs[0].pinned_slot,
        )

    # ------------------------------------------------------------------ extras

    @torch.inference_mode()
    def prompt_logprobs(self, prompt_token_ids: list[int], num_logprobs: int,
                        images: Sequence[ImageSpan] = ()) -> list[TokenLogprobs | None]:
        """Logprobs of each prompt token given its prefix (first is None), computed in a scratch pass
        (`images`: encoded spans whose embeddings replace those input rows)."""
        from deepinfer.engine.model_runner import ScratchModelRunner

        runner = ScratchModelRunner(self.model, max_seqs=1, max_len=len(prompt_token_ids) + 1)
        n = len(prompt_token_ids)
        batch = runner.batch([(0, prompt_token_ids)], logits="all")
        if images:
            batch.input_embeds = torch.zeros(n, images[0].embeds.shape[-1], dtype=images[0].embeds.dtype,
                                             device=runner.device)  # [n, hidden]
            batch.embeds_mask = torch.zeros(n, dtype=torch.bool, device=runner.device)
            for span in images:
                batch.input_embeds[span.offset:span.end] = span.embeds
                batch.embeds_mask[span.offset:span.end] = True
        logits = runner.run_batch(batch)[:-1]
        lt = compute_logprobs(torch.log_softmax(logits, dim=-1), torch.tensor(prompt_token_ids[1:], device=logits.device),
                              num_logprobs)
        return [None] + lt.tolists([num_logprobs] * (len(prompt_token_ids) - 1))

