"""The inference service's config class and spec (light: no heavy imports here)."""

from __future__ import annotations

from pydantic import Field

from treadle.proto.v1 import inference_service_pb2, inference_service_pb2_grpc
from treadle.services.registry import ServiceSpec
from treadle.services.sections import GrpcSection, ServiceConfig, StrictModel

DEFAULT_GRPC_PORT = 50061


class InferenceSection(StrictModel):
    """[inference]: settings of the inference service."""

    grpc: GrpcSection = Field(default_factory=lambda: GrpcSection(port=DEFAULT_GRPC_PORT))
    """Control-plane endpoint (InferenceAdmin + health)."""


class InferenceConfig(ServiceConfig):
    """Everything the inference service reads: the shared sections and [inference]."""

    inference: InferenceSection = Field(default_factory=InferenceSection)


SPEC = ServiceSpec(
    name="inference",
    summary="serves the policy with vLLM and hot-swaps its weights",
    config_cls=InferenceConfig,
    module="treadle.inference",
    control=inference_service_pb2.DESCRIPTOR.services_by_name["InferenceAdmin"],
    stub=inference_service_pb2_grpc.InferenceAdminStub,
)
