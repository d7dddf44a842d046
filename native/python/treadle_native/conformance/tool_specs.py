"""Tool schemas and tool-call arguments for the conformance corpus.

Schemas are OpenAI/HF function dicts (`{"type": "function", "function": {...}}`). They and
the arguments stress what a JSON writer must reproduce exactly as Python's `json.dumps`
(which the templates' `tojson` is): key order as inserted (never sorted), floats in Python
`repr` form (`1e-05`, `3.0`, `1e+16`), nested objects and arrays, empty objects, `null`,
booleans, non-ASCII text left unescaped, and control characters escaped as `\\u001f`.

Every argument value is a JSON object, as a dict or as a JSON string; this module does not
decide which (see `corpus.py`), it only offers the JSON string spellings.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from .texts import TextSource


def _fn(name: str, description: str | None, parameters: dict[str, Any]) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required is not None:
        out["required"] = required
    return out


SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": _fn(
        "get_weather",
        "Get the current weather for a location.",
        _obj(
            {
                "location": {"type": "string", "description": "City and country, e.g. Paris, FR"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            ["location"],
        ),
    ),
    "search_web": _fn(
        "search_web",
        "Search the web.\nReturns a list of results with \"title\", 'url' and\tscore.",
        _obj(
            {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "default": 10, "minimum": 1},
                "min_score": {"type": "number", "default": 0.5, "maximum": 1.0},
                "filters": _obj(
                    {"site": {"type": "string"}, "after": {"type": "string", "format": "date"}}
                ),
            },
            ["query"],
        ),
    ),
    "create_event": _fn(
        "create_event",
        "Create a calendar event.",
        _obj(
            {
                "title": {"type": "string"},
                "start": _obj({"date": {"type": "string"}, "time": {"type": "string"}}),
                "attendees": {
                    "type": "array",
                    "items": _obj({"name": {"type": "string"}, "optional": {"type": "boolean"}}),
                },
                "reminder_minutes": {"type": ["integer", "null"]},
            },
            ["title", "start"],
        ),
    ),
    "get_time": _fn("get_time", "Current UTC time. Takes no arguments.", _obj({})),
    "calculate": _fn(
        "calculate",
        "Evaluate an arithmetic expression.",
        _obj(
            {
                "expression": {"type": "string"},
                "precision": {"type": "number", "default": 1e-05, "minimum": 5e-324},
                "scale": {"type": "number", "default": 3.0, "maximum": 1e16},
            },
            ["expression"],
        ),
    ),
    "translate": _fn(
        "translate",
        "翻译文本 🌐 — traduire un texte (العربية ↔ 中文)",
        _obj(
            {"text": {"type": "string"}, "目标语言": {"type": "string", "enum": ["zh", "ar", "fr"]}}
        ),
    ),
    "run_code": {
        # keys deliberately not in the usual order
        "function": {
            "parameters": _obj({"language": {"type": "string"}, "code": {"type": "string"}}),
            "name": "run_code",
        },
        "type": "function",
    },
    "set_config": _fn(
        "set_config",
        None,
        _obj(
            {
                "values": {
                    "type": "object",
                    "additionalProperties": {"type": "number"},
                    "examples": [{"alpha": 0.1, "beta": -2.5e-07, "gamma": 1.7976931348623157e308}],
                }
            }
        ),
    ),
}
TOOL_NAMES = tuple(SCHEMAS)


def _weather(src: TextSource, rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {"location": rng.choice(["Paris, FR", "東京", "São Paulo", src.short()])}
    if rng.random() < 0.6:
        args["unit"] = rng.choice(["celsius", "fahrenheit"])
    return args


def _search(src: TextSource, rng: random.Random) -> dict[str, Any]:
    args: dict[str, Any] = {"query": src.short(), "max_results": rng.choice([1, 5, 10, 100])}
    if rng.random() < 0.7:
        args["min_score"] = rng.choice([0.5, 0.25, 0.1, 0.333, 1.0, 0.0])
    if rng.random() < 0.5:
        args["filters"] = rng.choice(
            [{}, {"site": "example.com"}, {"site": "wiki", "after": "2024-01-31"}]
        )
    return args


def _event(src: TextSource, rng: random.Random) -> dict[str, Any]:
    return {
        "title": src.short(),
        "start": {"date": "2025-03-01", "time": rng.choice(["09:30", "23:59"])},
        "attendees": rng.choice(
            [[], [{"name": "Ana", "optional": False}, {"name": "李雷", "optional": True}]]
        ),
        "reminder_minutes": rng.choice([None, 0, 15]),
    }


# floats around the points where Python's repr switches notation (1e-04 / 1e-05, 1e15 / 1e16)
EDGE_FLOATS = (
    0.0001,
    1e-05,
    1e15,
    1e16,
    123456789012345678.0,
    1.0000000000000002,
    0.30000000000000004,
)


def random_float(rng: random.Random) -> float:
    """A float of random magnitude (1e-9 .. 1e21), rounded to a random number of digits."""
    value = rng.uniform(-1, 1) * 10.0 ** rng.randint(-9, 21)
    return float(f"{value:.{rng.randint(1, 17)}g}")


def _calculate(src: TextSource, rng: random.Random) -> dict[str, Any]:
    return {
        "expression": rng.choice(["2 + 2", "sqrt(2) * 10**-5", "1/3", src.short()]),
        "precision": rng.choice([1e-05, 0.1, 2.5e-07, 5e-324, 1.0, *EDGE_FLOATS]),
        "scale": rng.choice([3.0, -0.0, 1e16, 12345678.9, 1.5e300, 100.0]),
        "samples": [random_float(rng) for _ in range(rng.randint(0, 4))],
    }


def _translate(src: TextSource, rng: random.Random) -> dict[str, Any]:
    return {"text": src.short(), "目标语言": rng.choice(["zh", "ar", "fr"])}


def _run_code(src: TextSource, rng: random.Random) -> dict[str, Any]:
    code = rng.choice(
        [
            'print("héllo\\n", end="")\n',
            "for i in range(3):\n\tprint(i, '\\t', i ** 0.5)",
            "x = {'a': [1, 2, {}]}\n# control chars: \x01\x1f\x7f",
        ]
    )
    return {"language": "python", "code": code}


def _set_config(src: TextSource, rng: random.Random) -> dict[str, Any]:
    values = {"alpha": 0.1, "beta": -2.5e-07, "gamma": 1e16, "delta": 3.0, "eps": 1e-08}
    keys = rng.sample(sorted(values), rng.randint(0, len(values)))
    chosen = {k: values[k] for k in keys} | {
        f"r{i}": random_float(rng) for i in range(rng.randint(0, 3))
    }
    return {"values": chosen, "flags": {"dry_run": True, "note": None}}


ARGUMENTS: dict[str, Callable[[TextSource, random.Random], dict[str, Any]]] = {
    "get_weather": _weather,
    "search_web": _search,
    "create_event": _event,
    "get_time": lambda src, rng: {},
    "calculate": _calculate,
    "translate": _translate,
    "run_code": _run_code,
    "set_config": _set_config,
}
assert set(ARGUMENTS) == set(SCHEMAS)


def json_spellings(args: dict[str, Any]) -> list[str]:
    """Ways a client may have serialised the same arguments object as a JSON string."""
    return [
        json.dumps(args),  # ensure_ascii=True: non-ASCII as \\uXXXX escapes
        json.dumps(args, ensure_ascii=False),
        json.dumps(args, ensure_ascii=False, separators=(",", ":")),
        json.dumps(args, ensure_ascii=False, indent=2),
    ]


def tool_result(src: TextSource, rng: random.Random, name: str) -> str:
    """What a tool returned, as the string content of a `tool` message."""
    r = rng.random()
    if r < 0.4:
        payload = {"tool": name, "ok": True, "value": rng.choice([21.5, 3.0, 0.1, 7, None])}
        return json.dumps(payload, ensure_ascii=False)
    if r < 0.5:
        return json.dumps({"error": "timeout", "retry_after_s": 1.5})
    return src.text()
