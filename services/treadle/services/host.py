"""The lifecycle every service process shares.

    parse config ─▶ logging ─▶ telemetry ─▶ object store ─▶ NATS (+ streams)
        ─▶ build the app ─▶ gRPC (health, reflection, control) ─▶ SERVING
        ─▶ app.run(stop) until SIGTERM/SIGINT or the app ends
        ─▶ NOT_SERVING ─▶ stop gRPC (grace) ─▶ drain NATS ─▶ flush telemetry ─▶ exit code

A service's ``__main__`` is one call: ``sys.exit(serve(SPEC, build))``. Exit codes: 0 clean
stop, 1 the service failed (its error logged as one line, with the traceback only for
bugs), 2 bad configuration, 130 interrupted before it was up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.js.errors
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.proto.v1 import common_pb2, metrics_pb2
from treadle.services import __version__
from treadle.services.bus import Bus
from treadle.services.config import gather, split_argv, to_toml, validate
from treadle.services.errors import BusUnavailableError, ConfigError, TreadleError
from treadle.services.logs import setup_logging
from treadle.services.objectstore import ObjectStore, open_store
from treadle.services.redact import redact_urls, register_config_secrets
from treadle.services.registry import ServiceSpec, known_sections
from treadle.services.rpc import ControlSecurity, GrpcServer, configure_clients, start_server
from treadle.services.sections import ServiceConfig
from treadle.services.startup import StartupInterrupted, StartupServer
from treadle.services.telemetry import setup_telemetry

log = logging.getLogger(__name__)

State = common_pb2.ServiceState


@dataclass
class ServiceContext:
    """What a service app gets from the chassis."""

    spec: ServiceSpec
    config: Any  # the service's config class instance (ServiceConfig subclass)
    instance_id: str
    bus: Bus
    store: ObjectStore
    started_at: float = field(default_factory=time.monotonic)
    state: common_pb2.ServiceState = State.SERVICE_STATE_STARTING
    message: str = ""
    grpc_port: int = 0  # the control plane's bound port, once it serves

    async def report_metrics(self, step: int, values: dict[str, float]) -> None:
        """Publish a MetricsReport (live progress, metrics.jsonl); never raises on a full bus."""
        report = metrics_pb2.MetricsReport(
            service=self.spec.name, instance_id=self.instance_id, step=step, values=values
        )
        stamp = Timestamp()
        stamp.GetCurrentTime()
        report.time.CopyFrom(stamp)
        try:
            await self.bus.publish(self.bus.subjects.metrics(self.spec.name), report, msg_id=None)
        except TreadleError as e:
            log.warning("metrics of step %d not published: %s", step, e)

    def info(self) -> common_pb2.ServiceInfo:
        """The ServiceInfo every *Status message embeds."""
        return common_pb2.ServiceInfo(
            service=self.spec.name,
            instance_id=self.instance_id,
            run=self.config.run.name,
            version=__version__,
            state=self.state,
            uptime_s=time.monotonic() - self.started_at,
            message=self.message,
        )


class ServiceApp(Protocol):
    """What a service builds: its gRPC servicers and its work loop."""

    def servicers(self) -> Sequence[tuple[Callable[[Any, Any], None], Any, Any]]:
        """(add_XServicer_to_server, servicer, service descriptor) triples."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """The work loop; returns after ``stop`` is set (or when the work is done)."""
        ...


Builder = Callable[[ServiceContext], Awaitable[ServiceApp]]


CPUS_ENV = "TREADLE_CPUS"  # comma-separated CPU ids this service process runs on


def apply_cpu_affinity(environ: Mapping[str, str]) -> list[int] | None:
    """Pin this process (and the threads and children it starts later) to the CPUs in
    ``TREADLE_CPUS``, as the local launcher sets it; None when unset."""
    raw = environ.get(CPUS_ENV, "").strip()
    if not raw:
        return None
    try:
        cpus = sorted({int(c) for c in raw.split(",")})
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{CPUS_ENV}={raw!r} is not a usable list of CPU ids: {e}") from None
    return cpus


def load_service_config(spec: ServiceSpec, argv: Sequence[str]) -> tuple[ServiceConfig, bool]:
    """(config, dry_run) for ``spec`` from a command line."""
    sources = split_argv(argv)
    cfg = validate(spec.config_cls, gather(sources), known_sections())
    return cfg, sources.dry_run


def serve(spec: ServiceSpec, build: Builder, argv: Sequence[str] | None = None) -> int:
    """Run one service process to completion; returns its exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg, dry_run = load_service_config(spec, argv)
    except ConfigError as e:
        print(f"treadle {spec.name}: {e}", file=sys.stderr)
        return 2
    if dry_run:
        print(to_toml(cfg), end="")
        return 0
    instance_id = f"{spec.name}-{socket.gethostname()}-{os.getpid()}"
    register_config_secrets(cfg)  # masked in every log line from here on
    setup_logging(spec.name, cfg.log)
    try:
        pinned = apply_cpu_affinity(os.environ)
        security = ControlSecurity.load(cfg.control)
    except ConfigError as e:
        print(f"treadle {spec.name}: {e}", file=sys.stderr)
        return 2
    if pinned is not None:
        log.info("[startup] running on CPUs %s", ",".join(map(str, pinned)))
    tel = setup_telemetry(spec.name, cfg.telemetry, instance_id=instance_id)
    log.info("[startup] %s %s (run %s, pid %d)", spec.name, __version__, cfg.run.name, os.getpid())
    configure_clients(security)
    try:
        asyncio.run(_serve(spec, cfg, instance_id, build, security))
    except StartupInterrupted as e:
        log.info("[shutdown] %s %s", spec.name, e)
        return 130
    except TreadleError as e:
        log.error("[shutdown] %s failed: %s", spec.name, e)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception:
        log.exception("[shutdown] %s crashed", spec.name)
        return 1
    finally:
        tel.shutdown()
    log.info("[shutdown] %s stopped cleanly", spec.name)
    return 0


async def _serve(
    spec: ServiceSpec, cfg: Any, instance_id: str, build: Builder, security: ControlSecurity
) -> None:
    grpc_cfg = spec.grpc_section(cfg)
    # the port answers from the start: health NOT_SERVING, GetStatus says what we wait for
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    startup = StartupServer(spec, instance_id, cfg.run.name, stop)
    port = await startup.start(grpc_cfg, security)
    patience = cfg.run.startup_wait_s
    bus: Bus | None = None
    server: GrpcServer | None = None
    try:
        store = await startup.wait_for(
            f"the object store ({_store_name(cfg)})",
            lambda: asyncio.to_thread(open_store, cfg.object_store, cfg.run.name, cfg.run.run_dir),
            patience,
        )
        bus = await startup.wait_for(
            f"NATS at {redact_urls(cfg.nats.url or '(nats.url unset)')}",
            lambda: Bus.connect(cfg.nats, cfg.run.name, store=store, name=instance_id,
                                role=spec.name),
            patience,
        )  # fmt: skip
        connected = bus
        streams = await startup.wait_for(
            "the run's streams", lambda: run_streams(connected, cfg.nats.manage_streams), patience
        )
        log.info(
            "[startup] nats %s (%s), streams: %s",
            redact_urls(cfg.nats.url),
            "authenticated" if cfg.nats.credentials else "anonymous",
            ", ".join(streams),
        )
        ctx = ServiceContext(spec, cfg, instance_id, bus, store)
        startup.ctx = ctx
        app = await _unless_signalled(build(ctx), stop)
        await startup.stop()
        server = await start_server(grpc_cfg.host, port, app.servicers(), security=security)
        log.info(
            "[startup] gRPC on %s:%d (%s)",
            grpc_cfg.host,
            server.port,
            ", ".join(
                ["TLS" if security.cert else "plaintext"]
                + (["client certificates required"] if security.require_client_cert else [])
                + (["token required"] if security.token else ["no token"])
            ),
        )
        ctx.grpc_port = server.port
        ctx.state = State.SERVICE_STATE_READY
        await server.set_serving(True)
        work = asyncio.create_task(app.run(stop))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        ctx.state = State.SERVICE_STATE_DRAINING
        if stop.is_set():
            log.info("[shutdown] signal received; draining")
        await server.set_serving(False)
        try:
            await work
        except Exception:
            ctx.state = State.SERVICE_STATE_FAILED
            raise
        ctx.state = State.SERVICE_STATE_STOPPED
    finally:
        await startup.stop()
        if server is not None:
            await server.stop(grpc_cfg.shutdown_grace_s)
        if bus is not None:
            await bus.close()


async def _unless_signalled(building: Awaitable[Any], stop: asyncio.Event) -> Any:
    """The app ``building`` returns; StartupInterrupted when ``stop`` is set first. The
    build is then cancelled, so what it started (a vLLM still loading) is stopped by its
    own cleanup before this service exits, not left to outlive it."""
    task = asyncio.ensure_future(building)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise StartupInterrupted("stopped while starting; what had started is stopped")


def _store_name(cfg: Any) -> str:
    section = cfg.object_store
    if section.backend == "s3":
        return f"S3 at {section.endpoint}, bucket {section.bucket}"
    return f"local directory {section.root or cfg.run.run_dir / 'store'}"


async def run_streams(bus: Bus, manage: bool) -> list[str]:
    """Create/update the run's streams, or (a user that may not) check that they exist."""
    if manage:
        return await bus.ensure_streams()
    names = [spec.name for spec in bus.subjects.streams(bus.cfg)]
    for name in names:
        try:
            await bus.js.stream_info(name)
        except nats.js.errors.NotFoundError:
            raise BusUnavailableError(
                f"stream {name} does not exist and nats.manage_streams is false: start the "
                "stack with `treadle stack`/`rl` (it creates the streams), or let a user that "
                "may manage streams create them first"
            ) from None
    return names


class IdleApp:
    """An app whose work loop has not landed yet: it serves its control plane (health,
    GetStatus) and says in its status message why it does no work."""

    def __init__(self, ctx: ServiceContext, servicers: Sequence[tuple[Any, Any, Any]], why: str):
        self.ctx = ctx
        self._servicers = list(servicers)
        self.why = why

    def servicers(self) -> Sequence[tuple[Any, Any, Any]]:
        return self._servicers

    async def run(self, stop: asyncio.Event) -> None:
        self.ctx.message = self.why
        log.warning("[startup] %s is idle: %s", self.ctx.spec.name, self.why)
        await stop.wait()
