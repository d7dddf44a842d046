"""The inference service: vLLM under supervision, its weights following the POLICY stream,
and the InferenceAdmin control plane.

    build(): start vLLM on [inference] model as policy version 0 ─▶ apply the newest
             PolicyPublished if there is one ─▶ (host: gRPC health SERVING)
    run():   POLICY consumer ──PolicyPublished(N)──▶ WeightUpdater.update(N) ─▶ ack
             watchdog: vLLM died unasked ─▶ the service fails with vLLM's last log lines
    gRPC:    UpdateWeights ─▶ WeightUpdater.update   Pause/Resume ─▶ the admission gate
             GetStatus ─▶ served version (and LoRA adapter), paused, vLLM /metrics (running,
             waiting, KV use)

Clients generate on vLLM's own HTTP API (``treadle.services.inference_client``), not here.
With ``inference.model`` unset the service serves only its control plane and says so.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from typing import Any, NoReturn

import grpc

from treadle.inference.engine import EngineMetrics, VllmEngine, detect_device
from treadle.inference.errors import (
    EngineError,
    EngineStartError,
    ManifestError,
    NotServingError,
    StaleVersionError,
    VerificationError,
)
from treadle.inference.probe import LORA_FORMAT, POLICY_FORMATS
from treadle.inference.spec import SPEC, InferenceConfig
from treadle.inference.updater import WeightUpdater
from treadle.proto.v1 import (
    common_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    policy_pb2,
)
from treadle.services.bus import Bus, Delivery
from treadle.services.credentials import cert_names
from treadle.services.discovery import Announcer, advertised_host, replica_key, this_replica
from treadle.services.errors import (
    DecodeError,
    DropMessage,
    IntegrityError,
    ObjectNotFoundError,
    StoreUnavailableError,
    TreadleError,
)
from treadle.services.host import ServiceContext
from treadle.services.sections import nats_address

log = logging.getLogger(__name__)

POLICY_STREAM = "POLICY"
NO_MODEL = "inference.model is not set: no vLLM, serving the control plane only"
FIXED = "inference.follow_policy is false: this service serves a fixed model and loads no weights"

# errors an update cannot recover from by retrying the same message
_PERMANENT = (IntegrityError, ObjectNotFoundError, ManifestError, VerificationError)
_GRPC_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (StaleVersionError, grpc.StatusCode.FAILED_PRECONDITION),
    (ManifestError, grpc.StatusCode.INVALID_ARGUMENT),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    (ObjectNotFoundError, grpc.StatusCode.NOT_FOUND),
    (StoreUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (VerificationError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotServingError, grpc.StatusCode.FAILED_PRECONDITION),
    (EngineStartError, grpc.StatusCode.INTERNAL),
    (EngineError, grpc.StatusCode.UNAVAILABLE),
]


def grpc_code(error: BaseException) -> grpc.StatusCode:
    for cls, code in _GRPC_CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, error: BaseException) -> NoReturn:
    await context.abort(grpc_code(error), str(error))
    raise AssertionError("abort returns by raising")


class InferenceAdmin(inference_service_pb2_grpc.InferenceAdminServicer):
    """The control plane; every call maps typed errors to gRPC status codes."""

    def __init__(self, ctx: ServiceContext, updater: WeightUpdater | None):
        self.ctx = ctx
        self.updater = updater
        self.cfg = ctx.config.inference

    def _require(self) -> WeightUpdater:
        if self.updater is None:
            raise NotServingError(NO_MODEL)
        return self.updater

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.InferenceStatus:
        if self.updater is None:
            return inference_service_pb2.InferenceStatus(
                info=self.ctx.info(), policy_version=-1, model=self.cfg.served_model_name
            )
        load, num_held = EngineMetrics(0, 0, 0.0), 0
        if self.updater.updating_to is None:  # during a restart there is no engine to ask
            try:
                load = await self.updater.engine.metrics()
                num_held = (await self.updater.engine.gate()).num_held
            except EngineError as e:
                log.debug("status without engine metrics: %s", e)
        return inference_service_pb2.InferenceStatus(
            info=self.ctx.info(),
            policy_version=self.updater.served.policy_version,
            num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests + num_held,  # in vLLM or at the gate
            kv_cache_usage=load.kv_cache_usage,
            paused=self.updater.user_paused,
            model=self.cfg.served_model_name,
            adapter=self.updater.served.adapter or "",
        )

    async def UpdateWeights(
        self, request: inference_service_pb2.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.UpdateWeightsResponse:
        try:
            updater = self._require()
            if not self.cfg.follow_policy:
                raise NotServingError(FIXED)
            if request.policy_version < 0:
                raise ManifestError(f"policy_version must be >= 0, got {request.policy_version}")
            result = await updater.update(request.policy_version, request.weights)
        except TreadleError as e:
            log.error("UpdateWeights(%d) failed: %s", request.policy_version, e)
            await _abort(context, e)
        return inference_service_pb2.UpdateWeightsResponse(
            policy_version=result.policy_version,
            load_s=result.load_s,
            already_loaded=result.already_loaded,
        )

    async def Pause(
        self, request: inference_service_pb2.PauseRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.PauseResponse:
        try:
            num_aborted = await self._require().pause(request.abort_in_flight)
        except TreadleError as e:
            await _abort(context, e)
        return inference_service_pb2.PauseResponse(num_aborted=num_aborted)

    async def Resume(
        self, request: inference_service_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> inference_service_pb2.ResumeResponse:
        try:
            await self._require().resume()
        except TreadleError as e:
            await _abort(context, e)
        return inference_service_pb2.ResumeResponse()


def consumer_name(http_port: int) -> str:
    """Durable POLICY consumer of this replica: one per host and data-plane port."""
    host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64]
    return f"inference-{host}-{http_port}"


def admin_servicers(
    admin: inference_service_pb2_grpc.InferenceAdminServicer,
) -> list[tuple[Any, Any, Any]]:
    """The control plane an inference app serves."""
    return [(inference_service_pb2_grpc.add_InferenceAdminServicer_to_server, admin, SPEC.control)]


class InferenceApp:
    """The running service: POLICY consumer, vLLM watchdog and the control plane."""

    def __init__(self, ctx: ServiceContext, updater: WeightUpdater | None):
        self.ctx = ctx
        self.updater = updater
        self.admin = InferenceAdmin(ctx, updater)

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return admin_servicers(self.admin)

    async def run(self, stop: asyncio.Event) -> None:
        updater = self.updater
        if updater is None:
            self.ctx.message = NO_MODEL
            log.warning("[startup] %s", NO_MODEL)
            await stop.wait()
            return
        self._set_message()
        bus = self.ctx.bus
        section = self.ctx.config.inference
        tasks: list[asyncio.Task[None]] = []
        try:
            tasks = [asyncio.create_task(self._watch(stop))]
            if section.follow_policy:
                consumer = await bus.consumer(
                    POLICY_STREAM,
                    consumer_name(section.http_port),
                    bus.subjects.policy_published,
                    policy_pb2.PolicyPublished,
                    max_ack_pending=1,
                )
                tasks.append(asyncio.create_task(consumer.run(self._on_policy, stop)))
            if section.announce:
                tasks.append(asyncio.create_task(self.announcer().run(stop)))
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises the engine's failure
        finally:
            stop.set()
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            log.info("[shutdown] stopping vLLM")
            await updater.engine.aclose()

    def announcer(self) -> Announcer:
        """This replica's announcement in the run's replicas bucket."""
        section = self.ctx.config.inference
        nats_host, nats_port = nats_address(self.ctx.config.nats.url or "127.0.0.1")
        host = advertised_host(section.http_host, section.advertise_host, nats_host, nats_port)
        grpc_host = advertised_host(section.grpc.host, section.advertise_host, nats_host, nats_port)
        tls_name = ""
        cert = self.ctx.config.control.tls_cert
        if cert is not None:  # dialled by its address: name one its certificate holds
            names = cert_names(cert.read_bytes())
            if names and grpc_host not in names:
                tls_name = names[0]

        def bracket(h: str) -> str:  # an IPv6 address in a URL or gRPC target
            return f"[{h}]" if ":" in h else h

        announcement = this_replica(
            f"http://{bracket(host)}:{section.http_port}",
            f"{bracket(grpc_host)}:{self.ctx.grpc_port}", section.served_model_name, tls_name,
        )  # fmt: skip
        key = replica_key(section.http_port)
        log.info("[startup] announcing this replica as %s (%s, control %s)", key,
                 announcement.url, announcement.grpc)  # fmt: skip
        return Announcer(self.ctx.bus, key, announcement, ttl_s=section.announce_ttl_s)

    async def _watch(self, stop: asyncio.Event) -> None:
        updater = self.updater
        assert updater is not None
        while not stop.is_set():
            if updater.fatal is not None:
                raise EngineStartError(f"vLLM cannot serve any more: {updater.fatal}")
            if updater.updating_to is None and (died := updater.engine.died()) is not None:
                raise died
            await asyncio.sleep(0.5)

    async def _on_policy(self, msg: policy_pb2.PolicyPublished, delivery: Delivery) -> None:
        updater = self.updater
        assert updater is not None
        version = msg.policy_version
        if msg.format and msg.format not in POLICY_FORMATS:
            raise DropMessage(
                f"policy version {version} is published as {msg.format!r}; "
                f"the inference service loads {', '.join(POLICY_FORMATS)}"
            )
        if msg.format == LORA_FORMAT and not self.ctx.config.inference.lora.enabled:
            log.error(
                "cannot serve policy version %d: it is a LoRA adapter and inference.lora.enabled "
                "is false (set [inference.lora] enabled = true)", version,
            )  # fmt: skip
            raise DropMessage(f"policy version {version}: a LoRA adapter, inference.lora is off")
        try:
            result = await updater.update(version, msg.weights)
        except StaleVersionError as e:
            log.info("ignoring %s: %s", delivery.subject, e)
            return
        except ObjectNotFoundError as e:
            await skip_if_superseded(updater, version, e)
        except _PERMANENT as e:
            log.error("cannot serve policy version %d: %s", version, e)
            raise DropMessage(f"policy version {version}: {e}") from None
        finally:
            self._set_message()
        if result.already_loaded:
            log.info("policy version %d is already served", version)

    def _set_message(self) -> None:
        assert self.updater is not None
        served = self.updater.served
        section = self.ctx.config.inference
        if not section.follow_policy:
            self.ctx.message = (
                f"serving {section.model} as {section.served_model_name!r} on "
                f"{self.updater.engine.base_url}, fixed (follow_policy = false)"
            )
            return
        adapter = f" (LoRA adapter {served.adapter})" if served.adapter else ""
        self.ctx.message = (
            f"serving policy version {served.policy_version}{adapter} as "
            f"{section.served_model_name!r} on {self.updater.engine.base_url}"
        )


async def skip_if_superseded(updater: WeightUpdater, version: int, e: ObjectNotFoundError) -> None:
    """A policy version not found in the store: skipped (logged) when a newer one is
    published there -- the trainer deleted it (``trainer.keep_policies``) before this
    replica read its announcement; otherwise logged and dead-lettered (DropMessage)."""
    label = updater.log_label
    if (newer := await updater.superseded(version)) is None:
        log.error("%scannot serve policy version %d: %s", label, version, e)
        raise DropMessage(f"{label}policy version {version}: {e}") from None
    log.info("%sskipping policy version %d: it is no longer in the object store, and version "
             "%d is (old versions deleted by trainer.keep_policies)", label, version, newer)  # fmt: skip


async def catch_up(bus: Bus, updater: WeightUpdater, label: str = "") -> None:
    """Serve the newest PolicyPublished on ``bus``, if any; an undecodable or unservable
    one is logged and the served version kept (``label``: the run, on a hosted one)."""
    try:
        latest = await bus.last(
            POLICY_STREAM, bus.subjects.policy_published, policy_pb2.PolicyPublished
        )
    except (DecodeError, IntegrityError, ObjectNotFoundError) as e:  # dead-lettered by the bus
        log.error("[startup] %sthe newest PolicyPublished is undecodable (%s); serving "
                  "version %d until the next one", label, e, updater.served.policy_version)  # fmt: skip
        return
    if latest is None or latest.policy_version <= 0:
        return
    log.info("[startup] %scatching up to the newest published policy version %d", label,
             latest.policy_version)  # fmt: skip
    try:
        await updater.update(latest.policy_version, latest.weights)
    except _PERMANENT as e:
        log.error("[startup] %scannot serve policy version %d: %s", label,
                  latest.policy_version, e)  # fmt: skip


async def build(ctx: ServiceContext) -> Any:
    cfg: InferenceConfig = ctx.config
    section = cfg.inference
    if section.hosted.runs or section.hosted.accept_runs:  # several runs' adapters on one base
        from treadle.inference.hosted import build_hosted

        return await build_hosted(ctx)
    if section.model is None:
        return InferenceApp(ctx, None)
    device = detect_device(section.device)
    logs_dir = cfg.run.run_dir / "logs"
    weights_dir = (
        section.weights_dir or cfg.run.run_dir / "inference" / f"weights-{section.http_port}"
    )
    weights_dir.mkdir(parents=True, exist_ok=True)
    engine = VllmEngine(section, device, logs_dir / f"vllm-{section.http_port}.log",
                        otlp_endpoint=cfg.telemetry.otlp_endpoint
                        if cfg.telemetry.engine_traces else None)  # fmt: skip
    updater = WeightUpdater(section, engine, ctx.store, weights_dir, report=ctx.report_metrics,
                            adapter_prefix=section.lora.adapter_name or cfg.run.name)  # fmt: skip
    try:
        started_s = await updater.start()
        if section.follow_policy:  # a fixed model's numbers are not the policy's
            await ctx.report_metrics(0, {"policy_version": 0.0, "vllm_start_s": started_s})
            await catch_up(ctx.bus, updater)
        else:
            log.info("[startup] %s (%s, vLLM up in %.1fs)", FIXED, section.model, started_s)
    except BaseException:
        await engine.aclose()
        raise
    return InferenceApp(ctx, updater)
