"""Plug-ins named by a setting: ``"package.module:attribute"`` imported and checked.

Services that let a run bring its own Python code (an orchestrator's algorithm, a
trainer's loss) resolve it here, so a bad path fails the same way everywhere: a
``ConfigError`` that names the setting, before the service does any work.

Not here: what a plug-in must be (each service checks its own contract).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from treadle.services.errors import ConfigError


def is_import_path(value: str) -> bool:
    """True when ``value`` looks like ``"package.module:attribute"`` (not a built-in name)."""
    return ":" in value


def load_object(target: str, setting: str) -> Any:
    """Import ``"package.module:attribute"`` (dotted attributes allowed after the colon)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name.strip() or not attr.strip():
        raise ConfigError(f"{setting} = {target!r} is not of the form 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # any error while importing user code is a config error
        raise ConfigError(
            f"{setting} = {target!r}: cannot import {module_name!r} ({type(e).__name__}: {e})"
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{setting} = {target!r}: {module_name!r} has no {attr!r}") from None
    return obj


def load_callable(target: str, setting: str) -> Callable[..., Any]:
    """``load_object`` that must be callable."""
    obj = load_object(target, setting)
    if not callable(obj):
        raise ConfigError(f"{setting} = {target!r} is a {type(obj).__name__}, not a function")
    return obj


def check_call(fn: Callable[..., Any], setting: str, call: str, *args: Any, **kwargs: Any) -> None:
    """ConfigError naming ``setting`` unless ``fn`` accepts ``fn(*args, **kwargs)``;
    ``call`` shows that call in the message (e.g. ``"fn(group, normalize=...)"``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{setting}: {getattr(fn, '__qualname__', fn)}{sig} cannot be called as {call}: {e}"
        ) from None
