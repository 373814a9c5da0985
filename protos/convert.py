"""Conversions between engine dataclasses and their wire messages.

`sampling_params_to_proto` / `sampling_params_from_proto` map `engine.sampling.SamplingParams` onto
`deepinfer.v1.SamplingParams` (see the unset rules in `protos/common.proto`), its
`structured_output` included (`StructuredOutputParams` <-> `deepinfer.v1.StructuredOutput`). The round
trip `from_proto(to_proto(p)) == p` holds for every valid `p`, with one exception: `logit_bias={}`
comes back as None (the engine treats both as "no bias").
"""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.sampling.params import STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutputParams
from protos import common_pb2

_DEFAULTS = SamplingParams()

_OPTIONAL_WITH_DEFAULT = ("n", "temperature", "top_p", "top_k", "repetition_penalty", "skip_special_tokens")
"""Optional on the wire; unset means the engine default."""
_OPTIONAL_NONE = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
"""Optional on the wire; unset means None."""
_PLAIN = (
    "min_p", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos", "include_stop_str_in_output",
)
"""Plain proto3 scalars whose zero value is the engine default."""


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The wire message of `params`; every field is set explicitly except None-valued ones.

    Raises ValueError if a value does not fit its wire type (e.g. a seed outside int64).
    """
    msg = common_pb2.SamplingParams()
    for name in _OPTIONAL_WITH_DEFAULT + _PLAIN:
        setattr(msg, name, getattr(params, name))
    for name in _OPTIONAL_NONE:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.logit_bias:
        msg.logit_bias.update(params.logit_bias)
    msg.stop.extend(params.stop)
    msg.stop_token_ids.extend(params.stop_token_ids)
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_output_to_proto(params.structured_output))
    return msg


def structured_output_to_proto(params: StructuredOutputParams) -> common_pb2.StructuredOutput:
    """The wire message of a structured-output constraint."""
    msg = common_pb2.StructuredOutput(disable_any_whitespace=params.disable_any_whitespace)
    setattr(msg, params.kind, True if params.kind == "any_json" else params.spec)
    if params.reasoning_end is not None:
        msg.reasoning_end = params.reasoning_end
    return msg


def structured_output_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutputParams:
    """The engine's constraint of a wire message; raises `InvalidRequestError` when none or a bad one is set."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        raise InvalidRequestError(
            f"structured_output is set but names no constraint; set one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
            field="structured_output",
        )
    return StructuredOutputParams(
        **{kind: getattr(msg, kind)},
        reasoning_end=msg.reasoning_end if msg.HasField("reasoning_end") else None,
        disable_any_whitespace=msg.disable_any_whitespace,
    )


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """The engine's SamplingParams of a wire message; raises `InvalidRequestError` naming the bad field."""
    kwargs = {}
    for name in _OPTIONAL_WITH_DEFAULT:
        kwargs[name] = getattr(msg, name) if msg.HasField(name) else getattr(_DEFAULTS, name)
    for name in _OPTIONAL_NONE:
        kwargs[name] = getattr(msg, name) if msg.HasField(name) else None
    for name in _PLAIN:
        kwargs[name] = getattr(msg, name)
    return SamplingParams(
        **kwargs,
        logit_bias=dict(msg.logit_bias) or None,
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        structured_output=(structured_output_from_proto(msg.structured_output)
                           if msg.HasField("structured_output") else None),
    )
