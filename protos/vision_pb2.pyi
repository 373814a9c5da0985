from deepinfer.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageEmbeddings(_message.Message):
    __slots__ = ("content_hash", "num_tokens", "agent_name", "agent_metadata", "addr", "num_bytes", "mem_type", "dev_id", "hidden_size", "dtype", "is_cached")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IS_CACHED_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    num_tokens: int
    agent_name: str
    agent_metadata: bytes
    addr: int
    num_bytes: int
    mem_type: str
    dev_id: int
    hidden_size: int
    dtype: str
    is_cached: bool
    def __init__(self, content_hash: _Optional[str] = ..., num_tokens: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., addr: _Optional[int] = ..., num_bytes: _Optional[int] = ..., mem_type: _Optional[str] = ..., dev_id: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ..., is_cached: _Optional[bool] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "images", "lease_ms", "deadline_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    lease_ms: int
    deadline_ms: int
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("request_id", "embeddings", "lease_deadline_unix_ms", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    embeddings: _containers.RepeatedCompositeFieldContainer[ImageEmbeddings]
    lease_deadline_unix_ms: int
    error: _common_pb2.Error
    def __init__(self, request_id: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[ImageEmbeddings, _Mapping]]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("was_found",)
    WAS_FOUND_FIELD_NUMBER: _ClassVar[int]
    was_found: bool
    def __init__(self, was_found: _Optional[bool] = ...) -> None: ...
