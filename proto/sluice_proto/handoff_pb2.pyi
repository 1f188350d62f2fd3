from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchHandoffRequest(_message.Message):
    __slots__ = ("handoff_id", "token")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    token: bytes
    def __init__(self, handoff_id: _Optional[str] = ..., token: _Optional[bytes] = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
