"""A starting service: what it waits for, why, and how a health probe reads it.

    serve() ─▶ StartupServer on the service's gRPC port
                 health: NOT_SERVING
                 <Control>/GetStatus: STARTING, "waiting for NATS: <why> (attempt 3, next in 2s)"
                 every other control call: UNAVAILABLE with the same message
           ─▶ wait_for("the object store", ...) ─▶ wait_for("NATS", ...) ─▶ build the app
           ─▶ the StartupServer stops; the service's own server binds the same port

A dependency that does not answer yet (nothing listening, a timeout, a 5xx, the run's
streams not created yet) is tried again with exponential backoff for
``run.startup_wait_s`` seconds; every failed attempt is logged with its reason, and the
last one ends the service with it. A dependency that refuses us (NATS turned the
credentials away, S3 rejected the keys, the bucket is missing) ends it at once: waiting
would not help. So a container whose NATS or S3 is late says which and why in its health
status and its log, and never restarts in a loop without a message.

``probe`` is the other side: ``treadle health SERVICE`` (a compose healthcheck) asks the
service's gRPC health and, when it is not SERVING, its GetStatus for the reason.

Not here: the service lifecycle itself (``host.py``), the dependencies' clients
(``bus.py``, ``objectstore.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc

from treadle.proto.v1 import common_pb2
from treadle.services import __version__
from treadle.services.errors import (
    BusRefusedError,
    BusUnavailableError,
    StoreUnreachableError,
    TreadleError,
)
from treadle.services.rpc import ControlSecurity, GrpcServer, open_channel, start_server

if TYPE_CHECKING:
    from treadle.services.host import ServiceContext
    from treadle.services.registry import ServiceSpec
    from treadle.services.sections import GrpcSection

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY_S = 0.5  # backoff between attempts: doubles from this ...
MAX_DELAY_S = 15.0  # ... up to this


class StartupInterrupted(TreadleError):
    """A stop signal arrived while the service waited for a dependency."""


def transient(e: BaseException) -> bool:
    """Whether a failure to reach a dependency may pass if we wait."""
    if isinstance(e, BusRefusedError):
        return False
    return isinstance(e, (BusUnavailableError, StoreUnreachableError))


class StartupServer:
    """The service's gRPC port while it starts: health NOT_SERVING, GetStatus says why."""

    def __init__(
        self, spec: ServiceSpec, instance_id: str, run: str, stop: asyncio.Event | None = None
    ):
        self.spec = spec
        self.stop_requested = stop or asyncio.Event()  # SIGTERM while waiting ends the wait
        self.instance_id = instance_id
        self.run = run
        self.started_at = time.monotonic()
        self.message = "starting"
        self.ctx: ServiceContext | None = None  # once the app is being built: its own message
        self.server: GrpcServer | None = None

    def status_message(self) -> str:
        if self.ctx is not None and self.ctx.message:
            return self.ctx.message
        return self.message

    def info(self) -> common_pb2.ServiceInfo:
        return common_pb2.ServiceInfo(
            service=self.spec.name, instance_id=self.instance_id, run=self.run,
            version=__version__, state=common_pb2.ServiceState.SERVICE_STATE_STARTING,
            uptime_s=time.monotonic() - self.started_at, message=self.status_message(),
        )  # fmt: skip

    def _handler(self) -> grpc.GenericRpcHandler:
        """The control service's methods: GetStatus answers, the rest are UNAVAILABLE."""
        handlers = {}
        for method in self.spec.control.methods:
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            if method.name == "GetStatus":

                async def get_status(request: Any, context: Any, cls: Any = response_cls) -> Any:
                    return cls(info=self.info())

                fn: Callable[..., Any] = get_status
            else:

                async def unavailable(request: Any, context: Any) -> Any:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"{self.spec.name} is starting: {self.status_message()}",
                    )

                fn = unavailable
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                fn,
                request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString,
            )
        return grpc.method_handlers_generic_handler(self.spec.control.full_name, handlers)

    async def start(self, grpc_cfg: GrpcSection, security: ControlSecurity) -> int:
        """Serve on ``grpc_cfg``'s port (health NOT_SERVING); returns the bound port."""
        handler = self._handler()

        def register(_servicer: Any, server: Any) -> None:
            server.add_generic_rpc_handlers((handler,))

        self.server = await start_server(
            grpc_cfg.host, grpc_cfg.port, [(register, None, self.spec.control)], security=security
        )
        return self.server.port

    async def stop(self) -> None:
        """Release the port (idempotent)."""
        if self.server is not None:
            server, self.server = self.server, None
            await server.server.stop(None)

    async def wait_for(
        self, what: str, attempt: Callable[[], Awaitable[T]], patience_s: float
    ) -> T:
        """``await attempt()``, tried again with backoff while it fails transiently, for up
        to ``patience_s``; the status message says ``what`` is awaited and why."""
        deadline = time.monotonic() + patience_s
        delay = FIRST_DELAY_S
        n = 0
        while True:
            n += 1
            self.message = f"connecting to {what}"
            try:
                return await attempt()
            except TreadleError as e:
                if not transient(e):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    if n == 1:
                        raise
                    raise type(e)(
                        f"{e} (gave up after {n} attempts in {patience_s:.0f}s: run.startup_wait_s)"
                    ) from None
                wait = min(delay, left)
                self.message = f"waiting for {what}: {e} (attempt {n} failed, next in {wait:.1f}s)"
                log.warning("[startup] %s", self.message)
                try:
                    await asyncio.wait_for(self.stop_requested.wait(), wait)
                except TimeoutError:
                    pass
                else:
                    raise StartupInterrupted(f"stopped while waiting for {what}") from None
                delay = min(delay * 2, MAX_DELAY_S)


async def probe(
    spec: ServiceSpec, target: str, security: ControlSecurity, timeout_s: float = 5.0
) -> tuple[bool, str]:
    """(healthy, one line) for the service at ``target``: its gRPC health, and when it is
    not SERVING its GetStatus state and message (what it waits for and why)."""
    name = spec.control.full_name
    try:
        async with open_channel(
            target, default_timeout_s=timeout_s, max_attempts=1, security=security
        ) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=name)
            )
            serving = health.status == health_pb2.HealthCheckResponse.SERVING
            try:
                status = await spec.stub(channel).GetStatus(common_pb2.GetStatusRequest())
            except grpc.aio.AioRpcError as e:
                detail = f"GetStatus: {e.code().name}: {e.details()}"
            else:
                state = common_pb2.ServiceState.Name(status.info.state)
                detail = state.removeprefix("SERVICE_STATE_")
                if status.info.message:
                    detail += f": {status.info.message}"
    except grpc.aio.AioRpcError as e:
        return False, f"{spec.name} at {target}: no answer ({e.code().name}: {e.details()})"
    health_name = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    return serving, f"{spec.name} at {target}: {health_name} ({detail})"


def probe_target(grpc_cfg: GrpcSection) -> str:
    """Where a probe on the service's own machine reaches its gRPC port."""
    host = grpc_cfg.host
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    return f"[{host}]:{grpc_cfg.port}" if ":" in host else f"{host}:{grpc_cfg.port}"
