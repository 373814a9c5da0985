from deepinfer.protos import common_pb2 as _common_pb2
from deepinfer.protos import vision_pb2 as _vision_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "images", "num_kv_tokens", "deadline_ms", "lease_ms", "image_embeddings", "kv_traffic_class", "is_conversation", "rank", "num_original_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    KV_TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    IS_CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_ORIGINAL_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    num_kv_tokens: int
    deadline_ms: int
    lease_ms: int
    image_embeddings: _containers.RepeatedCompositeFieldContainer[_vision_pb2.ImageEmbeddings]
    kv_traffic_class: str
    is_conversation: bool
    rank: int
    num_original_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ..., num_kv_tokens: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., lease_ms: _Optional[int] = ..., image_embeddings: _Optional[_Iterable[_Union[_vision_pb2.ImageEmbeddings, _Mapping]]] = ..., kv_traffic_class: _Optional[str] = ..., is_conversation: _Optional[bool] = ..., rank: _Optional[int] = ..., num_original_prompt_tokens: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("request_id", "agent_name", "agent_metadata", "block_ids", "block_size", "transfer_id", "lease_deadline_unix_ms", "error", "agent_layout", "state_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AGENT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    agent_name: str
    agent_metadata: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    transfer_id: str
    lease_deadline_unix_ms: int
    error: _common_pb2.Error
    agent_layout: bytes
    state_slot: int
    def __init__(self, request_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., transfer_id: _Optional[str] = ..., lease_deadline_unix_ms: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., agent_layout: _Optional[bytes] = ..., state_slot: _Optional[int] = ...) -> None: ...

class StartRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "first_token_logprobs", "num_cached_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    first_token_logprobs: _common_pb2.TokenLogprobs
    num_cached_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finish_reason", "stop_token_id", "stop_str", "usage", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    stop_str: str
    usage: _common_pb2.Usage
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_str: _Optional[str] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...
