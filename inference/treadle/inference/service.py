"""The inference service: control plane now; vLLM serving lands with the end-to-end issue."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from treadle.inference.spec import SPEC
from treadle.proto.v1 import common_pb2, inference_service_pb2, inference_service_pb2_grpc
from treadle.services.host import IdleApp, ServiceContext

NOT_YET = "vLLM serving and weight updates are not implemented yet (end-to-end async RL issue)"


class InferenceAdmin(inference_service_pb2_grpc.InferenceAdminServicer):
    def __init__(self, ctx: ServiceContext):
        self.ctx = ctx

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.InferenceStatus:
        return inference_service_pb2.InferenceStatus(info=self.ctx.info(), policy_version=-1)

    async def _unimplemented(self, context: grpc.aio.ServicerContext) -> NoReturn:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET)
        raise AssertionError("abort returns by raising")

    async def UpdateWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._unimplemented(context)

    async def Pause(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._unimplemented(context)

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._unimplemented(context)


async def build(ctx: ServiceContext) -> Any:
    servicer = InferenceAdmin(ctx)
    return IdleApp(
        ctx,
        [(inference_service_pb2_grpc.add_InferenceAdminServicer_to_server, servicer, SPEC.control)],
        NOT_YET + "; serving the control plane only",
    )
