"""The balancer process's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepinfer.loadbalancer.membership import DEFAULT_HEARTBEAT_TIMEOUT_S
from deepinfer.loadbalancer.policies import POLICIES


class LoadBalancerConfig(BaseModel):
    """Everything one stage's balancer process needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    stage: str = "prefill"
    """The stage it balances: vision, prefill or decode."""
    policy: str = "power_of_two"
    """Routing policy (a `loadbalancer.policies.POLICIES` name): prefix_aware, kv_load, power_of_two, ..."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = an ephemeral port (the bound address is printed / returned)."""
    advertise_host: str | None = None
    """Host workers and the entrypoint reach this balancer at; None = `host`."""
    heartbeat_timeout_s: float = Field(DEFAULT_HEARTBEAT_TIMEOUT_S, gt=0)
    """An instance silent this long is dropped."""

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, value: str) -> str:
        if value not in ("vision", "prefill", "decode"):
            raise ValueError(f"stage {value!r} is not one of vision, prefill, decode")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"policy {value!r} is not registered; choose one of {sorted(POLICIES)}")
        return value
