"""One inference deployment serving several runs' LoRA adapters on one base (hosted serving).

    this process's config: [inference] = the base and the engine (model, [inference.lora]),
                           [inference.hosted] runs = run files
        ─▶ read every run file (the files only: this process's env vars and flags are the
           host's) ─▶ check each fits (below); any misfit: nothing starts
        ─▶ vLLM on the base, once: version 0 of every run
        ─▶ for each run: its object store ─▶ its bus, as its own NATS user (it reaches only
           treadle.<run>.…) ─▶ its key registered at the gate (the sha256 only) ─▶ catch up
           to its newest PolicyPublished
        ─▶ open the gate
    run():   per run: POLICY consumer ──PolicyPublished(N)──▶ RunAdapters.update(N) ─▶ ack
             watchdog: vLLM died unasked ─▶ the service fails with vLLM's last log lines

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

Quotas (``inference.hosted.quotas``): the sampled tokens a run may have, counting what its
usage ledger billed before this process; the gate counts each answer's tokens and answers
429 naming the run once it is at its quota (gate.py).

Refused at start, naming the run file and the setting: a run without a key file or with
an empty one, two runs with one key or one name, a run named like the served model, a run
whose file names another base model, hosting without ``[inference.lora] enabled``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from treadle.inference.engine import VllmEngine, detect_device
from treadle.inference.errors import StaleVersionError
from treadle.inference.probe import LORA_FORMAT
from treadle.inference.service import (
    _PERMANENT,
    POLICY_STREAM,
    admin_servicers,
    catch_up,
    consumer_name,
)
from treadle.inference.spec import SPEC, InferenceConfig, InferenceSection
from treadle.inference.updater import Served, WeightUpdater, start_engine
from treadle.proto.v1 import (
    common_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    policy_pb2,
)
from treadle.services import usage
from treadle.services.bus import Bus, Delivery
from treadle.services.config import ConfigSources, gather, validate
from treadle.services.errors import (
    ConfigError,
    DropMessage,
)
from treadle.services.host import ServiceContext
from treadle.services.objectstore import ObjectStore, open_store
from treadle.services.registry import known_sections

log = logging.getLogger(__name__)


def load_run_config(path: Path, host: InferenceSection) -> tuple[InferenceConfig, str]:
    """A hosted run's config from its file alone, and its key (ConfigError naming the file)."""
    raw = gather(ConfigSources(files=[path]), environ={})
    cfg = validate(InferenceConfig, raw, known_sections())
    hosted = cfg.inference.hosted
    if hosted.runs:
        raise ConfigError(f"{path}: inference.hosted.runs is set in a hosted run's own file")
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

    async def _swap_adapter(self, published: Any, folder: Path, timings: dict[str, float]) -> None:
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


@dataclass
class HostedServing:
    """One run on the deployment, and how its POLICY consumer ended."""

    name: str
    ctx: ServiceContext  # the run's own: its bus, store and metrics
    adapters: RunAdapters
    error: str = ""


class HostedInferenceApp:
    """The running deployment: a POLICY consumer per run, the vLLM watchdog, the control plane."""

    def __init__(self, ctx: ServiceContext, engine: VllmEngine, runs: dict[str, HostedServing]):
        self.ctx = ctx
        self.engine = engine
        self.runs = runs
        self.admin = HostedAdmin(self)

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return admin_servicers(self.admin)

    async def run(self, stop: asyncio.Event) -> None:
        self.describe()
        port = self.ctx.config.inference.http_port
        follow = [asyncio.create_task(self._follow(r, consumer_name(port), stop))
                  for r in self.runs.values()]  # fmt: skip
        watch = asyncio.create_task(self._watch(stop))
        try:
            await watch  # raises when vLLM died
        finally:
            stop.set()
            await asyncio.gather(*follow, return_exceptions=True)
            if not watch.done():
                watch.cancel()
            for run in self.runs.values():
                await run.ctx.bus.close()
            log.info("[shutdown] stopping vLLM")
            await self.engine.aclose()

    async def _follow(self, run: HostedServing, durable: str, stop: asyncio.Event) -> None:
        bus = run.ctx.bus

        async def on_policy(msg: policy_pb2.PolicyPublished, delivery: Delivery) -> None:
            await self._on_policy(run, msg, delivery)

        try:
            consumer = await bus.consumer(POLICY_STREAM, durable, bus.subjects.policy_published,
                                          policy_pb2.PolicyPublished, max_ack_pending=1)  # fmt: skip
            await consumer.run(on_policy, stop)
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
        self.ctx.message = f"serving {len(self.runs)} runs on {self.engine.base_url}: " + "; ".join(
            parts
        )


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


async def build_hosted(ctx: ServiceContext) -> HostedInferenceApp:
    """Check every run, start vLLM on the base, then each run: store, bus, key, catch-up."""
    cfg: InferenceConfig = ctx.config
    section = cfg.inference
    if not section.lora.enabled:
        raise ConfigError("inference.hosted needs [inference.lora] enabled = true: hosted runs "
                          "are served as LoRA adapters on one base")  # fmt: skip
    if section.model is None:
        raise ConfigError("inference.hosted needs inference.model (the shared base)")
    if section.announce:
        raise ConfigError("inference.announce is not supported with inference.hosted yet")
    runs: dict[str, tuple[Path, InferenceConfig, str]] = {}
    keys: dict[str, str] = {}
    for path in section.hosted.runs:
        run_cfg, key = load_run_config(path, section)
        name = run_cfg.run.name
        if name in runs:
            raise ConfigError(f"{path} and {runs[name][0]} are both run {name!r}")
        digest = hashlib.sha256(key.encode()).hexdigest()
        if digest in keys:
            raise ConfigError(f"{path}: its key is run {keys[digest]!r}'s too: a key is one run's")
        keys[digest] = name
        runs[name] = (path, run_cfg, digest)
    unknown = sorted(set(section.hosted.quotas) - set(runs))
    if unknown:
        raise ConfigError(f"inference.hosted.quotas names runs {unknown} that no run file is")
    if section.lora.max_loras < len(runs):
        log.warning("[startup] inference.lora.max_loras = %d is below the %d runs hosted: "
                    "their requests cannot share one batch", section.lora.max_loras, len(runs))  # fmt: skip
    device = detect_device(section.device)
    weights_root = (
        section.weights_dir or cfg.run.run_dir / "inference" / f"weights-{section.http_port}"
    )
    engine = VllmEngine(section, device, cfg.run.run_dir / "logs" / f"vllm-{section.http_port}.log",
                        otlp_endpoint=cfg.telemetry.otlp_endpoint
                        if cfg.telemetry.engine_traces else None)  # fmt: skip
    served: dict[str, HostedServing] = {}
    try:
        await ctx.report_metrics(0, {"vllm_start_s": await start_engine(engine, section.model)})
        for name, (path, run_cfg, digest) in runs.items():
            served[name] = await _start_run(ctx, engine, section, name, run_cfg, weights_root)
            limit, used = None, 0
            if name in section.hosted.quotas:  # with what its ledger billed before
                limit = section.hosted.quotas[name]["sampled_tokens"]
                used = int((await usage.read_usage(served[name].ctx.bus)).total("sampled_tokens"))
                log.info("[startup] run %s: quota %d sampled tokens, %d used before", name,
                         limit, used)  # fmt: skip
            await engine.set_route(name, None, key_sha256=digest, max_sampled_tokens=limit,
                                   sampled_tokens=used)  # fmt: skip
            log.info("[startup] run %s (%s)", name, path)
        for run in served.values():  # the routes exist: now catch up
            await catch_up(run.ctx.bus, run.adapters, f"run {run.name}: ")
        await engine.set_gate(True)
    except BaseException:
        for run in served.values():
            await run.ctx.bus.close()
        await engine.aclose()
        raise
    log.info("[startup] serving runs %s on one base (%s)", ", ".join(runs), section.model)
    return HostedInferenceApp(ctx, engine, served)


async def _start_run(
    host: ServiceContext, engine: VllmEngine, section: InferenceSection, name: str,
    cfg: InferenceConfig, weights_root: Path,
) -> HostedServing:  # fmt: skip
    store = await asyncio.to_thread(open_store, cfg.object_store, name, cfg.run.run_dir)
    instance_id = f"{host.instance_id}-{name}"
    bus = await Bus.connect(cfg.nats, name, store=store, name=instance_id, role=SPEC.name)
    ctx = ServiceContext(SPEC, cfg, instance_id, bus, store)
    weights_dir = weights_root / name
    weights_dir.mkdir(parents=True, exist_ok=True)
    adapters = RunAdapters(name, section, engine, store, weights_dir, report=ctx.report_metrics)
    return HostedServing(name, ctx, adapters)
