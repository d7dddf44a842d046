"""Tools for function calling: Python functions with an OpenAI-style JSON schema.

    def search(query: str, k: int = 3) -> str:
        '''Search the local corpus.

        Args:
            query: words to look for.
            k: how many passages to return.
        '''

    tools = ToolSet([search, calculator])
    tools.schemas()                       # [{"type": "function", "function": {...}}]
    await tools.call("search", '{"query": "nile"}', state)   # -> ToolResult

The schema comes from the signature (types -> JSON types, defaults -> optional) and the
docstring (first paragraph -> description, ``Args:`` lines -> parameter descriptions).
A parameter named ``state`` is not shown to the model: it receives the rollout's
RolloutState. Bad calls (unknown tool, arguments that are not a JSON object, missing or
unexpected arguments) and tools that raise come back as a ToolResult with a status and
an error text the model can read; they never raise out of ``call``.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

HIDDEN = {"state"}

_JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}


def _json_type(ann: Any) -> dict[str, Any]:
    if ann is inspect.Parameter.empty or ann is Any:
        return {}
    origin = typing.get_origin(ann)
    if origin is Literal:
        values = list(typing.get_args(ann))
        return {"enum": values, **_json_type(type(values[0]))}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {"anyOf": [_json_type(a) for a in args]}
    if origin in (list, tuple, Sequence):
        items = typing.get_args(ann)
        return {"type": "array", **({"items": _json_type(items[0])} if items else {})}
    if origin is dict:
        return {"type": "object"}
    if ann in _JSON_TYPES:
        return {"type": _JSON_TYPES[ann]}
    return {}


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    doc = inspect.cleandoc(doc or "")
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    m = re.search(r"^(Args|Arguments|Parameters):\s*$(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    if m:
        current = None
        for line in m.group(2).splitlines():
            hit = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if hit and (current is None or len(line) - len(line.lstrip()) <= 8):
                current = hit.group(1)
                params[current] = hit.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


def function_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-style tool entry (what ``tools=[...]`` of a chat request holds)."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


@dataclass
class ToolResult:
    content: str
    status: str = "ok"
    """ok | unknown_tool | invalid_arguments | malformed | error"""


class Tool:
    """One callable tool and its schema."""

    def __init__(
        self, fn: Callable[..., Any], name: str | None = None, description: str | None = None
    ):
        self.fn = fn
        self.name = name or fn.__name__
        doc_description, doc_params = _doc_parts(fn.__doc__ or "")
        self.description = description or doc_description or self.name
        hints = typing.get_type_hints(fn) if not isinstance(fn, functools.partial) else {}
        sig = inspect.signature(fn)
        props: dict[str, Any] = {}
        required: list[str] = []
        self.accepts_state = "state" in sig.parameters
        for pname, p in sig.parameters.items():
            if pname in HIDDEN or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            prop = _json_type(hints.get(pname, p.annotation))
            if pname in doc_params:
                prop["description"] = doc_params[pname]
            if p.default is p.empty:
                required.append(pname)
            else:
                if p.default is None or isinstance(p.default, (str, int, float, bool)):
                    prop["default"] = p.default
            props[pname] = prop
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": props,
            "required": required,
        }
        self.is_async = inspect.iscoroutinefunction(fn)

    def schema(self) -> dict[str, Any]:
        return function_schema(self.name, self.description, self.parameters)

    def check(self, args: dict[str, Any]) -> str | None:
        """Why ``args`` do not fit the schema (None when they do)."""
        props: dict[str, dict[str, Any]] = self.parameters["properties"]
        missing = [r for r in self.parameters["required"] if r not in args]
        if missing:
            return f"missing argument(s): {', '.join(missing)}"
        extra = [a for a in args if a not in props]
        if extra:
            return f"unexpected argument(s): {', '.join(extra)}"
        for k, v in args.items():
            want = props[k].get("type")
            if want and not _fits(v, want):
                return f"argument {k!r} should be {want}, got {type(v).__name__}"
        return None


def _fits(v: Any, want: str) -> bool:
    if want == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if want == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(
        v, {"string": str, "boolean": bool, "array": list, "object": dict}.get(want, object)
    )


RunSync = Callable[[Callable[[], Any]], Awaitable[Any]]


class ToolSet:
    """Tools by name; ``call`` never raises (see the module doc)."""

    def __init__(self, tools: Sequence[Tool | Callable[..., Any]] = ()):
        self.tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool | Callable[..., Any]) -> None:
        t: Any = tool if isinstance(tool, Tool) or hasattr(tool, "schema") else Tool(tool)
        if t.name in self.tools:
            raise ValueError(f"two tools are named {t.name!r}")
        self.tools[t.name] = t

    def __bool__(self) -> bool:
        return bool(self.tools)

    def __len__(self) -> int:
        return len(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    async def call(
        self,
        name: str,
        arguments: str | dict[str, Any],
        state: Any = None,
        run_sync: RunSync | None = None,
    ) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(
                f"error: unknown tool {name!r}; available: {', '.join(self.tools) or 'none'}",
                "unknown_tool",
            )
        if isinstance(arguments, str):
            try:
                args = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return ToolResult(f"error: arguments are not valid JSON ({e.msg})", "malformed")
        else:
            args = arguments
        if not isinstance(args, dict):
            return ToolResult("error: arguments must be a JSON object", "invalid_arguments")
        if problem := tool.check(args):
            return ToolResult(f"error: {problem}", "invalid_arguments")
        try:
            kwargs = {**args, "state": state} if getattr(tool, "accepts_state", False) else args
            if tool.is_async:
                out = await tool.fn(**kwargs)
            elif run_sync is not None:
                out = await run_sync(lambda: tool.fn(**kwargs))
            else:
                out = tool.fn(**kwargs)
        except Exception as e:
            return ToolResult(f"error: {type(e).__name__}: {e}", "error")
        return ToolResult(
            out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)
        )
