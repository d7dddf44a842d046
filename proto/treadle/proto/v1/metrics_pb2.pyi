import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MetricsReport(_message.Message):
    __slots__ = ("service", "instance_id", "step", "values", "time")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    step: int
    values: _containers.ScalarMap[str, float]
    time: _timestamp_pb2.Timestamp
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class UsageRecord(_message.Message):
    __slots__ = ("service", "unit", "tenant", "rollouts", "prompt_tokens", "sampled_tokens", "trained_tokens", "loss_tokens", "trainer_s", "time")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_S_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    service: str
    unit: str
    tenant: str
    rollouts: int
    prompt_tokens: int
    sampled_tokens: int
    trained_tokens: int
    loss_tokens: int
    trainer_s: float
    time: _timestamp_pb2.Timestamp
    def __init__(self, service: _Optional[str] = ..., unit: _Optional[str] = ..., tenant: _Optional[str] = ..., rollouts: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., sampled_tokens: _Optional[int] = ..., trained_tokens: _Optional[int] = ..., loss_tokens: _Optional[int] = ..., trainer_s: _Optional[float] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...
