"""gRPC metadata keys of the deepinfer services: the one place that names them.

Trailing metadata carries what a response message has no field for. Every service (entrypoint,
workers, balancers) and every client (HTTP front, deploy controller, benchmarks, tests) reads the
keys from here, so a key is renamed in one place.
"""

from __future__ import annotations

STATS_METADATA_KEY = "deepinfer-stats-json"
"""Trailing metadata of every `Health` answer: the instance's counters (load, kv_transfer, ...) as one
JSON object."""

ERROR_FIELD_METADATA_KEY = "deepinfer-error-field"
"""Trailing metadata of an INVALID_ARGUMENT status: the name of the offending request parameter."""
