"""Treadle env runner: environments (task set × harness × runtime) and the service that
runs them and publishes rollouts with per-token provenance.

The environment library, imported lazily (this package never imports torch or vLLM, and
importing it for the service spec stays light):

    from treadle.env_runner import Environment, Rubric, TaskSet, ToolUse, JudgeReward
    from treadle.env_runner import ConcisenessBonus, PairwiseJudge, RankingJudge
    from treadle.env_runner import SandboxRuntime, LocalRuntime, ContainerRuntime, CommandHarness

Layout: ``tasksets/`` (where tasks come from), ``harnesses/`` (how the model acts),
``runtimes/`` (where programs run), ``environments.py`` (the three put together, with a
rubric), ``envs/`` (the built-in environments), ``interception/`` and ``session.py``
(model calls, token-exact), and beside them the service (``service.py``).
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
    "TaskSet": "tasksets",
    "TaskError": "tasksets",
    "Tool": "tools",
    "ToolSet": "tools",
    "SingleTurn": "harnesses.chat",
    "ToolUse": "harnesses.chat",
    "UserSimulator": "harnesses.chat",
    "HarnessError": "harnesses.base",
    "CommandHarness": "harnesses.command",
    "OpenAIChat": "session",
    "with_privileged": "session",
    "Runtime": "runtimes.base",
    "Workspace": "runtimes.base",
    "LocalRuntime": "runtimes.local",
    "SandboxRuntime": "runtimes.sandbox",
    "ContainerRuntime": "runtimes.container",
    "make_runtime": "runtimes",
    "Sandbox": "runtimes.sandbox",
    "SandboxLimits": "runtimes.base",
    "InterceptionServer": "interception",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
