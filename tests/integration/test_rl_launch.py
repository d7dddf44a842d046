"""`treadle rl` starts the orchestrator and the env runners once the trainer is healthy,
while vLLM is still starting (``launcher.inference_started_later``): the orchestrator
dispatches nothing until inference serves (``orchestrator.inference_wait_s``), and an
inference that dies after they started takes the whole launch down with it. Real
nats-server, vLLM, trainer, orchestrator and env runner on a tiny model."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testkit.chaos import build_model, write_tasks
from testkit.procs import processes_under

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 2


def run_file(tmp_path: Path) -> Path:
    model = build_model(tmp_path / "model")
    tasks = write_tasks(tmp_path / "tasks.jsonl")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"""
[run]
name = "later"
output_dir = "{tmp_path / "out"}"

[inference]
model = "{model}"
max_model_len = 256

[trainer]
model = "{model}"
max_steps = {STEPS}

[orchestrator]
tasks = "{tasks}"
max_steps = {STEPS}
group_size = 4
groups_per_step = 2
max_groups_in_flight = 4
seq_len = 256

[orchestrator.sampling]
max_tokens = 8

[env_runner]
tokenizer = "{model}"
max_concurrency = 8
""")
    return cfg


def seconds(line: str) -> int:
    """The second of the day (HH:MM:SS) a log line starts with."""
    h, m, s = (int(x) for x in line.split()[0].split(":"))
    return h * 3600 + m * 60 + s


@pytest.mark.timeout(600)
def test_rl_starts_orchestrator_before_vllm_is_up_and_dispatches_once_it_serves(
    tmp_path: Path,
) -> None:
    cfg = run_file(tmp_path)
    argv = [sys.executable, "-m", "treadle.services.cli", "rl", "@", str(cfg)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    run_dir = tmp_path / "out" / "later"
    assert proc.returncode == 0, out[-4000:]
    assert "the next services start once the trainer is healthy" in out
    # the second stage started on the trainer's health, not inference's
    assert out.index("trainer healthy") < out.index("starting orchestrator, env_runner")
    orchestrator_log = (run_dir / "logs" / "orchestrator.log").read_text()
    assert "--orchestrator.inference_wait_s " in orchestrator_log  # set by the launcher
    served = re.search(r"^(\S+) INFO +orchestrator +\[startup\] inference serves after", orchestrator_log, re.M)  # fmt: skip
    assert served, orchestrator_log[-3000:]
    assert "dispatching regardless" not in orchestrator_log
    # it went on only once inference served policy 0 (the log's clocks: whole seconds)
    inference_log = (run_dir / "logs" / "inference.log").read_text()
    ready = re.search(r"^(\S+) INFO +inference +\[startup\] serving policy version 0", inference_log, re.M)  # fmt: skip
    assert ready, inference_log[-3000:]
    assert (seconds(served.group(0)) - seconds(ready.group(0))) % 86400 < 3600  # not before
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = {r["step"] for r in rows if r["service"] == "trainer" and "loss" in r}
    assert trained == set(range(1, STEPS + 1))
    assert not processes_under(tmp_path)


@pytest.mark.timeout(600)
def test_rl_inference_dying_after_the_orchestrator_started_stops_the_launch(
    tmp_path: Path,
) -> None:
    """SIGKILL of the inference service once the orchestrator and env runner are up (vLLM
    still starting, or just up): the launch fails naming inference and leaves nothing of
    the run running -- no orchestrator waiting forever, no orphaned vLLM."""
    cfg = run_file(tmp_path)
    argv = [sys.executable, "-m", "treadle.services.cli", "rl", "@", str(cfg)]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        assert launcher.stdout is not None
        while "orchestrator healthy" not in "".join(seen):
            line = launcher.stdout.readline()
            assert line, f"the launcher ended before the orchestrator was up: {''.join(seen)}"
            seen.append(line)
        inference = [
            pid for pid in processes_under(tmp_path)
            if b"-m\0treadle.inference\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]  # fmt: skip
        assert len(inference) == 1, inference
        os.kill(inference[0], signal.SIGKILL)
        rest, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    out = "".join(seen) + rest
    assert launcher.returncode not in (0, None), out[-4000:]
    assert "inference died" in out, out[-4000:]
    deadline = time.monotonic() + 30  # vLLM, orphaned by the SIGKILL, stops on its own
    while processes_under(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_under(tmp_path), out[-4000:]
