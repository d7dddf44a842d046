"""Treadle env runner: environments (task set × harness × runtime) and the service that
runs them and publishes rollouts with per-token provenance.

The environment library, imported lazily (this package never imports torch or vLLM, and
importing it for the service spec stays light):

    from treadle.env_runner import Environment, Rubric, TaskSet, ToolUse, JudgeReward
    from treadle.env_runner import ConcisenessBonus, PairwiseJudge, RankingJudge
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Environment": "environments",
    "load_environment": "environments",
    "Rubric": "rubric",
    "RolloutState": "rubric",
    "JudgeReward": "rubric",
    "GroupResult": "rubric",
    "ConcisenessBonus": "group_rewards",
    "PairwiseJudge": "group_rewards",
    "RankingJudge": "group_rewards",
    "JudgeError": "judge",
    "TaskSet": "tasks",
    "TaskError": "tasks",
    "Tool": "tools",
    "ToolSet": "tools",
    "SingleTurn": "harness",
    "ToolUse": "harness",
    "UserSimulator": "harness",
    "HarnessError": "harness",
    "OpenAIChat": "session",
    "with_privileged": "session",
    "Sandbox": "sandbox",
    "SandboxLimits": "sandbox",
    "ContainerRuntime": "container",
    "CommandHarness": "cli_agent",
    "InterceptionServer": "interception",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
