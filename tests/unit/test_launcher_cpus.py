"""The launcher's CPU split for `treadle rl` on a machine without a GPU, and the
affinity each service applies from it."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from treadle.services.errors import ConfigError
from treadle.services.host import CPUS_ENV, apply_cpu_affinity
from treadle.services.launcher import (
    LauncherSection,
    cpu_schedule,
    cpu_split_env,
    inference_started_later,
    start_stages,
    teacher_cpu_env,
)

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
        "orchestrator": {CPUS_ENV: "0,1,2,3,4"},  # anywhere: the kernel places them
        "env_runner": {CPUS_ENV: "0,1,2,3,4"},
    }
    # the CPUs this process may use, not 0..n-1
    two = cpu_split_env("rl", RL, [6, 9], {})
    assert two["inference"]["VLLM_CPU_OMP_THREADS_BIND"] == "6"
    assert two["trainer"] == {CPUS_ENV: "9", "OMP_NUM_THREADS": "1"}


def test_the_distillation_teacher_runs_where_launcher_teacher_cpus_says() -> None:
    """On the student's generation CPUs or the trainer's, with their thread count and
    vLLM's binding there (left alone, vLLM would bind the first cores)."""
    split = cpu_split_env("rl", RL, [6, 7, 8, 9], {})
    assert teacher_cpu_env(split, "training") == {
        CPUS_ENV: "8,9",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "8,9",
    }
    assert teacher_cpu_env(split, "generation") == {
        CPUS_ENV: "6,7",
        "OMP_NUM_THREADS": "2",
        "VLLM_CPU_OMP_THREADS_BIND": "6,7",
    }
    default = LauncherSection().teacher_cpus
    assert teacher_cpu_env(split) == teacher_cpu_env(split, default)
    for where in ("generation", "training"):  # not split (a GPU, split_cpus = false, ...)
        assert teacher_cpu_env({}, where) == {}
    with pytest.raises(ValueError, match="'trainer'"):
        teacher_cpu_env(split, "trainer")
    with pytest.raises(ValidationError, match="teacher_cpus"):
        LauncherSection.model_validate({"teacher_cpus": "all"})


def test_launcher_places_the_orchestrator_and_env_runners_where_asked() -> None:
    cpus = [0, 1, 2, 3]
    for helpers, where in [("generation", "0,1"), ("training", "2,3"), ("all", "0,1,2,3")]:
        env = cpu_split_env("rl", RL, cpus, {}, helpers=helpers)
        assert env["orchestrator"] == env["env_runner"] == {CPUS_ENV: where}, helpers
        assert env["inference"][CPUS_ENV] == "0,1"  # generation and training stay split
        assert env["trainer"][CPUS_ENV] == "2,3"


def test_launcher_cpu_split_applies_only_where_it_helps() -> None:
    cpus = [0, 1, 2, 3]
    assert cpu_split_env("rl", RL, cpus, {}, gpu=True) == {}
    assert cpu_split_env("rl", RL, cpus, {}, enabled=False) == {}
    assert cpu_split_env("sft", ["trainer", "orchestrator"], cpus, {}) == {}
    assert cpu_split_env("rl", RL, [0], {}) == {}
    # the user's own thread settings win
    assert cpu_split_env("rl", RL, cpus, {"OMP_NUM_THREADS": "4"}) == {}
    assert cpu_split_env("rl", RL, cpus, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}) == {}


@pytest.mark.parametrize(
    ("cpus", "environ", "kw", "says"),
    [
        ([0, 1], {}, {}, "split, 1 CPU(s) generating and 1 training"),
        ([0, 1, 2, 3, 4], {}, {}, "split, 2 CPU(s) generating and 3 training"),
        ([0, 1], {}, {"enabled": False}, "shared ([launcher] split_cpus = false)"),
        ([0, 1], {"OMP_NUM_THREADS": "2"}, {}, "as you set it (OMP_NUM_THREADS=2)"),
        ([3], {}, {}, "shared (one CPU, 3)"),
        ([0, 1], {}, {"gpu": True}, "not split (a GPU"),
    ],
)  # fmt: skip
def test_launcher_says_which_cpu_schedule_it_uses_and_why(
    cpus: list[int], environ: dict[str, str], kw: dict[str, bool], says: str
) -> None:
    line = cpu_schedule("rl", RL, cpus, environ, **kw)
    assert line is not None
    assert says in line
    # the schedule said is the one applied
    split = bool(cpu_split_env("rl", RL, cpus, environ, **kw))
    assert ("CPU schedule: split" in line) == split


def test_no_cpu_schedule_to_explain_outside_rl() -> None:
    assert cpu_schedule("sft", ["trainer", "orchestrator"], [0, 1], {}) is None
    assert cpu_schedule("rl", ["inference", "orchestrator"], [0, 1], {}) is None


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


def test_inference_and_trainer_start_first_side_by_side_then_the_rest() -> None:
    assert start_stages(RL) == [["inference", "trainer"], ["orchestrator", "env_runner"]]
    assert start_stages(["trainer", "orchestrator"]) == [["trainer"], ["orchestrator"]]
    assert start_stages(["orchestrator"]) == [["orchestrator"]]
    assert start_stages(["inference"]) == [["inference"]]


def test_rl_starts_the_rest_once_the_trainer_is_up_unless_replicas_or_a_teacher() -> None:
    """inference started later: an rl launch of one inference service without a launched
    teacher (its orchestrator waits for inference itself)."""
    assert inference_started_later("rl", RL, replicas=1, teacher=False)
    assert not inference_started_later("rl", RL, replicas=2, teacher=False)  # a replica may lag
    assert not inference_started_later("rl", RL, replicas=1, teacher=True)  # checked first
    assert not inference_started_later("stack", RL, replicas=1, teacher=False)
    assert not inference_started_later("sft", ["trainer", "orchestrator"], replicas=1,
                                       teacher=False)  # fmt: skip
    assert not inference_started_later("rl", ["inference", "orchestrator", "env_runner"],
                                       replicas=1, teacher=False)  # fmt: skip
