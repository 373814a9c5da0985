"""The decode instance's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deepinfer.engine.attention import attention_backend_names
from deepinfer.engine.engine import EngineConfig
from deepinfer.engine.moe import moe_backend_names


class DecodeWorkerConfig(BaseModel):
    """Everything a decode instance (rank 0 of its group) needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id; None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    dtype: str = "float32"
    """Weights and cache dtype: float32 or bfloat16 (must match the prefill instances')."""
    device: str = "cpu"
    """torch device of the engine (cpu, cuda, cuda:1, ...)."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = an ephemeral port (the bound address is printed / returned)."""
    advertise_host: str | None = None
    """Host other processes reach this instance at; None = `host`."""
    lb_address: str | None = None
    """host:port of the decode balancer to register with; None = run unregistered (tests)."""
    instance_id: str = ""
    """Unique id within the decode stage; empty = `decode-<random hex>`."""
    agent_name: str = ""
    """Name of the NIXL agent (unique in the cluster); empty = the instance id."""
    datacenter: str = ""
    """Datacenter label reported to the balancer."""
    max_num_seqs: int = Field(64, gt=0)
    """Most requests in one engine step (also the number of state slots)."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """Token budget per engine step."""
    num_blocks: int | None = Field(None, gt=0)
    """KV cache blocks; None = the engine's default sizing."""
    max_model_len: int | None = Field(None, gt=1)
    """Longest prompt + output; None = the engine default (must match the prefill instances')."""
    bounded_state: Literal["send", "replay"] | None = None
    """How a request's bounded state (sliding-window ring, compressor buffers) gets here: "send" =
    the prefill writes it into a reserved slot with the KV; "replay" = recomputed here by bounded
    replay of the prompt's tail; None = "send", or "replay" with speculative="mtp" (the replay also
    rebuilds the MTP drafter's window). With "dspark" the DSpark stages' window rings are part of the slot
    (`dspark_keys`), so "send" moves them too (the prefill runs `--speculative dspark` as well). Outputs are
    identical; BENCHMARKS.md compares the two."""
    loopback_ucx: bool = False
    """Keep UCX on loopback (`kv_transfer.LOOPBACK_UCX_ENV`): every process on one host (tests)."""
    embedding_rows: int = Field(8192, gt=0)
    """Rows of the buffer image embeddings are READ into during Reserve (models with a vision tower)."""
    kv_lease_s: float = Field(30.0, gt=0)
    """How long a reservation waits for its KV when Reserve leaves lease_ms at 0."""
    start_grace_s: float = Field(10.0, ge=0)
    """A reservation whose Start has not come this long after its lease ended is aborted."""
    heartbeat_interval_s: float | None = Field(0.5, gt=0)
    """Seconds between heartbeats (shortened when the balancer asks for more); None = what it asks for."""
    max_rpc_threads: int = Field(256, gt=0)
    """gRPC handler threads (each Start stream holds one until its request finishes)."""

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
    """Speculative decoding (`engine.spec_decode`; lossless): None = off, "mtp" = DeepSeek-V4's MTP layer drafts
    `num_draft_tokens` per request per step (`--speculative mtp --num-draft-tokens 3`; needs `bounded_state`
    "replay", the default then), "dspark" = DeepSeek-V4.1's DSpark stages draft a block (`--speculative dspark`;
    its window rings come with the sent state, or are rebuilt by "replay"). Checked against the checkpoint."""
    num_draft_tokens: int | None = Field(None, ge=1)
    """Drafts proposed per request per step with `speculative` on; None = 3 (`spec_decode.config`)."""
    speculative_tokens: int | None = Field(None, ge=0)
    """Alias of `speculative` + `num_draft_tokens` kept for existing YAML and scripts: K > 0 = "mtp" with K drafts,
    0 = off; refused when it disagrees with them. Once validated it mirrors them (0 when off)."""
    speculative_method: Literal["mtp", "dspark"] | None = None
    """Alias of `speculative` (the drafter `speculative_tokens` turns on); once validated it mirrors it."""
    verify_schedule: Literal["full", "confidence"] = "full"
    """Drafts verified per request: "full" all of them, "confidence" a prefix chosen over the batch from the
    drafts' confidences (`engine.spec_decode.verify_schedule`)."""
    verify_floor: int = Field(1, ge=0, le=1)
    """Drafts every request verifies at least under the "confidence" schedule: 1, or 0 (none when its drafts are
    unlikely to be accepted); 0 needs verify_schedule "confidence"."""
    engram_placement: Literal["auto", "device", "pinned_host"] = "auto"
    """DeepSeek-V4.1: where the FP8 Engram tables live (`EngineConfig.engram_placement`): "device", "pinned_host"
    (gathered over PCIe) or "auto" (the fit check decides); refused for a checkpoint without Engram tables."""
    verify_cost_table: str | None = None
    """Step-cost table (JSON, `benchmarks/speculative.py --profile-cost --json FILE`) of the "confidence" schedule,
    checked when the config is built (a host that validates it, e.g. `deepinfer up`'s, must read it too); None = the
    shipped CPU table on a CPU device, the linear stand-in elsewhere; "linear" = the linear stand-in."""

    kv_store: Literal["off", "embedded", "mooncake"] = "off"
    """Persistent compressed-KV store (`kvstore`) finished conversation turns are written to (requests reserved with
    `is_conversation`: their prompt's and answer's full blocks, so the next turn's prefill loads the whole
    conversation): off, embedded or mooncake. Give it the prefill stage's store (`deepinfer up` does)."""
    kv_store_dirs: str = ""
    """Comma-separated directories of the store (as the prefill worker's `kv_store_dirs`)."""
    kv_store_capacity_gb: float = Field(64.0, gt=0)
    """GiB of stored blocks before least-recently-used eviction."""
    kv_store_mooncake_master: str = "127.0.0.1:50051"
    """mooncake: the master's host:port."""
    kv_store_mooncake_metadata: str = "http://127.0.0.1:8080/metadata"
    """mooncake: the metadata server URL (the master's embedded HTTP one by default)."""

    def kv_store_config(self):
        """The `kvstore.KVStoreConfig` of `kv_store`, or None when it is off."""
        from deepinfer.kvstore.config import worker_store_config

        return worker_store_config(self.kv_store, self.kv_store_dirs, self.kv_store_capacity_gb,
                                   self.kv_store_mooncake_master, self.kv_store_mooncake_metadata,
                                   self.advertise_host or self.host)

    @model_validator(mode="before")
    @classmethod
    def _speculative_aliases(cls, data):
        from deepinfer.engine.spec_decode.config import resolve_speculative_fields

        return resolve_speculative_fields(data, keep_aliases=True)  # raises when the two spellings disagree

    @model_validator(mode="after")
    def _verify_floor_needs_confidence(self) -> DecodeWorkerConfig:
        from deepinfer.engine.spec_decode.config import check_verify_floor

        check_verify_floor(self.verify_floor, self.verify_schedule)
        return self

    @model_validator(mode="after")
    def _cost_table_is_usable(self) -> DecodeWorkerConfig:
        # NOTE: the engine loads the table only after the weights; a bad path or file fails here, before anything loads
        if self.verify_cost_table is None:
            return self
        if self.speculative is None or self.verify_schedule != "confidence":
            raise ValueError("verify_cost_table prices the 'confidence' verify schedule of speculative decoding: set "
                             "speculative ('mtp', or 'dspark' for V4.1) and verify_schedule='confidence' (--speculative "
                             "mtp --verify-schedule confidence) or leave it unset")
        from deepinfer.engine.spec_decode.step_cost import load_cost_table

        load_cost_table(self.verify_cost_table, self.device)  # ValueError naming the file and how to write one
        return self

    @model_validator(mode="after")
    def _speculation_needs_replay(self) -> DecodeWorkerConfig:
        # NOTE: the MTP drafter's window (its keys at the prompt's last positions) is rebuilt by the same
        # bounded replay that rebuilds the target's state; a sent state would leave it empty
        # (`engine.spec_decode`'s docstring, "Disaggregated decode"). DSpark's rings are slot state: they are sent.
        if self.speculative == "mtp" and self.bounded_state == "send":
            raise ValueError("speculative='mtp' on a decode instance rebuilds the MTP drafter's window by bounded "
                             "replay: set bounded_state='replay' (--bounded-state replay) or leave it unset")
        return self

    @model_validator(mode="after")
    def _checkpoint_fits(self) -> DecodeWorkerConfig:
        from deepinfer.serving.model_checks import check_worker_model

        check_worker_model(self.model, self.speculative, self.engram_placement)  # before anything starts
        return self

    @property
    def is_state_sent(self) -> bool:
        """The prefill writes the bounded state with the KV (`bounded_state`, resolved: see its docstring)."""
        return self.bounded_state == "send" or (self.bounded_state is None and self.speculative != "mtp")

    def engine_config(self) -> EngineConfig:
        """The engine part of this config."""
        return EngineConfig(model=self.model, revision=self.revision, dtype=self.dtype, device=self.device, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, num_blocks=self.num_blocks,
                            max_model_len=self.max_model_len, attention_backend=self.attention_backend,
                            moe_backend=self.moe_backend, fp8_activations=self.fp8_activations,
                            indexer_numerics=self.indexer_numerics, enforce_eager=self.enforce_eager,
                            batch_invariant=self.batch_invariant, speculative=self.speculative,
                            v41_decoder_replay=self.v41_decoder_replay,
                            num_draft_tokens=self.num_draft_tokens, verify_schedule=self.verify_schedule,
                            verify_floor=self.verify_floor,
                            verify_cost_table=self.verify_cost_table,
                            engram_placement=self.engram_placement,
                            expert_parallel_size=self.expert_parallel_size,
                            rank_group_address=self.rank_group_address, local_ranks=self.local_ranks,
                            num_redundant_experts=self.num_redundant_experts,
                            eplb_interval_steps=self.eplb_interval_steps)
