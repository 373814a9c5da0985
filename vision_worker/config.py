"""The vision instance's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from pydantic import Field

from deepinfer.engine.images import ImageLimits
from deepinfer.serving.worker_config import WorkerConfig


class VisionWorkerConfig(WorkerConfig):
    """Everything a vision instance (rank 0 of its group) needs to start (the fields every stage shares:
    `serving.worker_config`)."""

    model: str | None = None
    """Checkpoint directory or Hugging Face repo id (must have a `vision_config`); None = the built-in default model."""
    dtype: str = "float32"
    """Tower dtype and embedding dtype: float32 or bfloat16 (must match the prefill instances')."""
    device: str = "cpu"
    """torch device of the tower (cpu, cuda, cuda:1, ...)."""
    agent_name: str = ""
    """Name of the embedding NIXL agent (unique in the cluster); empty = the instance id."""

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
    max_rpc_threads: int = Field(64, gt=0)
    """gRPC handler threads (each Encode call holds one until its images are encoded)."""

    def limits(self) -> ImageLimits:
        """The per-request image limits."""
        return ImageLimits(self.max_images, self.max_image_bytes, self.max_total_image_bytes, self.max_image_pixels)
