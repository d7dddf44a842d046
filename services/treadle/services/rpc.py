"""gRPC control plane: server bootstrap and clients with deadlines, retries and tracing.

Servers always expose ``grpc.health.v1.Health`` (overall and per service) and server
reflection, and shut down gracefully (health flips to NOT_SERVING, in-flight calls get
``shutdown_grace_s``). Clients always send a deadline (a default is added to calls that
do not set one) and retry only methods the contract marks idempotent — the
``idempotency_level`` option in the ``.proto`` (NO_SIDE_EFFECTS or IDEMPOTENT) — on
UNAVAILABLE, a bounded number of times. Trace context travels in metadata both ways.

Security (``[control]``, see ``ControlSecurity``): with a certificate the server speaks
TLS only (and with ``require_client_cert`` accepts only clients whose certificate the
run's CA signed); with a token every call but health and reflection must carry
``authorization: Bearer <token>``, else it is answered UNAUTHENTICATED and counted
(``treadle.rpc.unauthenticated``). A process's clients use what ``configure_clients``
was given (the service host calls it with the service's own config). A port that is
already bound is an error naming it: the server never shares a port (no SO_REUSEPORT).
"""

from __future__ import annotations

import hmac
import json
import logging
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from treadle.services import telemetry
from treadle.services.errors import ConfigError
from treadle.services.ports import is_listening
from treadle.services.sections import ControlSection

log = logging.getLogger(__name__)

_UNTRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes are not work
_OPEN = _UNTRACED  # callable without the token: probes reveal nothing and change nothing
AUTH_HEADER = "authorization"
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


def service_config(services: Sequence[ServiceDescriptor], *, max_attempts: int = 4) -> str:
    """gRPC service config JSON: the retry policy of idempotent methods. No timeout: gRPC
    takes the smaller of a service config's timeout and a call's own deadline, so a default
    here would cut every longer deadline short (an UpdateWeights draining busy replicas
    failed at 10 s while it asked for 120); ``_ClientInterceptor`` fills in the default
    only for calls that have none."""
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
                }
            )
    return json.dumps({"methodConfig": configs})


# --- security -------------------------------------------------------------------------------
def _read_private(path: Path, what: str) -> bytes:
    """A key or token file: must exist and be readable by its owner only."""
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{what} {path} is readable by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
    return data


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror})") from None


@dataclass(frozen=True)
class ControlSecurity:
    """The control plane's TLS material and token, loaded from a ``[control]`` section."""

    cert: bytes | None = None  # PEM
    key: bytes | None = None  # PEM
    ca: bytes | None = None  # PEM
    require_client_cert: bool = False
    token: str | None = None

    @classmethod
    def load(cls, section: ControlSection) -> ControlSecurity:
        """Read the files ``section`` names (ConfigError naming a missing or loose one)."""
        if section.require_client_cert and (section.tls_ca is None or section.tls_cert is None):
            raise ConfigError(
                "control.require_client_cert needs control.tls_ca and control.tls_cert/tls_key"
            )
        token = None
        if section.token_file is not None:
            token = _read_private(section.token_file, "control.token_file").decode().strip()
            if not token:
                raise ConfigError(f"control.token_file {section.token_file} is empty")
        return cls(
            cert=_read(section.tls_cert, "control.tls_cert") if section.tls_cert else None,
            key=_read_private(section.tls_key, "control.tls_key") if section.tls_key else None,
            ca=_read(section.tls_ca, "control.tls_ca") if section.tls_ca else None,
            require_client_cert=section.require_client_cert,
            token=token,
        )

    @property
    def tls(self) -> bool:
        """Whether channels to servers use TLS (a CA to verify them is configured)."""
        return self.ca is not None


_clients = ControlSecurity()


def configure_clients(security: ControlSecurity) -> None:
    """What ``open_channel``/``check_health`` of this process use unless told otherwise."""
    global _clients
    _clients = security


_unauthenticated = telemetry.meter(__name__).create_counter(
    "treadle.rpc.unauthenticated", description="control RPCs refused for a missing or wrong token"
)
rejected_calls: dict[str, int] = {}
"""Control RPCs refused for a missing or wrong token, by method (this process)."""


class _ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call but health/reflection that lacks ``authorization: Bearer <token>``."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        method = details.method
        if method.startswith(_OPEN):
            return await continuation(details)
        given = next((v for k, v in (details.invocation_metadata or ()) if k == AUTH_HEADER), "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self.expected):
            return await continuation(details)
        rejected_calls[method] = rejected_calls.get(method, 0) + 1
        _unauthenticated.add(1, {"rpc.method": method})
        if rejected_calls[method] == 1:
            log.warning("refused %s: %s bearer token", method, "wrong" if given else "no")

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "this control RPC needs the run's bearer token (control.token_file)",
            )

        return grpc.unary_unary_rpc_method_handler(deny)


# --- interceptors ---------------------------------------------------------------------------
class _ClientInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the default deadline when a call has none, the trace context and the token."""

    def __init__(self, default_timeout_s: float, token: str | None = None):
        self.default_timeout_s = default_timeout_s
        self.token = token

    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        metadata = list(details.metadata or [])
        carrier: dict[str, str] = {}
        telemetry.inject(carrier)
        metadata += list(carrier.items())
        if self.token:
            metadata.append((AUTH_HEADER, f"Bearer {self.token}"))
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
    *,
    security: ControlSecurity | None = None,
) -> GrpcServer:
    """Bind ``host:port`` (0 = any free port) with health + reflection and start serving.

    ``services``: (add_XServicer_to_server, servicer, X service descriptor) triples.
    Health starts NOT_SERVING; call ``set_serving(True)`` once the service is ready.
    ``security``: TLS and token (default: plaintext, no token). A port already in use
    is a ConfigError naming it.
    """
    security = security or ControlSecurity()
    interceptors: list[grpc.aio.ServerInterceptor] = [_ServerTracing()]
    if security.token:
        interceptors.insert(0, _ServerAuth(security.token))
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
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
    address = f"{host}:{port}"
    try:
        if security.cert is not None and security.key is not None:
            creds = grpc.ssl_server_credentials(
                [(security.key, security.cert)],
                root_certificates=security.ca if security.require_client_cert else None,
                require_client_auth=security.require_client_cert,
            )
            bound = server.add_secure_port(address, creds)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        why = (
            "the port is already in use by another process"
            if port
            and is_listening(host if host not in ("0.0.0.0", "::", "") else "127.0.0.1", port)
            else "the address cannot be bound on this machine"
        )
        # stop the unbound server now, in this event loop: left to the garbage collector it
        # is torn down later from a closed loop
        await server.stop(None)
        raise ConfigError(
            f"cannot serve gRPC on {address}: {why}; choose another grpc.port (0 = a free one)"
        )
    await server.start()
    srv = GrpcServer(server, bound, health_servicer, names)
    await srv.set_serving(False)
    return srv


# --- client ---------------------------------------------------------------------------------
def _channel(
    target: str,
    security: ControlSecurity,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[Any] = (),
    tls_name: str = "",
) -> grpc.aio.Channel:
    if not security.tls:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    if tls_name:  # the server's certificate names this, not the address dialled
        options = [*options, ("grpc.ssl_target_name_override", tls_name)]
    creds = grpc.ssl_channel_credentials(
        root_certificates=security.ca,
        private_key=security.key if security.cert is not None else None,
        certificate_chain=security.cert,
    )
    return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)


def open_channel(
    target: str,
    services: Sequence[ServiceDescriptor] = (),
    *,
    default_timeout_s: float = 10.0,
    max_attempts: int = 4,
    security: ControlSecurity | None = None,
    tls_name: str = "",
) -> grpc.aio.Channel:
    """An aio channel whose calls always carry a deadline and retry only idempotent methods;
    over TLS with the token when ``security`` (default: ``configure_clients``'s) has them.
    ``tls_name``: the name to verify the server's certificate against when it is not the
    host of ``target`` (a replica found by its address; still signed by the run's CA)."""
    security = security or _clients
    options = [
        ("grpc.enable_retries", 1),
        (
            "grpc.service_config",
            service_config(services, max_attempts=max_attempts),
        ),
    ]
    return _channel(
        target,
        security,
        options,
        [_ClientInterceptor(default_timeout_s, security.token)],
        tls_name,
    )


async def check_health(
    target: str,
    service: str = "",
    timeout_s: float = 2.0,
    *,
    security: ControlSecurity | None = None,
) -> bool:
    """True when ``target`` reports SERVING for ``service`` ('' = the whole server)."""
    async with _channel(target, security or _clients) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
