"""The orchestrator service: control plane now; the RL loop lands with the end-to-end issue."""

from __future__ import annotations

from typing import Any

import grpc

from treadle.orchestrator.spec import SPEC
from treadle.proto.v1 import common_pb2, orchestrator_service_pb2, orchestrator_service_pb2_grpc
from treadle.services.host import IdleApp, ServiceContext


class OrchestratorControl(orchestrator_service_pb2_grpc.OrchestratorControlServicer):
    def __init__(self, ctx: ServiceContext):
        self.ctx = ctx

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_service_pb2.OrchestratorStatus:
        return orchestrator_service_pb2.OrchestratorStatus(info=self.ctx.info())


async def build(ctx: ServiceContext) -> Any:
    servicer = OrchestratorControl(ctx)
    return IdleApp(
        ctx,
        [
            (
                orchestrator_service_pb2_grpc.add_OrchestratorControlServicer_to_server,
                servicer,
                SPEC.control,
            )
        ],
        "the RL loop is not implemented yet (it lands with the end-to-end async RL issue); "
        "serving the control plane only",
    )
