"""Several environments in one RL run: the weighted (environment, task) draw, its resume
from the saved state, the config that lists the environments, and the launcher handing
them to the env runner it starts."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from treadle.env_runner.spec import SPEC as ENV_RUNNER
from treadle.env_runner.spec import EnvRunnerConfig
from treadle.orchestrator.mixture import EnvMixture, EnvTasks
from treadle.orchestrator.spec import OrchestratorSection
from treadle.orchestrator.state import GroupState, OrchestratorState
from treadle.orchestrator.tasks import Cursor, Task, TaskSampler
from treadle.services.config import split_argv
from treadle.services.errors import ConfigError
from treadle.services.host import load_service_config
from treadle.services.launcher import _wiring, child_sources, env_runner_envs, resolve


def tasks(prefix: str, n: int) -> list[Task]:
    return [Task(f"{prefix}{i}", {"i": i}, json.dumps({"i": i})) for i in range(n)]


def mixture(**kw: Any) -> EnvMixture:
    envs = [EnvTasks("a", tasks("a", 7), 3.0), EnvTasks("b", tasks("b", 5), 1.0)]
    return EnvMixture(envs, seed=kw.pop("seed", 0), **kw)


def draws(m: EnvMixture, n: int) -> list[tuple[str, str]]:
    return [(env, task.task_id) for env, task in (m.next() for _ in range(n))]


def test_env_mixture_draws_environments_at_their_weights() -> None:
    got = Counter(env for env, _ in draws(mixture(), 4000))
    assert got["a"] / 4000 == pytest.approx(0.75, abs=0.03)  # 3 : 1
    assert got["a"] + got["b"] == 4000


def test_env_mixture_is_deterministic_per_seed() -> None:
    assert draws(mixture(), 200) == draws(mixture(), 200)
    assert draws(mixture(seed=1), 200) != draws(mixture(), 200)


def test_env_mixture_resumes_the_same_sequence_from_its_saved_state() -> None:
    whole = draws(mixture(), 120)
    first = mixture()
    head = draws(first, 37)
    # what the orchestrator saves: the draw count and each environment's task cursor
    state = OrchestratorState(env_draws=first.draws,
                              env_cursors={e: [c.epoch, c.position] for e, c in first.cursors.items()})  # fmt: skip
    saved = OrchestratorState.from_json(state.to_json())
    again = mixture(draws=saved.env_draws,
                    cursors={e: Cursor(*at) for e, at in saved.env_cursors.items()})  # fmt: skip
    assert head + draws(again, 83) == whole


def test_env_mixture_walks_each_environment_s_tasks_once_per_epoch() -> None:
    picked = [task for env, task in draws(mixture(), 400) if env == "b"]
    for epoch in range(len(picked) // 5):
        assert sorted(picked[5 * epoch : 5 * epoch + 5]) == [f"b{i}" for i in range(5)]


def test_env_mixture_of_one_environment_is_the_run_s_task_order() -> None:
    one = EnvMixture([EnvTasks("a", tasks("a", 7), 1.0)], seed=4)
    plain = TaskSampler(tasks("a", 7), 4)
    assert [t for _, t in draws(one, 20)] == [plain.next()[0].task_id for _ in range(20)]


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan, math.inf])
def test_env_mixture_refuses_a_weight_that_is_not_positive(weight: float) -> None:
    with pytest.raises(ValueError, match="is not > 0"):
        EnvMixture([EnvTasks("a", tasks("a", 2), weight)], seed=0)


def test_group_state_saved_before_groups_had_an_environment_still_loads() -> None:
    doc = json.loads(
        OrchestratorState(groups={"g": GroupState("g", "t", "{}", ["g-0"], 0)}).to_json()
    )
    del doc["groups"]["g"]["env"], doc["env_cursors"], doc["env_draws"]
    old = OrchestratorState.from_json(json.dumps(doc).encode())
    assert old.groups["g"].env == ""
    assert (old.env_draws, old.env_cursors) == (0, {})


# --- config -------------------------------------------------------------------------------
def task_file(tmp_path: Path, name: str, n: int = 3) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"{name}{i}"}) for i in range(n)))
    return str(path)


def two_envs(tmp_path: Path, **over: Any) -> dict[str, Any]:
    return {
        "countdown": {"tasks": task_file(tmp_path, "countdown"), "weight": 3, "algorithm": "rloo"},
        "reverse_text": {"tasks": task_file(tmp_path, "reverse"), **over},
    }


def test_orchestrator_lists_several_environments_with_their_weights_and_algorithms(
    tmp_path: Path,
) -> None:
    cfg = OrchestratorSection(envs=two_envs(tmp_path), algorithm="grpo")
    assert [(e.name, e.weight) for e in cfg.run_envs()] == [
        ("countdown", 3.0),
        ("reverse_text", 1.0),
    ]
    algos = cfg.resolve_algorithms()
    assert (algos["countdown"].name, algos["reverse_text"].name) == ("rloo", "grpo")
    assert cfg.default_env == "countdown"  # the first listed: eval's default
    assert (
        OrchestratorSection(envs=two_envs(tmp_path), env="reverse_text").default_env
        == "reverse_text"
    )
    with_eval = OrchestratorSection(envs=two_envs(tmp_path),
                                    eval={"every_steps": 2, "tasks": task_file(tmp_path, "held"),
                                          "env": "heldout"})  # fmt: skip
    assert with_eval.served_envs() == ["countdown", "reverse_text", "heldout"]


def test_orchestrator_one_environment_form_is_unchanged(tmp_path: Path) -> None:
    cfg = OrchestratorSection(env="countdown", tasks=task_file(tmp_path, "t"),
                              envs={"countdown": {"algorithm": "rloo"}})  # fmt: skip
    assert not cfg.lists_envs
    assert [(e.name, str(e.tasks), e.weight) for e in cfg.run_envs()] == [
        ("countdown", str(tmp_path / "t.jsonl"), 1.0)
    ]
    assert cfg.served_envs() == ["countdown"]


@pytest.mark.parametrize(
    ("weight", "message"),
    [
        (0, "greater than 0"),
        (-2, "greater than 0"),
        ("nan", "finite number"),
        ("inf", "finite number"),
    ],
)
def test_orchestrator_refuses_an_environment_weight_that_is_not_positive(
    tmp_path: Path, weight: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=rf"envs\.reverse_text\.weight[\s\S]*{message}"):
        OrchestratorSection(envs=two_envs(tmp_path, weight=float(weight)))


@pytest.mark.parametrize(
    ("envs", "extra", "message"),
    [
        ({"reverse_text": {"tasks": "missing.jsonl"}}, {}, r"orchestrator.envs.reverse_text.tasks: task file not found: missing.jsonl"),
        ({"reverse_text": {"algorithm": "rloo"}}, {}, r"orchestrator.envs.reverse_text has no tasks"),
        ({}, {"tasks": "x.jsonl"}, r"orchestrator.tasks = 'x.jsonl' and orchestrator.envs.<env>.tasks are both set"),
        ({}, {"env": "other"}, r"orchestrator.env = 'other' is none of the run's environments"),
        ({}, {"mode": "sft"}, r"several environments are for RL runs"),
    ],
)  # fmt: skip
def test_orchestrator_refuses_a_bad_list_of_environments(
    tmp_path: Path, envs: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    listed = {"countdown": {"tasks": task_file(tmp_path, "countdown")}, **envs}
    with pytest.raises(ValueError, match=message):
        OrchestratorSection(envs=listed, **extra)


def test_orchestrator_one_environment_form_refuses_another_environment_s_table() -> None:
    with pytest.raises(ValueError, match=r"orchestrator.envs.other: this run's environment is "
                                         r"'countdown'.*orchestrator.envs.<env>.tasks"):  # fmt: skip
        OrchestratorSection(env="countdown", envs={"other": {"weight": 2}})


# --- launcher -----------------------------------------------------------------------------
def run_file(tmp_path: Path, runner: str = "") -> list[str]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"vocab_size": 64}')
    (model / "model.safetensors").write_bytes(b"")
    toml = tmp_path / "run.toml"
    toml.write_text(f"""
[inference]
model = "{model}"
[trainer]
model = "{model}"
[env_runner]
tokenizer = "{model}"
{runner}
[orchestrator.envs.countdown]
tasks = "{task_file(tmp_path, "countdown")}"
weight = 2
[orchestrator.envs.reverse_text]
tasks = "{task_file(tmp_path, "reverse")}"
[orchestrator.eval]
every_steps = 5
tasks = "{task_file(tmp_path, "held")}"
env = "tool_search"
""")
    return ["@", str(toml)]


def test_rl_launch_hands_the_env_runner_every_environment_the_orchestrator_requests(
    tmp_path: Path,
) -> None:
    sources = split_argv(run_file(tmp_path))
    _, specs = resolve(sources, "rl")  # no orchestrator.tasks needed: each env has its own
    wanted = env_runner_envs(specs)
    assert wanted == ["countdown", "reverse_text", "tool_search"]
    child_argv, _ = child_sources(sources)
    wired = _wiring(ENV_RUNNER, "rl", {}, runner_envs=wanted)
    cfg, _ = load_service_config(ENV_RUNNER, [*child_argv, *wired])
    assert isinstance(cfg, EnvRunnerConfig)
    assert cfg.env_runner.envs == ["countdown", "reverse_text", "tool_search"]


def test_rl_launch_refuses_an_env_runner_that_does_not_serve_an_environment(
    tmp_path: Path,
) -> None:
    _, specs = resolve(split_argv(run_file(tmp_path, 'envs = ["countdown", "tool_search"]')), "rl")
    with pytest.raises(ConfigError, match=r"does not serve reverse_text"):
        env_runner_envs(specs)
    _, specs = resolve(split_argv(run_file(
        tmp_path, 'envs = ["countdown", "tool_search", "reverse_text", "extra"]')), "rl")  # fmt: skip
    assert env_runner_envs(specs) is None  # a superset is kept as it is
