"""The HTTP front's configuration (frozen, validated); `python -m deepinfer.entrypoint.http` generates its CLI from it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HttpConfig(BaseModel):
    """Everything the HTTP front needs to start."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    entrypoint: str = ""
    """host:port of the token-level gRPC entrypoint (required)."""
    host: str = "127.0.0.1"
    """Interface the HTTP server binds."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port; 0 = an ephemeral port (the bound address is printed)."""
    model: str | None = None
    """Checkpoint directory or Hugging Face repo id: its config.json (context length, `chat_encoding`)
    and tokenizer.json; None = the built-in default model."""
    revision: str | None = None
    """Hugging Face revision (branch, tag or commit) when `model` is a repo id; None = main."""
    served_model_name: str | None = None
    """Model name clients send and /v1/models lists; None = the checkpoint directory's name (a repo id's
    name part for a hub model). Recipe's
    official API names (DeepSeek-V4-Pro, DeepSeek-V4.1-Flash) are accepted as aliases of it."""
    api_key: str | None = None
    """Key every route but /health requires (`Authorization: Bearer KEY` or `x-api-key: KEY`); several keys
    comma-separated (any one is accepted), each optionally with its policy `KEY;name=N;class=agent|chat;
    max_concurrent=C;rpm=R` (`entrypoint.http.keys`); None = the DEEPINFER_API_KEY environment variable,
    else the file named by DEEPINFER_API_KEY_FILE; neither = no key."""
    key_max_concurrent_requests: int = Field(0, ge=0)
    """Generation requests one API key may have in flight (a key's `max_concurrent` overrides it); more get
    429 with Retry-After. 0 = no per-key limit."""
    key_requests_per_minute: float = Field(0.0, ge=0)
    """Generation requests per minute one API key may send (a key's `rpm` overrides it); more get 429 with
    Retry-After. 0 = no per-key limit."""
    default_traffic_class: Literal["", "agent", "chat"] = ""
    """KV store traffic class of requests whose key names none (`class=`); "" = the store's default."""
    max_model_len: int | None = Field(None, gt=1)
    """Context length of prompt + output; None = min(max_position_embeddings, 8192), as the entrypoint."""
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    """Largest request body accepted; larger ones get 413."""
    drain_body_bytes: int = Field(128 * 1024 * 1024, ge=0)
    """A refused request (413, 401, 429) whose body is at most this large is read to its end and thrown
    away before the answer: a client that writes the whole body before reading (Python's urllib) would
    otherwise get a connection reset instead of the error. Larger bodies are answered at once and the
    connection closed. 0 = never drain."""
    max_inflight_requests: int = Field(256, gt=0)
    """Requests served at once; more get 429 with Retry-After."""
    image_url_allowed_hosts: str = ""
    """Comma-separated host names whose image URLs may be fetched (exact match); empty = none
    (data: URLs are always accepted, they need no fetch)."""
    prefill_lb_address: str = ""
    """host:port of the prefill balancer; when set, /metrics gathers its instances' stats (KV blocks,
    KV transfer bytes). Empty = not gathered."""
    decode_lb_address: str = ""
    """host:port of the decode balancer; as `prefill_lb_address`."""
    vision_lb_address: str = ""
    """host:port of the vision balancer; as `prefill_lb_address` (images encoded, cache hits, embedding bytes)."""
    request_timeout_s: float = Field(600.0, gt=0, le=86400)
    """Deadline of each request's token call (the cluster aborts the request when it runs out)."""
    retry_after_s: int = Field(1, ge=0)
    """Retry-After seconds sent with 429 and 503 answers."""
    batch_invariant: bool = False
    """Whether the cluster's workers run batch-invariant numerics (`engine.batch_invariant`); reported by
    /health (the launcher sets it from the cluster config)."""
    default_thinking: bool = True
    """Thinking mode of a chat / responses / messages request that names none (`thinking`,
    `reasoning`): on, as DeepSeek's API (`--no-default-thinking` = off)."""
    thinking_sampling: Literal["official", "request"] = "official"
    """Temperature and top_p of thinking-mode requests: `official` samples at 1.0 / 1.0 whatever the
    request asks, as DeepSeek's API (the response's X-DeepInfer-Sampling-Overridden header says so);
    `request` honours the request's values in thinking mode too."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the front's own logs (stderr)."""
    log_format: Literal["text", "json"] = "text"
    """`json`: one JSON object per log line (time, level, logger, message, request_id when known)."""
    access_log: bool = True
    """One `entrypoint.http.access` log line per request: method, path, status, duration, request ids."""
    https: bool = True
    """Serve HTTPS when a certificate is known: `https_cert`, else the process's cluster TLS certificate
    (`--tls-cert` / DEEPINFER_TLS_CERT, `serving.auth`). `--no-https`: plain HTTP even then (a TLS-terminating
    proxy in front); without any certificate the front serves plain HTTP."""
    https_cert: str | None = None
    """PEM certificate (chain) of the HTTPS front when it differs from the cluster's (a public name);
    None = the cluster TLS certificate, if any."""
    https_key: str | None = None
    """PEM private key of `https_cert`."""
