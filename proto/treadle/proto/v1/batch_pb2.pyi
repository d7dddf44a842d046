import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from treadle.proto.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SampleRef(_message.Message):
    __slots__ = ("rollout_id", "leaf_node_id", "num_tokens", "truncated", "num_tokens_dropped")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    LEAF_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    leaf_node_id: int
    num_tokens: int
    truncated: bool
    num_tokens_dropped: int
    def __init__(self, rollout_id: _Optional[str] = ..., leaf_node_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., truncated: _Optional[bool] = ..., num_tokens_dropped: _Optional[int] = ...) -> None: ...

class MicroBatch(_message.Message):
    __slots__ = ("rank", "index", "num_tokens", "input_ids", "position_ids", "cu_seqlens", "loss_mask", "advantages", "behaviour_logprobs", "policy_versions", "sample_index", "teacher_top_k", "teacher_topk_ids", "teacher_topk_logprobs", "teacher_weight")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITION_IDS_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOUR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    index: int
    num_tokens: int
    input_ids: _common_pb2.TokenArray
    position_ids: _common_pb2.TokenArray
    cu_seqlens: _common_pb2.TokenArray
    loss_mask: _common_pb2.TokenArray
    advantages: _common_pb2.TokenArray
    behaviour_logprobs: _common_pb2.TokenArray
    policy_versions: _common_pb2.TokenArray
    sample_index: _common_pb2.TokenArray
    teacher_top_k: int
    teacher_topk_ids: _common_pb2.TokenArray
    teacher_topk_logprobs: _common_pb2.TokenArray
    teacher_weight: _common_pb2.TokenArray
    def __init__(self, rank: _Optional[int] = ..., index: _Optional[int] = ..., num_tokens: _Optional[int] = ..., input_ids: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., position_ids: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., cu_seqlens: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., loss_mask: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., behaviour_logprobs: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., policy_versions: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., sample_index: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., teacher_top_k: _Optional[int] = ..., teacher_topk_ids: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., teacher_topk_logprobs: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ..., teacher_weight: _Optional[_Union[_common_pb2.TokenArray, _Mapping]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("step", "samples", "micro_batches")
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    samples: _containers.RepeatedCompositeFieldContainer[SampleRef]
    micro_batches: _containers.RepeatedCompositeFieldContainer[MicroBatch]
    def __init__(self, step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[SampleRef, _Mapping]]] = ..., micro_batches: _Optional[_Iterable[_Union[MicroBatch, _Mapping]]] = ...) -> None: ...

class MicroBatchLayout(_message.Message):
    __slots__ = ("rank", "index", "num_docs", "num_tokens_used", "num_loss_tokens")
    RANK_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_DOCS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    index: int
    num_docs: int
    num_tokens_used: int
    num_loss_tokens: int
    def __init__(self, rank: _Optional[int] = ..., index: _Optional[int] = ..., num_docs: _Optional[int] = ..., num_tokens_used: _Optional[int] = ..., num_loss_tokens: _Optional[int] = ...) -> None: ...

class BatchReady(_message.Message):
    __slots__ = ("step", "rollout_ids", "num_ranks", "seq_len", "layout", "data", "num_samples", "num_tokens", "num_loss_tokens", "min_policy_version", "max_policy_version", "created_at", "metrics", "temperature")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOSS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    step: int
    rollout_ids: _containers.RepeatedScalarFieldContainer[str]
    num_ranks: int
    seq_len: int
    layout: _containers.RepeatedCompositeFieldContainer[MicroBatchLayout]
    data: _common_pb2.ObjectRef
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    min_policy_version: int
    max_policy_version: int
    created_at: _timestamp_pb2.Timestamp
    metrics: _containers.ScalarMap[str, float]
    temperature: float
    def __init__(self, step: _Optional[int] = ..., rollout_ids: _Optional[_Iterable[str]] = ..., num_ranks: _Optional[int] = ..., seq_len: _Optional[int] = ..., layout: _Optional[_Iterable[_Union[MicroBatchLayout, _Mapping]]] = ..., data: _Optional[_Union[_common_pb2.ObjectRef, _Mapping]] = ..., num_samples: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_loss_tokens: _Optional[int] = ..., min_policy_version: _Optional[int] = ..., max_policy_version: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metrics: _Optional[_Mapping[str, float]] = ..., temperature: _Optional[float] = ...) -> None: ...
