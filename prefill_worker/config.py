"""The prefill instance's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deepinfer.serving.worker_config import EngineWorkerConfig


class PrefillWorkerConfig(EngineWorkerConfig):
    """Everything a prefill instance (rank 0 of its group) needs to start (the fields every LM stage shares:
    `serving.worker_config`)."""

    embedding_rows: int = Field(8192, gt=0)
    """Rows of the buffer image embeddings are READ into (models with a vision tower; 184 per small image)."""
    kv_lease_margin_s: float = Field(0.5, ge=0)
    """The KV WRITE must end this long before the decode reservation's lease does."""
    max_rpc_threads: int = Field(128, gt=0)
    """gRPC handler threads (each Prefill call holds one until its KV is sent)."""
    max_queued_requests: int | None = Field(96, gt=0)
    """Requests waiting for their prefill at once; more are refused with RESOURCE_EXHAUSTED and a retry hint
    (`serving.admission`; the entrypoint tries another instance). None = unbounded."""

    speculative: Literal["mtp", "dspark"] | None = None
    """Speculative decoding's first draft (`engine.spec_decode`; set it as on the decode stage): after the first token
    the drafter drafts `num_draft_tokens`, sent with the KV so the decode instance's first step verifies them: "mtp" =
    DeepSeek-V4's MTP layer, "dspark" = DeepSeek-V4.1's DSpark stages (whose window rings, seeded from the prompt,
    also travel with a sent state slot: `dspark_keys`); None = none (the decode's first step verifies nothing).
    Checked against the checkpoint."""
    num_draft_tokens: int = Field(3, ge=1)
    """Drafts sent with the KV when `speculative` is set."""

    kv_store: Literal["off", "embedded", "mooncake"] = "off"
    """Persistent compressed-KV store (`kvstore`): off, embedded (block files on local disk, SQLite index) or
    mooncake (Mooncake Store via `kv_store_mooncake_master`). Prompts' full blocks are written after prefill and a
    local prefix miss loads the longest stored prefix (then bounded replay)."""
