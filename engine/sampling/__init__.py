"""Sampling: per-request parameters, the batched sampler, detokenization and stop conditions."""

from deepinfer.engine.sampling.params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams
from deepinfer.engine.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingBatch,
    TokenLogprobs,
    compute_logprobs,
)
from deepinfer.engine.sampling.stop import (
    FinishReason,
    IncrementalDetokenizer,
    StopChecker,
    StopUpdate,
    check_stop_strings,
    max_stop_hold_back,
    stop_hold_back_len,
)

__all__ = [
    "MAX_LOGPROBS",
    "FinishReason",
    "IncrementalDetokenizer",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingParams",
    "StopChecker",
    "StopUpdate",
    "StructuredOutputParams",
    "TokenLogprobs",
    "check_stop_strings",
    "compute_logprobs",
    "max_stop_hold_back",
    "stop_hold_back_len",
]
