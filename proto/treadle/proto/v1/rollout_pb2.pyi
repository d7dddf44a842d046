import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
ROLE_UNSPECIFIED: Role
ROLE_SYSTEM: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_TOOL: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "max_total_tokens", "seed", "stop", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    max_total_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RolloutRequested(_message.Message):
    __slots__ = ("rollout_id", "group_id", "group_index", "group_size", "env", "task_id", "task_json", "sampling", "policy_version", "requested_at", "timeout_s", "labels", "want_privileged_prompts")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    WANT_PRIVILEGED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    group_id: str
    group_index: int
    group_size: int
    env: str
    task_id: str
    task_json: str
    sampling: SamplingParams
    policy_version: int
    requested_at: _timestamp_pb2.Timestamp
    timeout_s: float
    labels: _containers.ScalarMap[str, str]
    want_privileged_prompts: bool
    def __init__(self, rollout_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_index: _Optional[int] = ..., group_size: _Optional[int] = ..., env: _Optional[str] = ..., task_id: _Optional[str] = ..., task_json: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., requested_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., timeout_s: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., want_privileged_prompts: _Optional[bool] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json", "status", "raw_text")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[ToolCall.Status]
        STATUS_OK: _ClassVar[ToolCall.Status]
        STATUS_MALFORMED: _ClassVar[ToolCall.Status]
        STATUS_UNKNOWN_TOOL: _ClassVar[ToolCall.Status]
        STATUS_INVALID_ARGUMENTS: _ClassVar[ToolCall.Status]
    STATUS_UNSPECIFIED: ToolCall.Status
    STATUS_OK: ToolCall.Status
    STATUS_MALFORMED: ToolCall.Status
    STATUS_UNKNOWN_TOOL: ToolCall.Status
    STATUS_INVALID_ARGUMENTS: ToolCall.Status
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RAW_TEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    status: ToolCall.Status
    raw_text: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., status: _Optional[_Union[ToolCall.Status, str]] = ..., raw_text: _Optional[str] = ...) -> None: ...

class MessageNode(_message.Message):
    __slots__ = ("node_id", "parent_id", "role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name", "token_ids", "sampled_mask", "logprobs", "policy_versions", "finish_reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: int
    parent_id: int
    role: Role
    content: str
    reasoning_content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    token_ids: _common_pb2.TokenArray
    sampled_mask: _common_pb2.TokenArray
    logprobs: _common_pb2.TokenArray
    policy_versions: _common_pb2.TokenArray
    finish_reason: FinishReason
    def __init__(self, node_id: _Optional[int] = ..., parent_id: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., sampled_mask: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., policy_versions: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Reward(_message.Message):
    __slots__ = ("name", "value", "weight", "from_group")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    FROM_GROUP_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    weight: float
    from_group: bool
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., weight: _Optional[float] = ..., from_group: _Optional[bool] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("kind", "truncation", "error_kind", "message")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[RolloutStatus.Kind]
        KIND_OK: _ClassVar[RolloutStatus.Kind]
        KIND_TRUNCATED: _ClassVar[RolloutStatus.Kind]
        KIND_ERROR: _ClassVar[RolloutStatus.Kind]
        KIND_CANCELLED: _ClassVar[RolloutStatus.Kind]
    KIND_UNSPECIFIED: RolloutStatus.Kind
    KIND_OK: RolloutStatus.Kind
    KIND_TRUNCATED: RolloutStatus.Kind
    KIND_ERROR: RolloutStatus.Kind
    KIND_CANCELLED: RolloutStatus.Kind
    class Truncation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TRUNCATION_UNSPECIFIED: _ClassVar[RolloutStatus.Truncation]
        TRUNCATION_MAX_TOKENS: _ClassVar[RolloutStatus.Truncation]
        TRUNCATION_MAX_TOTAL_TOKENS: _ClassVar[RolloutStatus.Truncation]
        TRUNCATION_MAX_TURNS: _ClassVar[RolloutStatus.Truncation]
        TRUNCATION_TIMEOUT: _ClassVar[RolloutStatus.Truncation]
    TRUNCATION_UNSPECIFIED: RolloutStatus.Truncation
    TRUNCATION_MAX_TOKENS: RolloutStatus.Truncation
    TRUNCATION_MAX_TOTAL_TOKENS: RolloutStatus.Truncation
    TRUNCATION_MAX_TURNS: RolloutStatus.Truncation
    TRUNCATION_TIMEOUT: RolloutStatus.Truncation
    class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ERROR_KIND_UNSPECIFIED: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_INVALID_REQUEST: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_ENV: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_HARNESS: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_SANDBOX: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_MODEL_OUTPUT: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_TOOL: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_REWARD: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_INFERENCE: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_TEMPLATE: _ClassVar[RolloutStatus.ErrorKind]
        ERROR_KIND_INTERNAL: _ClassVar[RolloutStatus.ErrorKind]
    ERROR_KIND_UNSPECIFIED: RolloutStatus.ErrorKind
    ERROR_KIND_INVALID_REQUEST: RolloutStatus.ErrorKind
    ERROR_KIND_ENV: RolloutStatus.ErrorKind
    ERROR_KIND_HARNESS: RolloutStatus.ErrorKind
    ERROR_KIND_SANDBOX: RolloutStatus.ErrorKind
    ERROR_KIND_MODEL_OUTPUT: RolloutStatus.ErrorKind
    ERROR_KIND_TOOL: RolloutStatus.ErrorKind
    ERROR_KIND_REWARD: RolloutStatus.ErrorKind
    ERROR_KIND_INFERENCE: RolloutStatus.ErrorKind
    ERROR_KIND_TEMPLATE: RolloutStatus.ErrorKind
    ERROR_KIND_INTERNAL: RolloutStatus.ErrorKind
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: RolloutStatus.Kind
    truncation: RolloutStatus.Truncation
    error_kind: RolloutStatus.ErrorKind
    message: str
    def __init__(self, kind: _Optional[_Union[RolloutStatus.Kind, str]] = ..., truncation: _Optional[_Union[RolloutStatus.Truncation, str]] = ..., error_kind: _Optional[_Union[RolloutStatus.ErrorKind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class RolloutTiming(_message.Message):
    __slots__ = ("requested_at", "started_at", "finished_at", "generation_s", "env_s", "reward_s", "num_model_calls", "prompt_tokens", "sampled_tokens")
    REQUESTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_S_FIELD_NUMBER: _ClassVar[int]
    ENV_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_S_FIELD_NUMBER: _ClassVar[int]
    NUM_MODEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    requested_at: _timestamp_pb2.Timestamp
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    generation_s: float
    env_s: float
    reward_s: float
    num_model_calls: int
    prompt_tokens: int
    sampled_tokens: int
    def __init__(self, requested_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., generation_s: _Optional[float] = ..., env_s: _Optional[float] = ..., reward_s: _Optional[float] = ..., num_model_calls: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., sampled_tokens: _Optional[int] = ...) -> None: ...

class Rollout(_message.Message):
    __slots__ = ("rollout_id", "group_id", "group_index", "env", "task_id", "nodes", "rewards", "reward", "metrics", "status", "timing", "runner_id", "trace_id", "min_policy_version", "max_policy_version", "request_policy_version", "privileged_prompts")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RUNNER_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIVILEGED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    group_id: str
    group_index: int
    env: str
    task_id: str
    nodes: _containers.RepeatedCompositeFieldContainer[MessageNode]
    rewards: _containers.RepeatedCompositeFieldContainer[Reward]
    reward: float
    metrics: _containers.ScalarMap[str, float]
    status: RolloutStatus
    timing: RolloutTiming
    runner_id: str
    trace_id: str
    min_policy_version: int
    max_policy_version: int
    request_policy_version: int
    privileged_prompts: _containers.RepeatedCompositeFieldContainer[PrivilegedPrompt]
    def __init__(self, rollout_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_index: _Optional[int] = ..., env: _Optional[str] = ..., task_id: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[MessageNode, _Mapping]]] = ..., rewards: _Optional[_Iterable[_Union[Reward, _Mapping]]] = ..., reward: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[RolloutStatus, _Mapping]] = ..., timing: _Optional[_Union[RolloutTiming, _Mapping]] = ..., runner_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., request_policy_version: _Optional[int] = ..., privileged_prompts: _Optional[_Iterable[_Union[PrivilegedPrompt, _Mapping]]] = ...) -> None: ...

class PrivilegedPrompt(_message.Message):
    __slots__ = ("root_node_id", "num_replaced", "token_ids")
    ROOT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLACED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    root_node_id: int
    num_replaced: int
    token_ids: _common_pb2.TokenArray
    def __init__(self, root_node_id: _Optional[int] = ..., num_replaced: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ...) -> None: ...

class RolloutCompleted(_message.Message):
    __slots__ = ("rollout", "completed_at")
    ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_AT_FIELD_NUMBER: _ClassVar[int]
    rollout: Rollout
    completed_at: _timestamp_pb2.Timestamp
    def __init__(self, rollout: _Optional[_Union[Rollout, _Mapping]] = ..., completed_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GroupScoreRequest(_message.Message):
    __slots__ = ("env", "group_id", "task_json", "rollouts")
    ENV_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    env: str
    group_id: str
    task_json: str
    rollouts: _containers.RepeatedCompositeFieldContainer[Rollout]
    def __init__(self, env: _Optional[str] = ..., group_id: _Optional[str] = ..., task_json: _Optional[str] = ..., rollouts: _Optional[_Iterable[_Union[Rollout, _Mapping]]] = ...) -> None: ...

class GroupRewards(_message.Message):
    __slots__ = ("rollout_id", "rewards", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    rewards: _containers.RepeatedCompositeFieldContainer[Reward]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, rollout_id: _Optional[str] = ..., rewards: _Optional[_Iterable[_Union[Reward, _Mapping]]] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class GroupScoreReply(_message.Message):
    __slots__ = ("rollouts", "error")
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    rollouts: _containers.RepeatedCompositeFieldContainer[GroupRewards]
    error: str
    def __init__(self, rollouts: _Optional[_Iterable[_Union[GroupRewards, _Mapping]]] = ..., error: _Optional[str] = ...) -> None: ...
