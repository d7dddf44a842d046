from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnvRunnerStatus(_message.Message):
    __slots__ = ("info", "envs", "max_concurrency", "num_active_rollouts", "num_completed", "num_failed")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENVS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    envs: _containers.RepeatedScalarFieldContainer[str]
    max_concurrency: int
    num_active_rollouts: int
    num_completed: int
    num_failed: int
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., envs: _Optional[_Iterable[str]] = ..., max_concurrency: _Optional[int] = ..., num_active_rollouts: _Optional[int] = ..., num_completed: _Optional[int] = ..., num_failed: _Optional[int] = ...) -> None: ...
