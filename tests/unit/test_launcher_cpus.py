"""The launcher's CPU split for `treadle rl` on a machine without a GPU, and the
affinity each service applies from it."""

from __future__ import annotations

import os

import pytest

from treadle.services.errors import ConfigError
from treadle.services.host import CPUS_ENV, apply_cpu_affinity
from treadle.services.launcher import cpu_split_env

RL = ["inference", "trainer", "orchestrator", "env_runner"]


def test_launcher_gives_the_trainer_its_own_cpus() -> None:
    env = cpu_split_env("rl", RL, [0, 1, 2, 3, 4], {})
    assert env == {
        "inference": {
            CPUS_ENV: "0,1",
            "OMP_NUM_THREADS": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0,1",
        },
        "trainer": {CPUS_ENV: "2,3,4", "OMP_NUM_THREADS": "3"},
        "orchestrator": {CPUS_ENV: "0,1"},
        "env_runner": {CPUS_ENV: "0,1"},
    }
    # the CPUs this process may use, not 0..n-1
    two = cpu_split_env("rl", RL, [6, 9], {})
    assert two["inference"]["VLLM_CPU_OMP_THREADS_BIND"] == "6"
    assert two["trainer"] == {CPUS_ENV: "9", "OMP_NUM_THREADS": "1"}


def test_launcher_cpu_split_applies_only_where_it_helps() -> None:
    cpus = [0, 1, 2, 3]
    assert cpu_split_env("rl", RL, cpus, {}, gpu=True) == {}
    assert cpu_split_env("rl", RL, cpus, {}, enabled=False) == {}
    assert cpu_split_env("sft", ["trainer", "orchestrator"], cpus, {}) == {}
    assert cpu_split_env("rl", RL, [0], {}) == {}
    # the user's own thread settings win
    assert cpu_split_env("rl", RL, cpus, {"OMP_NUM_THREADS": "4"}) == {}
    assert cpu_split_env("rl", RL, cpus, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {}


def test_service_pins_itself_to_the_cpus_it_is_given() -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    try:
        assert apply_cpu_affinity({}) is None
        assert apply_cpu_affinity({CPUS_ENV: str(one)}) == [one]
        assert os.sched_getaffinity(0) == {one}
        with pytest.raises(ConfigError, match="TREADLE_CPUS"):
            apply_cpu_affinity({CPUS_ENV: "zero"})
        with pytest.raises(ConfigError, match="TREADLE_CPUS"):
            apply_cpu_affinity({CPUS_ENV: "100000"})
    finally:
        os.sched_setaffinity(0, before)
