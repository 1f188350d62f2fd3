from sluice_proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_OK: _ClassVar[ShardStatus]
    SHARD_NOT_FOUND: _ClassVar[ShardStatus]
    SHARD_CORRUPT: _ClassVar[ShardStatus]
    SHARD_REJECTED: _ClassVar[ShardStatus]
SHARD_OK: ShardStatus
SHARD_NOT_FOUND: ShardStatus
SHARD_CORRUPT: ShardStatus
SHARD_REJECTED: ShardStatus

class ShardRef(_message.Message):
    __slots__ = ("object_id", "index")
    OBJECT_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    object_id: bytes
    index: int
    def __init__(self, object_id: _Optional[bytes] = ..., index: _Optional[int] = ...) -> None: ...

class PutShardChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    data: bytes
    def __init__(self, header: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutShardReply(_message.Message):
    __slots__ = ("stored_bytes",)
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    stored_bytes: int
    def __init__(self, stored_bytes: _Optional[int] = ...) -> None: ...

class GetShardRequest(_message.Message):
    __slots__ = ("ref", "chunk_bytes")
    REF_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ref: ShardRef
    chunk_bytes: int
    def __init__(self, ref: _Optional[_Union[ShardRef, _Mapping]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class GetShardChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: bytes
    data: bytes
    def __init__(self, header: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardPiece(_message.Message):
    __slots__ = ("ref", "status", "header", "data", "detail")
    REF_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ref: int
    status: ShardStatus
    header: bytes
    data: bytes
    detail: str
    def __init__(self, ref: _Optional[int] = ..., status: _Optional[_Union[ShardStatus, str]] = ..., header: _Optional[bytes] = ..., data: _Optional[bytes] = ..., detail: _Optional[str] = ...) -> None: ...

class ShardPieces(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[ShardPiece]
    def __init__(self, pieces: _Optional[_Iterable[_Union[ShardPiece, _Mapping]]] = ...) -> None: ...

class GetShardsRequest(_message.Message):
    __slots__ = ("refs", "chunk_bytes")
    REFS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[ShardRef]
    chunk_bytes: int
    def __init__(self, refs: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class PutShardsReply(_message.Message):
    __slots__ = ("status", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[ShardStatus]
    detail: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, status: _Optional[_Iterable[_Union[ShardStatus, str]]] = ..., detail: _Optional[_Iterable[str]] = ...) -> None: ...

class ShardRefs(_message.Message):
    __slots__ = ("refs",)
    REFS_FIELD_NUMBER: _ClassVar[int]
    refs: _containers.RepeatedCompositeFieldContainer[ShardRef]
    def __init__(self, refs: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ...) -> None: ...

class CountReply(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class StatShardReply(_message.Message):
    __slots__ = ("exists", "size", "traffic_class", "last_access_unix", "expires_unix")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_UNIX_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    exists: bool
    size: int
    traffic_class: int
    last_access_unix: float
    expires_unix: float
    def __init__(self, exists: _Optional[bool] = ..., size: _Optional[int] = ..., traffic_class: _Optional[int] = ..., last_access_unix: _Optional[float] = ..., expires_unix: _Optional[float] = ...) -> None: ...

class NodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatsReply(_message.Message):
    __slots__ = ("node_id", "used_bytes", "capacity_bytes", "shard_count", "evicted_shards", "expired_shards", "discarded_at_start", "corrupt_detected", "cache_used_bytes", "cache_hits", "cache_misses")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_AT_START_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_DETECTED_FIELD_NUMBER: _ClassVar[int]
    CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    used_bytes: int
    capacity_bytes: int
    shard_count: int
    evicted_shards: int
    expired_shards: int
    discarded_at_start: int
    corrupt_detected: int
    cache_used_bytes: int
    cache_hits: int
    cache_misses: int
    def __init__(self, node_id: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., shard_count: _Optional[int] = ..., evicted_shards: _Optional[int] = ..., expired_shards: _Optional[int] = ..., discarded_at_start: _Optional[int] = ..., corrupt_detected: _Optional[int] = ..., cache_used_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ...) -> None: ...
