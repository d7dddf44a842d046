"""Hand-written corpus cases, one per template quirk a native renderer must reproduce.

Each case pins one behaviour found by reading the templates (named in the case), e.g.
Qwen3 dropping reasoning before the last user query, Llama trimming with Python's notion of
whitespace, DeepSeek hoisting the last system message to the top. `corpus.cases` puts them
first, ahead of the generated cases. Kinds derived from the content (system, tools,
tool_calls, multi_turn, thinking) are added by `corpus.py`; here only the intent is named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .dialects import EMPTY, NONE, Dialect
from .tool_specs import SCHEMAS

Message = dict[str, Any]


@dataclass
class Quirk:
    name: str
    kinds: tuple[str, ...]
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)


def u(text: str) -> Message:
    return {"role": "user", "content": text}


def a(text: str, **extra: Any) -> Message:
    return {"role": "assistant", "content": text, **extra}


def s(text: str) -> Message:
    return {"role": "system", "content": text}


def result(text: str, call_id: str = "call_0") -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


FLOAT_ARGS = {
    "values": {
        "alpha": 0.1,
        "beta": 3.0,
        "gamma": 1e16,
        "delta": 1e-05,
        "eps": -0.0,
        "huge": 1.7976931348623157e308,
        "tiny": 5e-324,
        "third": 1 / 3,
    },
    "flags": {"dry_run": True, "retries": 7, "offset": -12, "note": None},
}
NESTED_UNICODE_ARGS = {
    "text": "你好 😀 مرحبا e\u0301 \u200b",
    "目标语言": "zh",
    "meta": {"tags": ["ü", "ß", "👍🏽"], "empty": {}, "list": [], "deep": {"x": {"y": [1.5, {}]}}},
}
BIG_INT_ARGS = {"id": 18446744073709551617, "neg": -9223372036854775809, "max_i64": 2**63 - 1}


class _Calls:
    """Tool-call messages in the form a dialect accepts (dict or string arguments, content)."""

    def __init__(self, d: Dialect) -> None:
        self.d = d

    def args(self, value: dict[str, Any] | str) -> dict[str, Any] | str:
        """A dict as the dialect takes it (a JSON string where dicts are not accepted)."""
        if isinstance(value, dict) and not self.d.arguments_as_dict:
            return json.dumps(value, ensure_ascii=False)
        return value

    def message(
        self, *calls: tuple[str, dict[str, Any] | str], content: str | None = None, **extra: Any
    ) -> Message:
        """An assistant turn calling `calls`; without `content` the key is left out, or set
        to "" where the dialect needs a string."""
        msg: Message = {"role": "assistant"}
        if content is not None or self.d.tool_call_contents[0] == EMPTY:
            msg["content"] = content or ""
        msg.update(extra)
        msg["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": name, "arguments": self.args(args)},
            }
            for i, (name, args) in enumerate(calls)
        ]
        return msg


def quirk_cases(d: Dialect) -> list[Quirk]:
    """The quirk cases for a dialect: the common ones, then the family's own."""
    family = {
        "qwen3": _qwen3,
        "qwen2.5": _qwen25,
        "llama3": _llama3,
        "deepseek-r1": _deepseek,
    }[d.family]
    return _common(d) + family(d)


def _common(d: Dialect) -> list[Quirk]:
    c = _Calls(d)
    calc, config, translate = SCHEMAS["calculate"], SCHEMAS["set_config"], SCHEMAS["translate"]
    out = [
        Quirk(
            "float-arguments",
            ("tool_calls",),
            [
                u("Set the config."),
                c.message(("set_config", FLOAT_ARGS)),
                result('{"ok": true}'),
                a("Done."),
            ],
            [config],
        ),
        Quirk(
            "empty-object-arguments",
            ("tool_calls", "empty"),
            [u("What time is it?"), c.message(("get_time", {})), result("12:00Z")],
            [SCHEMAS["get_time"]],
            True,
        ),
        Quirk(
            "nested-unicode-arguments",
            ("tool_calls", "unicode"),
            [u("翻译一下"), c.message(("translate", NESTED_UNICODE_ARGS)), result("Hello 😀")],
            [translate],
            True,
        ),
        Quirk(
            "arguments-ascii-escaped-pretty-string",
            ("tool_calls", "unicode", "whitespace"),
            [
                u("Translate."),
                c.message(("translate", json.dumps(NESTED_UNICODE_ARGS, indent=2))),
                result("done"),
                a("Translated."),
            ],
            [translate],
        ),
        Quirk(
            "tool-schema-key-order",
            ("tools",),
            [u("Run some code.")],
            [SCHEMAS["run_code"], config, calc],
            True,
        ),
        Quirk("tools-empty-list", ("tools", "empty"), [u("Hi")], [], True),
        Quirk("system-only", ("system",), [s("You are terse.")], None, True),
        Quirk("empty-contents", ("empty",), [s(""), u(""), a(""), u("")], None, True),
        Quirk(
            "whitespace-only-contents",
            ("whitespace",),
            [s(" \n"), u("\t"), a("\r\n"), u("   ")],
            None,
            True,
        ),
        Quirk(
            "crlf-and-tabs",
            ("whitespace", "multi_turn"),
            [u("line one\r\nline two\r\n"), a("\tindented\r\n\r\n"), u("\r\n")],
            None,
            True,
        ),
        Quirk(
            "tool-output-with-control-chars",
            ("tool_calls", "whitespace"),
            [
                u("Run ls."),
                c.message(("run_code", {"language": "sh", "code": "ls --color"})),
                result("\x1b[31mred\x1b[0m\tfile\x07\nnul\x00byte"),
                a("Listed."),
            ],
            [SCHEMAS["run_code"]],
        ),
        Quirk(
            "tools-with-late-system",
            ("tools", "system"),
            [u("Q1"), a("A1"), s("Late system."), u("Weather?")],
            [SCHEMAS["get_weather"]],
            True,
        ),
    ]
    if d.arguments_as_dict:
        out.append(
            Quirk(
                "big-integer-arguments",
                ("tool_calls",),
                [u("Look it up."), c.message(("calculate", BIG_INT_ARGS)), result("ok")],
                [calc],
                True,
            )
        )
    if d.parallel_tool_calls:
        out.append(
            Quirk(
                "parallel-calls-consecutive-results",
                ("tool_calls",),
                [
                    u("Weather in Paris and Tokyo, and the time?"),
                    c.message(
                        ("get_weather", {"location": "Paris"}),
                        ("get_weather", {"location": "東京", "unit": "celsius"}),
                        ("get_time", {}),
                    ),
                    result("18C", "call_0"),
                    result("21.5", "call_1"),
                    result("12:00Z", "call_2"),
                    a("Paris 18C, Tokyo 21.5C, 12:00Z."),
                ],
                [SCHEMAS["get_weather"], SCHEMAS["get_time"]],
            )
        )
    return out


def _qwen3(d: Dialect) -> list[Quirk]:
    c = _Calls(d)
    weather = [SCHEMAS["get_weather"]]
    out = [
        Quirk(
            "reasoning-dropped-before-last-query",
            ("thinking", "multi_turn"),
            [u("Q1"), a("A1", reasoning_content="R1"), u("Q2"), a("A2", reasoning_content="R2")],
        ),
        Quirk(
            "think-tags-split-from-content",
            ("thinking",),
            [u("Q"), a("<think>\nR\n</think>\n\nA")],
        ),
        Quirk("close-tag-only", ("thinking",), [u("Q"), a("R\n</think>\nA")]),
        Quirk("open-tag-only-not-split", ("thinking",), [u("Q"), a("<think>\nR without end")]),
        Quirk("two-close-tags", ("thinking",), [u("Q"), a("<think>R1</think>mid</think>\n\nA")]),
        Quirk(
            "reasoning-content-wins-over-tags",
            ("thinking",),
            [u("Q"), a("<think>inline</think>A", reasoning_content="R")],
        ),
        Quirk(
            "reasoning-newlines-stripped",
            ("thinking", "whitespace"),
            [u("Q"), a("\n\nA\n", reasoning_content="\n\nR\r\n\n")],
        ),
        Quirk(
            "empty-reasoning-last-turn",
            ("thinking", "empty"),
            [u("Q"), a("A", reasoning_content="")],
        ),
        Quirk("final-turn-gets-empty-think", ("thinking",), [u("Q"), a("A")]),
        Quirk(
            "intermediate-turn-without-reasoning",
            ("thinking", "tool_calls"),
            [
                u("Weather?"),
                c.message(("get_weather", {"location": "Paris"})),
                result("18C"),
                a("18C", reasoning_content="The tool said 18C."),
            ],
            weather,
        ),
        Quirk(
            "multi-step-tool-reasoning",
            ("thinking", "tool_calls"),
            [
                u("Weather?"),
                c.message(
                    ("get_weather", {"location": "Paris"}),
                    content="Checking.",
                    reasoning_content="Need the tool.",
                ),
                result("18C"),
                a("It is 18C.", reasoning_content="Got it."),
            ],
            weather,
        ),
        Quirk(
            "user-tool-response-is-not-a-query",
            ("thinking", "multi_turn"),
            [
                u("Q"),
                a("A1", reasoning_content="R1"),
                u("<tool_response>\n42\n</tool_response>"),
                a("A2", reasoning_content="R2"),
            ],
        ),
        Quirk(
            "user-half-wrapped-tool-response-is-a-query",
            ("thinking", "multi_turn"),
            [
                u("Q"),
                a("A1", reasoning_content="R1"),
                u("<tool_response>\n42"),
                a("A2", reasoning_content="R2"),
            ],
        ),
        Quirk(
            "enable-thinking-false-prefill",
            ("generation_prompt", "thinking"),
            [u("Q")],
            None,
            True,
            {"enable_thinking": False},
        ),
        Quirk(
            "enable-thinking-false-no-prompt",
            ("generation_prompt",),
            [u("Q"), a("A")],
            None,
            False,
            {"enable_thinking": False},
        ),
        Quirk(
            "enable-thinking-true",
            ("generation_prompt", "thinking"),
            [u("Q")],
            None,
            True,
            {"enable_thinking": True},
        ),
        Quirk(
            "text-before-parallel-calls",
            ("tool_calls",),
            [
                u("Two cities?"),
                c.message(
                    ("get_weather", {"location": "Paris"}),
                    ("get_weather", {"location": "Rome"}),
                    content="Let me check.",
                ),
                result("18C"),
                result("25C"),
            ],
            weather,
            True,
        ),
        Quirk(
            "raw-string-arguments",
            ("tool_calls", "whitespace"),
            [
                u("Weather?"),
                c.message(("get_weather", '{ "location" :"Paris",\n  "unit":"celsius" }')),
                result("18C"),
            ],
            weather,
            True,
        ),
        Quirk(
            "system-with-tools", ("system", "tools"), [s("Be brief."), u("Weather?")], weather, True
        ),
        Quirk(
            "system-mid-conversation",
            ("system",),
            [u("Q1"), a("A1"), s("New rules."), u("Q2")],
            None,
            True,
        ),
    ]
    if NONE in d.tool_call_contents:
        out.append(
            Quirk(
                "calls-with-none-content",
                ("tool_calls",),
                [
                    u("Weather?"),
                    {**c.message(("get_weather", {"location": "Oslo"})), "content": None},
                    result("-3C"),
                ],
                weather,
                True,
            )
        )
    return out


def _qwen25(d: Dialect) -> list[Quirk]:
    c = _Calls(d)
    weather = [SCHEMAS["get_weather"]]
    return [
        Quirk("default-system-prompt", ("basic",), [u("Hi")], None, True),
        Quirk("default-system-with-tools", ("tools",), [u("Weather?")], weather, True),
        Quirk(
            "system-with-tools", ("system", "tools"), [s("Be brief."), u("Weather?")], weather, True
        ),
        Quirk(
            "string-arguments-encoded-again",
            ("tool_calls",),
            [u("Weather?"), c.message(("get_weather", '{"location": "Paris"}')), result("18C")],
            weather,
            True,
        ),
        Quirk(
            "calls-with-none-empty-and-text-content",
            ("tool_calls", "empty"),
            [
                u("Weather?"),
                {**c.message(("get_weather", {"location": "Oslo"})), "content": None},
                result("-3C"),
                c.message(("get_weather", {"location": "Rome"}), content=""),
                result("25C"),
                c.message(("get_weather", {"location": "Lima"}), content="One more."),
                result("19C"),
                a("Done."),
            ],
            weather,
        ),
        Quirk("think-tags-kept-verbatim", ("thinking",), [u("Q"), a("<think>\nR\n</think>\n\nA")]),
        Quirk("reasoning-content-ignored", ("thinking",), [u("Q"), a("A", reasoning_content="R")]),
        Quirk(
            "system-mid-conversation",
            ("system",),
            [u("Q1"), a("A1"), s("New rules."), u("Q2")],
            None,
            True,
        ),
    ]


def _llama3(d: Dialect) -> list[Quirk]:
    c = _Calls(d)
    weather = [SCHEMAS["get_weather"]]
    return [
        Quirk(
            "trim-uses-python-whitespace",
            ("whitespace", "system"),
            [s("\x1c system \u3000"), u("\x85 hi \x1f\u2028"), a("\u00a0 hello \x0b")],
            None,
            True,
        ),
        Quirk(
            "tools-in-first-user-message",
            ("tools", "whitespace"),
            [s(" Be brief. "), u("\n  Weather in Paris?  \n"), a("Let me check."), u("Thanks")],
            weather,
            True,
        ),
        Quirk(
            "tool-result-string-json-quoted",
            ("tool_calls",),
            [
                u("Weather?"),
                c.message(("get_weather", {"location": "Paris"})),
                result('He said "hi"\n\tok\\'),
                a("OK"),
            ],
            weather,
        ),
        Quirk(
            "sequential-single-calls",
            ("tool_calls", "multi_turn"),
            [
                u("Weather in Paris, then Rome?"),
                c.message(("get_weather", {"location": "Paris"})),
                result("18C"),
                c.message(("get_weather", {"location": "Rome"})),
                result("25C"),
                a("Paris 18C, Rome 25C."),
                u("Thanks"),
            ],
            weather,
            True,
        ),
        Quirk(
            "string-arguments-encoded-again",
            ("tool_calls",),
            [u("Weather?"), c.message(("get_weather", '{"location": "Paris"}')), result("18C")],
            weather,
            True,
        ),
        Quirk(
            "calls-without-tools",
            ("tool_calls",),
            [
                u("Weather?"),
                c.message(("get_weather", {"location": "Paris"})),
                result("18C"),
                a("18C"),
            ],
        ),
        Quirk(
            "system-mid-conversation-trimmed",
            ("system",),
            [u("Q1"), a("A1"), s("  New rules.\n"), u("Q2")],
            None,
            True,
        ),
        Quirk(
            "leap-day-date",
            ("basic",),
            [u("What day is it?")],
            None,
            True,
            {"date_string": "29 Feb 2028"},
        ),
        Quirk("no-system-message", ("basic",), [u("Hi")], None, True),
        Quirk(
            "think-tags-trimmed", ("thinking", "whitespace"), [u("Q"), a("  <think>R</think> A \n")]
        ),
    ]


def _deepseek(d: Dialect) -> list[Quirk]:
    c = _Calls(d)
    weather = [SCHEMAS["get_weather"]]
    paris = ("get_weather", {"location": "Paris"})
    return [
        Quirk(
            "system-hoisted-to-top",
            ("system",),
            [u("Q1"), a("A1"), s("Late system."), u("Q2")],
            None,
            True,
        ),
        Quirk(
            "last-system-wins",
            ("system",),
            [s("First."), u("Q1"), a("A1"), s("Second."), u("Q2")],
            None,
            True,
        ),
        Quirk(
            "think-removed-from-history",
            ("thinking", "multi_turn"),
            [u("Q1"), a("<think>\nR1\n</think>\n\nA1"), u("Q2")],
            None,
            True,
        ),
        Quirk(
            "two-close-tags-keep-last", ("thinking",), [u("Q"), a("<think>R</think>mid</think>A")]
        ),
        Quirk("reasoning-content-ignored", ("thinking",), [u("Q"), a("A", reasoning_content="R")]),
        Quirk(
            "calls-with-empty-content-dropped",
            ("tool_calls",),
            [u("Weather?"), c.message(paris), result("18C"), a("18C")],
            weather,
        ),
        Quirk(
            "calls-with-text-content",
            ("tool_calls",),
            [u("Weather?"), c.message(paris, content="Checking."), result("18C")],
            weather,
            True,
        ),
        Quirk(
            "answer-after-tool-outputs-keeps-think",
            ("tool_calls", "thinking"),
            [u("Weather?"), c.message(paris), result("18C"), a("<think>\nfine\n</think>\n\n18C")],
            weather,
        ),
        Quirk(
            "tool-outputs-then-generation-prompt",
            ("tool_calls", "generation_prompt"),
            [u("Weather?"), c.message(paris), result("18C")],
            weather,
            True,
        ),
        Quirk(
            "second-tool-round-without-outputs-begin",
            ("tool_calls", "multi_turn"),
            [
                u("Q1"),
                c.message(paris),
                result("18C"),
                result("dry"),
                a("18C"),
                u("Q2"),
                c.message(paris),
                result("19C"),
                a("19C"),
            ],
            weather,
        ),
        Quirk(
            "user-after-tool-outputs",
            ("tool_calls",),
            [u("Q1"), c.message(paris), result("18C"), u("Q2")],
            weather,
            True,
        ),
        Quirk("tools-not-rendered", ("tools",), [u("Weather?")], weather, True),
    ]
