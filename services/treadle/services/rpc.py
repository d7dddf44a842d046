"""gRPC control plane: server bootstrap and clients with deadlines, retries and tracing.

Servers always expose ``grpc.health.v1.Health`` (overall and per service) and server
reflection, and shut down gracefully (health flips to NOT_SERVING, in-flight calls get
``shutdown_grace_s``). Clients always send a deadline (a default is added to calls that
do not set one) and retry only methods the contract marks idempotent — the
``idempotency_level`` option in the ``.proto`` (NO_SIDE_EFFECTS or IDEMPOTENT) — on
UNAVAILABLE, a bounded number of times. Trace context travels in metadata both ways.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from treadle.services import telemetry

log = logging.getLogger(__name__)

_UNTRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes are not work
_RETRYABLE_LEVELS = (
    descriptor_pb2.MethodOptions.NO_SIDE_EFFECTS,
    descriptor_pb2.MethodOptions.IDEMPOTENT,
)


def idempotent_methods(service: ServiceDescriptor) -> list[str]:
    """Names of the methods of ``service`` that the contract marks safe to retry."""
    out = []
    for method in service.methods:
        opts = method.GetOptions()
        if opts.idempotency_level in _RETRYABLE_LEVELS:
            out.append(method.name)
    return out


def service_config(
    services: Sequence[ServiceDescriptor], *, max_attempts: int = 4, timeout_s: float = 10.0
) -> str:
    """gRPC service config JSON: retry policy for idempotent methods, timeout for all."""
    retry = {
        "maxAttempts": max_attempts,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    configs: list[dict[str, Any]] = []
    for svc in services:
        names = idempotent_methods(svc)
        if names:
            configs.append(
                {
                    "name": [{"service": svc.full_name, "method": m} for m in names],
                    "retryPolicy": retry,
                    "timeout": f"{timeout_s}s",
                }
            )
        others = [m.name for m in svc.methods if m.name not in names]
        if others:
            configs.append(
                {
                    "name": [{"service": svc.full_name, "method": m} for m in others],
                    "timeout": f"{timeout_s}s",
                }
            )
    return json.dumps({"methodConfig": configs})


# --- interceptors ---------------------------------------------------------------------------
class _ClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the default deadline when a call has none, and the trace context."""

    def __init__(self, default_timeout_s: float):
        self.default_timeout_s = default_timeout_s

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        metadata = list(details.metadata or [])
        carrier: dict[str, str] = {}
        telemetry.inject(carrier)
        metadata += list(carrier.items())
        new = grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout if details.timeout is not None else self.default_timeout_s,
            metadata=grpc.aio.Metadata(*metadata),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )
        return await continuation(new, request)


class _ServerTracing(grpc.aio.ServerInterceptor):
    """Starts a SERVER span per unary call, parented by the caller's trace context."""

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or details.method.startswith(_UNTRACED):
            return handler
        method = details.method
        carrier = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        inner = handler.unary_unary

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with telemetry.tracer(__name__).start_as_current_span(
                method.lstrip("/"),
                context=telemetry.extract(carrier),
                kind=trace.SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.method": method},
            ):
                return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            traced,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# --- server ---------------------------------------------------------------------------------
Registrar = Callable[[Any, Any], None]  # e.g. add_TrainerControlServicer_to_server


@dataclass
class GrpcServer:
    """A started server with health; ``port`` is the bound port."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: list[str]

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Flip health to NOT_SERVING, then stop accepting and let calls finish."""
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_server(
    host: str,
    port: int,
    services: Sequence[tuple[Registrar, Any, ServiceDescriptor]],
) -> GrpcServer:
    """Bind ``host:port`` (0 = any free port) with health + reflection and start serving.

    ``services``: (add_XServicer_to_server, servicer, X service descriptor) triples.
    Health starts NOT_SERVING; call ``set_serving(True)`` once the service is ready.
    """
    server = grpc.aio.server(interceptors=[_ServerTracing()])
    names = []
    for register, servicer, descriptor in services:
        register(servicer, server)
        names.append(descriptor.full_name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port} (port in use?)")
    await server.start()
    srv = GrpcServer(server, bound, health_servicer, names)
    await srv.set_serving(False)
    return srv


# --- client ---------------------------------------------------------------------------------
def open_channel(
    target: str,
    services: Sequence[ServiceDescriptor] = (),
    *,
    default_timeout_s: float = 10.0,
    max_attempts: int = 4,
) -> grpc.aio.Channel:
    """An aio channel whose calls always carry a deadline and retry only idempotent methods."""
    options = [
        ("grpc.enable_retries", 1),
        (
            "grpc.service_config",
            service_config(services, max_attempts=max_attempts, timeout_s=default_timeout_s),
        ),
    ]
    return grpc.aio.insecure_channel(
        target, options=options, interceptors=[_ClientInterceptor(default_timeout_s)]
    )


async def check_health(target: str, service: str = "", timeout_s: float = 2.0) -> bool:
    """True when ``target`` reports SERVING for ``service`` ('' = the whole server)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
