"""The conformance corpus: deterministic, valid chat-rendering cases for every target.

`cases(target, n, seed)` returns `n` cases: first the hand-written quirk cases of the
target's dialect (`quirks.py`), then generated ones. A generated case combines a *shape*
(what the conversation looks like) with a *flavour* (what its text stresses, `texts.py`);
shapes and flavours are dealt round-robin so every (shape, flavour) pair appears several
times per target. The same (target, n, seed) always gives the same cases.

A case's `kinds` name the shape, the flavour (unless plain) and whatever else the case
contains (a system message, tool schemas, tool calls, several user turns, reasoning).

This module does not render anything; `oracle.py` does, and `test_corpus.py` checks that
every case renders under the Hugging Face oracle.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .dialects import ABSENT, DIALECTS, EMPTY, NONE, TEXT, Dialect
from .quirks import quirk_cases
from .texts import FLAVOURS, TextSource
from .tool_specs import ARGUMENTS, SCHEMAS, TOOL_NAMES, json_spellings, tool_result

Message = dict[str, Any]

SHAPES = ("basic", "multi_turn", "system", "tools", "tool_calls", "thinking", "generation_prompt")
KINDS = (
    "basic",
    "multi_turn",
    "system",
    "tools",
    "tool_calls",
    "thinking",
    "unicode",
    "empty",
    "long",
    "whitespace",
    "generation_prompt",
)
LLAMA_DATES = ("26 Jul 2024", "01 Jan 2025", "29 Feb 2028", "09 Nov 2023")
DEFAULT_DATE = LLAMA_DATES[0]


@dataclass
class Case:
    id: str  # "<target>/<index>-<shape>-<flavour>" or "<target>/q<index>-<quirk name>"
    kinds: tuple[str, ...]  # case kinds, a subset of KINDS
    messages: list[Message]  # HF/OpenAI chat messages
    tools: list[dict[str, Any]] | None = None  # JSON-schema function dicts
    add_generation_prompt: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # enable_thinking, date_string

    def fingerprint(self) -> str:
        """Canonical text of everything that affects rendering (dict order included)."""
        return json.dumps(
            [self.messages, self.tools, self.add_generation_prompt, self.template_kwargs],
            ensure_ascii=False,
        )


def cases(target: str, n: int = 240, seed: int = 0) -> list[Case]:
    """`n` valid cases for `target` (a name in targets.TARGETS), deterministic in `seed`."""
    dialect = DIALECTS.get(target)
    if dialect is None:
        raise ValueError(f"unknown conformance target {target!r}; known: {tuple(DIALECTS)}")
    prefix = f"{target}/" if seed == 0 else f"{target}/s{seed}/"
    out: list[Case] = []
    for i, quirk in enumerate(quirk_cases(dialect)[:n]):
        kwargs = dict(quirk.template_kwargs)
        if dialect.needs_date:
            kwargs.setdefault("date_string", DEFAULT_DATE)
        kinds = _with_derived_kinds(quirk.kinds, quirk.messages, quirk.tools)
        out.append(
            Case(
                f"{prefix}q{i:02d}-{quirk.name}",
                kinds,
                quirk.messages,
                quirk.tools,
                quirk.add_generation_prompt,
                kwargs,
            )
        )
    rng = random.Random(f"{target}:{seed}")
    for i in range(n - len(out)):
        shape = SHAPES[i % len(SHAPES)]
        flavour = FLAVOURS[(i // len(SHAPES)) % len(FLAVOURS)]
        b = Builder(rng, dialect, TextSource(rng, flavour))
        messages, tools, add_gen = SHAPE_BUILDERS[shape](b)
        explicit = (shape,) if flavour == "plain" else (shape, flavour)
        out.append(
            Case(
                f"{prefix}{i:03d}-{shape}-{flavour}",
                _with_derived_kinds(explicit, messages, tools),
                messages,
                tools,
                add_gen,
                b.template_kwargs(),
            )
        )
    return out


def _with_derived_kinds(
    kinds: tuple[str, ...], messages: list[Message], tools: list[dict[str, Any]] | None
) -> tuple[str, ...]:
    found = set(kinds)
    if any(m["role"] == "system" for m in messages):
        found.add("system")
    if tools:
        found.add("tools")
    if any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        found.add("tool_calls")
    if sum(m["role"] == "user" for m in messages) >= 2:
        found.add("multi_turn")
    if any("reasoning_content" in m or "</think>" in (m.get("content") or "") for m in messages):
        found.add("thinking")
    unknown = found - set(KINDS)
    assert not unknown, f"unknown kinds {unknown}"
    return tuple(k for k in KINDS if k in found)


class Builder:
    """Makes messages for one case from a seeded rng, a dialect and a flavoured text source."""

    def __init__(self, rng: random.Random, dialect: Dialect, src: TextSource) -> None:
        self.rng = rng
        self.d = dialect
        self.src = src

    # --- plain turns ----------------------------------------------------------------------
    def user(self) -> Message:
        return {"role": "user", "content": self.src.text()}

    def assistant(self) -> Message:
        return {"role": "assistant", "content": self.src.text()}

    def system(self) -> Message:
        return {"role": "system", "content": self.src.text()}

    def exchanges(self, k: int) -> list[Message]:
        out: list[Message] = []
        for _ in range(k):
            out += [self.user(), self.assistant()]
        return out

    def maybe_system(self, p: float = 0.5) -> list[Message]:
        return [self.system()] if self.rng.random() < p else []

    # --- tools ----------------------------------------------------------------------------
    def tool_names(self, k: int) -> list[str]:
        return self.rng.sample(TOOL_NAMES, k)

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        return [SCHEMAS[name] for name in names]

    def arguments(self, name: str) -> dict[str, Any] | str:
        args = ARGUMENTS[name](self.src, self.rng)
        if self.d.arguments_as_dict and self.rng.random() < 0.6:
            return args
        return self.rng.choice(json_spellings(args))

    def call(self, name: str) -> dict[str, Any]:
        return {
            "id": f"call_{self.rng.randrange(16**8):08x}",
            "type": "function",
            "function": {"name": name, "arguments": self.arguments(name)},
        }

    def call_message(self, names: list[str], reasoning: str | None = None) -> Message:
        msg: Message = {"role": "assistant"}
        form = self.rng.choice(self.d.tool_call_contents)
        if form == NONE:
            msg["content"] = None
        elif form == EMPTY:
            msg["content"] = ""
        elif form == TEXT:
            msg["content"] = self.src.text()
        else:
            assert form == ABSENT
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        msg["tool_calls"] = [self.call(name) for name in names]
        return msg

    def results(self, calls: Message) -> list[Message]:
        out = []
        for call in calls["tool_calls"]:
            msg: Message = {
                "role": "tool",
                "tool_call_id": call["id"],
                "content": tool_result(self.src, self.rng, call["function"]["name"]),
            }
            if self.rng.random() < 0.3:
                msg["name"] = call["function"]["name"]
            out.append(msg)
        return out

    def tool_round(self, names: list[str], reasoning: str | None = None) -> list[Message]:
        """One assistant turn calling tools (in parallel where allowed) and the results."""
        if self.d.parallel_tool_calls and self.rng.random() < 0.5:
            picked = [self.rng.choice(names) for _ in range(self.rng.randint(2, 3))]
        else:
            picked = [self.rng.choice(names)]
        calls = self.call_message(picked, reasoning)
        return [calls, *self.results(calls)]

    # --- reasoning ------------------------------------------------------------------------
    def think_content(self) -> str:
        """Assistant content carrying reasoning inside <think> tags, in several spellings."""
        r, a = self.src.text(), self.src.text()
        return self.rng.choice(
            [
                f"<think>\n{r}\n</think>\n\n{a}",
                f"<think>{r}</think>{a}",
                f"{r}\n</think>\n\n{a}",  # closing tag only
                f"<think>\n{r}\n</think>",  # no answer
                f"<think>\n{r}\n</think>\n\n{a}\n</think>\n{a}",  # two closing tags
            ]
        )

    # --- case-level settings --------------------------------------------------------------
    def gen_prompt(self, messages: list[Message]) -> bool:
        """Usually on after a user or tool turn and off after an assistant turn."""
        wants = messages[-1]["role"] in ("user", "tool", "system")
        return wants if self.rng.random() < 0.85 else not wants

    def template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.d.needs_date:
            kwargs["date_string"] = self.rng.choice(LLAMA_DATES)
        if self.d.thinking_switch:
            choice = self.rng.choice(["absent", True, False])
            if choice != "absent":
                kwargs["enable_thinking"] = choice
        return kwargs


Built = tuple[list[Message], list[dict[str, Any]] | None, bool]


def _basic(b: Builder) -> Built:
    msgs = [b.user()] if b.rng.random() < 0.4 else b.exchanges(1)
    return msgs, None, b.gen_prompt(msgs)


def _multi_turn(b: Builder) -> Built:
    msgs = b.maybe_system(0.3) + b.exchanges(b.rng.randint(2, 5))
    if b.rng.random() < 0.5:
        msgs.append(b.user())
    return msgs, None, b.gen_prompt(msgs)


def _system(b: Builder) -> Built:
    r = b.rng.random()
    if r < 0.5:
        msgs = [b.system(), *b.exchanges(b.rng.randint(0, 2)), b.user()]
    elif r < 0.7:  # a system message later in the conversation
        msgs = [b.user(), b.assistant(), b.system(), b.user()]
    elif r < 0.85:  # two system messages
        msgs = [b.system(), b.user(), b.assistant(), b.system(), b.user()]
    else:  # system message only
        msgs = [b.system()]
    return msgs, None, b.gen_prompt(msgs)


def _tools(b: Builder) -> Built:
    tools = b.schemas(b.tool_names(b.rng.randint(1, 4)))
    msgs = [*b.maybe_system(), b.user()]
    if b.rng.random() < 0.4:
        msgs += [b.assistant(), b.user()]
    if b.rng.random() < 0.3:
        msgs.append(b.assistant())
    return msgs, tools, b.gen_prompt(msgs)


def _tool_calls(b: Builder) -> Built:
    names = b.tool_names(b.rng.randint(1, 3))
    tools = b.schemas(names) if b.rng.random() < 0.85 else None
    msgs = [*b.maybe_system(0.3), b.user()]
    for round_ in range(b.rng.randint(1, 2)):
        if round_ and b.rng.random() < 0.5:
            msgs += [b.assistant(), b.user()]
        msgs += b.tool_round(names)
    if b.rng.random() < 0.6:
        msgs.append(b.assistant())
    return msgs, tools, b.gen_prompt(msgs)


def _thinking(b: Builder) -> Built:
    if b.d.renders_reasoning:
        return _thinking_qwen3(b)
    msgs = [b.user()]
    for _ in range(b.rng.randint(1, 3)):
        turn: Message = {"role": "assistant", "content": b.think_content()}
        if b.rng.random() < 0.3:  # ignored by these templates, but must not break them
            turn["reasoning_content"] = b.src.text()
        msgs += [turn, b.user()]
    if b.rng.random() < 0.5:
        msgs.pop()
    if b.d.strips_think_from_history and b.rng.random() < 0.4:
        # after tool outputs DeepSeek writes the content as is, <think> included
        msgs += [
            *b.tool_round(b.tool_names(1)),
            {"role": "assistant", "content": b.think_content()},
        ]
    return msgs, None, b.gen_prompt(msgs)


def _thinking_qwen3(b: Builder) -> Built:
    def reasoned() -> Message:
        if b.rng.random() < 0.5:
            return {"role": "assistant", "reasoning_content": b.src.text(), "content": b.src.text()}
        return {"role": "assistant", "content": b.think_content()}

    r = b.rng.random()
    if r < 0.3:  # reasoning in history (dropped) and in the last turn (kept)
        msgs = [b.user(), reasoned(), b.user(), reasoned()]
    elif r < 0.55:  # multi-step tool use after the last query keeps every reasoning
        names = b.tool_names(b.rng.randint(1, 2))
        msgs = [b.user(), *b.tool_round(names, b.src.text()), reasoned()]
        return msgs, b.schemas(names), b.gen_prompt(msgs)
    elif r < 0.75:  # reasoning only in history, conversation ends with a user turn
        msgs = [b.user(), reasoned(), b.user()]
    else:  # a final assistant turn without reasoning still gets an empty think block
        msgs = [b.user(), reasoned(), b.user(), b.assistant()]
    return msgs, None, b.gen_prompt(msgs)


def _generation_prompt(b: Builder) -> Built:
    r = b.rng.random()
    if r < 0.4:
        msgs = [*b.exchanges(b.rng.randint(0, 2)), b.user()]
    elif r < 0.7:
        msgs = b.exchanges(b.rng.randint(1, 2))
    else:
        names = b.tool_names(1)
        msgs = [b.user(), *b.tool_round(names)]
        return msgs, b.schemas(names), b.rng.random() < 0.5
    return msgs, None, b.rng.random() < 0.5


SHAPE_BUILDERS: dict[str, Callable[[Builder], Built]] = {
    "basic": _basic,
    "multi_turn": _multi_turn,
    "system": _system,
    "tools": _tools,
    "tool_calls": _tool_calls,
    "thinking": _thinking,
    "generation_prompt": _generation_prompt,
}
assert set(SHAPE_BUILDERS) == set(SHAPES)
