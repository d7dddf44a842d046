"""The orchestrator service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pydantic import Field

from treadle.proto.v1 import orchestrator_service_pb2, orchestrator_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50063


class OrchestratorSection(StrictModel):
    """[orchestrator]: settings of the orchestrator service."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (OrchestratorControl + health)."""


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
