"""Environments: a task set × a harness × a runtime, and a rubric (and the tools the
harness offers).

    ENVIRONMENT = Environment(
        "countdown",
        prompt=lambda task: f"Use {task['numbers']} to make {task['target']}.",
        rubric=Rubric(rewards=[correct], metrics=[num_tokens]),
        tasks=lambda: TaskSet.from_generator(make_task, n=1000),
        required=("numbers", "target"),
    )

``prompt(task)`` returns chat messages, or a string (one user message, after
``system_prompt`` when set). ``harness`` defaults to SingleTurn, or ToolUse when tools
are given. ``runtime`` is where the environment's programs run (a CLI agent harness, a
reward that runs tests): "sandbox" (default), "local", "container", a config table or a
Runtime (``treadle.env_runner.runtimes``); ``[env_runner.runtimes.<name>]`` overrides it
from the run's config. ``tools`` is a list of Python functions / Tools, or a function of the task
returning one (per-task tools, e.g. a corpus). ``tasks`` builds the default task set
(used by ``treadle eval`` when no task file is given). ``privileged(task)`` returns
context only a teacher may see (a hint, the answer) for self-distillation: the env runner
renders each branch's prompt again with it added to the first user message
(``session.with_privileged``) and sends those ids along (``Rollout.privileged_prompts``) when the
orchestrator asks (``orchestrator.teacher.self_distill``).

Environments are found by name: the built-ins below, plus
``[env_runner] environments = {name = "module:attribute"}``, and
``[[env_runner.group_rewards.<name>]]`` tables add built-in group rewards to one
(``group_rewards.from_spec``) and ``[env_runner.runtimes.<name>]`` sets its runtime. An object of the older minimal contract (``name``, ``prompt(task)``, ``reward(task, completion)``) still works:
it becomes a single-turn Environment whose one reward is ``reward``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from treadle.env_runner.harnesses.base import Harness, RunSync
from treadle.env_runner.harnesses.chat import SingleTurn, ToolUse
from treadle.env_runner.rubric import Rubric
from treadle.env_runner.runtimes import make_runtime
from treadle.env_runner.runtimes.base import Runtime
from treadle.env_runner.runtimes.sandbox import SandboxUnavailableError
from treadle.env_runner.tasksets import TaskSet, check_task
from treadle.env_runner.tools import ToolSet
from treadle.services.errors import ConfigError

BUILTIN = {
    "reverse_text": "treadle.env_runner.envs.reverse_text:ENVIRONMENT",
    "countdown": "treadle.env_runner.envs.countdown:ENVIRONMENT",
    "arithmetic": "treadle.env_runner.envs.countdown:ARITHMETIC",
    "tool_search": "treadle.env_runner.envs.tool_search:ENVIRONMENT",
    "python_code": "treadle.env_runner.envs.python_code:ENVIRONMENT",
    "support_chat": "treadle.env_runner.envs.support_chat:ENVIRONMENT",
}


class Environment:
    """See the module doc."""

    def __init__(
        self,
        name: str,
        *,
        prompt: Callable[[dict[str, Any]], Any],
        rubric: Rubric | None = None,
        harness: Harness | None = None,
        tools: Sequence[Any] | ToolSet | Callable[[dict[str, Any]], Sequence[Any] | ToolSet] = (),
        tasks: Callable[[], TaskSet] | TaskSet | None = None,
        required: Sequence[str] = (),
        system_prompt: str | None = None,
        max_total_tokens: int = 0,
        timeout_s: float = 0.0,
        description: str = "",
        privileged: Callable[[dict[str, Any]], str] | None = None,
        runtime: Runtime | str | Mapping[str, Any] | None = None,
    ):
        self.name = name
        self.prompt_fn = prompt
        self.rubric = rubric or Rubric()
        self.tools = tools
        self.harness: Harness = harness or (ToolUse() if tools else SingleTurn())
        self._tasks = tasks
        self.required = tuple(required)
        self.system_prompt = system_prompt
        self.max_total_tokens = max_total_tokens
        """Default token budget of a branch when the request sets none (0 = none)."""
        self.timeout_s = timeout_s
        """Default wall-clock budget of a rollout when the request sets none (0 = none)."""
        self.description = description
        self.privileged = privileged
        """Context for a self-distillation teacher only (module doc); None: the environment
        has none."""
        self.runtime: Runtime = make_runtime(runtime)
        """Where the environment's programs run (module doc)."""
        _check_harness_runtime(self)

    def check(self, task: Any, where: str = "task") -> dict[str, Any]:
        """``task`` if it has every required field; TaskError otherwise."""
        return check_task(task, self.required, f"{self.name} {where}")

    def task_set(self) -> TaskSet:
        if self._tasks is None:
            raise ConfigError(
                f"environment {self.name!r} has no built-in task set: give a task file"
            )
        ts = self._tasks() if callable(self._tasks) else self._tasks
        return ts

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        """The opening conversation of ``task`` (a synchronous prompt function only)."""
        return self._as_messages(self.prompt_fn(task))

    async def messages(self, task: dict[str, Any], run_sync: RunSync) -> list[dict[str, Any]]:
        """The opening conversation of ``task`` (prompt may block: it runs via run_sync)."""
        if inspect.iscoroutinefunction(self.prompt_fn):
            out = await self.prompt_fn(task)
        else:
            out = await run_sync(lambda: self.prompt_fn(task))
        return self._as_messages(out)

    def _as_messages(self, out: Any) -> list[dict[str, Any]]:
        if isinstance(out, str):
            out = [{"role": "user", "content": out}]
            if self.system_prompt:
                out.insert(0, {"role": "system", "content": self.system_prompt})
        if not isinstance(out, list) or not all(isinstance(m, dict) and "role" in m for m in out):
            raise TypeError(
                "prompt() must return a string or a list of chat messages (dicts with 'role')"
            )
        return [dict(m) for m in out]

    def toolset(self, task: dict[str, Any]) -> ToolSet:
        tools = self.tools(task) if callable(self.tools) else self.tools
        return tools if isinstance(tools, ToolSet) else ToolSet(list(tools))


def as_environment(obj: Any, name: str = "") -> Environment:
    """``obj`` as an Environment (it may be one, or follow the minimal contract)."""
    if isinstance(obj, Environment):
        return obj
    if callable(getattr(obj, "prompt", None)) and callable(getattr(obj, "reward", None)):
        legacy = obj

        def reward(task: dict[str, Any], completion: str) -> Any:
            return legacy.reward(task, completion)

        return Environment(
            getattr(obj, "name", name) or name,
            prompt=obj.prompt,
            rubric=Rubric(rewards=[reward]),
            tasks=getattr(obj, "tasks", None),
            required=getattr(obj, "required", ()),
        )
    raise ConfigError(
        f"{obj!r} is neither an Environment nor an object with name, prompt(task) and reward(task, completion)"
    )


def load_object(target: str) -> Any:
    """Import ``"package.module:attribute"``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{target!r} is not of the form 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import {module_name!r} for {target!r}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{module_name!r} has no attribute {attr!r}") from None


def load_environment(
    name: str,
    extra: Mapping[str, str] | None = None,
    group_rewards: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    runtimes: Mapping[str, Any] | None = None,
) -> Environment:
    """Environment ``name``: a built-in, one of ``extra`` (name -> "module:attr"), or a
    "module:attr" target itself; with the group rewards ``group_rewards[name]`` specifies
    and the runtime ``runtimes[name]`` names (a kind or a table), when given."""
    env = _load_environment(name, extra)
    specs = (group_rewards or {}).get(name)
    if specs:
        env = with_group_rewards(env, specs)
    if runtimes and name in runtimes:
        env = with_runtime(env, runtimes[name])
    return env


def with_runtime(env: Environment, spec: Runtime | str | Mapping[str, Any]) -> Environment:
    """A copy of ``env`` whose programs run in the runtime ``spec`` names; ``env`` itself
    is left as it was. A bad spec, or a runtime this machine cannot run (no bubblewrap, no
    container engine), is a ConfigError naming the setting."""
    try:
        runtime = make_runtime(spec)
        runtime.check()  # asked for by name: this machine must be able to run it
    except (ConfigError, SandboxUnavailableError) as e:
        raise ConfigError(f"env_runner.runtimes.{env.name}: {e}") from None
    out = copy.copy(env)
    out.runtime = runtime
    _check_harness_runtime(out, f"env_runner.runtimes.{env.name}: ")
    return out


def _check_harness_runtime(env: Environment, where: str = "") -> None:
    """A harness that runs a program in the environment's runtime must fit it (e.g. the
    paths it needs readable must not be hidden by the sandbox): a ConfigError now, not at
    every rollout."""
    runtime_for = getattr(env.harness, "runtime_for", None)
    if runtime_for is None:
        return
    try:
        runtime_for(env)
    except ValueError as e:
        raise ConfigError(f"{where}environment {env.name!r}: {e}") from None


def with_group_rewards(env: Environment, specs: Sequence[Mapping[str, Any]]) -> Environment:
    """A copy of ``env`` whose rubric also has the group rewards of ``specs`` (config
    tables, see ``group_rewards.from_spec``); ``env`` itself is left as it was."""
    from treadle.env_runner.group_rewards import from_spec

    try:
        extra = [from_spec(s) for s in specs]
    except ValueError as e:
        raise ConfigError(f"env_runner.group_rewards.{env.name}: {e}") from None
    out = copy.copy(env)
    out.rubric = copy.copy(env.rubric)
    out.rubric.group_rewards = [
        *env.rubric.group_rewards,
        *Rubric(group_rewards=extra).group_rewards,
    ]
    return out


def _load_environment(name: str, extra: Mapping[str, str] | None) -> Environment:
    table = {**BUILTIN, **(extra or {})}
    if name in table:
        target = table[name]
    elif ":" in name:
        target = name
    else:
        raise ConfigError(
            f"unknown environment {name!r}; known: {', '.join(sorted(table))} (add it to env_runner.environments)"
        )
    obj = load_object(target)
    if callable(obj) and not isinstance(obj, Environment) and not hasattr(obj, "prompt"):
        obj = obj()  # a factory
    return as_environment(obj, name)


def load_environments(
    names: list[str],
    extra: Mapping[str, str],
    group_rewards: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    runtimes: Mapping[str, Any] | None = None,
) -> dict[str, Environment]:
    """The environments ``names`` (built-in or from ``extra``, with the group rewards of
    ``group_rewards`` and the runtimes of ``runtimes``), checked against the contract."""
    return {name: load_environment(name, extra, group_rewards, runtimes) for name in names}
