"""Runtimes: where an environment's programs run (``base.py`` has the common surface).

    local       LocalRuntime      child processes of the runner; isolates nothing
                                  (development, trusted programs)
    sandbox     SandboxRuntime    bubblewrap: an unprivileged uid in its own namespaces, no
                                  network, read-only system, every limit enforced (default)
    container   ContainerRuntime  a fresh docker/podman container per program

An environment names its runtime (``Environment(..., runtime="sandbox")``, or a runtime
object); the run's config overrides it per environment::

    [env_runner.runtimes.python_code]
    kind = "container"                 # local | sandbox | container | "pkg.module:Class"
    image = "python:3.11-slim"         # the kind's own settings
    network = false
    limits = { wall_s = 30, memory_bytes = 1073741824 }

Harnesses and rewards that run programs (CommandHarness, python_code's grader) run them in
the rollout's runtime (``RolloutState.runtime``). A new runtime is a subclass of
:class:`~treadle.env_runner.runtimes.base.Runtime` in a file of its own, named in
:data:`RUNTIMES` (or by import path in a config). This package imports its runtimes
lazily: ``base`` and ``sandbox`` need only the standard library and the chassis's errors.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from treadle.services.errors import ConfigError

if TYPE_CHECKING:
    from treadle.env_runner.runtimes.base import Runtime

RUNTIMES = {
    "local": "treadle.env_runner.runtimes.local:LocalRuntime",
    "sandbox": "treadle.env_runner.runtimes.sandbox:SandboxRuntime",
    "container": "treadle.env_runner.runtimes.container:ContainerRuntime",
}
DEFAULT = "sandbox"


def runtime_class(kind: str) -> type[Runtime]:
    """The Runtime class named ``kind``: a key of RUNTIMES or "module:Class"."""
    from treadle.env_runner.runtimes.base import Runtime

    target = RUNTIMES.get(kind, kind)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ConfigError(
            f"unknown runtime {kind!r}; known: {', '.join(RUNTIMES)} (or 'package.module:Class')"
        )
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"runtime {kind!r}: cannot import {target}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise ConfigError(f"runtime {kind!r}: {target} is not a Runtime subclass")
    return cls


def make_runtime(spec: Runtime | str | Mapping[str, Any] | None) -> Runtime:
    """A runtime from a Runtime (itself), a kind ("sandbox"), a config table (``kind``
    plus that runtime's settings; ``limits`` a table of SandboxLimits fields), or None
    (the default, the sandbox). Bad settings are a ConfigError naming them."""
    from treadle.env_runner.runtimes.base import Runtime, SandboxLimits

    if isinstance(spec, Runtime):
        return spec
    if spec is None or isinstance(spec, str):
        return runtime_class(spec or DEFAULT)()
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a runtime is a kind or a table, not {type(spec).__name__}")
    settings = dict(spec)
    kind = settings.pop("kind", None)
    if not isinstance(kind, str):
        raise ConfigError(
            f"runtime table {dict(spec)!r}: needs kind = one of {', '.join(RUNTIMES)}"
        )
    cls = runtime_class(kind)
    if "limits" in settings:
        limits = settings["limits"]
        if not isinstance(limits, Mapping):
            raise ConfigError(f"runtime {kind!r}: limits must be a table of SandboxLimits fields")
        try:
            settings["limits"] = SandboxLimits(**limits)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"runtime {kind!r}: limits: {e}") from None
    try:
        return cls(**settings)
    except TypeError as e:
        raise ConfigError(f"runtime {kind!r}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"runtime {kind!r}: {e}") from None
