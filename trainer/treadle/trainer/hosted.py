"""One trainer process serving several runs on one shared base model (hosted training).

    this process's config: [trainer] = the base (model, dtype, LoRA shape),
                           [trainer.hosted] runs = run files, weights (accept_runs: more
                           runs at runtime)
        ─▶ SharedBase (the frozen base, built once)
        ─▶ for each run file (its own [run], [nats], [object_store], [trainer]):
             read it (the files only: this process's env vars and flags are the host's)
             ─▶ check its [trainer] fits the base (tenancy.py) ─▶ its object store
             ─▶ its bus: its own NATS user, so it reaches only treadle.<run>.…
             ─▶ RunTrainer on the base ─▶ resume from the run's newest checkpoint
             ─▶ TrainerApp: the single-run loop of service.py, unchanged
        ─▶ every TrainerApp runs at once; steps take turns on the model (FairShare)
    gRPC HostedRuns (accept_runs; the platform, with the control token):
        AddRun(run file, quota) ─▶ read, checked and started like a run of ``runs``
                                ─▶ its TrainerApp runs beside the others
        RemoveRun(run)          ─▶ it finishes its step and checkpoints (as Stop)
                                ─▶ its adapter, optimizer state and turn freed
        the other runs train throughout; the base is never rebuilt

A run that fails (its store or bus unreachable, a fatal step) stops alone with its error
logged and reported by GetStatus; the other runs go on. Without accept_runs the process
ends when every run has ended (or on SIGTERM: each run finishes its step and
checkpoints), with exit code 1 naming the failed runs if any failed. With accept_runs it
runs until it is stopped (SIGTERM, or Stop without a run); a run that ended by itself
(max_steps, or failed) stays listed, its GetStatus saying how it ended, until RemoveRun.
TrainerControl names the run in each request (``run``); GetStatus without one describes
the host.

AddRun refuses, leaving nothing of the run behind (bus closed, adapter freed): a file
that cannot be read or validated, or that does not fit the base (INVALID_ARGUMENT naming
the file and the setting), a run already hosted (ALREADY_EXISTS), a trainer not
accepting runs (FAILED_PRECONDITION) or stopping (UNAVAILABLE).

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

from treadle.proto.v1 import (
    common_pb2,
    platform_service_pb2,
    platform_service_pb2_grpc,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.config import ConfigSources, gather, validate
from treadle.services.errors import ConfigError, TreadleError
from treadle.services.host import ServiceContext, run_streams
from treadle.services.objectstore import open_store
from treadle.services.registry import known_sections
from treadle.trainer.service import TrainerApp, TrainerControl
from treadle.trainer.spec import SPEC, HostedSection, TrainerConfig

log = logging.getLogger(__name__)

HOSTED_RUNS = platform_service_pb2.DESCRIPTOR.services_by_name["HostedRuns"]
State = common_pb2.ServiceState


class RunExistsError(TreadleError):
    """AddRun of a run this trainer hosts already (ALREADY_EXISTS)."""


class StoppingError(TreadleError):
    """AddRun while the trainer is stopping (UNAVAILABLE)."""


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def load_run_config(path: Path) -> TrainerConfig:
    """A hosted run's config from its file alone (ConfigError naming the file)."""
    raw = gather(ConfigSources(files=[path]), environ={})
    cfg = validate(TrainerConfig, raw, known_sections())
    hosted = cfg.trainer.hosted
    if hosted.enabled:
        which = "runs" if hosted.runs else "accept_runs"
        raise ConfigError(f"{path}: trainer.hosted.{which} is set in a hosted run's own file")
    if cfg.trainer.model is None:
        raise ConfigError(f"{path}: trainer.model is not set (name the shared base model)")
    return cfg


@dataclass
class HostedRun:
    """One run on the shared base, and how it ended."""

    name: str
    app: TrainerApp
    path: Path  # its run file
    error: str = ""  # why it stopped, when it failed
    done: bool = False
    task: asyncio.Task[None] | None = None  # its work loop (_run_one), once started
    removal: asyncio.Task[int] | None = None  # RemoveRun's work, shared by repeated calls


@dataclass
class HostedApp:
    """Servicers and work loop of a trainer hosting several runs."""

    ctx: ServiceContext
    base: Any  # tenancy.SharedBase
    runs: dict[str, HostedRun] = field(default_factory=dict)
    _stop: asyncio.Event | None = None  # run()'s, once it runs
    _adding: set[str] = field(default_factory=set)  # names AddRun is starting
    _executor: ThreadPoolExecutor | None = None  # the loop's default executor, once sized
    _workers: int = 0  # its worker threads at most

    @property
    def section(self) -> HostedSection:
        hosted: HostedSection = self.ctx.config.trainer.hosted
        return hosted

    @property
    def accept_runs(self) -> bool:
        return self.section.accept_runs

    @property
    def stopping(self) -> bool:
        return self._stop is not None and self._stop.is_set()

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return [
            (
                trainer_service_pb2_grpc.add_TrainerControlServicer_to_server,
                HostedControl(self),
                SPEC.control,
            ),
            (
                platform_service_pb2_grpc.add_HostedRunsServicer_to_server,
                HostedRuns(self),
                HOSTED_RUNS,
            ),
        ]

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        tasks = [self._launch(r) for r in self.runs.values()]
        if not self.accept_runs:
            self.ctx.message = f"training {len(self.runs)} runs on one base"
            await asyncio.gather(*tasks)
            failed = {r.name: r.error for r in self.runs.values() if r.error}
            if failed:  # after every other run has ended: a failure is never silent
                raise TreadleError(f"hosted runs failed: {failed}")
            return
        self.ctx.message = f"training {len(self.runs)} runs on one base; accepting runs"
        await stop.wait()
        # each run sees ``stop`` too: it finishes its step and checkpoints; a run that
        # AddRun or RemoveRun is handling meanwhile is waited for as well
        while pending := [
            t for r in list(self.runs.values()) for t in (r.task, r.removal) if t and not t.done()
        ]:
            await asyncio.wait(pending)
        failed = {r.name: r.error for r in self.runs.values() if r.error}
        if failed:  # reported by GetStatus all along; the trainer itself did not fail
            log.warning("[shutdown] runs that had failed and were not removed: %s", failed)

    def _launch(self, run: HostedRun) -> asyncio.Task[None]:
        if run.task is None:
            run.task = asyncio.create_task(self._run_one(run, self._stop or asyncio.Event()))
        return run.task

    async def _run_one(self, run: HostedRun, stop: asyncio.Event) -> None:
        run.app.ctx.state = State.SERVICE_STATE_READY
        try:
            await run.app.run(stop)
        except Exception as e:  # service boundary: one run's failure stops that run only
            run.error = f"{type(e).__name__}: {e}"
            log.error("run %s stopped: %s (the other runs go on)", run.name, run.error)
        finally:
            run.done = True
            run.app.ctx.message = run.error or "stopped"
            run.app.ctx.state = (
                State.SERVICE_STATE_FAILED if run.error else State.SERVICE_STATE_STOPPED
            )
            await run.app.ctx.bus.close()
            log.info("[shutdown] run %s: trained through step %d", run.name, run.app.step)

    def _size_executor(self, num_runs: int) -> None:
        """Worker threads (the loop's default executor) for ``num_runs``: one per run
        waiting for its turn, plus fetches and checkpoints. Grown, doubling, when runs are
        added (the former executor finishes what it was given, then its threads exit)."""
        wanted = 4 * num_runs + 4
        if wanted <= self._workers:
            return
        old = self._executor
        self._workers = max(wanted, 2 * self._workers)
        self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="hosted")
        asyncio.get_running_loop().set_default_executor(self._executor)
        if old is not None:
            old.shutdown(wait=False)

    def request_stop(self) -> None:
        """Stop the trainer (accept_runs): every run finishes its step and checkpoints."""
        if self._stop is not None:
            self._stop.set()

    async def add_run(self, path: Path, limits: dict[str, float] | None) -> HostedRun:
        """Start hosting the run of ``path`` beside the others (``limits``: its quota;
        None: trainer.hosted.quotas). TreadleError naming the file when it does not fit or
        does not start; nothing of it is left then."""
        if self.stopping:
            raise StoppingError("the trainer is stopping: it accepts no more runs")
        cfg = await asyncio.to_thread(load_run_config, path)
        name = cfg.run.name
        if name in self.runs or name in self._adding:
            where = self.runs[name].path if name in self.runs else "(being added)"
            raise RunExistsError(
                f"run {name!r} of {path} is hosted already, from {where}: remove it first "
                "(RemoveRun), or give the run another run.name"
            )
        self.base.check_fits(name, cfg.trainer)
        self._adding.add(name)
        try:
            self._size_executor(len(self.runs) + len(self._adding))
            app = await _start_run(self.ctx, self.base, cfg, self.section, path, limits)
        finally:
            self._adding.discard(name)
        run = HostedRun(name, app, path)
        if self.stopping:  # stopped while it started: it never runs
            await app.ctx.bus.close()
            await asyncio.to_thread(self.base.remove_run, name)
            raise StoppingError(f"the trainer stopped while run {name!r} was starting")
        self.runs[name] = run
        if self._stop is not None:  # else run() starts it
            self._launch(run)
        log.info("[startup] run %s added (%s) at step %d: hosting %s", name, path, app.step,
                 ", ".join(self.runs))  # fmt: skip
        return run

    async def remove_run(self, name: str, reason: str) -> int | None:
        """Stop hosting run ``name``: its step finishes, it checkpoints, its adapter and
        optimizer state are freed. Its last step; None when it is not hosted."""
        run = self.runs.get(name)
        if run is None:
            return None
        if run.removal is None:
            run.removal = asyncio.create_task(self._remove(run, reason))
        # a caller that gives up (deadline) does not cut the removal short
        return await asyncio.shield(run.removal)

    async def _remove(self, run: HostedRun, reason: str) -> int:
        log.info("[shutdown] run %s: removing it (%s)", run.name, reason or "no reason given")
        run.app.stop_requested.set()  # as TrainerControl.Stop: finish the step, checkpoint
        run.app.wake.set()
        await self._launch(run)  # one never started stops at once, closing its bus
        await asyncio.to_thread(self.base.remove_run, run.name)
        del self.runs[run.name]
        log.info("[shutdown] run %s removed at step %d: hosting %s", run.name, run.app.step,
                 ", ".join(self.runs) or "no runs")  # fmt: skip
        return int(run.app.step)

    def status(self) -> trainer_service_pb2.TrainerStatus:
        share = self.base.share
        parts = [
            f"{r.name}: step {r.app.step}, {share.used_s.get(r.name, 0.0):.1f}s"
            + (f", failed ({r.error})" if r.error else ", stopped" if r.done else "")
            for r in self.runs.values()
        ]
        bank = self.base.bank
        adapters = f"{len(bank)} adapters ({bank.nbytes() >> 10} KiB) on the base"
        self.ctx.message = "; ".join([adapters, *parts])
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
        if self.app.accept_runs:  # the trainer itself stops (else: when its runs have)
            self.app.request_stop()
        return trainer_service_pb2.StopResponse()


class HostedRuns(platform_service_pb2_grpc.HostedRunsServicer):
    """Runs added and removed at runtime (the platform's calls; the other runs untouched)."""

    def __init__(self, app: HostedApp):
        self.app = app

    async def AddRun(
        self, request: platform_service_pb2.AddRunRequest, context: grpc.aio.ServicerContext
    ) -> platform_service_pb2.AddRunResponse:
        if not self.app.accept_runs:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this trainer hosts the runs of trainer.hosted.runs only: set "
                "trainer.hosted.accept_runs = true to add runs at runtime",
            )
        if not request.run_file:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "AddRunRequest.run_file is empty: give the path of the run's TOML file",
            )
        path = Path(request.run_file)
        q = request.quota  # sampled_tokens is inference's
        given = {"trainer_s": q.trainer_s, "trained_tokens": float(q.trained_tokens)}
        limits = {k: v for k, v in given.items() if v > 0} or None
        try:
            run = await self.app.add_run(path, limits)
        except RunExistsError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
            raise AssertionError("abort returns by raising") from None
        except StoppingError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            raise AssertionError("abort returns by raising") from None
        except TreadleError as e:
            text = str(e) if str(path) in str(e) else f"run file {path}: {e}"
            log.warning("AddRun refused: %s", text)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, text)
            raise AssertionError("abort returns by raising") from None
        except Exception as e:  # service boundary: a bug, named, the other runs untouched
            log.exception("AddRun of %s failed", path)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"run file {path}: {type(e).__name__}: {e}"
            )
            raise AssertionError("abort returns by raising") from None
        return platform_service_pb2.AddRunResponse(run=run.name, step=run.app.step)

    async def RemoveRun(
        self, request: platform_service_pb2.RemoveRunRequest, context: grpc.aio.ServicerContext
    ) -> platform_service_pb2.RemoveRunResponse:
        step = await self.app.remove_run(request.run, request.reason)
        if step is None:
            return platform_service_pb2.RemoveRunResponse(was_hosted=False)
        return platform_service_pb2.RemoveRunResponse(step=step, was_hosted=True)


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
        if unknown and not section.hosted.accept_runs:  # else: runs added later
            raise ConfigError(f"trainer.hosted.{table} names runs {unknown} that no run file is")
    base = await asyncio.to_thread(SharedBase, section)
    for name, (_, cfg) in configs.items():
        base.check_fits(name, cfg.trainer)  # every run is checked before any one starts
    app = HostedApp(ctx, base)
    app._size_executor(len(configs))
    try:
        for name, (path, cfg) in configs.items():
            trainer_app = await _start_run(ctx, base, cfg, section.hosted, path, None)
            app.runs[name] = HostedRun(name, trainer_app, path)
    except BaseException:
        for run in app.runs.values():
            await run.app.ctx.bus.close()
        raise
    log.info(
        "[startup] hosting runs %s on one base (%s)%s", ", ".join(configs) or "(none yet)",
        section.model, "; accepting runs (HostedRuns)" if section.hosted.accept_runs else "",
    )  # fmt: skip
    return app


async def _start_run(
    host: ServiceContext,
    base: Any,
    cfg: TrainerConfig,
    section: HostedSection,
    path: Path,
    limits: dict[str, float] | None,
) -> TrainerApp:
    """The run's store, bus, trainer on ``base`` and resume; nothing of it is left when
    this raises. ``limits``: its quota (None: from trainer.hosted.quotas)."""
    from treadle.trainer.tenancy import Quota

    name = cfg.run.name
    store = await asyncio.to_thread(open_store, cfg.object_store, name, cfg.run.run_dir)
    instance_id = f"{host.instance_id}-{name}"
    bus = await Bus.connect(cfg.nats, name, store=store, name=instance_id, role=SPEC.name)
    added = False
    try:
        await run_streams(bus, cfg.nats.manage_streams)
        checkpoint_dir = cfg.trainer.checkpoint_dir or cfg.run.run_dir / "trainer" / "checkpoints"
        quota = None
        if limits is None and name in section.quotas:
            limits = {str(k): v for k, v in section.quotas[name].items()}
        if limits:  # what the run used before: its usage ledger
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
            weight=section.weights.get(name, 1.0),
            quota=quota,
        )
        added = True
        await asyncio.to_thread(trainer.resume)
    except BaseException:
        await bus.close()
        if added:
            await asyncio.to_thread(base.remove_run, name)
        raise
    log.info("[startup] run %s (%s) from step %d", name, path, trainer.step)
    return TrainerApp(ServiceContext(SPEC, cfg, instance_id, bus, store), trainer)
