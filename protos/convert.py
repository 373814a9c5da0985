"""Conversions between engine dataclasses and their wire messages.

`sampling_params_to_proto` / `sampling_params_from_proto` map `engine.sampling.SamplingParams` onto
`deepinfer.v1.SamplingParams` (see the unset rules in `protos/common.proto`), its
`structured_output` included (`StructuredOutputParams` <-> `deepinfer.v1.StructuredOutput`). The round
trip `from_proto(to_proto(p)) == p` holds for every valid `p`, with one exception: `logit_bias={}`
comes back as None (the engine treats both as "no bias").

`token_chunk` turns the engine's cumulative `RequestOutput` of a request into the decode stage's next
`deepinfer.v1.TokenChunk` delta; `token_logprobs_to_proto` maps the engine's `TokenLogprobs` onto the wire.
"""

from __future__ import annotations

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.sampling.params import STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutputParams
from deepinfer.protos import common_pb2, decode_pb2

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


FINISH_REASON_TO_PROTO = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
"""The engine's finish reasons -> wire (anything else: STOP)."""


def token_logprobs_to_proto(lp) -> common_pb2.TokenLogprobs:
    """The wire message of an engine `TokenLogprobs` (logprobs narrowed to float32, as the engine computes them)."""
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                                    top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs):
    """The engine's `TokenLogprobs` of a wire message."""
    from deepinfer.engine.sampling.sampler import TokenLogprobs

    return TokenLogprobs(msg.token_id, msg.logprob, msg.rank, list(msg.top_token_ids), list(msg.top_logprobs))


def token_chunk(request_id: str, out, num_sent_tokens: int, num_sent_chars: int,
                num_prompt_tokens: int) -> decode_pb2.TokenChunk | None:
    """The delta of an engine `RequestOutput` (cumulative, first sequence) after `num_sent_tokens` tokens
    and `num_sent_chars` characters were sent; None when nothing new and not finished.

    A finishing chunk carries the finish reason, the stop token or string, and the usage; an engine
    error finishes the request with FINISH_REASON_ERROR and an INTERNAL `Error`.

    Logprobs (when the request asked for them): the engine has none for output tokens it did not sample
    itself (the first token, which a decode instance imports from the prefill, `Engine.commit_kv`); those
    are the sequence's leading tokens, so the chunk's `logprobs` then lack their first entries, and whoever
    holds them (decode's Start: `StartRequest.first_token_logprobs`) puts them in front.
    """
    co = out.outputs[0]
    new_token_ids = co.token_ids[num_sent_tokens:]
    text = co.text[num_sent_chars:]
    chunk = decode_pb2.TokenChunk(request_id=request_id, token_ids=new_token_ids, text=text)
    if co.logprobs:
        num_imported = len(co.token_ids) - len(co.logprobs)  # leading tokens sampled elsewhere
        start = max(0, num_sent_tokens - num_imported)
        chunk.logprobs.extend(token_logprobs_to_proto(lp) for lp in co.logprobs[start:])
    if out.error:
        chunk.finish_reason = common_pb2.FINISH_REASON_ERROR
        chunk.error.CopyFrom(common_pb2.Error(code=common_pb2.ERROR_CODE_INTERNAL, message=out.error))
    elif out.finished:
        chunk.finish_reason = FINISH_REASON_TO_PROTO.get(co.finish_reason, common_pb2.FINISH_REASON_STOP)
        if isinstance(co.stop_reason, int):
            chunk.stop_token_id = co.stop_reason
        elif isinstance(co.stop_reason, str):
            chunk.stop_str = co.stop_reason
    elif not new_token_ids and not text:
        return None
    if chunk.finish_reason:
        chunk.usage.CopyFrom(common_pb2.Usage(prompt_tokens=num_prompt_tokens, completion_tokens=len(co.token_ids)))
    return chunk
