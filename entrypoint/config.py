"""The entrypoint's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EntrypointConfig(BaseModel):
    """Everything the token-level entrypoint needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id whose config.json gives the vocabulary and context
    length to validate against; None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = an ephemeral port (the bound address is printed / returned)."""
    advertise_host: str | None = None
    """Host clients reach the entrypoint at; None = `host`."""
    prefill_lb_address: str = ""
    """host:port of the prefill balancer (required)."""
    decode_lb_address: str = ""
    """host:port of the decode balancer (required)."""
    vision_lb_address: str = ""
    """host:port of the vision balancer; empty = no vision stage (image prompts are refused)."""
    instance_id: str = ""
    """Id of this entrypoint in logs and Health; empty = `entrypoint-<random hex>`."""
    max_model_len: int | None = Field(None, gt=1)
    """Longest prompt + output accepted; None = the engine default, min(max_position_embeddings, 8192)."""
    kv_lease_ms: int = Field(30000, gt=0)
    """Lease asked of decode reservations: how long a decode instance waits for the prefill's KV."""
    max_attempts: int = Field(2, ge=1)
    """Instances tried per stage when one is full or draining (it is excluded from the next pick)."""
    rpc_timeout_s: float = Field(10.0, gt=0)
    """Timeout of unary calls to balancers (Pick) and of Abort calls."""
    max_rpc_threads: int = Field(256, gt=0)
    """gRPC handler threads (each Generate stream holds one until its request finishes)."""
    migration_limit: int = Field(3, ge=0)
    """Times a request moves to another prefill -> decode pair when its instance dies or hangs
    (`entrypoint.migration`); 0 = never (the request fails with UNAVAILABLE)."""
    liveness_interval_s: float = Field(0.5, gt=0)
    """How often the decode instances serving requests are checked at the decode balancer (missed heartbeats)."""
    liveness_probe_timeout_s: float = Field(1.0, gt=0)
    """Timeout of the direct Health probe of a decode instance its balancer dropped; no answer = hung: migrate."""
    outage_wait_s: float = Field(30.0, ge=0)
    """How long after a stage lost an instance (it died or hung) requests finding no usable instance of
    that stage wait for one to come back (bounded by their deadline) before failing with UNAVAILABLE
    (`entrypoint.migration.StageOutages`); 0 = fail at once."""
