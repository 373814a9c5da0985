from deepinfer.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrafficClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAFFIC_CLASS_UNSPECIFIED: _ClassVar[TrafficClass]
    TRAFFIC_CLASS_INTERACTIVE: _ClassVar[TrafficClass]
    TRAFFIC_CLASS_BATCH: _ClassVar[TrafficClass]
TRAFFIC_CLASS_UNSPECIFIED: TrafficClass
TRAFFIC_CLASS_INTERACTIVE: TrafficClass
TRAFFIC_CLASS_BATCH: TrafficClass

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "images", "traffic_class", "deadline_ms", "is_max_tokens_default", "kv_traffic_class", "is_conversation", "num_original_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    IS_MAX_TOKENS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    KV_TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    IS_CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    NUM_ORIGINAL_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    traffic_class: TrafficClass
    deadline_ms: int
    is_max_tokens_default: bool
    kv_traffic_class: str
    is_conversation: bool
    num_original_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ..., traffic_class: _Optional[_Union[TrafficClass, str]] = ..., deadline_ms: _Optional[int] = ..., is_max_tokens_default: _Optional[bool] = ..., kv_traffic_class: _Optional[str] = ..., is_conversation: _Optional[bool] = ..., num_original_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "logprobs", "prompt_logprobs", "finish_reason", "stop_token_id", "stop_str", "usage", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_str: str
    usage: _common_pb2.Usage
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
