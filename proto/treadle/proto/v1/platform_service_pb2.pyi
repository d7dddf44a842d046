from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_PHASE_UNSPECIFIED: _ClassVar[RunPhase]
    RUN_PHASE_STARTING: _ClassVar[RunPhase]
    RUN_PHASE_RUNNING: _ClassVar[RunPhase]
    RUN_PHASE_SUCCEEDED: _ClassVar[RunPhase]
    RUN_PHASE_FAILED: _ClassVar[RunPhase]
    RUN_PHASE_CANCELLED: _ClassVar[RunPhase]
RUN_PHASE_UNSPECIFIED: RunPhase
RUN_PHASE_STARTING: RunPhase
RUN_PHASE_RUNNING: RunPhase
RUN_PHASE_SUCCEEDED: RunPhase
RUN_PHASE_FAILED: RunPhase
RUN_PHASE_CANCELLED: RunPhase

class AddRunRequest(_message.Message):
    __slots__ = ("run_file", "quota")
    RUN_FILE_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    run_file: str
    quota: HostedQuota
    def __init__(self, run_file: _Optional[str] = ..., quota: _Optional[_Union[HostedQuota, _Mapping]] = ...) -> None: ...

class HostedQuota(_message.Message):
    __slots__ = ("trainer_s", "trained_tokens", "sampled_tokens")
    TRAINER_S_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    trainer_s: float
    trained_tokens: int
    sampled_tokens: int
    def __init__(self, trainer_s: _Optional[float] = ..., trained_tokens: _Optional[int] = ..., sampled_tokens: _Optional[int] = ...) -> None: ...

class AddRunResponse(_message.Message):
    __slots__ = ("run", "step")
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RemoveRunRequest(_message.Message):
    __slots__ = ("run", "reason")
    RUN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run: str
    reason: str
    def __init__(self, run: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RemoveRunResponse(_message.Message):
    __slots__ = ("step", "was_hosted")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAS_HOSTED_FIELD_NUMBER: _ClassVar[int]
    step: int
    was_hosted: bool
    def __init__(self, step: _Optional[int] = ..., was_hosted: _Optional[bool] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("name", "config", "tasks", "env", "env_wheel", "env_entry")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    ENV_WHEEL_FIELD_NUMBER: _ClassVar[int]
    ENV_ENTRY_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: str
    tasks: bytes
    env: str
    env_wheel: bytes
    env_entry: str
    def __init__(self, name: _Optional[str] = ..., config: _Optional[str] = ..., tasks: _Optional[bytes] = ..., env: _Optional[str] = ..., env_wheel: _Optional[bytes] = ..., env_entry: _Optional[str] = ...) -> None: ...

class RunState(_message.Message):
    __slots__ = ("run", "tenant", "phase", "trained_step", "served_version", "max_steps", "message", "model", "env_pin", "inference_url", "inference_key")
    RUN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    TRAINED_STEP_FIELD_NUMBER: _ClassVar[int]
    SERVED_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENV_PIN_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_URL_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_KEY_FIELD_NUMBER: _ClassVar[int]
    run: str
    tenant: str
    phase: RunPhase
    trained_step: int
    served_version: int
    max_steps: int
    message: str
    model: str
    env_pin: str
    inference_url: str
    inference_key: str
    def __init__(self, run: _Optional[str] = ..., tenant: _Optional[str] = ..., phase: _Optional[_Union[RunPhase, str]] = ..., trained_step: _Optional[int] = ..., served_version: _Optional[int] = ..., max_steps: _Optional[int] = ..., message: _Optional[str] = ..., model: _Optional[str] = ..., env_pin: _Optional[str] = ..., inference_url: _Optional[str] = ..., inference_key: _Optional[str] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunState]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunState, _Mapping]]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run", "reason")
    RUN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    run: str
    reason: str
    def __init__(self, run: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
