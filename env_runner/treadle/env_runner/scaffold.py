"""``treadle env init NAME``: a new environment package, ready to test and evaluate.

NAME/
  pyproject.toml          pip-installable; depends on treadle-env-runner
  NAME/__init__.py        ENVIRONMENT = Environment(...): prompt, rubric, task set
  NAME/tasks.jsonl        a few example tasks
  tests/test_NAME.py      the rubric on right and wrong answers, every task well-formed
  eval.toml               `treadle eval @ NAME/eval.toml` against any OpenAI-compatible model
  README.md
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from treadle.services.errors import ConfigError

TASKS = [
    {"id": "t1", "question": "What is 2 + 3?", "answer": "5"},
    {"id": "t2", "question": "What is the capital of France?", "answer": "Paris"},
    {"id": "t3", "question": "Spell 'cat' backwards.", "answer": "tac"},
]

MODULE = '''"""{name}: a Treadle environment (edit the prompt, the rewards and the tasks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from treadle.env_runner import Environment, Rubric, TaskSet

HERE = Path(__file__).parent


def prompt(task: dict[str, Any]) -> str:
    return f"{{task['question']}} Reply with the answer only."


def correct(completion: str, answer: str) -> float:
    """1.0 when the reply is the answer (case and surrounding space ignored)."""
    return float(completion.strip().lower() == answer.strip().lower())


def num_words(completion: str) -> float:
    return float(len(completion.split()))


ENVIRONMENT = Environment(
    "{name}",
    prompt=prompt,
    system_prompt="You are a careful assistant.",
    rubric=Rubric(rewards=[correct], metrics=[num_words]),
    tasks=lambda: TaskSet.from_jsonl(HERE / "tasks.jsonl", required=("question", "answer")),
    required=("question", "answer"),
)
'''

TEST = '''"""Tests of the {name} environment: run with `pytest`."""

import asyncio

from treadle.env_runner.rubric import RolloutState

from {name} import ENVIRONMENT


def score(task, reply):
    state = RolloutState(task=task, messages=[{{"role": "assistant", "content": reply}}])
    return asyncio.run(ENVIRONMENT.rubric.score(state)).total


def test_every_task_is_well_formed():
    tasks = list(ENVIRONMENT.task_set())
    assert tasks
    for task in tasks:
        ENVIRONMENT.check(task)
        assert ENVIRONMENT.prompt(task)[-1]["role"] == "user"


def test_rubric_rewards_right_answers_only():
    task = ENVIRONMENT.task_set()[0]
    assert score(task, task["answer"]) == 1.0
    assert score(task, "certainly not " + task["answer"] + "!") == 0.0
'''

PYPROJECT = """[build-system]
requires = ["hatchling>=1.25"]
build-backend = "hatchling.build"

[project]
name = "{dist}"
version = "0.1.0"
description = "A Treadle environment: {name}"
requires-python = ">=3.11"
dependencies = ["treadle-env-runner"]

[tool.hatch.build.targets.wheel]
packages = ["{name}"]
"""

EVAL = """# Score a model on {name}:  treadle eval @ {path}/eval.toml
[run]
name = "{name}-eval"

[eval]
env = "{name}:ENVIRONMENT"
base_url = "http://127.0.0.1:8000/v1"   # any OpenAI-compatible endpoint
model = "default"
rollouts_per_task = 1
"""

README = """# {name}

A Treadle environment. `{name}/__init__.py` holds the prompt, the rubric and the task set.

    pip install -e .          # next to treadle-env-runner
    pytest                    # the environment's own tests
    treadle eval @ eval.toml  # score a model (edit base_url / model first)

Train on it: name it in a run file (`[env_runner] environments = {{{name} = "{name}:ENVIRONMENT"}}`).
"""


def init(name: str, parent: Path) -> Path:
    """Create ``parent/name`` (see the module doc); ConfigError when the name is not a
    Python identifier or the folder exists."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ConfigError(
            f"environment name {name!r}: use lower-case letters, digits and _ (a Python module name)"
        )
    root = parent / name
    if root.exists():
        raise ConfigError(f"{root} already exists")
    pkg = root / name
    (root / "tests").mkdir(parents=True)
    pkg.mkdir()
    fmt = {"name": name, "dist": name.replace("_", "-"), "path": root}
    (pkg / "__init__.py").write_text(MODULE.format(**fmt), encoding="utf-8")
    (pkg / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS), encoding="utf-8")
    (root / "tests" / f"test_{name}.py").write_text(TEST.format(**fmt), encoding="utf-8")
    (root / "pyproject.toml").write_text(PYPROJECT.format(**fmt), encoding="utf-8")
    (root / "eval.toml").write_text(EVAL.format(**fmt), encoding="utf-8")
    (root / "README.md").write_text(README.format(**fmt), encoding="utf-8")
    return root
