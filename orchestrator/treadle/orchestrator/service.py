"""The orchestrator service: the RL loop (or SFT feed) plus its control plane.

One orchestrator per run: the work starts only once this process holds the run's
``orchestrator`` lease (NATS key-value, ``treadle.services.lease``); a second one exits
with a clear error, and one that loses its lease stops its work.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from treadle.orchestrator.loop import RLLoop
from treadle.orchestrator.sft import SFTFeed
from treadle.orchestrator.spec import SPEC, OrchestratorSection
from treadle.proto.v1 import common_pb2, orchestrator_service_pb2, orchestrator_service_pb2_grpc
from treadle.services.host import IdleApp, ServiceContext
from treadle.services.lease import Lease


class OrchestratorControl(orchestrator_service_pb2_grpc.OrchestratorControlServicer):
    def __init__(self, ctx: ServiceContext, work: RLLoop | SFTFeed | None):
        self.ctx = ctx
        self.work = work

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> orchestrator_service_pb2.OrchestratorStatus:
        work = self.work.status() if self.work is not None else {}
        return orchestrator_service_pb2.OrchestratorStatus(info=self.ctx.info(), **work)


def control_servicers(control: OrchestratorControl) -> list[tuple[Any, Any, Any]]:
    return [
        (
            orchestrator_service_pb2_grpc.add_OrchestratorControlServicer_to_server,
            control,
            SPEC.control,
        )
    ]


class OrchestratorApp:
    def __init__(self, ctx: ServiceContext, cfg: OrchestratorSection):
        self.ctx = ctx
        self.cfg = cfg
        self.work: RLLoop | SFTFeed = RLLoop(ctx, cfg) if cfg.mode == "rl" else SFTFeed(ctx, cfg)
        self.control = OrchestratorControl(ctx, self.work)

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return control_servicers(self.control)

    async def run(self, stop: asyncio.Event) -> None:
        lease = Lease(
            self.ctx.bus, "orchestrator", self.ctx.instance_id, ttl_s=self.cfg.lease_ttl_s
        )
        self.ctx.message = "waiting for the run's orchestrator lease"
        await lease.acquire()
        done = asyncio.Event()
        keeper = asyncio.create_task(lease.keep(done))
        work = asyncio.create_task(self.work.run(stop))
        try:
            await asyncio.wait({keeper, work}, return_when=asyncio.FIRST_COMPLETED)
            if keeper.done() and not work.done():
                stop.set()  # the lease is lost (keeper raised): end the work at once
                await asyncio.gather(work, return_exceptions=True)
                keeper.result()
            await work
        finally:
            done.set()
            await asyncio.gather(keeper, return_exceptions=True)
            await lease.release()


async def build(ctx: ServiceContext) -> OrchestratorApp | IdleApp:
    cfg: OrchestratorSection = ctx.config.orchestrator
    if cfg.tasks is None:  # e.g. `treadle stack` on embedded defaults
        return IdleApp(
            ctx,
            control_servicers(OrchestratorControl(ctx, None)),
            "orchestrator.tasks is not set: serving the control plane only "
            "(set [orchestrator] tasks to a JSONL task file to run the loop)",
        )
    return OrchestratorApp(ctx, cfg)
