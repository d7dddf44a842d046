from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class ServiceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_STATE_UNSPECIFIED: _ClassVar[ServiceState]
    SERVICE_STATE_STARTING: _ClassVar[ServiceState]
    SERVICE_STATE_READY: _ClassVar[ServiceState]
    SERVICE_STATE_DRAINING: _ClassVar[ServiceState]
    SERVICE_STATE_STOPPED: _ClassVar[ServiceState]
    SERVICE_STATE_FAILED: _ClassVar[ServiceState]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
DTYPE_INT8: DType
DTYPE_UINT32: DType
DTYPE_FLOAT64: DType
SERVICE_STATE_UNSPECIFIED: ServiceState
SERVICE_STATE_STARTING: ServiceState
SERVICE_STATE_READY: ServiceState
SERVICE_STATE_DRAINING: ServiceState
SERVICE_STATE_STOPPED: ServiceState
SERVICE_STATE_FAILED: ServiceState

class TokenArray(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ObjectRef(_message.Message):
    __slots__ = ("uri", "sha256", "size_bytes", "media_type")
    URI_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    uri: str
    sha256: str
    size_bytes: int
    media_type: str
    def __init__(self, uri: _Optional[str] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., media_type: _Optional[str] = ...) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("service", "instance_id", "run", "version", "state", "uptime_s", "message")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    service: str
    instance_id: str
    run: str
    version: str
    state: ServiceState
    uptime_s: float
    message: str
    def __init__(self, service: _Optional[str] = ..., instance_id: _Optional[str] = ..., run: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[_Union[ServiceState, str]] = ..., uptime_s: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...
