"""The control plane closed: TLS with the run's CA, a bearer token on control RPCs, mutual
TLS when asked, and one service per port. Real gRPC servers on free loopback ports;
each attack (plaintext, no token, a wrong token, a foreign certificate, a second server
on a bound port) is the real call."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import grpc
import pytest

from treadle.proto.v1 import common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.credentials import cert_names, generate, make_ca, make_leaf
from treadle.services.errors import ConfigError
from treadle.services.rpc import (
    ControlSecurity,
    check_health,
    open_channel,
    rejected_calls,
    start_server,
)
from treadle.services.sections import ControlSection

pytestmark = pytest.mark.integration

TRAINER = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerControl"]


class Trainer(trainer_service_pb2_grpc.TrainerControlServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.calls += 1
        return trainer_service_pb2.TrainerStatus(step=7)


def security(tmp_path: Path, *, mtls: bool = False) -> ControlSecurity:
    creds = generate(tmp_path / "credentials", "rpcsec")
    return ControlSecurity.load(
        ControlSection(
            tls_cert=creds.cert,
            tls_key=creds.key,
            tls_ca=creds.ca,
            token_file=creds.token,
            require_client_cert=mtls,
        )
    )


async def serve(
    servicer: Trainer, sec: ControlSecurity, port: int = 0, host: str = "127.0.0.1"
) -> Any:
    server = await start_server(
        host, port,
        [(trainer_service_pb2_grpc.add_TrainerControlServicer_to_server, servicer, TRAINER)],
        security=sec,
    )  # fmt: skip
    await server.set_serving(True)
    return server


async def status(target: str, sec: ControlSecurity, tls_name: str = "") -> int:
    async with open_channel(
        target, [TRAINER], default_timeout_s=3, security=sec, tls_name=tls_name
    ) as channel:
        reply = await trainer_service_pb2_grpc.TrainerControlStub(channel).GetStatus(
            common_pb2.GetStatusRequest()
        )
    return int(reply.step)


def test_rpc_tls_and_token_let_the_run_s_clients_in(tmp_path: Path) -> None:
    sec = security(tmp_path)

    async def main() -> None:
        servicer = Trainer()
        server = await serve(servicer, sec)
        try:
            assert await status(f"127.0.0.1:{server.port}", sec) == 7
            assert await status(f"localhost:{server.port}", sec) == 7
            assert await check_health(f"127.0.0.1:{server.port}", security=sec)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_rpc_dialled_by_an_address_the_certificate_lacks_verifies_a_name_it_holds(
    tmp_path: Path,
) -> None:
    """An announced replica is dialled by its address (127.0.0.2 here, not among the
    certificate's names): refused as it is, let in when told a name the certificate
    holds; a certificate from another CA stays refused under that name."""
    sec = security(tmp_path)
    other_ca, other_key = make_ca("someone else")
    names = cert_names(sec.cert or b"")
    assert "127.0.0.2" not in names

    async def main() -> None:
        server = await serve(Trainer(), sec, host="0.0.0.0")
        impostor = await serve(Trainer(), ControlSecurity(*make_leaf(other_ca, other_key,
                               ["localhost"]), token=sec.token), host="0.0.0.0")  # fmt: skip
        try:
            target = f"127.0.0.2:{server.port}"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status(target, sec)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert await status(target, sec, tls_name=names[0]) == 7
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status(f"127.0.0.2:{impostor.port}", sec, tls_name="localhost")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
            await impostor.stop(0)

    asyncio.run(main())


def test_rpc_without_token_is_unauthenticated_and_counted(tmp_path: Path) -> None:
    sec = security(tmp_path)
    no_token = ControlSecurity(ca=sec.ca)
    wrong = ControlSecurity(ca=sec.ca, token="not-the-token")

    async def main() -> None:
        servicer = Trainer()
        server = await serve(servicer, sec)
        target = f"127.0.0.1:{server.port}"
        before = rejected_calls.get("/treadle.proto.v1.TrainerControl/GetStatus", 0)
        try:
            for client in (no_token, wrong):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await status(target, client)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "bearer token" in (err.value.details() or "")
            assert servicer.calls == 0  # the servicer never ran
            assert rejected_calls["/treadle.proto.v1.TrainerControl/GetStatus"] == before + 2
            assert await check_health(target, security=no_token)  # probes stay open
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_rpc_plaintext_and_foreign_ca_clients_are_refused(tmp_path: Path) -> None:
    sec = security(tmp_path)
    other_ca, _ = make_ca("someone else")
    plaintext = ControlSecurity(token=sec.token)
    foreign = ControlSecurity(ca=other_ca, token=sec.token)

    async def main() -> None:
        servicer = Trainer()
        server = await serve(servicer, sec)
        target = f"127.0.0.1:{server.port}"
        try:
            for client in (plaintext, foreign):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await status(target, client)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls == 0
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_rpc_mutual_tls_refuses_clients_without_the_run_s_certificate(tmp_path: Path) -> None:
    sec = security(tmp_path, mtls=True)
    other_ca, other_key = make_ca("someone else")
    cert, key = make_leaf(other_ca, other_key, ["127.0.0.1"])
    no_cert = ControlSecurity(ca=sec.ca, token=sec.token)
    foreign_cert = ControlSecurity(ca=sec.ca, token=sec.token, cert=cert, key=key)

    async def main() -> None:
        servicer = Trainer()
        server = await serve(servicer, sec)
        target = f"127.0.0.1:{server.port}"
        try:
            assert await status(target, sec) == 7
            for client in (no_cert, foreign_cert):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await status(target, client)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert servicer.calls == 1
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_rpc_port_in_use_is_an_error_naming_it() -> None:
    async def main() -> None:
        first = await serve(Trainer(), ControlSecurity())
        try:
            with pytest.raises(
                ConfigError, match=rf"127\.0\.0\.1:{first.port}: the port is already in use"
            ):
                await serve(Trainer(), ControlSecurity(), port=first.port)
        finally:
            await first.stop(0)
        # a port held by any other process's socket is refused the same way
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
                await serve(Trainer(), ControlSecurity(), port=port)

    asyncio.run(main())


def test_rpc_loose_token_file_is_a_config_error(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token")
    token.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        ControlSecurity.load(ControlSection(token_file=token))


def test_rpc_client_certificates_without_a_ca_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="require_client_cert needs"):
        ControlSecurity.load(ControlSection(require_client_cert=True))
