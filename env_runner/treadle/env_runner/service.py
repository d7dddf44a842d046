"""The env runner service: control plane now; the rollout loop lands with the environments issue."""

from __future__ import annotations

from typing import Any

import grpc

from treadle.env_runner.spec import SPEC
from treadle.proto.v1 import common_pb2, env_runner_service_pb2, env_runner_service_pb2_grpc
from treadle.services.host import IdleApp, ServiceContext


class EnvRunnerControl(env_runner_service_pb2_grpc.EnvRunnerControlServicer):
    def __init__(self, ctx: ServiceContext):
        self.ctx = ctx

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> env_runner_service_pb2.EnvRunnerStatus:
        return env_runner_service_pb2.EnvRunnerStatus(info=self.ctx.info())


async def build(ctx: ServiceContext) -> Any:
    servicer = EnvRunnerControl(ctx)
    return IdleApp(
        ctx,
        [
            (
                env_runner_service_pb2_grpc.add_EnvRunnerControlServicer_to_server,
                servicer,
                SPEC.control,
            )
        ],
        "rollout execution is not implemented yet (it lands with the environments issue); "
        "serving the control plane only",
    )
