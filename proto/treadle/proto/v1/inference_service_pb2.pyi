from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("policy_version", "weights")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    weights: _common_pb2.ObjectRef
    def __init__(self, policy_version: _Optional[int] = ..., weights: _Optional[_Union[_common_pb2.ObjectRef, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "load_s", "already_loaded")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    ALREADY_LOADED_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    load_s: float
    already_loaded: bool
    def __init__(self, policy_version: _Optional[int] = ..., load_s: _Optional[float] = ..., already_loaded: _Optional[bool] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("abort_in_flight",)
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    abort_in_flight: bool
    def __init__(self, abort_in_flight: _Optional[bool] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InferenceStatus(_message.Message):
    __slots__ = ("info", "policy_version", "num_running_requests", "num_waiting_requests", "kv_cache_usage", "paused", "model", "adapter")
    INFO_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    policy_version: int
    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    paused: bool
    model: str
    adapter: str
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., policy_version: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., paused: _Optional[bool] = ..., model: _Optional[str] = ..., adapter: _Optional[str] = ...) -> None: ...
