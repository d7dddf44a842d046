"""A vLLM left behind by a killed inference service is stopped by the next start
(``engine.stop_leftover``): its whole process group, and only a process that is a vLLM."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from treadle.inference.engine import stop_leftover

pytestmark = pytest.mark.integration

# a stand-in vLLM: its command line names vllm (as `python -m vllm.entrypoints...` does),
# and it starts a child in its process group (as vLLM's engine process is), then hangs
FAKE_VLLM = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
    "time.sleep(120)"
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if int(p) != pid]


def test_stop_leftover_kills_the_recorded_vllm_and_its_process_group(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_VLLM, "vllm.entrypoints.openai.api_server"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not _children(proc.pid):
            assert time.monotonic() < deadline, "the stand-in vLLM never started its child"
            time.sleep(0.05)
        child = _children(proc.pid)[0]
        pid_file = tmp_path / "vllm-8000.pid"
        pid_file.write_text(f"{proc.pid}\n")
        assert stop_leftover(pid_file) == proc.pid
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the engine stand-in outlived its group's kill"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_leftover_leaves_other_programs_alone(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_file = tmp_path / "vllm-8000.pid"
        pid_file.write_text(f"{proc.pid}\n")  # a pid reused by something that is not vLLM
        assert stop_leftover(pid_file) is None
        assert proc.poll() is None
        assert stop_leftover(tmp_path / "missing.pid") is None
        pid_file.write_text("garbage")
        assert stop_leftover(pid_file) is None
    finally:
        proc.kill()
        proc.wait()
