"""Bad input never crashes the interpreter: every one raises a typed exception naming where.

An env runner calls the renderer on model output and environment data for every
rollout, so the cases that used to end the process (deep nesting, reference cycles)
run in a child interpreter: a segfault is a failed test, not a dead test session.
Everything else runs in-process and checks the exception class and that its message
names the message index and field (or the token position).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from typing import Any

import numpy as np
import pytest

import treadle_native as tn
from testkit.paths import shared_tokenizer

FAMILIES = ["qwen3", "qwen2.5", "llama3", "deepseek-r1", "jinja"]
DATE = "26 Jul 2024"
MAX_DEPTH = 100  # treadle_core::json::MAX_DEPTH, documented on Renderer


def tokenizer_of(family: str) -> str:
    """The generic renderer runs Qwen3's template (from its tokenizer_config.json)."""
    return str(shared_tokenizer("qwen3" if family == "jinja" else family))


@cache
def renderer(family: str) -> tn.Renderer:
    return tn.Renderer(family, tokenizer_of(family))


def render(family: str, messages: Any, tools: Any = None) -> tn.Rendered:
    return renderer(family).render(messages, tools=tools, date_string=DATE)


def nested(depth: int, leaf: Any = None) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# --- crash-prone input, in a child interpreter -------------------------------------------------

# The child runs every case in order and prints one JSON line per case before and after
# it, so a crash names the case it died in.
CHILD = r'''
import json, sys
import numpy as np
import treadle_native as tn

family, tokenizer = sys.argv[1], sys.argv[2]
r = tn.Renderer(family, tokenizer)
DATE = "26 Jul 2024"
USER = {"role": "user", "content": "hi"}

def nested(depth, leaf=None):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value

def deep_schema(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}

def self_dict():
    m = {"role": "user", "content": "hi"}
    m["self"] = m
    return [m]

def self_list():
    loop = []
    loop.append(loop)
    return [{"role": "user", "content": "hi", "extra": loop}]

def mutual():
    a, b = {"name": "a"}, {"name": "b"}
    a["next"], b["next"] = b, a
    return [{"role": "user", "content": "hi", "extra": [a]}]

def messages_in_message():
    msgs = [USER]
    msgs.append({"role": "user", "content": "x", "history": msgs})
    return msgs

def call(args):
    return [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": args}}]}]

prev = r.render([USER], add_generation_prompt=True, date_string=DATE).token_ids \
    if family != "jinja" else np.array([1, 2, 3], np.int64)

def content_ids(text):
    """The ids of `text` as a completion: its content tokens in a render."""
    out = r.render([{"role": "user", "content": text}], date_string=DATE)
    return out.token_ids[out.is_content == 1]

cases = {
    "deep_list_render": lambda: r.render([{"role": "user", "content": "hi", "extra": nested(10_000)}], date_string=DATE),
    "deep_list_content": lambda: r.render([{"role": "user", "content": nested(10_000)}], date_string=DATE),
    "deep_list_batch": lambda: r.render_batch([[USER], [USER, {"role": "user", "content": "hi", "x": nested(10_000)}]], date_string=DATE),
    "deep_list_bridge": lambda: r.bridge(prev, [{"role": "user", "content": "hi", "extra": nested(10_000)}]),
    "deep_tuple_render": lambda: r.render([{"role": "user", "content": "hi", "extra": (((),),) * 2 + (nested(10_000),)}], date_string=DATE),
    "deep_schema_render": lambda: r.render([USER], tools=[deep_schema(200_000)], date_string=DATE),
    "deep_schema_batch": lambda: r.render_batch([[USER]] * 4, tools=[deep_schema(200_000)], date_string=DATE),
    "deep_args_dict": lambda: r.render(call({"a": nested(10_000)}), date_string=DATE),
    "deep_args_text": lambda: r.render(call("[" * 200_000 + "]" * 200_000), date_string=DATE),
    "self_dict_render": lambda: r.render(self_dict(), date_string=DATE),
    "self_dict_batch": lambda: r.render_batch([[USER], self_dict()], date_string=DATE),
    "self_dict_bridge": lambda: r.bridge(prev, self_dict()),
    "self_list_render": lambda: r.render(self_list(), date_string=DATE),
    "mutual_render": lambda: r.render(mutual(), date_string=DATE),
    "messages_in_message": lambda: r.render(messages_in_message(), date_string=DATE),
    "self_tool": lambda: r.render([USER], tools=self_dict(), date_string=DATE),
}
# parse: a completion whose tool call is JSON nested 100k deep, as a model could sample it
text = "<tool_call>\n" + '{"name": "f", "arguments": ' + "[" * 100_000
if family == "llama3":
    text = '{"name": "f", "parameters": ' + "[" * 100_000
if family == "deepseek-r1":
    text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n" + "[" * 100_000 + "\n```<｜tool▁call▁end｜>"
cases["deep_json_parse"] = lambda: r.parse(content_ids(text) if family != "jinja" else [1] * 1000)

for name, fn in cases.items():
    print(json.dumps({"case": name, "started": True}), flush=True)
    try:
        fn()
        out = {"case": name, "error": None, "message": ""}
    except Exception as e:
        out = {"case": name, "error": type(e).__name__, "message": str(e)[:400]}
    print(json.dumps(out), flush=True)
'''

# what each case raises: (class name, substring of the message)
EXPECTED: dict[str, tuple[str | None, str]] = {
    "deep_list_render": ("InvalidMessageError", "messages[0].extra[0][0]"),
    "deep_list_content": ("InvalidMessageError", "messages[0].content[0]"),
    "deep_list_batch": ("InvalidMessageError", "conversations[1][1].x[0]"),
    "deep_list_bridge": ("InvalidMessageError", "messages[0].extra[0]"),
    "deep_tuple_render": ("InvalidMessageError", "messages[0].extra[2][0]"),
    "deep_schema_render": ("TreadleNativeError", "tools[0].function.parameters.properties.a"),
    "deep_schema_batch": ("TreadleNativeError", "tools[0].function.parameters.properties.a"),
    "deep_args_dict": ("InvalidMessageError", "messages[1].tool_calls[0].function.arguments.a[0]"),
    "deep_args_text": ("InvalidMessageError", "message 1, tool call 0: arguments of"),
    "self_dict_render": ("InvalidMessageError", "messages[0].self: the dict contains itself"),
    "self_dict_batch": (
        "InvalidMessageError",
        "conversations[1][0].self: the dict contains itself",
    ),
    "self_dict_bridge": ("InvalidMessageError", "messages[0].self: the dict contains itself"),
    "self_list_render": ("InvalidMessageError", "messages[0].extra[0]: the list contains itself"),
    "mutual_render": ("InvalidMessageError", "messages[0].extra[0].next.next: the dict contains"),
    "messages_in_message": (
        "InvalidMessageError",
        "messages[1].history[1]: the dict contains itself",
    ),
    "self_tool": ("TreadleNativeError", "tools[0].self: the dict contains itself"),
    "deep_json_parse": (None, ""),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_crash_prone_input_raises_typed_errors_in_a_child(family: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, family, tokenizer_of(family)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    finished = {line["case"]: line for line in lines if "started" not in line}
    started = [line["case"] for line in lines if "started" in line]
    assert proc.returncode == 0, (
        f"child died with exit code {proc.returncode} in case {started[-1] if started else None!r}"
        f"\n{proc.stderr[-2000:]}"
    )
    assert set(finished) == set(EXPECTED), proc.stderr[-2000:]
    for case, (error, match) in EXPECTED.items():
        got = finished[case]
        assert got["error"] == error, (case, got)
        assert match in got["message"], (case, got)
    assert "nested deeper than 100 lists/dicts" in finished["deep_list_render"]["message"]
    assert "nested deeper than 100" in finished["deep_args_text"]["message"]


# --- depth: the limit is generous and holds on worker threads -----------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_values_at_the_depth_limit_render_also_in_batches(family: str) -> None:
    r = renderer(family)
    if family == "jinja":
        try:
            r.render([{"role": "user", "content": "hi"}])
        except tn.TemplateError as e:
            pytest.skip(f"the generic renderer cannot render at this commit: {e}")
    schema = {"type": "function", "function": {"name": "f", "parameters": nested(MAX_DEPTH - 2)}}
    at_limit = {"role": "user", "content": "hi", "extra": nested(MAX_DEPTH - 1)}
    convs = [[{"role": "system", "content": "s"}, at_limit]] * 64
    outs = r.render_batch(convs, tools=[schema], date_string=DATE)  # rayon workers, 2 MiB stacks
    assert len(outs) == 64
    assert all(len(o.token_ids) == len(o.loss_mask) == len(o.message_index) for o in outs)
    one_more = {"role": "user", "content": "hi", "extra": nested(MAX_DEPTH)}
    with pytest.raises(tn.InvalidMessageError, match=r"messages\[1\]\.extra\[0\].*nested deeper"):
        r.render([{"role": "system", "content": "s"}, one_more], date_string=DATE)
    deeper_schema = {
        "type": "function",
        "function": {"name": "f", "parameters": nested(MAX_DEPTH - 1)},
    }
    with pytest.raises(tn.TreadleNativeError, match=r"tools\[0\]\.function\.parameters"):
        r.render([at_limit], tools=[deeper_schema], date_string=DATE)


def test_shared_values_are_not_cycles() -> None:
    shared = {"type": "string"}
    messages = [
        {"role": "user", "content": "a", "x": [shared, shared], "y": shared},
        {"role": "assistant", "content": "b", "x": shared},
    ]
    assert len(render("qwen3", messages)) > 0


# --- everything else, in-process --------------------------------------------------------------

USER = {"role": "user", "content": "hi"}


def with_call(arguments: Any, name: Any = "f") -> list[dict[str, Any]]:
    return [
        USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": name, "arguments": arguments}}
            ],
        },
    ]


PORTS = [f for f in FAMILIES if f != "jinja"]


@pytest.mark.parametrize("family", PORTS)
@pytest.mark.parametrize("role", ["bogus", "", "USER", "developer", "function"])
def test_unknown_roles(family: str, role: str) -> None:
    with pytest.raises(
        tn.InvalidMessageError, match=rf"message 1: role: unknown role {json.dumps(role)}"
    ):
        render(family, [USER, {"role": role, "content": "x"}])


@pytest.mark.parametrize("role", ["bogus", "", "USER", "developer", "function"])
def test_generic_renderer_hands_any_role_to_the_template(role: str) -> None:
    # the template decides: Qwen3's renders unknown roles nowhere and raises on none
    out = render("jinja", [USER, {"role": role, "content": "x"}])
    assert len(out.token_ids) > 0


# messages the generic renderer passes to the template (content parts, a message
# without content, tool_calls on another role, a non-string field)
GENERIC_TEMPLATE_DECIDES = (
    "content must be a string",
    "needs a string content",
    "only assistant messages",
    "message 1: name must be a string",
)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (with_call("{oops"), r'message 1, tool call 0: arguments of "f" are not valid JSON'),
        (with_call('{"a": 1'), r"message 1, tool call 0: arguments of .* not valid JSON"),
        (with_call(""), r"message 1, tool call 0: arguments of .* not valid JSON"),
        (with_call("{}", name=5), r"message 1, tool call 0: name must be a string, got int"),
        (
            with_call([1, 2]),
            r"message 1, tool call 0: arguments of .* must be a JSON string or a dict",
        ),
        (
            [USER, {"role": "assistant", "tool_calls": ["x"]}],
            r"message 1, tool call 0: must be a dict",
        ),
        ([USER, {"role": "assistant", "tool_calls": "x"}], r"message 1: tool_calls must be a list"),
        ([USER, {"role": 5, "content": "x"}], r"message 1: role must be a string, got int"),
        ([USER, {"content": "x"}], r"message 1: role is missing"),
        ([USER, "hello"], r"message 1: must be a dict, got str"),
        (
            [USER, {"role": "user", "content": 5}],
            r"message 1: content must be a string or null, got int",
        ),
        (
            [USER, {"role": "user", "content": [{"type": "text"}]}],
            r"message 1: content must be a string",
        ),
        ([USER, {"role": "user"}], r"message 1: content: a user message needs a string content"),
        ([USER, {"role": "user", "content": "x", "name": 3}], r"message 1: name must be a string"),
        (
            [{"role": "tool", "content": "x", "tool_calls": []}],
            r"message 0: tool_calls: only assistant messages",
        ),
    ],
)
def test_invalid_messages(family: str, messages: list[Any], match: str) -> None:
    if family == "jinja" and any(k in match for k in GENERIC_TEMPLATE_DECIDES):
        # the generic renderer hands these to the template, as transformers does: it
        # renders them or raises from the template, never a family-specific check
        try:
            render(family, messages)
        except tn.TemplateError:
            pass
        return
    with pytest.raises(tn.InvalidMessageError, match=match):
        render(family, messages)


LONE = "\ud800"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("messages", "tools", "error", "match"),
    [
        (
            [USER, {"role": "user", "content": f"a{LONE}b"}],
            None,
            tn.InvalidMessageError,
            r"messages\[1\]\.content: string is not valid Unicode: lone surrogate '\\ud800' at index 1",
        ),
        (
            [USER, {"role": "user", "content": "\udfff"}],
            None,
            tn.InvalidMessageError,
            r"messages\[1\]\.content: .*lone surrogate",
        ),
        (
            with_call({"city": f"Par{LONE}is"}),
            None,
            tn.InvalidMessageError,
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments\.city: string is not valid Unicode",
        ),
        (
            with_call(f'{{"city": "{LONE}"}}'),
            None,
            tn.InvalidMessageError,
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: string is not valid Unicode",
        ),
        (
            [USER, {"role": "user", "content": "x", f"k{LONE}": 1}],
            None,
            tn.InvalidMessageError,
            r"messages\[1\]: a dict key is not valid Unicode: lone surrogate",
        ),
        (
            [USER],
            [{"type": "function", "function": {"name": "f", "description": f"d{LONE}"}}],
            tn.TreadleNativeError,
            r"tools\[0\]\.function\.description: string is not valid Unicode",
        ),
        (
            [USER],
            [{"type": "function", "function": {"name": "f", "parameters": {"a b": {LONE: 1}}}}],
            tn.TreadleNativeError,
            r'tools\[0\]\.function\.parameters\["a b"\]: a dict key is not valid Unicode',
        ),
    ],
)
def test_lone_surrogates(
    family: str, messages: list[Any], tools: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        render(family, messages, tools)
    if error is tn.TreadleNativeError:
        assert type(info.value) is tn.TreadleNativeError
    r = renderer(family)
    with pytest.raises(error, match=match.replace(r"messages\[", r"conversations\[1\]\[")):
        r.render_batch([[USER], messages], tools=tools, date_string=DATE)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("messages", "tools", "match"),
    [
        (
            [USER, {"role": "user", "content": "x", 1: "y"}],
            None,
            r"messages\[1\]: dict keys must be str, got int",
        ),
        (
            [USER, {"role": "user", "content": "x", ("a",): 1}],
            None,
            r"messages\[1\]: dict keys must be str, got tuple",
        ),
        (
            with_call({"a": {None: 1}}),
            None,
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments\.a: dict keys",
        ),
        (
            [USER],
            [{"function": {"parameters": {2: {}}}}],
            r"tools\[0\]\.function\.parameters: dict keys must be str",
        ),
        (
            [USER, {"role": "user", "content": object()}],
            None,
            r"messages\[1\]\.content: expected a JSON-like value",
        ),
        ([USER, {"role": "user", "content": b"x"}], None, r"messages\[1\]\.content: .*got bytes"),
        (
            [USER, {"role": "user", "content": "x", "s": {1, 2}}],
            None,
            r"messages\[1\]\.s: .*got set",
        ),
        (
            [USER, {"role": "user", "content": "x", "n": 2**200}],
            None,
            r"messages\[1\]\.n: integer .* does not fit",
        ),
        (
            [USER, {"role": "user", "content": "x", "k" * 10_000: {1: 2}}],
            None,
            r'messages\[1\]\["k{40}"\.\.\.\]: dict keys must be str, got int$',
        ),
        ("hello", None, r"messages must be a list, got str"),
        ({"role": "user"}, None, r"messages must be a list, got dict"),
        (None, None, r"messages must be a list, got NoneType"),
        ([USER], "tools", r"tools must be a list, got str"),
    ],
)
def test_wrong_python_types(family: str, messages: Any, tools: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        render(family, messages, tools)


@pytest.mark.parametrize("family", FAMILIES)
def test_tools_that_are_not_dicts(family: str) -> None:
    with pytest.raises(tn.TreadleNativeError, match=r"tools\[1\] must be a dict, got list"):
        render(family, [USER], [{"type": "function"}, []])


def vocab_cases(vocab: int) -> list[tuple[Any, int, int]]:
    """(ids, bad id, its position) with list and numpy inputs."""
    return [
        ([1, -1], -1, 1),
        ([vocab], vocab, 0),
        ([1, 2, vocab + 5], vocab + 5, 2),
        ([2**40], 2**40, 0),
        ([0, 2**63 - 1], 2**63 - 1, 1),
        ([-(2**63)], -(2**63), 0),
        (np.array([1, -7], np.int32), -7, 1),
        (np.array([3, 2**40], np.int64), 2**40, 1),
        (np.array([vocab], np.uint32), vocab, 0),
        (np.array([5, 2**64 - 1], np.uint64), 2**64 - 1, 1),
        ([1, 2**70], 2**70, 1),
        ([1, -(2**70)], -(2**70), 1),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_ids_outside_the_vocabulary(family: str) -> None:
    r = renderer(family)
    for ids, bad, position in vocab_cases(r.vocab_size):
        with pytest.raises(
            tn.TokenIdError, match=rf"token id {bad} at position {position} is outside"
        ):
            r.parse(ids)
        with pytest.raises(
            tn.TokenIdError, match=rf"token id {bad} at position {position} is outside"
        ):
            r.bridge(ids, [USER])
    r.parse([0, r.vocab_size - 1])  # the edges are inside


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ("hello", r" must be a 1-D integer numpy array or a list of ints, got str"),
        (b"\x01\x02", r" must be .*, got bytes"),
        ({1: 2}, r" must be .*, got dict"),
        (5, r" must be .*, got int"),
        (None, r" must be .*, got NoneType"),
        ([1, "2"], r"\[1\]: expected an int, got str"),
        ([1, 2.0], r"\[1\]: expected an int, got float"),
        ([1, None], r"\[1\]: expected an int, got NoneType"),
        ([[1, 2]], r"\[0\]: expected an int, got list"),
        (np.array([1.0, 2.0]), r"\[0\]: expected an int, got float64"),
        (np.array([[1, 2]], np.int64), r"\[0\]: expected an int, got ndarray"),
    ],
)
def test_ids_of_the_wrong_type(family: str, ids: Any, match: str) -> None:
    r = renderer(family)
    with pytest.raises(TypeError, match=r"completion_ids" + match):
        r.parse(ids)
    with pytest.raises(TypeError, match=r"prev_ids" + match):
        r.bridge(ids, [USER])


@pytest.mark.parametrize("family", FAMILIES)
def test_other_integer_id_types_are_read_exactly(family: str) -> None:
    r = renderer(family)
    ids = [1, 2, 3]
    want = r.parse(ids)
    for same in (
        np.array(ids, np.int16),
        np.array(ids, np.uint64),
        tuple(ids),
        [np.int64(i) for i in ids],
    ):
        got = r.parse(same)
        assert (got.content, got.num_tokens) == (want.content, want.num_tokens)


# --- templates that build values themselves (the generic renderer) -------------------------------

TEMPLATE_CHILD = r"""
import sys
import treadle_native as tn
r = tn.Renderer("jinja", sys.argv[1], chat_template=sys.argv[2])
try:
    r.render_batch([[{"role": "user", "content": "hi"}]] * 2)
except tn.TemplateError as e:
    print("TemplateError", e)
"""


@pytest.mark.parametrize(
    "template",
    [
        "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns | tojson }}",
        pytest.param(
            "{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns }}",
            marks=pytest.mark.xfail(
                strict=True, reason="minijinja prints a namespace that contains itself forever"
            ),
        ),
        "{% set ns = namespace(x=none) %}{% for i in range(20000) %}{% set ns.x = [ns.x] %}"
        "{% endfor %}{{ ns.x | tojson }}",
    ],
    ids=["namespace-cycle-tojson", "namespace-cycle-print", "deep-built-value-tojson"],
)
def test_templates_that_build_cyclic_or_deep_values(template: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.run(
        [sys.executable, "-c", TEMPLATE_CHILD, tokenizer_of("jinja"), template],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, f"child died with exit code {proc.returncode}"
    assert proc.stdout.startswith("TemplateError"), proc.stdout
