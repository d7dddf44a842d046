"""Single-turn environments: what a task's prompt is and how its answer is scored.

The minimal contract the env runner needs today (the full environment library —
harnesses, tools, sandboxes — builds on it): an object with

    name: str
    prompt(task: dict) -> list[dict]           # chat messages, without the answer
    reward(task: dict, completion: str) -> float | dict[str, float]

A dict of rewards is summed (weights 1) and every component recorded. Environments are
found by name: built-ins below, plus ``[env_runner] environments = {name = "mod:attr"}``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from treadle.services.errors import ConfigError

BUILTIN = {"reverse_text": "treadle.env_runner.envs.reverse_text:ENVIRONMENT"}


@runtime_checkable
class Environment(Protocol):
    name: str

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]: ...

    def reward(self, task: dict[str, Any], completion: str) -> float | dict[str, float]: ...


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


def load_environments(names: list[str], extra: Mapping[str, str]) -> dict[str, Environment]:
    """The environments ``names`` (built-in or from ``extra``), checked against the contract."""
    table = {**BUILTIN, **extra}
    found: dict[str, Environment] = {}
    for name in names:
        if name not in table:
            raise ConfigError(
                f"unknown environment {name!r}; known: {', '.join(sorted(table))} (add it to env_runner.environments)"
            )
        env = load_object(table[name])
        if not isinstance(env, Environment):
            raise ConfigError(
                f"{table[name]} does not provide name, prompt(task) and reward(task, completion)"
            )
        found[name] = env
    return found
