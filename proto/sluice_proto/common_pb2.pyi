from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("state", "detail", "version")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[HealthReply.State]
        SERVING: _ClassVar[HealthReply.State]
        NOT_SERVING: _ClassVar[HealthReply.State]
    STATE_UNSPECIFIED: HealthReply.State
    SERVING: HealthReply.State
    NOT_SERVING: HealthReply.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    state: HealthReply.State
    detail: str
    version: str
    def __init__(self, state: _Optional[_Union[HealthReply.State, str]] = ..., detail: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
