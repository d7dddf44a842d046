"""A service whose NATS or S3 is not there yet: its health says which and why, it tries
again with backoff, and it either comes up when the dependency does or exits with the
reason; credentials that are refused end it at once (no retry loop)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.seaweed import SeaweedS3
from treadle.services.credentials import create_streams, generate
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port
from treadle.services.supervisor import ManagedProcess

pytestmark = pytest.mark.integration

RUN = "waits"


def trainer_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--run.name", RUN, "--run.output_dir", str(tmp_path / "out"), *extra]


def health(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`treadle health trainer` with the service's own config (what compose runs)."""
    return subprocess.run(
        [sys.executable, "-m", "treadle.services.cli", "health", "trainer", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def wait_for_line(
    args: list[str], env: dict[str, str], proc: ManagedProcess, want: str, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        r = health(args, env)
        if want in r.stdout:
            return r
        assert proc.poll() is None, proc.failure("died").args[0]
        assert time.monotonic() < deadline, f"health never said {want!r}; last: {r.stdout}"
        time.sleep(0.5)


def test_startup_waits_for_late_nats_says_why_then_serves(tmp_path: Path) -> None:
    creds = generate(tmp_path / "creds", RUN)
    nats_port, grpc_port = free_port(), free_port()
    url = f"tls://127.0.0.1:{nats_port}"
    env = {**os.environ, **creds.child_env("trainer")}
    args = trainer_args(tmp_path, "--nats.url", url, "--trainer.grpc.port", str(grpc_port),
                        "--run.startup_wait_s", "120")  # fmt: skip
    proc = ManagedProcess(
        "trainer", [sys.executable, "-m", "treadle.trainer", *args], tmp_path / "trainer.log",
        env=env,
    ).start()  # fmt: skip
    nats = EmbeddedNats(tmp_path / "nats", tmp_path / "nats.log", port=nats_port,
                        config_file=creds.nats_conf)  # fmt: skip
    try:
        r = wait_for_line(args, env, proc, "failed, next in")
        assert r.returncode == 1
        line = r.stdout.strip()
        assert line.startswith(f"trainer at 127.0.0.1:{grpc_port}: NOT_SERVING (STARTING: ")
        assert f"waiting for NATS at {url}: cannot reach NATS at {url}" in line
        assert "nothing accepts connections" in line
        # backoff: the attempts are logged with growing waits
        time.sleep(2)
        log = (tmp_path / "trainer.log").read_text()
        assert "attempt 1 failed, next in 0.5s" in log
        assert "attempt 2 failed, next in 1.0s" in log
        # NATS comes up (and the streams, as compose's one-shot makes them): it serves
        nats.start()
        asyncio.run(create_streams(creds, url))
        ok = wait_for_line(args, env, proc, "SERVING (READY")
        assert ok.returncode == 0, ok.stdout
        assert proc.poll() is None
    finally:
        code = proc.stop(grace_s=20)
        nats.stop()
    assert code == 0, (tmp_path / "trainer.log").read_text()[-2000:]


def test_startup_gives_up_on_s3_with_the_reason(tmp_path: Path) -> None:
    s3_port, grpc_port = free_port(), free_port()
    args = trainer_args(
        tmp_path, "--nats.url", "nats://127.0.0.1:1", "--trainer.grpc.port", str(grpc_port),
        "--run.startup_wait_s", "6", "--object_store.backend", "s3",
        "--object_store.endpoint", f"127.0.0.1:{s3_port}", "--object_store.access_key", "a",
        "--object_store.max_retries", "0",
    )  # fmt: skip
    env = {**os.environ, "TREADLE_OBJECT_STORE__SECRET_KEY": "b"}
    proc = ManagedProcess(
        "trainer", [sys.executable, "-m", "treadle.trainer", *args], tmp_path / "trainer.log",
        env=env,
    ).start()  # fmt: skip
    try:
        r = wait_for_line(args, env, proc, "failed, next in")
        assert f"waiting for the object store (S3 at 127.0.0.1:{s3_port}, bucket treadle)" in (
            r.stdout
        )
        assert f"cannot reach S3 at 127.0.0.1:{s3_port}" in r.stdout
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() == 1
    finally:
        proc.stop(grace_s=10)
    log = (tmp_path / "trainer.log").read_text()
    assert f"cannot reach S3 at 127.0.0.1:{s3_port}" in log
    assert "(gave up after " in log
    assert "run.startup_wait_s)" in log
    assert "Traceback" not in log


def test_startup_refused_credentials_exit_at_once(tmp_path: Path, s3_server: SeaweedS3) -> None:
    started = time.monotonic()
    args = trainer_args(
        tmp_path, "--nats.url", "nats://127.0.0.1:1", "--trainer.grpc.port", "0",
        "--run.startup_wait_s", "300", "--object_store.backend", "s3",
        "--object_store.endpoint", s3_server.endpoint, "--object_store.access_key", "wrong",
    )  # fmt: skip
    env = {**os.environ, "TREADLE_OBJECT_STORE__SECRET_KEY": "not-the-key"}
    proc = subprocess.run([sys.executable, "-m", "treadle.trainer", *args],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 1
    assert "rejected the request" in proc.stderr
    assert "attempt 1 failed" not in proc.stderr  # refused keys are not retried
    assert time.monotonic() - started < 60
