"""The trainer service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pydantic import Field

from treadle.proto.v1 import trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50062


class TrainerSection(StrictModel):
    """[trainer]: settings of the trainer service."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (TrainerControl + health)."""


class TrainerConfig(ServiceConfig):
    """Everything the trainer service reads: the shared sections and [trainer]."""

    trainer: TrainerSection = Field(default_factory=TrainerSection)


SPEC = ServiceSpec(
    name="trainer",
    summary="optimises the policy with TorchTitan components and publishes weights",
    config_cls=TrainerConfig,
    module="treadle.trainer",
    control=trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerControl"],
    stub=trainer_service_pb2_grpc.TrainerControlStub,
)
