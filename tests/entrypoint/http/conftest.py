"""One live local cluster (real processes on loopback) for the HTTP tests of this folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("nixl")
pytest.importorskip("openai")
pytest.importorskip("anthropic")

API_KEY = "test-key-123"
ALLOWED_IMAGE_HOST = "images.example.com"
MAX_BODY_BYTES = 256 * 1024
MAX_INFLIGHT = 3


@pytest.fixture(scope="session")
def default_model_dir():
    from deepinfer.engine.testing.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, default_model_dir):
    from tests.entrypoint.http.cluster import LocalCluster

    http_args = ("--image-url-allowed-hosts", ALLOWED_IMAGE_HOST, "--max-body-bytes", str(MAX_BODY_BYTES),
                 "--max-inflight-requests", str(MAX_INFLIGHT))
    has_vision = "vision_config" in json.loads((default_model_dir / "config.json").read_text())
    vision_args = ("--image-url-allowed-hosts", ALLOWED_IMAGE_HOST) if has_vision else None
    with LocalCluster(default_model_dir, tmp_path_factory.mktemp("http-logs"), api_key=API_KEY,
                      http_args=http_args, vision_args=vision_args) as running:
        yield running
