"""The fields every stage worker's config shares, as two pydantic bases that mirror the shells of `serving.shell`:
`WorkerConfig` (every worker: the checkpoint, the device, and how the process binds, registers with its stage's
balancer and heartbeats) and `EngineWorkerConfig` (the LM stages, prefill and decode: the engine's settings, the
speculative drafter, the KV store, and the checks against the checkpoint).

Each stage's config (`vision_worker.config`, `prefill_worker.config`, `decode_worker.config`) subclasses one of them
and adds its own fields; a field a stage describes differently is redeclared there, which keeps its place. The CLI
(`serving.config_cli`) lists the inherited fields first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.engine.attention import attention_backend_names
from deepinfer.engine.engine import EngineConfig
from deepinfer.engine.moe import moe_backend_names


class WorkerConfig(BaseModel):
    """What a worker instance of any stage (rank 0 of its group) needs to start its process shell."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id; None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    dtype: str = "float32"
    """Weights and cache dtype: float32 or bfloat16 (the same on the prefill and the decode instances)."""
    device: str = "cpu"
    """torch device of the engine (cpu, cuda, cuda:1, ...)."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = an ephemeral port (the bound address is printed / returned)."""
    advertise_host: str | None = None
    """Host other processes reach this instance at; None = `host`."""
    lb_address: str | None = None
    """host:port of the stage's balancer to register with; None = run unregistered (tests)."""
    instance_id: str = ""
    """Unique id within the stage; empty = `<stage>-<random hex>` (`vision-…`, `prefill-…` or `decode-…`)."""
    agent_name: str = ""
    """Name of the NIXL agent (unique in the cluster); empty = the instance id."""
    datacenter: str = ""
    """Datacenter label reported to the balancer."""
    loopback_ucx: bool = False
    """Keep UCX on loopback (`kv_transfer.LOOPBACK_UCX_ENV`): every process on one host (tests)."""
    heartbeat_interval_s: float | None = Field(0.5, gt=0)
    """Seconds between heartbeats (shortened when the balancer asks for more); None = what it asks for."""


class EngineWorkerConfig(WorkerConfig):
    """What a prefill or decode instance shares: its engine's settings (`engine_config()`), the speculative drafter,
    the persistent KV store (`kv_store_config()`), and the checks of the drafter and the Engram placement against the
    checkpoint when the config is built."""

    max_num_seqs: int = Field(64, gt=0)
    """Most requests in one engine step (also the number of state slots)."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """Token budget per engine step."""
    num_blocks: int | None = Field(None, gt=0)
    """KV cache blocks; None = the engine's default sizing."""
    max_model_len: int | None = Field(None, gt=1)
    """Longest prompt + output; None = the engine default (the same on the prefill and the decode instances)."""

    attention_backend: str = Field("auto", json_schema_extra={"cli_choices": ["auto", *attention_backend_names()]})
    """Attention backend of the engine (a name of `engine.attention`'s registry), or "auto" (`EngineConfig`'s rule:
    "triton" on a CUDA device, "torch" on the CPU, in batch-invariant mode and for DeepSeek-V4.1)."""
    moe_backend: str = Field("auto", json_schema_extra={"cli_choices": ["auto", *moe_backend_names()]})
    """MoE backend of the engine (a name of `engine.moe`'s registry), or "auto" ("triton" on a CUDA device)."""
    fp8_activations: Literal["bf16", "fp8"] = "bf16"
    """Activations of FP8 linears: bf16 (matches transformers) or FP8 per token per 128 (the official reference's)."""
    indexer_numerics: Literal["transformers", "reference"] = "transformers"
    """Lightning-indexer numerics: transformers' (plain) or the official reference's (Hadamard + FP4 simulation)."""
    enforce_eager: bool = False
    """Run every engine step eagerly: no CUDA graphs for decode steps (they are used on CUDA when the backends allow)."""
    batch_invariant: bool = False
    """Batch-invariant numerics (`engine.batch_invariant`): a request's logits do not depend on its batch, chunking or
    cache hits; set it on the prefill and the decode instances alike."""
    v41_decoder_replay: bool = True
    """DeepSeek-V4.1: decoder-side bounded replay (`EngineConfig.v41_decoder_replay`; the layers after the last KV
    source over each prompt's last `sliding_window` tokens only); set it on the prefill and the decode instances
    alike (a decode instance that replays a prompt computes it the same way)."""
    expert_parallel_size: int = Field(1, ge=1)
    """Ranks of this instance (one process each: attention data-parallel, routed experts split over them, each rank
    with its own KV pools and KV transfer agent, `kv_transfer.ranked`); 1 = one process."""
    rank_group_address: str = ""
    """An instance spanning nodes: where its ranks meet (`EngineConfig.rank_group_address`; set by the launcher)."""
    local_ranks: int | None = Field(None, ge=1)
    """An instance spanning nodes: its ranks on this node (`EngineConfig.local_ranks`; set by the launcher)."""
    num_redundant_experts: int = Field(0, ge=0)
    """Extra replicas of hot routed experts per MoE layer (EPLB), with expert_parallel_size > 1."""
    eplb_interval_steps: int = Field(0, ge=0)
    """Re-place the routed experts (EPLB, moving weights while serving) every this many engine steps from the loads
    measured since the last time, with expert_parallel_size > 1; 0 = never (the initial placement stays)."""
    speculative: Literal["mtp", "dspark"] | None = None
    """Speculative decoding's drafter (`engine.spec_decode`; lossless): None = off, "mtp" = DeepSeek-V4's MTP layer,
    "dspark" = DeepSeek-V4.1's DSpark stages. Checked against the checkpoint."""
    num_draft_tokens: int | None = Field(None, ge=1)
    """Drafts proposed per request per step with `speculative` on; None = 3 (`spec_decode.config`)."""
    engram_placement: Literal["auto", "device", "pinned_host"] = "auto"
    """DeepSeek-V4.1: where the FP8 Engram tables live (`EngineConfig.engram_placement`): "device", "pinned_host"
    (gathered over PCIe) or "auto" (the fit check decides); refused for a checkpoint without Engram tables."""

    kv_store: Literal["off", "embedded", "mooncake"] = "off"
    """Persistent compressed-KV store (`kvstore`): off, embedded (block files on local disk, SQLite index) or
    mooncake (Mooncake Store via `kv_store_mooncake_master`)."""
    kv_store_dirs: str = ""
    """Comma-separated directories of the store (embedded: block files, one per SSD; both: the first holds the
    index); empty = `$DEEPINFER_KVSTORE_DIR` or `~/.cache/deepinfer/kvstore`."""
    kv_store_capacity_gb: float = Field(64.0, gt=0)
    """GiB of stored blocks before least-recently-used eviction."""
    kv_store_mooncake_master: str = "127.0.0.1:50051"
    """mooncake: the master's host:port."""
    kv_store_mooncake_metadata: str = "http://127.0.0.1:8080/metadata"
    """mooncake: the metadata server URL (the master's embedded HTTP one by default)."""

    def _check_stage(self) -> None:
        """A stage's own checks across fields, run before the checkpoint is read (a subclass's; none here)."""

    @model_validator(mode="after")
    def _checkpoint_fits(self) -> EngineWorkerConfig:
        # NOTE: one validator, the stage's checks first: a config with several problems names the same one first
        # as when each stage had its validators (the checkpoint's last)
        self._check_stage()
        from deepinfer.serving.model_checks import check_worker_model

        check_worker_model(self.model, self.speculative, self.engram_placement)  # before anything starts
        return self

    def kv_store_config(self):
        """The `kvstore.KVStoreConfig` of `kv_store`, or None when it is off."""
        from deepinfer.kvstore.config import worker_store_config

        return worker_store_config(self.kv_store, self.kv_store_dirs, self.kv_store_capacity_gb,
                                   self.kv_store_mooncake_master, self.kv_store_mooncake_metadata,
                                   self.advertise_host or self.host)

    def engine_config(self, **stage_fields) -> EngineConfig:
        """The engine part of this config; `stage_fields`: the stage's own `EngineConfig` fields."""
        return EngineConfig(model=self.model, revision=self.revision, dtype=self.dtype, device=self.device,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            num_blocks=self.num_blocks, max_model_len=self.max_model_len,
                            attention_backend=self.attention_backend, moe_backend=self.moe_backend,
                            fp8_activations=self.fp8_activations, indexer_numerics=self.indexer_numerics,
                            enforce_eager=self.enforce_eager, batch_invariant=self.batch_invariant,
                            speculative=self.speculative, v41_decoder_replay=self.v41_decoder_replay,
                            num_draft_tokens=self.num_draft_tokens, engram_placement=self.engram_placement,
                            expert_parallel_size=self.expert_parallel_size,
                            rank_group_address=self.rank_group_address, local_ranks=self.local_ranks,
                            num_redundant_experts=self.num_redundant_experts,
                            eplb_interval_steps=self.eplb_interval_steps, **stage_fields)
