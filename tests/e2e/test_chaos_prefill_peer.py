"""A decode instance that dies right after its restart, while a prefill connects its NIXL agent to the
new one (found by the chaos battery, benchmarks/chaos.py: NIXL_ERR_BACKEND "destination is
unreachable"): the prefill answers UNAVAILABLE on `destination`, which the entrypoint migrates
(`DecodeLost`), not INTERNAL, which fails the request (issue 26)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from deepinfer.protos import common_pb2, kv_transfer_pb2
from deepinfer.serving.errors import Refused


class _NixlBackendError(Exception):
    """What nixl raises when UCX cannot create an endpoint to the peer (not a ValueError)."""


def _admit_with(add_peer) -> Future:
    from deepinfer.prefill_worker.server import PrefillWorker

    worker = SimpleNamespace(_peer_digests={}, agent=SimpleNamespace(add_peer=add_peer),
                             logger=logging.getLogger("test"))
    work = SimpleNamespace(request_id="r1", destination=SimpleNamespace(peer="decode-0"))
    fut: Future = Future()
    PrefillWorker._admit(worker, work, b"agent metadata", kv_transfer_pb2.KVLayout().SerializeToString(), fut)
    return fut


def test_an_unreachable_decode_agent_is_a_lost_destination():
    from deepinfer.prefill_worker.server import _refusal

    def add_peer(name, metadata, regions):
        raise _NixlBackendError("NIXL_ERR_BACKEND")

    with pytest.raises(Refused) as e:
        _admit_with(add_peer).result(0)
    error = _refusal("r1", e.value).error
    assert error.code == common_pb2.ERROR_CODE_UNAVAILABLE and error.field == "destination"
    assert "decode-0" in error.message and "NIXL_ERR_BACKEND" in error.message


def test_a_mismatched_decode_agent_is_still_a_bad_request():
    def add_peer(name, metadata, regions):
        raise ValueError("peer 'decode-0' has no region 'kv'")

    with pytest.raises(Refused) as e:
        _admit_with(add_peer).result(0)
    assert e.value.code == common_pb2.ERROR_CODE_INVALID_REQUEST
