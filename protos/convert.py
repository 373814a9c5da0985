"""Conversions between engine dataclasses and their wire messages.

`sampling_params_to_proto` / `sampling_params_from_proto` map `engine.sampling.SamplingParams` onto
`deepinfer.v1.SamplingParams` (see the unset rules in `protos/common.proto`). The round trip
`from_proto(to_proto(p)) == p` holds for every valid `p`, with one exception: `logit_bias={}` comes
back as None (the engine treats both as "no bias").
"""

from __future__ import annotations

from engine.sampling.params import SamplingParams
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
    return msg


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
    )
