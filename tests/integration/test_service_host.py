"""A service process end to end: config, NATS, gRPC control plane, clean shutdown, and
clear failures for bad config or an unreachable bus."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treadle.proto.v1 import common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services.credentials import generate
from treadle.services.nats_server import EmbeddedNats
from treadle.services.rpc import check_health, open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.trainer.spec import SPEC as TRAINER

pytestmark = pytest.mark.integration


def trainer_argv(tmp_path: Path, nats_url: str, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "treadle.trainer",
        "--nats.url", nats_url,
        "--run.name", "hosttest",
        "--run.output_dir", str(tmp_path),
        "--trainer.grpc.port", str(port),
        *extra,
    ]  # fmt: skip


async def wait_healthy(proc: ManagedProcess, target: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check_health(target, TRAINER.control.full_name):
        if proc.poll() is not None:
            raise proc.failure("died")
        assert time.monotonic() < deadline, "service never became healthy"
        await asyncio.sleep(0.1)


def test_service_serves_status_and_stops_on_request(
    tmp_path: Path, nats_url: str, free_port: int
) -> None:
    proc = ManagedProcess(
        "trainer", trainer_argv(tmp_path, nats_url, free_port), tmp_path / "trainer.log"
    ).start()
    target = f"127.0.0.1:{free_port}"

    async def main() -> None:
        await wait_healthy(proc, target)
        async with open_channel(target, [TRAINER.control]) as channel:
            stub = trainer_service_pb2_grpc.TrainerControlStub(channel)
            status = await stub.GetStatus(common_pb2.GetStatusRequest())
            assert status.info.service == "trainer"
            assert status.info.run == "hosttest"
            assert status.info.state == common_pb2.ServiceState.SERVICE_STATE_READY
            assert "trainer.model is not set" in status.info.message
            await stub.Stop(trainer_service_pb2.StopRequest(reason="test"))

    try:
        asyncio.run(main())
        assert proc.proc is not None
        assert proc.proc.wait(timeout=20) == 0
    finally:
        proc.stop()
    log = (tmp_path / "trainer.log").read_text()
    assert "[startup] gRPC on 127.0.0.1" in log
    assert "stop requested over gRPC: test" in log
    assert "[shutdown] trainer stopped cleanly" in log


def test_service_sigterm_is_a_clean_stop(tmp_path: Path, nats_url: str, free_port: int) -> None:
    proc = ManagedProcess(
        "trainer", trainer_argv(tmp_path, nats_url, free_port), tmp_path / "trainer.log"
    ).start()
    try:
        asyncio.run(wait_healthy(proc, f"127.0.0.1:{free_port}"))
    finally:
        code = proc.stop(grace_s=20)
    assert code == 0
    assert "signal received; draining" in (tmp_path / "trainer.log").read_text()


def test_service_bad_config_exits_2_with_one_clear_error(tmp_path: Path, nats_url: str) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("[trainer.grpc]\nprot = 1\n")
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.trainer", "@", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "trainer.grpc.prot: unknown key" in proc.stderr
    assert "did you mean 'trainer.grpc.port'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_service_unreachable_nats_fails_fast_and_clearly(tmp_path: Path, free_port: int) -> None:
    started = time.monotonic()
    proc = subprocess.run(
        trainer_argv(tmp_path, f"nats://127.0.0.1:{free_port}", 0, "--nats.connect_timeout_s", "1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert f"cannot reach NATS at nats://127.0.0.1:{free_port}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - started < 30


def test_service_dry_run_prints_resolved_config(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.trainer", "--trainer.grpc.port", "6123", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[trainer.grpc]" in proc.stdout
    assert "port = 6123" in proc.stdout


def test_service_grpc_port_in_use_exits_1_naming_the_port(tmp_path: Path, nats_url: str) -> None:
    """Two services on one port: the second one fails with the port in its one-line
    error (gRPC's SO_REUSEPORT used to let both bind and split the calls)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = subprocess.run(trainer_argv(tmp_path, nats_url, port),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert f"cannot serve gRPC on 127.0.0.1:{port}: the port is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_service_refused_credentials_exit_1_with_one_line(tmp_path: Path) -> None:
    """A service whose seed is not a user of the server (here: another run's folder)
    stops at once with one line; a missing token file is a config error (exit 2)."""
    server_creds = generate(tmp_path / "server", "hosttest")
    other = generate(tmp_path / "other", "hosttest")
    nats = EmbeddedNats(
        tmp_path / "store", tmp_path / "nats.log", config_file=server_creds.nats_conf
    )
    url = nats.start()
    try:
        started = time.monotonic()
        proc = subprocess.run(
            trainer_argv(tmp_path, url, 0, "--nats.credentials", str(other.seed("trainer")),
                         "--nats.tls_ca", str(server_creds.ca)),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 1
        assert "refused this client (Authorization Violation)" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert time.monotonic() - started < 60
        missing = subprocess.run(
            trainer_argv(tmp_path, url, 0, "--control.token_file", str(tmp_path / "nope")),
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert missing.returncode == 2
        assert "control.token_file" in missing.stderr
        assert "Traceback" not in missing.stderr
    finally:
        nats.stop()
