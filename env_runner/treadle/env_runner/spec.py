"""The env_runner service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pydantic import Field

from treadle.proto.v1 import env_runner_service_pb2, env_runner_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50064


class EnvRunnerSection(StrictModel):
    """[env_runner]: settings of the env_runner service."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (EnvRunnerControl + health)."""


class EnvRunnerConfig(ServiceConfig):
    """Everything the env_runner service reads: the shared sections and [env_runner]."""

    env_runner: EnvRunnerSection = Field(default_factory=EnvRunnerSection)


SPEC = ServiceSpec(
    name="env_runner",
    summary="runs environments (task set x harness x runtime) and publishes rollouts",
    config_cls=EnvRunnerConfig,
    module="treadle.env_runner",
    control=env_runner_service_pb2.DESCRIPTOR.services_by_name["EnvRunnerControl"],
    stub=env_runner_service_pb2_grpc.EnvRunnerControlStub,
)
