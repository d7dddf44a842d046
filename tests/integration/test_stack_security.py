"""`treadle stack` closes its bus and control plane and keeps secrets out of argv and logs.

A real launch (nats-server + the trainer as a real child): the secret given as a flag
is read back from the child's /proc cmdline (absent) and environment (present), every
log and the saved config are searched for it, an anonymous NATS client and a gRPC call
without the token are made against the running stack and must be refused.
"""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from treadle.proto.v1 import common_pb2, trainer_service_pb2_grpc
from treadle.services.bus import Bus
from treadle.services.errors import BusUnavailableError
from treadle.services.rpc import ControlSecurity, open_channel
from treadle.services.sections import NatsSection
from treadle.trainer.spec import SPEC as TRAINER

pytestmark = pytest.mark.integration

SECRET = "Sup3r-Secret-Value-42"


def stack(tmp_path: Path, run: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "treadle.services.cli", "stack",
            "--run.output_dir", str(tmp_path), "--run.name", run, *args]  # fmt: skip


def wait_for(path: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_stack_closed_bus_token_and_secrets_off_argv(tmp_path: Path) -> None:
    run = tmp_path / "sec"
    launcher = subprocess.Popen(
        stack(tmp_path, "sec", "--launcher.services", '["trainer"]',
              "--object_store.secret_key", SECRET),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(run / "stack.json")
        doc = json.loads((run / "stack.json").read_text())
        pid = doc["services"]["trainer"]["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode()
        assert SECRET not in cmdline
        assert f"TREADLE_OBJECT_STORE__SECRET_KEY={SECRET}" in environ
        assert "TREADLE_NATS__CREDENTIALS=" in environ

        url = doc["nats"]["url"]
        assert url.startswith("tls://")
        target = doc["services"]["trainer"]["grpc"]
        ca = run / "credentials" / "ca.pem"

        async def attacks() -> None:
            # an anonymous client (with the right CA, even) is refused by nats-server
            with pytest.raises(BusUnavailableError, match="Authorization Violation"):
                await Bus.connect(NatsSection(url=url, tls_ca=ca, connect_timeout_s=2), "sec")
            # a control call without the token is refused by the trainer's server
            no_token = ControlSecurity(ca=ca.read_bytes())
            async with open_channel(target, [TRAINER.control], security=no_token) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await trainer_service_pb2_grpc.TrainerControlStub(channel).GetStatus(
                        common_pb2.GetStatusRequest(), timeout=5
                    )
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(attacks())
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err
    assert SECRET not in out + err
    assert stat.S_IMODE((run / "credentials").stat().st_mode) == 0o700
    for path in [*(run / "logs").iterdir(), run / "config.toml", run / "stack.json"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
        assert SECRET not in path.read_text(), path
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert "(TLS, token required)" in trainer_log
    assert "(authenticated)" in trainer_log


def test_stack_dry_run_masks_url_passwords_and_secrets(tmp_path: Path) -> None:
    proc = subprocess.run(
        stack(tmp_path, "dry", "--dry-run", "--nats.url", f"nats://treadle:{SECRET}@127.0.0.1:4222",
              "--object_store.secret_key", SECRET),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    assert "nats://treadle:**********@127.0.0.1:4222" in proc.stdout


def test_stack_hands_the_policy_vocabulary_to_the_orchestrator(tmp_path: Path) -> None:
    """A default stack with a policy model starts the orchestrator with that model's
    vocab_size, the bound its sanity check refuses forged token ids against (the refusal
    itself: test_poison_forged_rollouts_are_refused_before_training)."""
    from testkit.trainer import tiny_qwen3

    model = tiny_qwen3(tmp_path / "model")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = tmp_path / "voc"
    launcher = subprocess.Popen(
        stack(tmp_path, "voc", "--launcher.services", '["trainer", "orchestrator"]',
              "--trainer.model", str(model), "--trainer.device", "cpu"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(run / "stack.json")
        doc = json.loads((run / "stack.json").read_text())
        pid = doc["services"]["orchestrator"]["pid"]
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err
    assert argv[argv.index("--orchestrator.vocab_size") + 1] == str(vocab)
    assert f"orchestrator.vocab_size = {vocab} (trainer.model)" in err
