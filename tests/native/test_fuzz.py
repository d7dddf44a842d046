"""Fuzzing the Python API: random messages, tools and token ids for every renderer.

The property: every call returns a result whose arrays are aligned, or raises a
`TreadleNativeError` (or `TypeError` for values that are not JSON-like) — never another
exception, never a crash. Each family's fuzz run happens in a child interpreter, so a
segfault fails that test instead of ending the session. Deterministic (derandomized,
no example database) and bounded for CI: a few seconds per family.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

FAMILIES = ["qwen3", "qwen2.5", "llama3", "deepseek-r1", "jinja"]
DATE = "26 Jul 2024"
EXAMPLES = int(os.environ.get("TREADLE_FUZZ_EXAMPLES", "80"))

# --- strategies -------------------------------------------------------------------------

SPECIAL_TEXT = [
    "",
    "\n",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "<|eot_id|>",
    "<|python_tag|>",
    "<|start_header_id|>",
    "<｜end▁of▁sentence｜>",
    "<｜tool▁calls▁begin｜>",
    '{"name": "f", "parameters": {}}',
    "{{ messages }}",
    "{% endfor %}",
    "\x00",
    "\ufeff",
    "é🦀",
    "\ud800",  # lone surrogates: not valid Unicode
    "a\udfffb",
]

text = st.one_of(st.text(max_size=24), st.sampled_from(SPECIAL_TEXT))
FIELDS = [
    "role",
    "content",
    "tool_calls",
    "reasoning_content",
    "thinking",
    "reasoning",
    "tool_call_id",
    "name",
    "function",
    "arguments",
    "parameters",
    "type",
    "id",
]
keys = st.one_of(st.sampled_from(FIELDS), text)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-(2**130), 2**130),
    st.floats(allow_nan=True, allow_infinity=True),
    text,
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=4),
    ),
    max_leaves=12,
)
# what a caller should not pass, but might
odd_values = st.one_of(
    st.builds(object),
    st.binary(max_size=4),
    st.sets(st.integers(), max_size=2),
    st.dictionaries(st.integers(), st.integers(), min_size=1, max_size=2),
    st.integers(80, 400).map(lambda d: nested(d)),
)
values = st.one_of(json_values, odd_values)


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def tool_call() -> st.SearchStrategy[Any]:
    arguments = st.one_of(
        st.dictionaries(keys, json_values, max_size=3),
        st.dictionaries(keys, json_values, max_size=3).map(json.dumps),
        st.sampled_from(["{oops", "", "[]", '{"a": 1', "null", "[" * 200]),
        values,
    )
    name = st.one_of(st.sampled_from(["get_weather", "f"]), text, values)
    return st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries({"name": name, "arguments": arguments}),
            }
        ),
        st.fixed_dictionaries({"name": name, "arguments": arguments}),
        values,
    )


@st.composite
def message(draw: st.DrawFn) -> Any:
    role = draw(
        st.one_of(
            st.sampled_from(["system", "user", "assistant", "tool", "ipython"]),
            st.sampled_from(["bogus", "", "USER", "developer"]),
            values,
        )
    )
    m: dict[Any, Any] = {}
    if draw(st.integers(0, 30)) > 0:
        m["role"] = role
    if draw(st.integers(0, 10)) > 0:
        m["content"] = draw(st.one_of(text, text, text, st.none(), values))
    for field, strategy in [
        ("reasoning_content", st.one_of(text, values)),
        ("tool_calls", st.one_of(st.lists(tool_call(), max_size=2), values)),
        ("tool_call_id", st.one_of(text, values)),
        ("name", st.one_of(text, values)),
    ]:
        if draw(st.integers(0, 4)) == 0:
            m[field] = draw(strategy)
    if draw(st.integers(0, 6)) == 0:
        m[draw(keys)] = draw(values)
    if draw(st.integers(0, 40)) == 0:
        m["self"] = m  # a value that contains itself
    return m


tools_strategy = st.one_of(
    st.none(),
    st.lists(
        st.one_of(
            st.fixed_dictionaries(
                {
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {
                            "name": text,
                            "description": text,
                            "parameters": st.dictionaries(keys, json_values, max_size=3),
                        }
                    ),
                }
            ),
            values,
        ),
        max_size=2,
    ),
)


def id_arrays(pool: list[int], vocab: int) -> st.SearchStrategy[Any]:
    """Token ids: structural ids of the family, ordinary ids, ids outside the vocabulary;
    as a list, a tuple, or a numpy array of several integer dtypes."""
    ids = st.lists(
        st.one_of(
            st.sampled_from(pool),
            st.sampled_from(pool),
            st.integers(0, vocab - 1),
            st.sampled_from([-1, vocab, vocab + 1, 2**31, 2**40, 2**63 - 1, -(2**63), 2**70]),
        ),
        max_size=40,
    )

    def container(xs: list[int], kind: int) -> Any:
        in_i64 = all(-(2**63) <= x < 2**63 for x in xs)
        if kind == 1:
            return tuple(xs)
        if kind == 2 and in_i64:
            return np.array(xs, np.int64)
        if kind == 3 and all(0 <= x < 2**31 for x in xs):
            return np.array(xs, np.int32)
        if kind == 4 and all(0 <= x < 2**64 for x in xs):
            return np.array(xs, np.uint64)
        return xs

    return st.builds(container, ids, st.integers(0, 4))


# --- the property ------------------------------------------------------------------------------


def check_rendered(out: Any, num_messages: int, vocab: int) -> None:
    n = len(out.token_ids)
    assert len(out) == n == len(out.message_index) == len(out.loss_mask) == len(out.is_content)
    assert ((out.message_index >= -1) & (out.message_index < num_messages)).all()
    assert ((out.loss_mask <= 1) & (out.is_content <= 1)).all()
    assert ((out.token_ids >= 0) & (out.token_ids < vocab)).all()


def call(fn: Any) -> Any:
    """The result, or None after a typed error; anything else propagates (and fails)."""
    import treadle_native as tn

    try:
        return fn()
    except (TypeError, ValueError) as e:
        error = e
    if not isinstance(error, (tn.TreadleNativeError, TypeError)):
        raise AssertionError(f"untyped error {type(error).__name__}: {error}") from error
    assert str(error), "an error without a message"
    return None


def tokenizer_of(family: str) -> str:
    from testkit.paths import shared_tokenizer

    return str(shared_tokenizer("qwen3" if family == "jinja" else family))


def fuzz(family: str) -> None:
    """Run the fuzz properties for one family (in this process: the child)."""
    import treadle_native as tn

    r = tn.Renderer(family, tokenizer_of(family))
    native = tn.Renderer("qwen3" if family == "jinja" else family, tokenizer_of(family))
    vocab = r.vocab_size
    sample = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "a",
            "reasoning_content": "r",
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "content": "t"},
    ]
    prompt = native.render(sample[:2], add_generation_prompt=True, date_string=DATE).token_ids
    pool = sorted(
        set(native.render(sample, date_string=DATE).token_ids.tolist()) | set(prompt.tolist())
    )
    common = settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )

    @common
    @given(
        st.lists(message(), max_size=4),
        tools_strategy,
        st.booleans(),
        st.sampled_from([None, True, False]),
    )
    def render_any(messages: list[Any], tools: Any, gen: bool, thinking: bool | None) -> None:
        kw = {"add_generation_prompt": gen, "enable_thinking": thinking, "date_string": DATE}
        out = call(lambda: r.render(messages, tools, **kw))
        batch = call(lambda: r.render_batch([messages, messages], tools, **kw))
        assert (out is None) == (batch is None), "render and render_batch disagree"
        if out is not None:
            check_rendered(out, len(messages), vocab)
            assert len(batch) == 2
            for b in batch:  # the same render on worker threads
                assert b.token_ids.tolist() == out.token_ids.tolist()
                assert b.loss_mask.tolist() == out.loss_mask.tolist()
                assert b.message_index.tolist() == out.message_index.tolist()

    @common
    @given(id_arrays(pool, vocab))
    def parse_any(ids: Any) -> None:
        parsed = call(lambda: r.parse(ids))
        values = [int(x) for x in ids]
        if parsed is None:
            assert not all(0 <= x < vocab for x in values), "in-vocabulary ids refused"
            return
        assert all(0 <= x < vocab for x in values)
        assert parsed.num_tokens <= len(values)
        assert parsed.stopped or parsed.num_tokens == len(values)
        for c in parsed.tool_calls:
            assert c.status in ("ok", "malformed")
            if c.status == "ok":
                assert isinstance(json.loads(c.arguments), dict)

    @common
    @given(id_arrays(pool, vocab), st.lists(message(), max_size=3), st.booleans())
    def bridge_any(ids: Any, new: list[Any], gen: bool) -> None:
        prev = prompt.tolist() + [int(x) for x in ids]
        b = call(lambda: r.bridge(prev, new, gen))
        if b is None:
            return
        assert all(0 <= x < vocab for x in prev)
        k = len(b.appended_ids)
        assert len(b.message_index) == len(b.loss_mask) == len(b.is_content) == k
        assert len(b.token_ids) == len(prev) + k
        assert b.token_ids[: len(prev)].tolist() == prev  # append-only
        if b.ok:
            assert ((b.message_index >= -1) & (b.message_index < len(new))).all()
        else:
            assert b.reason
            assert k == 0

    for prop in (render_any, parse_any, bridge_any):
        prop()


@cache
def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@pytest.mark.parametrize("family", FAMILIES)
def test_fuzz_python_api(family: str) -> None:
    code = f"import runpy; runpy.run_path({__file__!r})['fuzz']({family!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=300
    )
    assert proc.returncode == 0, (
        f"fuzzing {family} failed (exit code {proc.returncode}; negative: killed by that signal)\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
