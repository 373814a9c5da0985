from deepinfer.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterRequest(_message.Message):
    __slots__ = ("instance_id", "stage", "address", "kv_agent_name", "kv_agent_metadata", "datacenter", "block_size", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    stage: _common_pb2.Stage
    address: str
    kv_agent_name: str
    kv_agent_metadata: bytes
    datacenter: str
    block_size: int
    load: LoadReport
    def __init__(self, instance_id: _Optional[str] = ..., stage: _Optional[_Union[_common_pb2.Stage, str]] = ..., address: _Optional[str] = ..., kv_agent_name: _Optional[str] = ..., kv_agent_metadata: _Optional[bytes] = ..., datacenter: _Optional[str] = ..., block_size: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "heartbeat_timeout_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_queued_prefill_tokens", "num_running_requests", "num_waiting_requests", "num_kv_blocks_used", "num_kv_blocks_total", "cached_block_hashes", "is_cached_hashes_delta", "evicted_block_hashes", "is_healthy", "is_draining", "ranks", "num_free_slots", "num_output_tokens_left")
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    IS_CACHED_HASHES_DELTA_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    IS_HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    num_queued_prefill_tokens: int
    num_running_requests: int
    num_waiting_requests: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    is_cached_hashes_delta: bool
    evicted_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    is_healthy: bool
    is_draining: bool
    ranks: _containers.RepeatedCompositeFieldContainer[RankLoad]
    num_free_slots: int
    num_output_tokens_left: int
    def __init__(self, num_queued_prefill_tokens: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[int]] = ..., is_cached_hashes_delta: _Optional[bool] = ..., evicted_block_hashes: _Optional[_Iterable[int]] = ..., is_healthy: _Optional[bool] = ..., is_draining: _Optional[bool] = ..., ranks: _Optional[_Iterable[_Union[RankLoad, _Mapping]]] = ..., num_free_slots: _Optional[int] = ..., num_output_tokens_left: _Optional[int] = ...) -> None: ...

class RankLoad(_message.Message):
    __slots__ = ("rank", "num_running_requests", "num_waiting_requests", "num_kv_blocks_used", "num_kv_blocks_total", "num_free_slots", "num_output_tokens_left")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_LEFT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_running_requests: int
    num_waiting_requests: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_free_slots: int
    num_output_tokens_left: int
    def __init__(self, rank: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_kv_blocks_used: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_free_slots: _Optional[int] = ..., num_output_tokens_left: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id", "load")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    load: LoadReport
    def __init__(self, instance_id: _Optional[str] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("is_known", "needs_full_cached_hashes")
    IS_KNOWN_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FULL_CACHED_HASHES_FIELD_NUMBER: _ClassVar[int]
    is_known: bool
    needs_full_cached_hashes: bool
    def __init__(self, is_known: _Optional[bool] = ..., needs_full_cached_hashes: _Optional[bool] = ...) -> None: ...

class PickRequest(_message.Message):
    __slots__ = ("request_id", "stage", "prompt_block_hashes", "num_prompt_tokens", "num_kv_blocks_needed", "preferred_datacenter", "exclude_instance_ids", "num_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_DATACENTER_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INSTANCE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    stage: _common_pb2.Stage
    prompt_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_kv_blocks_needed: int
    preferred_datacenter: str
    exclude_instance_ids: _containers.RepeatedScalarFieldContainer[str]
    num_output_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., stage: _Optional[_Union[_common_pb2.Stage, str]] = ..., prompt_block_hashes: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_kv_blocks_needed: _Optional[int] = ..., preferred_datacenter: _Optional[str] = ..., exclude_instance_ids: _Optional[_Iterable[str]] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "stage", "address", "kv_agent_name", "kv_agent_metadata", "datacenter", "block_size", "load", "num_cached_block_hashes", "heartbeat_age_ms")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_MS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    stage: _common_pb2.Stage
    address: str
    kv_agent_name: str
    kv_agent_metadata: bytes
    datacenter: str
    block_size: int
    load: LoadReport
    num_cached_block_hashes: int
    heartbeat_age_ms: int
    def __init__(self, instance_id: _Optional[str] = ..., stage: _Optional[_Union[_common_pb2.Stage, str]] = ..., address: _Optional[str] = ..., kv_agent_name: _Optional[str] = ..., kv_agent_metadata: _Optional[bytes] = ..., datacenter: _Optional[str] = ..., block_size: _Optional[int] = ..., load: _Optional[_Union[LoadReport, _Mapping]] = ..., num_cached_block_hashes: _Optional[int] = ..., heartbeat_age_ms: _Optional[int] = ...) -> None: ...

class PickResponse(_message.Message):
    __slots__ = ("instance", "num_matched_prefix_tokens", "rank")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    NUM_MATCHED_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    instance: Instance
    num_matched_prefix_tokens: int
    rank: int
    def __init__(self, instance: _Optional[_Union[Instance, _Mapping]] = ..., num_matched_prefix_tokens: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("was_found",)
    WAS_FOUND_FIELD_NUMBER: _ClassVar[int]
    was_found: bool
    def __init__(self, was_found: _Optional[bool] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListInstancesResponse(_message.Message):
    __slots__ = ("instances", "balance")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    balance: float
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., balance: _Optional[float] = ...) -> None: ...
