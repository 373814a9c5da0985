"""The scheduler's side of speculative decoding: drafts scheduled after the last token, trimmed to the
caps and the budget, and the rejected ones rolled back out of `num_computed_tokens`."""

from __future__ import annotations

import pytest

from tests.engine.test_scheduler import make_request, make_scheduler


def _prefill(sched, req):
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {req.req_id: [7]})
    return req


def test_drafts_are_verified_after_the_last_token_and_rejected_ones_rolled_back():
    sched = make_scheduler(budget=32)
    a = _prefill(sched, make_request("a", 6, max_tokens=20))
    assert a.num_computed_tokens == 6 and a.num_tokens == 7
    a.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_token_ids == {"a": [11, 12, 13]}
    assert out.sampling_req_ids == ["a"] and a.spec_token_ids == []
    sched.update_from_output(out, {"a": [11, 12, 99]})  # two drafts accepted, then a new token
    assert a.output_token_ids == [7, 11, 12, 99] and a.num_computed_tokens == 9 == a.num_tokens - 1
    out = sched.schedule()  # no drafts: a plain decode of the last token
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_token_ids
    sched.update_from_output(out, {"a": [5]})
    with pytest.raises(ValueError, match="samples at most 2"):
        a.spec_token_ids = [1]
        out = sched.schedule()
        sched.update_from_output(out, {"a": [1, 2, 3]})


def test_drafts_are_trimmed_to_max_tokens_model_len_and_budget():
    sched = make_scheduler(budget=32)
    a = _prefill(sched, make_request("a", 6, max_tokens=3))  # 1 output so far: 2 more at most
    a.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.scheduled_spec_token_ids == {"a": [1]}  # accepting it plus one more token reaches max_tokens
    sched.update_from_output(out, {"a": [1, 2]})
    assert a.is_finished and a.output_token_ids == [7, 1, 2]

    sched = make_scheduler(budget=3, max_model_len=12)
    b = _prefill(sched, make_request("b", 3, max_tokens=50))  # prefill over one step (budget 3)
    b.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.scheduled_spec_token_ids == {"b": [1, 2]}  # the budget: last token + 2 drafts
    sched.update_from_output(out, {"b": [1, 2, 3]})
    b.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()  # 7 tokens known, max_model_len 12: 4 drafts + 1 would reach 12
    assert out.scheduled_spec_token_ids == {"b": [1, 2]}


def test_preemption_drops_drafts():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=32)
    a, b = make_request("a", 4, max_tokens=20), make_request("b", 4, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update_from_output(out, {"a": [7], "b": [7]})
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3], [1, 2, 3]
    out = sched.schedule()  # 3 blocks of 4 cannot hold both verifications: b is preempted
    assert out.preempted_req_ids == ["b"] and b.spec_token_ids == []
    assert out.scheduled_spec_token_ids == {"a": [1, 2, 3]}
