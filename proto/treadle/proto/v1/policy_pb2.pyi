import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyPublished(_message.Message):
    __slots__ = ("policy_version", "weights", "format", "published_at", "base_model")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_AT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    weights: _common_pb2.ObjectRef
    format: str
    published_at: _timestamp_pb2.Timestamp
    base_model: str
    def __init__(self, policy_version: _Optional[int] = ..., weights: _Optional[_Union[_common_pb2.ObjectRef, _Mapping]] = ..., format: _Optional[str] = ..., published_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., base_model: _Optional[str] = ...) -> None: ...
