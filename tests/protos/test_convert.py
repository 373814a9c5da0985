"""SamplingParams <-> deepinfer.v1.SamplingParams round trips, unset optionals included."""

from __future__ import annotations

import pytest

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.sampling.params import SamplingParams
from deepinfer.protos import common_pb2
from deepinfer.protos.convert import sampling_params_from_proto, sampling_params_to_proto

CASES = [
    SamplingParams(),
    SamplingParams(max_tokens=None),
    SamplingParams(temperature=0.0, top_k=0, seed=0, logprobs=0, prompt_logprobs=0, max_tokens=1),
    SamplingParams(
        n=3,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=-1.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logit_bias={0: -100.0, 7: 0.1, 128000: 2.5},
        seed=2**62,
        stop=["\n\n", "</s>", "é"],
        stop_token_ids=[1, 2],
        max_tokens=4096,
        min_tokens=3,
        ignore_eos=True,
        logprobs=20,
        prompt_logprobs=5,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    ),
    SamplingParams(structured_output={"json_schema": '{"type": "object"}', "reasoning_end": "</think>"}),
    SamplingParams(structured_output={"any_json": True, "disable_any_whitespace": True}),
    SamplingParams(structured_output={"regex": "[a-z]+"}),
    SamplingParams(structured_output={"grammar": 'root ::= "yes" | "no"'}),
    SamplingParams(structured_output={"structural_tag": '{"type": "structural_tag", "format": {"type": "any_text"}}'}),
]


@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
def test_round_trip(params):
    msg = sampling_params_to_proto(params)
    wire = common_pb2.SamplingParams.FromString(msg.SerializeToString())
    assert sampling_params_from_proto(wire) == params


def test_none_optionals_stay_unset_on_the_wire():
    msg = sampling_params_to_proto(SamplingParams(max_tokens=None))
    for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
        assert not msg.HasField(name), name
    for name in ("n", "temperature", "top_p", "top_k", "repetition_penalty", "skip_special_tokens"):
        assert msg.HasField(name), name  # explicit even at the default: a zero value would mean something else
    assert len(msg.logit_bias) == 0


def test_empty_message_is_engine_default_without_token_cap():
    params = sampling_params_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams(max_tokens=None)


def test_explicit_zero_temperature_is_greedy_not_default():
    msg = common_pb2.SamplingParams(temperature=0.0)
    assert sampling_params_from_proto(msg).is_greedy
    assert not sampling_params_from_proto(common_pb2.SamplingParams()).is_greedy


def test_empty_logit_bias_comes_back_as_none():
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams(logit_bias={}))).logit_bias is None


def test_bad_wire_values_are_refused_naming_the_field():
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(top_p=0.0))
    assert e.value.field == "top_p"
    with pytest.raises(InvalidRequestError) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(n=0))
    assert e.value.field == "n"


def test_structured_output_without_a_constraint_is_refused():
    msg = common_pb2.SamplingParams()
    msg.structured_output.SetInParent()
    with pytest.raises(InvalidRequestError) as info:
        sampling_params_from_proto(msg)
    assert info.value.field == "structured_output"
