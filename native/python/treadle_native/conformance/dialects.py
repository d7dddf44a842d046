"""What each target's chat template accepts, as the corpus generator needs to know it.

A dialect lists the input forms a template renders without raising, so that the generator
only writes valid cases (and exercises every accepted form). The rules come from reading the
templates and from `transformers` 5.x, which drops message keys whose value is None before
rendering:

- qwen3: assistant `content` beside `tool_calls` may be None, "", absent or text; reasoning
  is rendered (`reasoning_content` or `<think>` in content); `enable_thinking` switch.
- qwen3-pkg (older Qwen3 template): as qwen3, but `content` must always be a string.
- qwen2.5: like qwen3 without reasoning; `arguments` given as a string is JSON-encoded again.
- llama3 / llama3.1: one tool call per assistant message; tools need a first user message;
  `date_string` is always passed (the 3.2 template prints today's date otherwise).
- deepseek-r1: the tool-call branch needs `content is none`, which transformers 5 can no
  longer produce (None keys are dropped, so the template raises on the missing key); tool
  calls are therefore written with string content, which the template renders as a plain
  assistant turn without the calls. Arguments are JSON strings (the template concatenates).
"""

from __future__ import annotations

from dataclasses import dataclass

# markers for the forms of assistant content beside tool calls
NONE = "none"  # "content": None
EMPTY = "empty"  # "content": ""
ABSENT = "absent"  # no "content" key
TEXT = "text"  # "content": "<some text>"


@dataclass(frozen=True)
class Dialect:
    family: str
    renders_reasoning: bool  # reasoning_content / <think> reach the prompt (Qwen3)
    strips_think_from_history: bool  # content before </think> is dropped (DeepSeek)
    parallel_tool_calls: bool  # more than one call per assistant message
    tool_call_contents: tuple[str, ...]  # accepted forms of content beside tool_calls
    arguments_as_dict: bool  # arguments may be a dict (else JSON string only)
    thinking_switch: bool  # accepts enable_thinking
    needs_date: bool  # date_string must always be set
    tools_need_user: bool  # tools require a (first) user message


QWEN3 = Dialect("qwen3", True, False, True, (NONE, EMPTY, ABSENT, TEXT), True, True, False, False)
QWEN3_PKG = Dialect("qwen3", True, False, True, (EMPTY, TEXT), True, True, False, False)
QWEN25 = Dialect(
    "qwen2.5", False, False, True, (NONE, EMPTY, ABSENT, TEXT), True, False, False, False
)
LLAMA3 = Dialect(
    "llama3", False, False, False, (NONE, EMPTY, ABSENT, TEXT), True, False, True, True
)
DEEPSEEK = Dialect("deepseek-r1", False, True, True, (EMPTY, TEXT), False, False, False, False)

# foreign templates (generic renderer): the widest input, as OpenAI-style clients send it;
# cases a template rejects must be rejected by the native renderer too
GENERIC = Dialect("qwen3", True, False, True, (NONE, EMPTY, ABSENT, TEXT), True, True, False, False)

DIALECTS = {
    "generic": GENERIC,
    "qwen3": QWEN3,
    "qwen3-pkg": QWEN3_PKG,
    "qwen2.5": QWEN25,
    "llama3": LLAMA3,
    "llama3.1": LLAMA3,
    "deepseek-r1": DEEPSEEK,
    "deepseek-r1-think": DEEPSEEK,
}
