"""The launcher's CPU split for `treadle rl` on a machine without a GPU."""

from __future__ import annotations

from treadle.services.launcher import cpu_split_env

RL = ["inference", "trainer", "orchestrator", "env_runner"]


def test_launcher_splits_cpus_between_vllm_and_the_trainer() -> None:
    env = cpu_split_env("rl", RL, [0, 1, 2, 3, 4], {})
    assert env == {
        "inference": {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0,1"},
        "trainer": {"OMP_NUM_THREADS": "3"},
    }
    # the CPUs this process may use, not 0..n-1
    two = cpu_split_env("rl", RL, [6, 9], {})
    assert two["inference"]["VLLM_CPU_OMP_THREADS_BIND"] == "6"
    assert two["trainer"]["OMP_NUM_THREADS"] == "1"


def test_launcher_cpu_split_applies_only_where_it_helps() -> None:
    cpus = [0, 1, 2, 3]
    assert cpu_split_env("rl", RL, cpus, {}, gpu=True) == {}
    assert cpu_split_env("rl", RL, cpus, {}, enabled=False) == {}
    assert cpu_split_env("sft", ["trainer", "orchestrator"], cpus, {}) == {}
    assert cpu_split_env("rl", RL, [0], {}) == {}
    # the user's own thread settings win
    assert cpu_split_env("rl", RL, cpus, {"OMP_NUM_THREADS": "4"}) == {}
    assert cpu_split_env("rl", RL, cpus, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {}
