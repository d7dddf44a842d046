"""One trainer process serving several runs on one shared base model (hosted training).

    this process's config: [trainer] = the base (model, dtype, LoRA shape),
                           [trainer.hosted] runs = run files, weights
        ─▶ SharedBase (the frozen base, built once)
        ─▶ for each run file (its own [run], [nats], [object_store], [trainer]):
             read it (the files only: this process's env vars and flags are the host's)
             ─▶ check its [trainer] fits the base (tenancy.py) ─▶ its object store
             ─▶ its bus: its own NATS user, so it reaches only treadle.<run>.…
             ─▶ RunTrainer on the base ─▶ resume from the run's newest checkpoint
             ─▶ TrainerApp: the single-run loop of service.py, unchanged
        ─▶ every TrainerApp runs at once; steps take turns on the model (FairShare)

A run that fails (its store or bus unreachable, a fatal step) stops alone with its error
logged and reported by GetStatus; the other runs go on. The process ends when every run
has ended (or on SIGTERM: each run finishes its step and checkpoints), with exit code 1
naming the failed runs if any failed. TrainerControl
names the run in each request (``run``); GetStatus without one describes the host.

Not here: the shared base and the scheduling (``tenancy.py``), the per-run loop
(``service.py``).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from treadle.proto.v1 import common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.config import ConfigSources, gather, validate
from treadle.services.errors import ConfigError, TreadleError
from treadle.services.host import ServiceContext, run_streams
from treadle.services.objectstore import open_store
from treadle.services.registry import known_sections
from treadle.trainer.service import TrainerApp, TrainerControl
from treadle.trainer.spec import SPEC, TrainerConfig

log = logging.getLogger(__name__)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def load_run_config(path: Path) -> TrainerConfig:
    """A hosted run's config from its file alone (ConfigError naming the file)."""
    raw = gather(ConfigSources(files=[path]), environ={})
    cfg = validate(TrainerConfig, raw, known_sections())
    if cfg.trainer.hosted.runs:
        raise ConfigError(f"{path}: trainer.hosted.runs is set in a hosted run's own file")
    if cfg.trainer.model is None:
        raise ConfigError(f"{path}: trainer.model is not set (name the shared base model)")
    return cfg


@dataclass
class HostedRun:
    """One run on the shared base, and how it ended."""

    name: str
    app: TrainerApp
    error: str = ""  # why it stopped, when it failed
    done: bool = False


@dataclass
class HostedApp:
    """Servicers and work loop of a trainer hosting several runs."""

    ctx: ServiceContext
    base: Any  # tenancy.SharedBase
    runs: dict[str, HostedRun] = field(default_factory=dict)

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return [
            (
                trainer_service_pb2_grpc.add_TrainerControlServicer_to_server,
                HostedControl(self),
                SPEC.control,
            )
        ]

    async def run(self, stop: asyncio.Event) -> None:
        self.ctx.message = f"training {len(self.runs)} runs on one base"
        await asyncio.gather(*(self._run_one(r, stop) for r in self.runs.values()))
        failed = {r.name: r.error for r in self.runs.values() if r.error}
        if failed:  # after every other run has ended: a failure is never silent
            raise TreadleError(f"hosted runs failed: {failed}")

    async def _run_one(self, run: HostedRun, stop: asyncio.Event) -> None:
        try:
            await run.app.run(stop)
        except Exception as e:  # service boundary: one run's failure stops that run only
            run.error = f"{type(e).__name__}: {e}"
            log.error("run %s stopped: %s (the other runs go on)", run.name, run.error)
        finally:
            run.done = True
            run.app.ctx.message = run.error or "stopped"
            await run.app.ctx.bus.close()
            log.info("[shutdown] run %s: trained through step %d", run.name, run.app.step)

    def status(self) -> trainer_service_pb2.TrainerStatus:
        share = self.base.share
        parts = [
            f"{r.name}: step {r.app.step}, {share.used_s.get(r.name, 0.0):.1f}s"
            + (f", failed ({r.error})" if r.error else ", stopped" if r.done else "")
            for r in self.runs.values()
        ]
        self.ctx.message = "; ".join(parts)
        return trainer_service_pb2.TrainerStatus(info=self.ctx.info(), last_checkpoint_step=-1)


class HostedControl(trainer_service_pb2_grpc.TrainerControlServicer):
    """TrainerControl of each hosted run, chosen by the request's ``run``."""

    def __init__(self, app: HostedApp):
        self.app = app

    async def _of(self, run: str, context: grpc.aio.ServicerContext) -> TrainerControl:
        found = self.app.runs.get(run)
        if found is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this trainer hosts runs {sorted(self.app.runs)}, not {run!r}",
            )
            raise AssertionError("abort returns by raising")
        return TrainerControl(found.app)

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.TrainerStatus:
        if not request.run:
            return self.app.status()
        return await (await self._of(request.run, context)).GetStatus(request, context)

    async def Checkpoint(
        self, request: trainer_service_pb2.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.CheckpointResponse:
        if not request.run:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"name the run to checkpoint (CheckpointRequest.run): {sorted(self.app.runs)}",
            )
        return await (await self._of(request.run, context)).Checkpoint(request, context)

    async def Stop(
        self, request: trainer_service_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.StopResponse:
        if request.run:
            return await (await self._of(request.run, context)).Stop(request, context)
        for run in self.app.runs.values():
            await TrainerControl(run.app).Stop(request, context)
        return trainer_service_pb2.StopResponse()


async def build_hosted(ctx: ServiceContext) -> HostedApp:
    """The shared base, then each run: its config, store, bus, trainer and resume."""
    from treadle.trainer.tenancy import SharedBase

    section = ctx.config.trainer
    configs: dict[str, tuple[Path, TrainerConfig]] = {}
    for path in section.hosted.runs:
        cfg = load_run_config(path)
        name = cfg.run.name
        if name in configs:
            raise ConfigError(
                f"{path} and {configs[name][0]} are both run {name!r}: runs need their own names"
            )
        configs[name] = (path, cfg)
    for table in ("weights", "quotas"):
        unknown = sorted(set(getattr(section.hosted, table)) - set(configs))
        if unknown:
            raise ConfigError(f"trainer.hosted.{table} names runs {unknown} that no run file is")
    base = await asyncio.to_thread(SharedBase, section)
    for name, (_, cfg) in configs.items():
        base.check_fits(name, cfg.trainer)  # every run is checked before any one starts
    # one worker thread per run waiting for its turn, plus fetches and checkpoints
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=4 * len(configs) + 4, thread_name_prefix="hosted")
    )
    app = HostedApp(ctx, base)
    try:
        for name, (path, cfg) in configs.items():
            app.runs[name] = HostedRun(name, await _start_run(ctx, base, cfg, section, path))
    except BaseException:
        for run in app.runs.values():
            await run.app.ctx.bus.close()
        raise
    log.info("[startup] hosting runs %s on one base (%s)", ", ".join(configs), section.model)
    return app


async def _start_run(
    host: ServiceContext, base: Any, cfg: TrainerConfig, section: Any, path: Path
) -> TrainerApp:
    name = cfg.run.name
    store = await asyncio.to_thread(open_store, cfg.object_store, name, cfg.run.run_dir)
    instance_id = f"{host.instance_id}-{name}"
    bus = await Bus.connect(cfg.nats, name, store=store, name=instance_id, role=SPEC.name)
    try:
        await run_streams(bus, cfg.nats.manage_streams)
        checkpoint_dir = cfg.trainer.checkpoint_dir or cfg.run.run_dir / "trainer" / "checkpoints"
        from treadle.trainer.tenancy import Quota

        quota = None
        if name in section.hosted.quotas:  # what the run used before: its usage ledger
            limits = section.hosted.quotas[name]
            ledger = await usage.read_usage(bus)
            quota = Quota(limits.get("trainer_s"), _int(limits.get("trained_tokens")),
                          ledger.trainer_s, int(ledger.total("trained_tokens")))  # fmt: skip
            log.info("[startup] run %s: quota %s, used before %.1f trainer s, %d tokens",
                     name, limits, quota.prior_trainer_s, quota.prior_trained_tokens)  # fmt: skip
        trainer = await asyncio.to_thread(
            base.add_run,
            name,
            cfg.trainer,
            store,
            checkpoint_dir=checkpoint_dir,
            weight=section.hosted.weights.get(name, 1.0),
            quota=quota,
        )
        await asyncio.to_thread(trainer.resume)
    except BaseException:
        await bus.close()
        raise
    log.info("[startup] run %s (%s) from step %d", name, path, trainer.step)
    return TrainerApp(ServiceContext(SPEC, cfg, instance_id, bus, store), trainer)
