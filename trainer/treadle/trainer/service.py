"""The trainer service: control plane now; training lands with the end-to-end issue."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc

from treadle.proto.v1 import common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.host import IdleApp, ServiceContext
from treadle.trainer.spec import SPEC

log = logging.getLogger(__name__)


class TrainerControl(trainer_service_pb2_grpc.TrainerControlServicer):
    def __init__(self, ctx: ServiceContext, stop: asyncio.Event):
        self.ctx = ctx
        self.stop = stop

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.TrainerStatus:
        return trainer_service_pb2.TrainerStatus(
            info=self.ctx.info(), step=0, policy_version=-1, last_checkpoint_step=-1, world_size=1
        )

    async def Checkpoint(
        self, request: trainer_service_pb2.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.CheckpointResponse:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "training is not implemented yet: nothing to checkpoint"
        )
        raise AssertionError("abort returns by raising")

    async def Stop(
        self, request: trainer_service_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.StopResponse:
        log.info("[shutdown] stop requested over gRPC: %s", request.reason or "(no reason)")
        self.stop.set()
        return trainer_service_pb2.StopResponse(step=0)


class _StoppableIdleApp(IdleApp):
    """IdleApp that also ends when TrainerControl.Stop is called."""

    def __init__(self, ctx: ServiceContext, why: str):
        self.requested_stop = asyncio.Event()
        servicer = TrainerControl(ctx, self.requested_stop)
        super().__init__(
            ctx,
            [
                (
                    trainer_service_pb2_grpc.add_TrainerControlServicer_to_server,
                    servicer,
                    SPEC.control,
                )
            ],
            why,
        )

    async def run(self, stop: asyncio.Event) -> None:
        waiter = asyncio.create_task(super().run(stop))
        requested = asyncio.create_task(self.requested_stop.wait())
        await asyncio.wait({waiter, requested}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        requested.cancel()


async def build(ctx: ServiceContext) -> Any:
    return _StoppableIdleApp(
        ctx,
        "training is not implemented yet (it lands with the end-to-end async RL issue); "
        "serving the control plane only",
    )
