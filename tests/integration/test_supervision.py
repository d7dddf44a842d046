"""Process supervision and the local launcher (`treadle stack`)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from testkit.grpc_busy import grpc_busy
from testkit.procs import processes_under
from treadle.services.supervisor import ManagedProcess, tail

pytestmark = pytest.mark.integration


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); its state in /proc tells
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_supervisor_escalates_to_sigkill(tmp_path: Path) -> None:
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('sig' + 'term ignored', flush=True); time.sleep(600)"
    proc = ManagedProcess("stubborn", [sys.executable, "-c", stubborn], tmp_path / "s.log").start()
    deadline = time.monotonic() + 10
    while "sigterm ignored" not in tail(tmp_path / "s.log"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    started = time.monotonic()
    code = proc.stop(grace_s=1.0)
    assert code == -signal.SIGKILL
    assert 0.9 < time.monotonic() - started < 10


def test_supervisor_failure_carries_the_last_log_lines(tmp_path: Path) -> None:
    script = "import sys; [print(f'line {i}') for i in range(100)]; sys.exit(3)"
    proc = ManagedProcess("crasher", [sys.executable, "-c", script], tmp_path / "c.log").start()
    assert proc.proc is not None
    proc.proc.wait(timeout=30)
    err = str(proc.failure("died"))
    assert "crasher died (exited with code 3)" in err
    assert "line 99" in err
    assert "line 50" not in err  # only the tail


def stack(tmp_path: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "treadle.services.cli",
        "stack",
        "--run.output_dir",
        str(tmp_path),
        *args,
    ]


def test_stack_check_starts_and_stops_everything(tmp_path: Path) -> None:
    proc = subprocess.run(
        stack(tmp_path, "--check", "--run.name", "check"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    run = tmp_path / "check"
    doc = json.loads((run / "stack.json").read_text())
    assert list(doc["services"]) == ["inference", "trainer", "orchestrator", "env_runner"]
    for name in doc["services"]:
        assert f"{name:<13} grpc" in proc.stdout
        assert "[shutdown]" in (run / "logs" / f"{name}.log").read_text()
    pids = [s["pid"] for s in doc["services"].values()] + [doc["nats"]["pid"]]
    assert not [p for p in pids if alive(p)]
    # the whole resolved config: shared sections and every service's own section
    kept = tomllib.loads((run / "config.toml").read_text())
    assert {"run", "nats", "launcher", *doc["services"]} <= set(kept)
    assert kept["run"]["name"] == "check"


def wait_for(path: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def test_stack_exits_nonzero_with_the_dead_child_s_log(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        stack(tmp_path, "--run.name", "crash", "--launcher.services", '["trainer", "env_runner"]'),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(tmp_path / "crash" / "stack.json")
        time.sleep(0.5)
        doc = json.loads((tmp_path / "crash" / "stack.json").read_text())
        os.kill(doc["services"]["trainer"]["pid"], signal.SIGKILL)
        _out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1
    assert "trainer died (exited with code -9)" in err
    assert "--- last lines of trainer ---" in err
    assert "[startup] gRPC on" in err  # the child's own log lines are shown
    assert not alive(doc["services"]["env_runner"]["pid"])
    assert not alive(doc["nats"]["pid"])


def test_stack_startup_failure_names_the_child(tmp_path: Path, free_port: int) -> None:
    # valid config, but the child cannot reach its object store: it dies while starting
    proc = subprocess.run(
        stack(tmp_path, "--check", "--run.name", "nos3", "--launcher.services", '["trainer"]',
              "--object_store.backend", "s3", "--object_store.endpoint", f"127.0.0.1:{free_port}",
              "--object_store.access_key", "a", "--object_store.secret_key", "b",
              "--object_store.max_retries", "0"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "trainer died during startup (exited with code 1)" in proc.stderr
    assert f"cannot reach S3 at 127.0.0.1:{free_port}" in proc.stderr
    assert "stack stopped" in proc.stdout


def test_stack_unbindable_host_is_a_config_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        stack(tmp_path, "--check", "--run.name", "badhost", "--launcher.services", '["trainer"]',
              "--trainer.grpc.host", "203.0.113.7"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "trainer.grpc.host = '203.0.113.7' cannot be bound on this machine" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_stack_ctrl_c_stops_everything_cleanly(tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        stack(tmp_path, "--run.name", "sigint", "--launcher.services", '["orchestrator"]'),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(tmp_path / "sigint" / "stack.json")
        doc = json.loads((tmp_path / "sigint" / "stack.json").read_text())
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err
    assert "orchestrator: exit 0" in out
    assert not alive(doc["services"]["orchestrator"]["pid"])


def test_stack_ctrl_c_during_startup_stops_at_once_and_starts_nothing_more(
    tmp_path: Path,
) -> None:
    """SIGINT while the first service is still starting: the launcher stops it and does
    not go on to start the next one (before, it started every service, then stopped)."""
    launcher = subprocess.Popen(
        stack(tmp_path, "--run.name", "early", "--launcher.services", '["trainer", "orchestrator"]'),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        seen = []
        while "treadle: starting trainer" not in "".join(seen):
            line = launcher.stdout.readline()
            assert line, f"the launcher ended before starting the trainer: {''.join(seen)}"
            seen.append(line)
        launcher.send_signal(signal.SIGINT)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(seen) + out
    assert launcher.returncode == 0, err
    assert "stack interrupted during startup; stopping what had started" in out
    assert "starting orchestrator" not in out
    assert "stack stopped (trainer: exit" in out
    assert not (tmp_path / "early" / "stack.json").exists()  # it never came up
    leftover = processes_under(tmp_path)
    assert not leftover


def test_a_child_whose_work_is_over_at_once_may_finish_during_startup(tmp_path: Path) -> None:
    # a job's trainer rerun after its last step, or an SFT feed that published every batch,
    # exits 0 before its health check passes: with may_finish that is not a startup failure
    import asyncio

    from treadle.services.errors import ChildFailedError
    from treadle.services.supervisor import Supervisor

    async def never() -> bool:
        return False

    async def start(name: str, code: int, may_finish: bool) -> int | None:
        sup = Supervisor(tmp_path / "logs")
        try:
            proc = await sup.start(
                name, [sys.executable, "-c", f"import sys; print('done'); sys.exit({code})"],
                health=never, health_timeout_s=30, may_finish=may_finish,
            )  # fmt: skip
            return proc.poll()
        finally:
            sup.stop_all()

    assert asyncio.run(start("done", 0, may_finish=True)) == 0
    with pytest.raises(ChildFailedError, match=r"plain died during startup \(exited with code 0\)"):
        asyncio.run(start("plain", 0, may_finish=False))
    with pytest.raises(
        ChildFailedError, match=r"failed died during startup \(exited with code 3\)"
    ):
        asyncio.run(start("failed", 3, may_finish=True))


def test_children_of_a_parent_busy_with_grpc_start_every_time(tmp_path: Path) -> None:
    """A service polls gRPC while it starts its children (the launcher its services'
    health, inference its vLLM). Set up between fork and exec in Python, one child in
    five died in gRPC's fork handlers (SIGABRT) on 2 cores; none may."""

    async def main() -> list[int | None]:
        codes: list[int | None] = []
        async with grpc_busy():
            for i in range(100):
                child = ManagedProcess(f"c{i}", ["true"], tmp_path / "children.log").start()
                assert child.proc is not None
                codes.append(await asyncio.to_thread(child.proc.wait))
        return codes

    codes = asyncio.run(main())
    assert codes == [0] * 100, tail(tmp_path / "children.log")


def test_a_child_dies_with_its_supervisor_and_a_missing_program_fails_at_start(
    tmp_path: Path,
) -> None:
    supervisor = (
        "import sys, time; from pathlib import Path;"
        "from treadle.services.supervisor import ManagedProcess;"
        f"p = ManagedProcess('sleeper', ['sleep', '600'], Path({str(tmp_path / 'c.log')!r})).start();"
        "print(p.pid, flush=True); time.sleep(600)"
    )  # fmt: skip
    sup = subprocess.Popen([sys.executable, "-c", supervisor], stdout=subprocess.PIPE, text=True)
    try:
        assert sup.stdout is not None
        child = int(sup.stdout.readline())
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":  # exec'd
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        deadline = time.monotonic() + 10
        while alive(child):
            assert time.monotonic() < deadline, "the child outlived its killed supervisor"
            time.sleep(0.05)
    finally:
        sup.kill()
        sup.wait(10)
    with pytest.raises(FileNotFoundError, match="no such program"):
        ManagedProcess("ghost", ["no-such-program-here"], tmp_path / "g.log").start()
    with pytest.raises(FileNotFoundError, match="no such program"):
        ManagedProcess("ghost", [str(tmp_path / "nope")], tmp_path / "g.log").start()


def test_inference_and_trainer_start_side_by_side_and_a_failure_stops_both(
    tmp_path: Path,
) -> None:
    """The trainer starts beside vLLM (not after it); when it dies during startup, the
    vLLM still starting is stopped too and nothing of the run is left running."""
    from treadle.services.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", tokenizer="bpe")
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    proc = subprocess.run(
        stack(tmp_path, "--check", "--run.name", "side", "--launcher.services",
              '["inference", "trainer"]', "--inference.model", str(model),
              "--trainer.model", str(not_a_model)),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "starting inference, trainer side by side" in proc.stderr
    assert "trainer died during startup (exited with code 1)" in proc.stderr
    assert "has no config.json: not a Hugging Face model folder" in proc.stderr
    assert "inference healthy" not in proc.stderr  # stopped while vLLM was still starting
    assert "inference: exit" in proc.stdout
    inference_log = (tmp_path / "side" / "logs" / "inference.log").read_text()
    assert "vLLM (cpu) starting" in inference_log
    leftover = processes_under(tmp_path)
    assert not leftover, [Path(f"/proc/{p}/cmdline").read_bytes()[:300] for p in leftover]


def test_a_setting_refused_midway_through_a_stage_stops_what_the_stage_started(
    tmp_path: Path,
) -> None:
    """Inference's start is already under way when the trainer's host turns out
    unbindable: the launch ends as a configuration error, and nothing of the stage is
    left running."""
    from treadle.services.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "model", tokenizer="bpe")
    proc = subprocess.run(
        stack(tmp_path, "--check", "--run.name", "midway", "--launcher.services",
              '["inference", "trainer"]', "--inference.model", str(model),
              "--trainer.grpc.host", "203.0.113.7"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "trainer.grpc.host = '203.0.113.7' cannot be bound on this machine" in proc.stderr
    assert "starting inference" in proc.stdout
    assert "Traceback" not in proc.stderr
    leftover = processes_under(tmp_path)
    assert not leftover, [Path(f"/proc/{p}/cmdline").read_bytes()[:300] for p in leftover]
