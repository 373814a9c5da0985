"""`serving.admission`: a full stage queue refuses with RESOURCE_EXHAUSTED and a retry hint."""

from __future__ import annotations

import pytest

from deepinfer.protos import common_pb2
from deepinfer.serving.admission import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, AdmissionLimit, retry_after_s
from deepinfer.serving.errors import Refused, status_of


def test_admits_below_the_bound_and_refuses_at_it():
    limit = AdmissionLimit(max_queued=2, stage="prefill", instance_id="prefill-0")
    limit.check(0)
    limit.check(1)
    with pytest.raises(Refused) as e:
        limit.check(2, num_queued_tokens=3000, tokens_per_s=1000.0)
    assert e.value.code == common_pb2.ERROR_CODE_RESOURCE_EXHAUSTED
    assert status_of(e.value.code).name == "RESOURCE_EXHAUSTED"
    assert "prefill-0" in str(e.value) and "retry after 3 s" in str(e.value)
    AdmissionLimit(max_queued=None, stage="prefill", instance_id="p").check(10**6)  # unbounded


def test_retry_hint_is_clipped():
    assert retry_after_s(0, None) == MIN_RETRY_AFTER_S
    assert retry_after_s(10, 1e6) == MIN_RETRY_AFTER_S
    assert retry_after_s(10**9, 1.0) == MAX_RETRY_AFTER_S
