"""One inference deployment serving several runs' LoRA adapters on one base (hosted serving).

    this process's config: [inference] = the base and the engine (model, [inference.lora]),
                           [inference.hosted] runs = run files (accept_runs: more at runtime)
        ─▶ read every run file (the files only: this process's env vars and flags are the
           host's) ─▶ check each fits (below); any misfit: nothing starts
        ─▶ vLLM on the base, once: version 0 of every run
        ─▶ for each run (host()): its object store ─▶ its bus, as its own NATS user (it
           reaches only treadle.<run>.…) ─▶ its key registered at the gate (the sha256
           only) ─▶ catch up to its newest PolicyPublished
        ─▶ open the gate
    run():   per run: POLICY consumer ──PolicyPublished(N)──▶ RunAdapters.update(N) ─▶ ack
             watchdog: vLLM died unasked ─▶ the service fails with vLLM's last log lines
    gRPC HostedRuns (accept_runs; the platform, with the control token):
             AddRun(run file) ─▶ checked like a run of ``runs`` ─▶ host() ─▶ its POLICY consumer
             RemoveRun(run)   ─▶ its key refused at the gate ─▶ its POLICY consumer stopped
                              ─▶ its bus closed ─▶ its adapters unloaded once no request
                                 runs on them
             the other runs are served throughout; vLLM is not restarted

A client of run R names R as its model and sends R's key (``Authorization: Bearer``,
``env_runner.inference_model``/``inference_key_file``); the gate binds each request to the
adapter serving R at admission and refuses every other model, adapter or key (gate.py).
The answer names the adapter, ``R-v<N>``: each of its tokens has version N
(``inference_client``). No engine-wide weight version changes here: vLLM labels every token
"0", which is true only of requests served by the base (a run before its first adapter).

An update of one run (``RunAdapters``) does not stop the others: the adapter is checked
against the base, loaded beside the served ones, verified by its probe (a request that runs
alone on CPU, where vLLM 0.32's LoRA path needs it: gate.py) and then becomes the run's
route. The replaced adapter is unloaded once no request runs on it any more (the gate
counts them), at the latest at the run's next update. A run whose update fails keeps its
served version; a run whose bus fails stops following its POLICY stream alone, and its
clients keep being served its last version.

Quotas (``inference.hosted.quotas``, or AddRun's): the sampled tokens a run may have,
counting what its usage ledger billed before this process; the gate counts each answer's
tokens and answers 429 naming the run once it is at its quota (gate.py).

More runs than ``inference.lora.max_loras`` are served, with a warning: vLLM 0.32 runs at
most max_loras adapters in one batch and keeps as many loaded (``max_cpu_loras``), so the
other runs' requests wait for a later batch and their adapters are reloaded from disk.

Refused at start, and by AddRun, naming the run file and the setting: a run without a key
file or with an empty one, two runs with one key or one name, a run named like the served
model, a run whose file names another base model, hosting without ``[inference.lora]
enabled``. AddRun leaves nothing of a run it refuses or fails to start (bus closed, key
unregistered, adapter unloaded).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from treadle.inference.engine import VllmEngine, detect_device
from treadle.inference.errors import (
    EngineError,
    InferenceError,
    NotServingError,
    StaleVersionError,
)
from treadle.inference.probe import LORA_FORMAT
from treadle.inference.service import (
    _PERMANENT,
    POLICY_STREAM,
    admin_servicers,
    catch_up,
    consumer_name,
    grpc_code,
    skip_if_superseded,
)
from treadle.inference.spec import SPEC, InferenceConfig, InferenceSection
from treadle.inference.updater import Served, WeightUpdater, start_engine
from treadle.proto.v1 import (
    common_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    platform_service_pb2,
    platform_service_pb2_grpc,
    policy_pb2,
)
from treadle.services import usage
from treadle.services.bus import Bus, Delivery
from treadle.services.config import ConfigSources, gather, validate
from treadle.services.errors import (
    BusRefusedError,
    BusUnavailableError,
    ConfigError,
    DropMessage,
    ObjectNotFoundError,
    StoreUnreachableError,
    TreadleError,
)
from treadle.services.host import ServiceContext
from treadle.services.objectstore import ObjectStore, open_store
from treadle.services.registry import known_sections

log = logging.getLogger(__name__)

HOSTED_RUNS = platform_service_pb2.DESCRIPTOR.services_by_name["HostedRuns"]


class AlreadyHostedError(InferenceError):
    """AddRun of a run this deployment hosts already (gRPC ALREADY_EXISTS)."""


def load_run_config(path: Path, host: InferenceSection) -> tuple[InferenceConfig, str]:
    """A hosted run's config from its file alone, and its key (ConfigError naming the file)."""
    raw = gather(ConfigSources(files=[path]), environ={})
    cfg = validate(InferenceConfig, raw, known_sections())
    hosted = cfg.inference.hosted
    if hosted.runs or hosted.accept_runs:
        which = "runs" if hosted.runs else "accept_runs"
        raise ConfigError(f"{path}: inference.hosted.{which} is set in a hosted run's own file")
    if cfg.inference.model is not None and cfg.inference.model != host.model:
        raise ConfigError(
            f"{path}: inference.model is {cfg.inference.model}, but this deployment serves "
            f"{host.model}: a hosted run's adapters must be trained on the served base"
        )
    if cfg.run.name == host.served_model_name:
        raise ConfigError(
            f"{path}: run {cfg.run.name!r} is named like the served model "
            f"(inference.served_model_name): rename the run"
        )
    if hosted.key_file is None:
        raise ConfigError(
            f"{path}: inference.hosted.key_file is not set: a hosted run's clients need a key"
        )
    try:
        key = hosted.key_file.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"{path}: inference.hosted.key_file: {e.strerror or e}") from None
    if len(key) < 16:
        raise ConfigError(
            f"{path}: inference.hosted.key_file {hosted.key_file} holds "
            f"{'no key' if not key else 'a key shorter than 16 characters'}"
        )
    return cfg, key


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class RunAdapters(WeightUpdater):
    """One hosted run's adapter versions on the shared engine (module doc)."""

    def __init__(
        self,
        run: str,
        cfg: InferenceSection,
        engine: VllmEngine,
        store: ObjectStore,
        weights_dir: Path,
        report: Any = None,
    ):
        super().__init__(cfg, engine, store, weights_dir, report=report, adapter_prefix=run)
        self.run = run
        self.log_label = f"run {run}: "
        self.retired: dict[str, Path | None] = {}  # replaced adapters still loaded
        self.closed = False  # the run is removed: no update any more

    async def _swap_adapter(self, published: Any, folder: Path, timings: dict[str, float]) -> None:
        if self.closed:  # an update that waited for the removal
            raise NotServingError(f"run {self.run} is no longer hosted here")
        version, old = published.policy_version, self.served
        name = await self._load_adapter(published, folder, timings)
        try:
            await self._verify_adapter(published, name, timings)
            await self.engine.set_route(self.run, name)
        except BaseException:
            await self._forget(name)
            raise
        self.served = Served(version, old.weights, published.probe, name, folder)
        if old.adapter is not None:
            self.retired[old.adapter] = old.adapter_dir
        await self.unload_retired()

    async def unload_retired(self) -> None:
        """Unload the replaced adapters no request runs on any more (module doc)."""
        if not self.retired:
            return
        busy = (await self.engine.gate()).adapter_in_flight
        for name, folder in list(self.retired.items()):
            if busy.get(name):
                continue
            await self._forget(name)
            del self.retired[name]
            if folder is not None and folder.parent == self.weights_dir:
                shutil.rmtree(folder, ignore_errors=True)

    async def close(self) -> None:
        """No update from now on; an update under way ends first."""
        async with self._lock:
            self.closed = True

    async def unload_all(self, warn_after_s: float) -> None:
        """After close(): unload the served and the replaced adapters, each once no request
        runs on it (a request still running after ``warn_after_s`` is logged once: an
        adapter is never unloaded, nor its folder deleted, under a running request)."""
        assert self.closed
        if self.served.adapter is not None:
            self.retired[self.served.adapter] = self.served.adapter_dir
        names, warn_at = sorted(self.retired), time.monotonic() + warn_after_s
        while True:
            try:
                await self.unload_retired()
            except EngineError as e:
                log.warning("%scould not unload adapters %s: %s", self.log_label,
                            sorted(self.retired), e)  # fmt: skip
                return
            if not self.retired:
                break
            if warn_at and time.monotonic() > warn_at:
                warn_at = 0.0
                log.warning("%srequests still run on adapters %s after %.0fs (inference."
                            "drain_timeout_s): they are unloaded once those end", self.log_label,
                            sorted(self.retired), warn_after_s)  # fmt: skip
            await asyncio.sleep(0.5)
        if names:
            log.info("%sunloaded adapters %s", self.log_label, ", ".join(names))
        try:
            self.weights_dir.rmdir()
        except OSError:
            pass  # not empty: not ours alone


@dataclass
class HostedServing:
    """One run on the deployment, and how its POLICY consumer ended."""

    name: str
    ctx: ServiceContext  # the run's own: its bus, store and metrics
    adapters: RunAdapters
    key_sha256: str
    error: str = ""
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set: its consumer stops
    following: asyncio.Task[None] | None = None  # its POLICY consumer, once run() started


def _set_aside(tasks: set[asyncio.Task[Any]], task: asyncio.Task[Any]) -> asyncio.Task[Any]:
    """Keep ``task`` referenced until it ends, and never lose its error."""

    def done(t: asyncio.Task[Any]) -> None:
        tasks.discard(t)
        if not t.cancelled() and (error := t.exception()) is not None:
            log.error("%s failed: %s: %s", t.get_name(), type(error).__name__, error)

    tasks.add(task)
    task.add_done_callback(done)
    return task


class HostedInferenceApp:
    """The running deployment: a POLICY consumer per run, the vLLM watchdog, the control
    plane (HostedAdmin; HostedRuns to add and remove runs at runtime)."""

    def __init__(self, ctx: ServiceContext, engine: VllmEngine, weights_root: Path):
        self.ctx = ctx
        self.engine = engine
        self.section: InferenceSection = ctx.config.inference
        self.weights_root = weights_root
        self.runs: dict[str, HostedServing] = {}
        self.keys: dict[str, str] = {}  # sha256 of each hosted run's key -> the run
        self.admin = HostedAdmin(self)
        self.admission = HostedRunsAdmission(self)
        self._changing = asyncio.Lock()  # one run added or removed at a time
        self._unloading: dict[str, asyncio.Task[None]] = {}  # removed runs' adapters
        self._tasks: set[asyncio.Task[Any]] = set()  # removals and unloads under way
        self._following = False  # run() started: a run added follows its stream at once
        self._closing = False

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return [*admin_servicers(self.admin),
                (platform_service_pb2_grpc.add_HostedRunsServicer_to_server, self.admission,
                 HOSTED_RUNS)]  # fmt: skip

    async def host(
        self, path: Path, cfg: InferenceConfig, key: str, max_sampled_tokens: int | None,
        tag: str = "",
    ) -> HostedServing:  # fmt: skip
        """Serve the run of ``path`` (checked already): its store, its bus, its key at the
        gate, its quota, the catch-up to its newest adapter. Raises leaving nothing of it."""
        name, digest = cfg.run.name, key_sha256(key)
        run = await _start_run(self.ctx, self.engine, self.section, name, cfg, self.weights_root,
                               digest)  # fmt: skip
        routed = False
        try:
            used = 0
            if max_sampled_tokens is not None:  # with what its ledger billed before
                used = int((await usage.read_usage(run.ctx.bus)).total("sampled_tokens"))
                log.info("%srun %s: quota %d sampled tokens, %d used before", tag, name,
                         max_sampled_tokens, used)  # fmt: skip
            routed = True
            await self.engine.set_route(name, None, key_sha256=digest,
                                        max_sampled_tokens=max_sampled_tokens, sampled_tokens=used)  # fmt: skip
            await catch_up(run.ctx.bus, run.adapters, f"run {name}: ")
        except BaseException:
            if routed:
                await self._unroute(name, strict=False)
            await run.adapters.close()
            await run.adapters.unload_all(self.section.drain_timeout_s)
            await run.ctx.bus.close()
            raise
        self.runs[name] = run
        self.keys[digest] = name
        return run

    def quota_of(self, name: str) -> int | None:
        """Run ``name``'s sampled-token quota of [inference.hosted] quotas, if any."""
        quota = self.section.hosted.quotas.get(name)
        return None if quota is None else quota["sampled_tokens"]

    async def add_run(self, path: Path, max_sampled_tokens: int = 0) -> HostedServing:
        """AddRun: host the run of ``path`` from now on, its POLICY stream followed, its
        quota ``max_sampled_tokens`` (0: [inference.hosted] quotas'). A run removed just
        before is added once its adapters of before are unloaded (they have its names)."""
        cfg, key = load_run_config(path, self.section)
        name = cfg.run.name
        while True:
            if (unloading := self._unloading.get(name)) is not None:
                log.info("run %s: waiting for its adapters of before to be unloaded", name)
                await asyncio.wait([unloading])
            async with self._changing:
                if name in self._unloading:  # removed again meanwhile
                    continue
                if self._closing:
                    raise NotServingError("this deployment is stopping: it hosts no more runs")
                if name in self.runs:
                    raise AlreadyHostedError(f"{path}: run {name!r} is hosted here already")
                if key_sha256(key) in self.keys:  # whose is not the caller's to know
                    raise ConfigError(f"{path}: inference.hosted.key_file holds the key of "
                                      "another hosted run: a key is one run's")  # fmt: skip
                run = await self.host(path, cfg, key, max_sampled_tokens or self.quota_of(name))
                if self._following:
                    self._follow(run)
                self.check_max_loras()
                log.info("run %s added (%s): serving policy version %d", name, path,
                         run.adapters.served.policy_version)  # fmt: skip
                self.describe()
                return run

    async def remove_run(self, name: str, reason: str = "") -> int | None:
        """RemoveRun: the last policy version run ``name`` was served (None: not hosted).
        Runs to its end if its caller goes away: a run half removed would be neither served
        nor stopped."""
        task = asyncio.create_task(self._remove(name, reason), name=f"RemoveRun({name})")
        return await asyncio.shield(_set_aside(self._tasks, task))

    async def _remove(self, name: str, reason: str) -> int | None:
        async with self._changing:
            run = self.runs.get(name)
            if run is None:
                return None
            await self._unroute(name)  # its clients get 401 from now on
            del self.runs[name]
            del self.keys[run.key_sha256]
            run.stop.set()
            if run.following is not None:
                await asyncio.wait([run.following])
            await run.adapters.close()
            await run.ctx.bus.close()
            version = run.adapters.served.policy_version
            unload = asyncio.create_task(self._unload(run), name=f"unloading run {name}")
            self._unloading[name] = _set_aside(self._tasks, unload)
            log.info("run %s removed (%s): it was served policy version %d; its adapters are "
                     "unloaded once no request runs on them", name, reason or "no reason given",
                     version)  # fmt: skip
            self.describe()
            return version

    async def _unload(self, run: HostedServing) -> None:
        try:
            await run.adapters.unload_all(self.section.drain_timeout_s)
        finally:
            if self._unloading.get(run.name) is asyncio.current_task():
                del self._unloading[run.name]

    async def _unroute(self, name: str, strict: bool = True) -> None:
        """Refuse run ``name``'s key and forget its route and quota at the gate (gate.py;
        ``strict``: raise when vLLM does not answer, else log it)."""
        try:
            await self.engine.unroute(name)
        except EngineError as e:
            if strict:
                raise
            log.warning("run %s: could not unregister its key: %s", name, e)

    def check_max_loras(self, tag: str = "") -> None:
        """Warn when more runs are hosted than vLLM runs adapters at once (module doc)."""
        max_loras = self.section.lora.max_loras
        if len(self.runs) > max_loras:
            log.warning("%s%d runs hosted, above inference.lora.max_loras = %d: vLLM runs at "
                        "most %d adapters in one batch and keeps as many loaded, so the other "
                        "runs' requests wait for a later batch and their adapters are reloaded "
                        "from disk (raise max_loras to serve them together)", tag,
                        len(self.runs), max_loras, max_loras)  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        self.describe()
        self._following = True
        for run in self.runs.values():
            self._follow(run)
        watch = asyncio.create_task(self._watch(stop))
        try:
            await watch  # raises when vLLM died
        finally:
            stop.set()
            if not watch.done():
                watch.cancel()
            async with self._changing:  # an AddRun or RemoveRun under way ends first
                self._closing = True
            for run in self.runs.values():
                run.stop.set()
            await asyncio.gather(*(r.following for r in self.runs.values() if r.following),
                                 return_exceptions=True)  # fmt: skip
            unloading = list(self._unloading.values())
            for task in unloading:  # vLLM stops: nothing to unload
                task.cancel()
            await asyncio.gather(*unloading, return_exceptions=True)
            for run in self.runs.values():
                await run.ctx.bus.close()
            log.info("[shutdown] stopping vLLM")
            await self.engine.aclose()

    def _follow(self, run: HostedServing) -> None:
        durable = consumer_name(self.section.http_port)
        run.following = asyncio.create_task(self._consume(run, durable),
                                            name=f"POLICY consumer of run {run.name}")  # fmt: skip

    async def _consume(self, run: HostedServing, durable: str) -> None:
        bus = run.ctx.bus

        async def on_policy(msg: policy_pb2.PolicyPublished, delivery: Delivery) -> None:
            await self._on_policy(run, msg, delivery)

        try:
            consumer = await bus.consumer(POLICY_STREAM, durable, bus.subjects.policy_published,
                                          policy_pb2.PolicyPublished, max_ack_pending=1)  # fmt: skip
            await consumer.run(on_policy, run.stop)
        except Exception as e:  # service boundary: one run's failure stops that run only
            run.error = f"{type(e).__name__}: {e}"
            log.error("run %s no longer follows its POLICY stream: %s (its clients keep "
                      "version %d; the other runs go on)", run.name, run.error,
                      run.adapters.served.policy_version)  # fmt: skip
        self.describe()

    async def _on_policy(
        self, run: HostedServing, msg: policy_pb2.PolicyPublished, delivery: Delivery
    ) -> None:
        version = msg.policy_version
        if msg.format != LORA_FORMAT:
            log.error("run %s: policy version %d is %r, but a hosted run publishes LoRA "
                      "adapters (trainer.lora)", run.name, version, msg.format or "full weights")  # fmt: skip
            raise DropMessage(f"run {run.name}: policy version {version} is not an adapter")
        try:
            await run.adapters.update(version, msg.weights)
        except StaleVersionError as e:
            log.info("run %s: ignoring %s: %s", run.name, delivery.subject, e)
        except ObjectNotFoundError as e:
            await skip_if_superseded(run.adapters, version, e)
        except _PERMANENT as e:
            log.error("run %s: cannot serve policy version %d: %s", run.name, version, e)
            raise DropMessage(f"run {run.name}: {e}") from None
        finally:
            self.describe()

    async def _watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if (died := self.engine.died()) is not None:
                raise died
            await asyncio.sleep(0.5)

    def describe(self) -> None:
        parts = []
        for r in self.runs.values():
            served = r.adapters.served
            parts.append(f"{r.name}: v{served.policy_version}"
                         + (f" ({served.adapter})" if served.adapter else " (base)")
                         + (f", not following its POLICY stream: {r.error}" if r.error else ""))  # fmt: skip
        message = f"serving {len(self.runs)} runs on {self.engine.base_url}"
        if self.section.hosted.accept_runs:
            message += " (accepting runs)"
        if parts:
            message += ": " + "; ".join(parts)
        self.ctx.message = message


class HostedAdmin(inference_service_pb2_grpc.InferenceAdminServicer):
    """GetStatus per run (``run``) or of the deployment; updates follow each run's POLICY
    stream, and pausing would stop every run, so UpdateWeights, Pause and Resume are refused."""

    def __init__(self, app: HostedInferenceApp):
        self.app = app

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.InferenceStatus:
        section = self.app.ctx.config.inference
        if not request.run:
            self.app.describe()
            return inference_service_pb2.InferenceStatus(
                info=self.app.ctx.info(), policy_version=-1, model=section.served_model_name
            )
        run = self.app.runs.get(request.run)
        if run is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"this deployment serves runs {sorted(self.app.runs)}, not {request.run!r}")  # fmt: skip
            raise AssertionError("abort returns by raising")
        served = run.adapters.served
        return inference_service_pb2.InferenceStatus(
            info=run.ctx.info(), policy_version=served.policy_version, model=run.name,
            adapter=served.adapter or "",
        )  # fmt: skip

    async def _refuse(self, context: grpc.aio.ServicerContext, what: str) -> Any:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{what} is not available on a deployment hosting several runs: each run's "
            "adapter follows its own POLICY stream",
        )
        raise AssertionError("abort returns by raising")

    async def UpdateWeights(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse(context, "UpdateWeights")

    async def Pause(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse(context, "Pause")

    async def Resume(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse(context, "Resume")


def add_run_code(error: TreadleError) -> grpc.StatusCode:
    """AddRun's status for ``error``: what the run file can fix is INVALID_ARGUMENT; an
    outage that may pass, UNAVAILABLE; the engine's own failures as InferenceAdmin's."""
    if isinstance(error, AlreadyHostedError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(error, BusUnavailableError | StoreUnreachableError) and not isinstance(
        error, BusRefusedError
    ):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, InferenceError):
        return grpc_code(error)
    return grpc.StatusCode.INVALID_ARGUMENT


class HostedRunsAdmission(platform_service_pb2_grpc.HostedRunsServicer):
    """AddRun and RemoveRun (platform_service.proto), with [inference.hosted] accept_runs."""

    def __init__(self, app: HostedInferenceApp):
        self.app = app

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     message: str) -> Any:  # fmt: skip
        await context.abort(code, message)
        raise AssertionError("abort returns by raising")

    async def _require_accepting(self, context: grpc.aio.ServicerContext) -> None:
        if not self.app.section.hosted.accept_runs:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                              "this deployment hosts the runs of inference.hosted.runs only: "
                              "set [inference.hosted] accept_runs = true to add and remove "
                              "runs while it serves")  # fmt: skip

    async def AddRun(
        self, request: platform_service_pb2.AddRunRequest, context: grpc.aio.ServicerContext
    ) -> platform_service_pb2.AddRunResponse:
        await self._require_accepting(context)
        if not request.run_file:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              "AddRun needs run_file: the path of the run's file on this host")  # fmt: skip
        if request.quota.sampled_tokens < 0:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              f"{request.run_file}: quota.sampled_tokens must be >= 0 (0: "
                              f"none, or inference.hosted.quotas'), got "
                              f"{request.quota.sampled_tokens}")  # fmt: skip
        try:
            run = await self.app.add_run(Path(request.run_file), request.quota.sampled_tokens)
        except TreadleError as e:
            text = str(e) if request.run_file in str(e) else f"{request.run_file}: {e}"
            log.warning("AddRun refused: %s", text)
            await self._abort(context, add_run_code(e), text)
        return platform_service_pb2.AddRunResponse(
            run=run.name, step=run.adapters.served.policy_version
        )

    async def RemoveRun(
        self, request: platform_service_pb2.RemoveRunRequest, context: grpc.aio.ServicerContext
    ) -> platform_service_pb2.RemoveRunResponse:
        await self._require_accepting(context)
        if not request.run:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                              "RemoveRun needs run: the run's name")  # fmt: skip
        try:
            version = await self.app.remove_run(request.run, request.reason)
        except TreadleError as e:  # vLLM did not answer: the run is still hosted (logged)
            await self._abort(context, grpc_code(e), f"run {request.run!r}: {e}")
        if version is None:
            log.info("RemoveRun(%s): not hosted here; nothing to do", request.run)
            return platform_service_pb2.RemoveRunResponse(was_hosted=False)
        return platform_service_pb2.RemoveRunResponse(step=version, was_hosted=True)


async def build_hosted(ctx: ServiceContext) -> HostedInferenceApp:
    """Check every run, start vLLM on the base, then host each run: store, bus, key,
    catch-up."""
    cfg: InferenceConfig = ctx.config
    section = cfg.inference
    hosted = section.hosted
    if not section.lora.enabled:
        raise ConfigError("inference.hosted needs [inference.lora] enabled = true: hosted runs "
                          "are served as LoRA adapters on one base")  # fmt: skip
    if section.model is None:
        raise ConfigError("inference.hosted needs inference.model (the shared base)")
    if section.announce:
        raise ConfigError("inference.announce is not supported with inference.hosted yet")
    runs: dict[str, tuple[Path, InferenceConfig, str]] = {}
    keys: dict[str, str] = {}
    for path in hosted.runs:
        run_cfg, key = load_run_config(path, section)
        name = run_cfg.run.name
        if name in runs:
            raise ConfigError(f"{path} and {runs[name][0]} are both run {name!r}")
        digest = key_sha256(key)
        if digest in keys:
            raise ConfigError(f"{path}: its key is run {keys[digest]!r}'s too: a key is one run's")
        keys[digest] = name
        runs[name] = (path, run_cfg, key)
    unknown = sorted(set(hosted.quotas) - set(runs))
    if unknown and not hosted.accept_runs:
        raise ConfigError(f"inference.hosted.quotas names runs {unknown} that no run file is")
    device = detect_device(section.device)
    weights_root = (
        section.weights_dir or cfg.run.run_dir / "inference" / f"weights-{section.http_port}"
    )
    engine = VllmEngine(section, device, cfg.run.run_dir / "logs" / f"vllm-{section.http_port}.log",
                        otlp_endpoint=cfg.telemetry.otlp_endpoint
                        if cfg.telemetry.engine_traces else None)  # fmt: skip
    app = HostedInferenceApp(ctx, engine, weights_root)
    try:
        await ctx.report_metrics(0, {"vllm_start_s": await start_engine(engine, section.model)})
        await engine.require_keys()  # a run's key needed, even with no run
        for name, (path, run_cfg, key) in runs.items():
            await app.host(path, run_cfg, key, app.quota_of(name), tag="[startup] ")
            log.info("[startup] run %s (%s)", name, path)
        app.check_max_loras("[startup] ")
        await engine.set_gate(True)
    except BaseException:
        for run in app.runs.values():
            await run.ctx.bus.close()
        await engine.aclose()
        raise
    log.info("[startup] serving %s on one base (%s)%s",
             f"runs {', '.join(runs)}" if runs else "no run yet", section.model,
             ": accepting runs (HostedRuns)" if hosted.accept_runs else "")  # fmt: skip
    return app


async def _start_run(
    host: ServiceContext, engine: VllmEngine, section: InferenceSection, name: str,
    cfg: InferenceConfig, weights_root: Path, digest: str,
) -> HostedServing:  # fmt: skip
    store = await asyncio.to_thread(open_store, cfg.object_store, name, cfg.run.run_dir)
    instance_id = f"{host.instance_id}-{name}"
    bus = await Bus.connect(cfg.nats, name, store=store, name=instance_id, role=SPEC.name)
    ctx = ServiceContext(SPEC, cfg, instance_id, bus, store)
    weights_dir = weights_root / name
    weights_dir.mkdir(parents=True, exist_ok=True)
    adapters = RunAdapters(name, section, engine, store, weights_dir, report=ctx.report_metrics)
    return HostedServing(name, ctx, adapters, digest)
