from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OrchestratorStatus(_message.Message):
    __slots__ = ("info", "step", "trainer_step", "inference_policy_version", "num_groups_in_flight", "num_rollouts_buffered", "num_rollouts_dropped_stale", "dispatch_gated")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRAINER_STEP_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_BUFFERED_FIELD_NUMBER: _ClassVar[int]
    NUM_ROLLOUTS_DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_GATED_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    step: int
    trainer_step: int
    inference_policy_version: int
    num_groups_in_flight: int
    num_rollouts_buffered: int
    num_rollouts_dropped_stale: int
    dispatch_gated: bool
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., step: _Optional[int] = ..., trainer_step: _Optional[int] = ..., inference_policy_version: _Optional[int] = ..., num_groups_in_flight: _Optional[int] = ..., num_rollouts_buffered: _Optional[int] = ..., num_rollouts_dropped_stale: _Optional[int] = ..., dispatch_gated: _Optional[bool] = ...) -> None: ...
