"""The vision instance's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from deepinfer.engine.images import ImageLimits


class VisionWorkerConfig(BaseModel):
    """Everything a vision instance (rank 0 of its group) needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id (must have a `vision_config`); None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    dtype: str = "float32"
    """Tower dtype and embedding dtype: float32 or bfloat16 (must match the prefill instances')."""
    device: str = "cpu"
    """torch device of the tower (cpu, cuda, cuda:1, ...)."""
    host: str = "127.0.0.1"
    """Interface the gRPC server binds."""
    port: int = Field(0, ge=0, le=65535)
    """gRPC port; 0 = an ephemeral port (the bound address is printed / returned)."""
    advertise_host: str | None = None
    """Host other processes reach this instance at; None = `host`."""
    lb_address: str | None = None
    """host:port of the vision balancer to register with; None = run unregistered (tests)."""
    instance_id: str = ""
    """Unique id within the vision stage; empty = `vision-<random hex>`."""
    agent_name: str = ""
    """Name of the embedding NIXL agent (unique in the cluster); empty = the instance id."""
    datacenter: str = ""
    """Datacenter label reported to the balancer."""
    loopback_ucx: bool = False
    """Keep UCX on loopback (`kv_transfer.LOOPBACK_UCX_ENV`): every process on one host (tests)."""
    max_batch_images: int = Field(8, gt=0)
    """Most images encoded in one step (across requests)."""
    embedding_rows: int = Field(16384, gt=0)
    """Rows of the registered embedding buffer: what held and cached images share (184 per small image)."""
    lease_s: float = Field(30.0, gt=0)
    """How long a request's embeddings stay held for the prefill when Encode names no lease."""
    image_url_allowed_hosts: str = ""
    """Comma-separated hosts whose http(s) image URLs may be fetched; empty = data: URLs only."""
    max_images: int = Field(ImageLimits.max_images, gt=0)
    """Images per request."""
    max_image_bytes: int = Field(ImageLimits.max_image_bytes, gt=0)
    """Encoded bytes of one image."""
    max_total_image_bytes: int = Field(ImageLimits.max_total_bytes, gt=0)
    """Encoded bytes of all images of one request."""
    max_image_pixels: int = Field(ImageLimits.max_image_pixels, gt=0)
    """Width x height of one decoded image."""
    heartbeat_interval_s: float | None = Field(0.5, gt=0)
    """Seconds between heartbeats (shortened when the balancer asks for more); None = what it asks for."""
    max_rpc_threads: int = Field(64, gt=0)
    """gRPC handler threads (each Encode call holds one until its images are encoded)."""

    def limits(self) -> ImageLimits:
        """The per-request image limits."""
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_total_image_bytes, self.max_image_pixels)
