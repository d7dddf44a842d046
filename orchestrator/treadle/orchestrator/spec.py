"""The orchestrator service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from treadle.proto.v1 import orchestrator_service_pb2, orchestrator_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel, check_name

DEFAULT_GRPC_PORT = 50063


class SamplingSection(StrictModel):
    """[orchestrator.sampling]: how env runners sample from the policy."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature (0 = greedy)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Keep the top_k tokens (0 = disabled)."""
    max_tokens: int = Field(256, ge=1)
    """Sampled tokens per model call."""


class OrchestratorSection(StrictModel):
    """[orchestrator]: the asynchronous RL loop (or the SFT data feed)."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (OrchestratorControl + health)."""
    mode: Literal["rl", "sft"] = "rl"
    """'rl': dispatch rollouts and build batches from them; 'sft': build batches from a dataset."""
    env: str = "reverse_text"
    """Environment name the rollouts run in (the env runners must serve it)."""
    tasks: Path | None = None
    """JSONL file of tasks (one JSON object per line; an 'id' field is used when present).
    RL: the task set sampled from. SFT: the conversations trained on ('messages' field)."""
    max_steps: int = Field(100, ge=1)
    """Trainer steps to produce batches for; the orchestrator stops after the last one."""
    group_size: int = Field(8, ge=1)
    """Rollouts per task (the group that shares an advantage baseline)."""
    groups_per_step: int = Field(4, ge=1)
    """Groups (tasks) whose rollouts make up one trainer step's batch."""
    max_groups_in_flight: int = Field(8, ge=1)
    """Groups dispatched and not yet complete, at most (continuous batching)."""
    max_async_level: int = Field(1, ge=0)
    """Rollouts for step s may use a policy at most this many versions older than s - 1."""
    max_off_policy_steps: int = Field(2, ge=0)
    """Samples whose oldest token is older than this (vs step s - 1) are dropped and counted."""
    advantage: Literal["grpo", "rloo", "sft"] = "grpo"
    """How rewards become advantages: group-mean baseline, leave-one-out baseline, or SFT (1)."""
    normalize_advantage: bool = False
    """GRPO: divide by the group's reward standard deviation."""
    seq_len: int = Field(2048, ge=16)
    """Tokens per micro-batch (samples longer than this are truncated and flagged)."""
    num_ranks: int = Field(1, ge=1)
    """Trainer data-parallel ranks to pack for."""
    sft_samples_per_step: int = Field(32, ge=1)
    """SFT: conversations per trainer step."""
    pad_token_id: int = Field(0, ge=0)
    """Token id written on padding positions."""
    seed: int = 0
    """Task shuffling seed."""
    renderer: str = "auto"
    """SFT: chat renderer -- "auto" (a family port only for a chat template it is proven
    equal to, else the generic renderer), a port name, or "jinja"."""
    renderer_force: bool = False
    """SFT: use the named port even on a template it is not proven equal to (logged loudly)."""
    tokenizer: Path | None = None
    """SFT: tokenizer.json (or model folder) the conversations are rendered with."""
    inference_grpc: list[str] = Field(default_factory=list)
    """RL: host:port of the inference service's control plane (policy version for the
    gate); a list with several replicas: the gate uses the oldest version any replica
    that answers serves. Empty: the gate assumes inference follows the trainer."""
    rollout_timeout_s: float = Field(600.0, gt=0)
    """Wall-clock budget of one rollout, passed to env runners."""
    group_reward_timeout_s: float = Field(120.0, gt=0)
    """How long a complete group waits for an env runner to compute its group rewards
    (environments without group rewards answer at once: nobody serves the request)."""
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    """Sampling settings sent with every rollout request."""
    status_poll_s: float = Field(0.5, gt=0)
    """How often the policy version served by inference is polled."""
    lease_ttl_s: float = Field(10.0, ge=1)
    """One orchestrator per run: the lease it renews in NATS expires this long after its
    holder stops renewing (a crashed orchestrator's restart waits at most this much longer)."""
    vocab_size: int | None = Field(None, ge=1)
    """RL: the policy model's vocabulary size; rollouts with a token id at or above it are
    refused before batching. `treadle stack`/`rl` set it from trainer.model's (else
    inference.model's) config.json. Unset: only negative ids are refused here, and the
    trainer skips a batch whose ids fall outside its vocabulary."""

    @field_validator("inference_grpc", mode="before")
    @classmethod
    def _one_or_more(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _checks(self) -> OrchestratorSection:
        check_name(self.env, "orchestrator.env")
        if self.mode == "rl" and self.group_size < 2 and self.advantage in ("grpo", "rloo"):
            raise ValueError(
                f"advantage {self.advantage!r} needs group_size >= 2 (a baseline from the group)"
            )
        if self.max_groups_in_flight < self.groups_per_step and self.max_async_level > 0:
            raise ValueError("max_groups_in_flight must be >= groups_per_step")
        return self


class OrchestratorConfig(ServiceConfig):
    """Everything the orchestrator service reads: the shared sections and [orchestrator]."""

    orchestrator: OrchestratorSection = Field(default_factory=OrchestratorSection)


SPEC = ServiceSpec(
    name="orchestrator",
    summary="runs the asynchronous RL loop: dispatch, group, score, pack, publish batches",
    config_cls=OrchestratorConfig,
    module="treadle.orchestrator",
    control=orchestrator_service_pb2.DESCRIPTOR.services_by_name["OrchestratorControl"],
    stub=orchestrator_service_pb2_grpc.OrchestratorControlStub,
)
