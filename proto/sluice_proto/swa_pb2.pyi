from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchSlotRequest(_message.Message):
    __slots__ = ("anchor", "tail")
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    anchor: bytes
    tail: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, anchor: _Optional[bytes] = ..., tail: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchSlotReply(_message.Message):
    __slots__ = ("num_tokens", "slot", "tail_block")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    slot: bytes
    tail_block: bytes
    def __init__(self, num_tokens: _Optional[int] = ..., slot: _Optional[bytes] = ..., tail_block: _Optional[bytes] = ...) -> None: ...
