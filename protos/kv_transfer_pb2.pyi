from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVRegion(_message.Message):
    __slots__ = ("name", "addr", "nbytes", "mem_type", "dev_id", "num_layers", "num_units", "unit_nbytes", "is_state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEV_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNITS_FIELD_NUMBER: _ClassVar[int]
    UNIT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    IS_STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    addr: int
    nbytes: int
    mem_type: str
    dev_id: int
    num_layers: int
    num_units: int
    unit_nbytes: int
    is_state: bool
    def __init__(self, name: _Optional[str] = ..., addr: _Optional[int] = ..., nbytes: _Optional[int] = ..., mem_type: _Optional[str] = ..., dev_id: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_units: _Optional[int] = ..., unit_nbytes: _Optional[int] = ..., is_state: _Optional[bool] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[KVRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[KVRegion, _Mapping]]] = ...) -> None: ...

class KVTransferNotice(_message.Message):
    __slots__ = ("output_token_ids", "draft_token_ids")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
