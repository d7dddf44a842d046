"""Environments published for ``verifiers`` (PyPI), run by Treadle.

A verifiers environment is a package with ``load_environment(**args)`` returning a
``vf.Environment`` (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, ...): a dataset, its
own rollout loop and a rubric. verifiers pins versions of what Treadle also uses (mcp,
openai), so it lives in a virtualenv of its own, and the adapter drives it from there:

    ENVIRONMENT = verifiers_environment(
        "vf-math-python", python="/opt/vf/bin/python", env_args={"num_train_examples": 500})

    tasks     the environment's dataset (``get_dataset``; ``split="eval"``:
              ``get_eval_dataset``), one task per row: its ``prompt`` messages as the
              task's opening conversation, the row as ``task["verifiers_input"]``, its
              ``example_id`` as the task id. Read once, by a child process of the runner
    harness   a CommandHarness running verifiers' own rollout of the row
              (``Environment.run_rollout``) in the environment's runtime, its client an
              OpenAI Chat Completions client of the rollout's interception endpoint: every
              model call the environment makes (tool turns, multi-turn responses) is
              recorded token-exactly in the rollout, as for any CLI agent
    rubric    verifiers' rubric scores the rollout there; its reward is the rollout's
              reward (``verifiers_reward``), its metrics recorded as ``verifiers_metrics.<name>``

What is covered of verifiers' API (tested with 0.3.1's classic API): ``load_environment``
with arguments; ``SingleTurnEnv``, ``ToolEnv`` (Python function tools, run by verifiers),
``MultiTurnEnv`` subclasses (``env_response``); ``Rubric`` reward functions and weights,
metrics; ``system_prompt``, datasets and eval datasets. Not covered: group-level
rubrics (``score_group``: each rollout is scored alone here), verifiers' own sampling
arguments (Treadle's sampling of the rollout applies), its sandboxes and server mode.

Not here: the harness (harnesses/command.py), the runtimes (runtimes/).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses.command import CommandHarness
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.runtimes.base import Runtime
from treadle.env_runner.runtimes.local import PASSED_ENV
from treadle.env_runner.tasksets import TaskSet
from treadle.services.errors import ConfigError

RESULT_MARK = "treadle-verifiers-result "
LIST_TIMEOUT_S = 600.0

# Run by the verifiers virtualenv's Python. argv: tasks <env_id> <args> <split> <n>
#                                              | rollout <env_id> <args> <task file>
DRIVER = r"""
import asyncio, json, os, sys

mode, env_id, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
import verifiers as vf

env = vf.load_environment(env_id, **args)
if mode == "tasks":
    split, n = sys.argv[4], int(sys.argv[5])
    rows = env.get_eval_dataset(n) if split == "eval" else env.get_dataset(n)
    out = sys.stdout
    for row in rows:
        out.write(json.dumps(dict(row), default=str) + "\n")
    sys.exit(0)
task = json.load(open(sys.argv[4]))
config = vf.ClientConfig(client_type="openai_chat_completions", api_key_var="OPENAI_API_KEY",
                         api_base_url=os.environ["OPENAI_BASE_URL"], max_retries=0)
out = asyncio.run(env.run_rollout(task["verifiers_input"], config, os.environ["TREADLE_MODEL"], {}))
error = out.get("error")
result = {"reward": out.get("reward"), "metrics": out.get("metrics") or {},
          "is_truncated": bool(out.get("is_truncated")), "stop_condition": out.get("stop_condition"),
          "error": None if error is None else str(error)}
print("\n" + "treadle-verifiers-result " + json.dumps(result, default=str), flush=True)
sys.exit(3 if error is not None else 0)
"""


def verifiers_environment(
    env_id: str,
    *,
    python: str | Path,
    env_args: Mapping[str, Any] | None = None,
    name: str | None = None,
    split: Literal["train", "eval"] = "train",
    num_tasks: int = -1,
    pythonpath: Sequence[str | Path] = (),
    runtime: Runtime | str | Mapping[str, Any] | None = None,
    timeout_s: float = 600.0,
    max_turns: int = 0,
) -> Environment:
    """A Treadle Environment running the verifiers environment ``env_id`` (module doc).

    ``python`` is the interpreter of a virtualenv where verifiers and the environment's
    package are installed; ``pythonpath`` adds folders holding environment modules (they
    must be readable in the runtime: not under /tmp or /work for the sandbox);
    ``runtime`` is where verifiers' rollouts run (default: the sandbox). The environment is
    loaded once here, to check it and read its tasks lazily: a missing interpreter, an
    environment that does not import or load, or arguments it refuses are a ConfigError.
    """
    interpreter = Path(python)
    if not interpreter.exists():
        raise ConfigError(f"verifiers environment {env_id!r}: no interpreter {interpreter} "
                          "(a virtualenv with `pip install verifiers` and the environment)")  # fmt: skip
    venv = interpreter.parent.parent if (interpreter.parent.parent / "pyvenv.cfg").is_file() else interpreter.parent  # fmt: skip
    args_json = json.dumps(dict(env_args or {}))
    paths = [str(Path(p).resolve()) for p in pythonpath]
    child_env = {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}
    child_env |= {"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1",
                  "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    rows = _list_rows(env_id, interpreter, args_json, split, num_tasks, child_env)
    env_name = name or env_id.replace("-", "_").split("/")[-1]
    harness = CommandHarness(
        [str(interpreter), "-c", DRIVER, "rollout", env_id, args_json, "{task_file}"],
        timeout_s=timeout_s, env=child_env, ro_paths=[str(venv), *paths], max_turns=max_turns,
    )  # fmt: skip
    return Environment(
        env_name,
        prompt=lambda task: task["prompt"],
        rubric=Rubric(rewards=[verifiers_reward], metrics=[verifiers_metrics]),
        harness=harness,
        tasks=lambda: TaskSet.from_rows(env_name, rows, ("prompt", "verifiers_input")),
        required=("prompt", "verifiers_input"),
        runtime=runtime,
        description=f"the verifiers environment {env_id} ({split} split)",
    )


def _list_rows(env_id: str, python: Path, args_json: str, split: str, num_tasks: int,
               child_env: Mapping[str, str]) -> list[dict[str, Any]]:  # fmt: skip
    """The environment's dataset as Treadle tasks, read by a child process."""
    basics = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    try:
        r = subprocess.run(
            [str(python), "-c", DRIVER, "tasks", env_id, args_json, split, str(num_tasks)],
            capture_output=True, text=True, timeout=LIST_TIMEOUT_S, env={**basics, **child_env},
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"verifiers environment {env_id!r}: cannot list its tasks: {e}") from None
    if r.returncode != 0:  # its last line says why (the exception); then the traceback
        lines = r.stderr.strip().splitlines() or ["(nothing on stderr)"]
        tail = "\n".join(lines)[-1500:]
        raise ConfigError(f"verifiers environment {env_id!r} did not load (exit {r.returncode}): "
                          f"{lines[-1]}\n{tail}")  # fmt: skip
    rows = []
    for i, line in enumerate(r.stdout.splitlines()):
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), list):
            raise ConfigError(f"verifiers environment {env_id!r}: row {i} has no prompt messages")
        example_id = row.get("example_id", i)
        rows.append({"id": str(example_id), "prompt": row["prompt"], "verifiers_input": row,
                     **({"answer": row["answer"]} if "answer" in row else {})})  # fmt: skip
    if not rows:
        raise ConfigError(f"verifiers environment {env_id!r}: its {split} dataset is empty")
    return rows


def verifiers_result(state: RolloutState) -> dict[str, Any]:
    """What verifiers' rubric said of the rollout (its program's last result line)."""
    if "verifiers" in state.info:
        return dict(state.info["verifiers"])
    stdout = str(state.info.get("stdout", ""))
    at = stdout.rfind("\n" + RESULT_MARK)
    if at < 0:
        raise ValueError("the verifiers rollout reported no result")
    line = stdout[at + 1 + len(RESULT_MARK) :].split("\n", 1)[0]
    result = json.loads(line)
    state.info["verifiers"] = result
    return dict(result)


def verifiers_reward(state: RolloutState) -> float:
    """verifiers' reward of the rollout (its rubric's weighted sum)."""
    reward = verifiers_result(state)["reward"]
    if reward is None:
        raise ValueError("verifiers scored no reward")
    return float(reward)


def verifiers_metrics(state: RolloutState) -> dict[str, float]:
    """verifiers' metrics of the rollout (each reward function's value, ...)."""
    metrics = verifiers_result(state)["metrics"]
    return {str(k): float(v) for k, v in metrics.items() if isinstance(v, int | float)}
