from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainerStatus(_message.Message):
    __slots__ = ("info", "step", "policy_version", "last_checkpoint_step", "world_size", "waiting_for_batch")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_BATCH_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    step: int
    policy_version: int
    last_checkpoint_step: int
    world_size: int
    waiting_for_batch: bool
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., world_size: _Optional[int] = ..., waiting_for_batch: _Optional[bool] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("step", "manifest")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    step: int
    manifest: _common_pb2.ObjectRef
    def __init__(self, step: _Optional[int] = ..., manifest: _Optional[_Union[_common_pb2.ObjectRef, _Mapping]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("reason", "run")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    reason: str
    run: str
    def __init__(self, reason: _Optional[str] = ..., run: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...
