"""Harnesses: how the model acts in an environment (``base.py`` has the protocol).

    SingleTurn()            one model call on the task's prompt            chat.py
    ToolUse(max_turns=8)    function calling until the model answers       chat.py
                            without a tool call (Python functions or MCP)
    UserSimulator(user)     another model or a scripted policy plays the   chat.py
                            user until it says the done marker
    CommandHarness(argv)    any program, in the environment's runtime,     command.py
                            talking to the model over its usual API
    claude_code(), codex(), third-party CLI agents, unmodified             agents.py
    opencode(), mini_swe_agent()

Imported lazily, so that importing one harness does not import the others' needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Harness": "base",
    "HarnessError": "base",
    "EnvView": "base",
    "RunSync": "base",
    "SingleTurn": "chat",
    "ToolUse": "chat",
    "UserSimulator": "chat",
    "run_tool_calls": "chat",
    "CommandHarness": "command",
    "claude_code": "agents",
    "codex": "agents",
    "mini_swe_agent": "agents",
    "opencode": "agents",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
