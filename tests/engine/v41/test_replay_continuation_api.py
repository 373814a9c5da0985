"""`num_original_prompt_tokens` on the token API (protos/): a continuation's original prompt length travels from the
entrypoint's `GenerateRequest` (set by the migration's continuation, `entrypoint.migration.continuation`) to the
prefill's `PrefillRequest` and the decode's `ReserveRequest`, image placeholders expanded on the way; bad values
are refused INVALID_ARGUMENT at every stage before anything is reserved or computed. The engine side (the V4.1
bits it keeps) is tests/engine/v41/test_replay_continuation.py."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from deepinfer.decode_worker.server import DecodeServicer
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.scheduler import check_num_original_prompt_tokens
from deepinfer.entrypoint.migration import continuation
from deepinfer.entrypoint.server import (
    expand_image_placeholders,
    expanded_num_original_prompt_tokens,
    validate_request,
)
from deepinfer.prefill_worker.server import PrefillServicer
from deepinfer.protos import common_pb2, decode_pb2, entrypoint_pb2, prefill_pb2
from deepinfer.serving.errors import status_of

VOCAB, MAX_LEN = 512, 256
FIELD = "num_original_prompt_tokens"


def _request(prompt, **kw) -> entrypoint_pb2.GenerateRequest:
    return entrypoint_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt,
                                          sampling_params=common_pb2.SamplingParams(max_tokens=8), **kw)


def test_the_field_round_trips_and_is_absent_by_default():
    for cls in (entrypoint_pb2.GenerateRequest, prefill_pb2.PrefillRequest, decode_pb2.ReserveRequest):
        assert not cls().HasField(FIELD), cls.__name__
        for n in (1, 40, 2**32 - 1):
            msg = cls.FromString(cls(prompt_token_ids=[5] * 3, num_original_prompt_tokens=n).SerializeToString())
            assert msg.HasField(FIELD) and msg.num_original_prompt_tokens == n, cls.__name__
        assert cls.FromString(cls(num_original_prompt_tokens=0).SerializeToString()).HasField(FIELD)  # 0 is sent
    cont = entrypoint_pb2.GenerateRequest.FromString(continuation(_request([1, 2, 3]), [9, 8]).SerializeToString())
    assert list(cont.prompt_token_ids) == [1, 2, 3, 9, 8] and cont.num_original_prompt_tokens == 3


def test_the_entrypoint_validates_it_and_expands_it_with_the_images():
    validate_request(_request([3] * 10, num_original_prompt_tokens=10), VOCAB, MAX_LEN)
    validate_request(_request([3] * 10, num_original_prompt_tokens=1), VOCAB, MAX_LEN)
    for bad in (0, 11):
        with pytest.raises(InvalidRequestError) as e:
            validate_request(_request([3] * 10, num_original_prompt_tokens=bad), VOCAB, MAX_LEN)
        assert e.value.field == FIELD
    image = common_pb2.ImageRef(descriptor=b"img", offset=4, num_tokens=1)
    with pytest.raises(InvalidRequestError, match="image lies after") as e:
        validate_request(_request([3] * 10, images=[image], num_original_prompt_tokens=4), VOCAB, MAX_LEN,
                         has_vision=True)
    request = _request([3] * 10, images=[image], num_original_prompt_tokens=5)
    validate_request(request, VOCAB, MAX_LEN, has_vision=True)
    prompt, _ = expand_image_placeholders(list(request.prompt_token_ids), request.images, [6], ["h"])
    assert len(prompt) == 15
    assert expanded_num_original_prompt_tokens(request, prompt) == 10  # 4 tokens, the image's 6, then 0 more
    assert expanded_num_original_prompt_tokens(_request([3] * 10), [3] * 10) is None


def test_prefill_and_decode_refuse_a_bad_value_invalid_argument():
    """In-band INVALID_REQUEST naming the field (the status INVALID_ARGUMENT, `serving.errors`), before the
    worker's loop is asked for anything (the fake worker has none)."""
    worker = SimpleNamespace(check_accepting=lambda: None, emb_agent=None, block_size=4)
    prefill, decode = PrefillServicer(worker), DecodeServicer(worker)
    dest = prefill_pb2.KVDestination(agent_name="d", block_ids=[0, 1], block_size=4, transfer_id="t")
    for bad in (0, 6):
        got = prefill.Prefill(prefill_pb2.PrefillRequest(request_id="r", prompt_token_ids=[3] * 5, destination=dest,
                                                         num_original_prompt_tokens=bad), None)
        assert got.error.code == common_pb2.ERROR_CODE_INVALID_REQUEST and got.error.field == FIELD, bad
        got = decode.Reserve(decode_pb2.ReserveRequest(request_id="r", prompt_token_ids=[3] * 5,
                                                       num_original_prompt_tokens=bad), None)
        assert got.error.code == common_pb2.ERROR_CODE_INVALID_REQUEST and got.error.field == FIELD, bad
    assert status_of(got.error.code) == grpc.StatusCode.INVALID_ARGUMENT
    check_num_original_prompt_tokens(None, 5)
    check_num_original_prompt_tokens(5, 5)
