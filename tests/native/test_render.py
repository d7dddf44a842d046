"""Renderer behaviour beyond token conformance: attribution, bridge, parse, bad input."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import treadle_native as tn
from testkit.paths import shared_tokenizer

DATE = "26 Jul 2024"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@cache
def renderer(family: str) -> tn.Renderer:
    return tn.Renderer(family, shared_tokenizer(family))


@cache
def hf(family: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(shared_tokenizer(family))


def hf_ids(family: str, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    tok = hf(family)
    if family == "llama3":
        kwargs.setdefault("date_string", DATE)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encode(family: str, text: str) -> list[int]:
    return list(hf(family)(text, add_special_tokens=False)["input_ids"])


# --- attribution ----------------------------------------------------------------------------


def test_render_attribution_marks_only_generated_assistant_tokens() -> None:
    r = renderer("qwen2.5")
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there"},
    ]
    out = r.render(msgs)
    assert (
        len(out.token_ids)
        == len(out.message_index)
        == len(out.loss_mask)
        == len(out.is_content)
        == len(out)
    )
    tok = hf("qwen2.5")
    trained = tok.decode(out.token_ids[out.loss_mask == 1].tolist())
    assert trained == "Hello there<|im_end|>"  # content + turn close; not the role header
    content = tok.decode(out.token_ids[(out.is_content == 1) & (out.message_index == 1)].tolist())
    assert content == "Hi"
    assert set(out.message_index.tolist()) == {0, 1, 2}
    assert out.prefix_stable is None  # native families know their rules


def test_render_qwen3_reasoning_is_trained_and_dropped_before_the_last_query() -> None:
    r = renderer("qwen3")
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "reasoning_content": "add them", "content": "4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "reasoning_content": "again", "content": "6"},
    ]
    out = r.render(msgs)
    assert "add them" not in out.text  # the template drops reasoning before the last query
    trained = hf("qwen3").decode(out.token_ids[out.loss_mask == 1].tolist())
    assert trained == "4<|im_end|><think>\nagain\n</think>\n\n6<|im_end|>"
    assert out.token_ids.tolist() == hf_ids("qwen3", msgs)


def test_render_batch_matches_single_renders() -> None:
    r = renderer("llama3")
    convs = [[{"role": "user", "content": f"question {i}"}] for i in range(20)]
    batch = r.render_batch(convs, add_generation_prompt=True, date_string=DATE)
    for conv, out in zip(convs, batch, strict=True):
        one = r.render(conv, add_generation_prompt=True, date_string=DATE)
        assert out.token_ids.tolist() == one.token_ids.tolist()


def test_render_generic_jinja_matches_the_native_family_and_reports_stability() -> None:
    path = shared_tokenizer("qwen2.5")
    generic = tn.Renderer("jinja", path)
    msgs = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    out = generic.render(msgs, add_generation_prompt=True)
    native = renderer("qwen2.5").render(msgs, add_generation_prompt=True)
    assert out.token_ids.tolist() == native.token_ids.tolist()
    assert out.loss_mask.tolist() == native.loss_mask.tolist()
    assert out.prefix_stable is True
    qwen3 = tn.Renderer("jinja", shared_tokenizer("qwen3"))
    unstable = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
        {"role": "user", "content": "c"},
    ]
    out3 = qwen3.render(unstable)
    assert out3.prefix_stable is False  # the reasoning shown while last is dropped later
    assert out3.token_ids.tolist() == hf_ids("qwen3", unstable)


# --- bridge ---------------------------------------------------------------------------------

SAMPLES = {
    "qwen3": '<think>\nneed the tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
}
AS_MESSAGE = {
    "qwen3": {
        "role": "assistant",
        "reasoning_content": "need the tool",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    "qwen2.5": {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    "llama3": {
        "role": "assistant",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
}


@pytest.mark.parametrize("family", ["qwen3", "qwen2.5", "llama3"])
def test_bridge_tool_result_equals_a_full_rerender(family: str) -> None:
    r = renderer(family)
    kw = {"date_string": DATE} if family == "llama3" else {}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = r.render(user, tools=[WEATHER], add_generation_prompt=True, **kw)
    prev = np.concatenate([prompt.token_ids, np.array(encode(family, SAMPLES[family]), np.int32)])
    tool = [{"role": "tool", "content": "sunny"}]
    b = r.bridge(prev, tool)
    assert b.ok, b.reason
    assert not b.closed_turn
    assert b.token_ids[: len(prev)].tolist() == prev.tolist()
    full = hf_ids(
        family, [*user, AS_MESSAGE[family], *tool], tools=[WEATHER], add_generation_prompt=True
    )
    assert b.token_ids.tolist() == full
    assert (b.loss_mask == 0).all()  # tool results and prompts are not trained
    assert set(b.message_index.tolist()) <= {-1, 0}


def test_bridge_closes_a_truncated_turn_without_touching_it() -> None:
    r = renderer("qwen2.5")
    prompt = r.render([{"role": "user", "content": "Count to ten"}], add_generation_prompt=True)
    sampled = encode("qwen2.5", "one two three four")  # cut by max_tokens: no <|im_end|>
    prev = np.concatenate([prompt.token_ids, np.array(sampled, np.int32)])
    b = r.bridge(prev, [{"role": "user", "content": "go on"}])
    assert b.ok
    assert b.closed_turn
    assert b.token_ids[: len(prev)].tolist() == prev.tolist()
    assert b.text.startswith("<|im_end|>\n<|im_start|>user\ngo on")


def test_bridge_refuses_when_qwen3_would_drop_reasoning() -> None:
    r = renderer("qwen3")
    prompt = r.render([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    prev = np.concatenate(
        [
            prompt.token_ids,
            np.array(encode("qwen3", "<think>\nadd\n</think>\n\n4<|im_end|>"), np.int32),
        ]
    )
    b = r.bridge(prev, [{"role": "user", "content": "and 3+3?"}])
    assert not b.ok
    assert "drop the reasoning" in b.reason
    assert b.token_ids.tolist() == prev.tolist()
    assert len(b.appended_ids) == 0
    # a tool result keeps the reasoning (multi-step tool use): that extends
    assert r.bridge(prev, [{"role": "tool", "content": "x"}]).ok


def test_bridge_refuses_a_turn_the_template_would_rewrite() -> None:
    r = renderer("llama3")
    prompt = r.render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, date_string=DATE
    )
    prev = np.concatenate(
        [prompt.token_ids, np.array(encode("llama3", "Hello!  \n<|eot_id|>"), np.int32)]
    )
    b = r.bridge(prev, [{"role": "user", "content": "again"}])
    assert not b.ok
    assert "differently" in b.reason  # Llama trims the trailing whitespace the model sampled


def test_bridge_needs_an_assistant_turn_at_the_end() -> None:
    r = renderer("qwen3")
    out = r.render([{"role": "user", "content": "hi"}])
    b = r.bridge(out.token_ids, [{"role": "user", "content": "x"}])
    assert not b.ok
    assert "does not end with an assistant turn" in b.reason
    assert not r.bridge(np.array([], np.int32), [{"role": "user", "content": "x"}]).ok


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40),
        min_size=1,
        max_size=4,
    ),
    st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=60),
    st.integers(0, 30),
)
def test_bridge_output_always_starts_with_prev_ids(users: list[str], answer: str, cut: int) -> None:
    r = renderer("qwen2.5")
    msgs: list[dict[str, Any]] = [{"role": "user", "content": users[0]}]
    prompt = r.render(msgs, add_generation_prompt=True)
    completion = encode("qwen2.5", answer + "<|im_end|>")
    completion = completion[: max(0, len(completion) - cut)]
    prev = np.concatenate([prompt.token_ids, np.array(completion, np.int32)])
    for text in users[1:]:
        b = r.bridge(prev, [{"role": "user", "content": text}])
        assert b.token_ids[: len(prev)].tolist() == prev.tolist()
        if not b.ok:
            break
        assert len(b.loss_mask) == len(b.appended_ids) == len(b.message_index)
        prev = np.concatenate([b.token_ids, np.array(encode("qwen2.5", "ok<|im_end|>"), np.int32)])


# --- parse ----------------------------------------------------------------------------------


def test_parse_qwen3_reasoning_content_and_calls() -> None:
    r = renderer("qwen3")
    ids = encode("qwen3", SAMPLES["qwen3"])
    p = r.parse(ids)
    assert p.reasoning == "need the tool"
    assert p.stopped
    assert [(c.name, json.loads(c.arguments), c.status) for c in p.tool_calls] == [
        ("get_weather", {"city": "Paris"}, "ok")
    ]


def test_parse_keeps_malformed_calls_with_their_text() -> None:
    r = renderer("qwen2.5")
    ids = encode(
        "qwen2.5",
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call><|im_end|>',
    )
    p = r.parse(ids)
    assert p.content == "Sure."
    (call,) = p.tool_calls
    assert call.status == "malformed"
    assert '"city": }' in call.raw_text
    cut = r.parse(encode("qwen2.5", '<tool_call>\n{"name": "get_wea'))
    assert cut.tool_calls[0].status == "malformed"
    assert not cut.stopped


def test_parse_matches_structural_tokens_by_id_only() -> None:
    r = renderer("qwen2.5")
    tok = hf("qwen2.5")
    # the characters of "<tool_call>" written as ordinary tokens, not the tool-call token
    spoof = [
        i
        for piece in ["<", "tool", "_call", ">", '{"name": "x"}']
        for i in tok(piece, add_special_tokens=False)["input_ids"]
    ]
    assert tok.convert_tokens_to_ids("<tool_call>") not in spoof
    p = r.parse(spoof)
    assert p.tool_calls == []
    assert p.content == '<tool_call>{"name": "x"}'


def test_parse_reasoning_cut_off_is_flagged() -> None:
    p = renderer("qwen3").parse(encode("qwen3", "<think>\nstill thinking about"))
    assert p.reasoning_truncated
    assert p.reasoning == "still thinking about"
    assert p.content == ""


def test_parse_llama_json_tool_call() -> None:
    p = renderer("llama3").parse(encode("llama3", SAMPLES["llama3"]))
    assert p.tool_calls[0].name == "get_weather"
    assert json.loads(p.tool_calls[0].arguments) == {"city": "Paris"}


# --- bad input ------------------------------------------------------------------------------


def test_bad_family_and_tokenizer(tmp_path: Any) -> None:
    with pytest.raises(tn.UnknownFamilyError, match='unknown renderer family "qwen4"'):
        tn.Renderer("qwen4", shared_tokenizer("qwen3"))
    with pytest.raises(tn.TemplateError, match=r"does not match the model's chat template"):
        tn.Renderer("qwen3", shared_tokenizer("llama3"))
    with pytest.raises(tn.TokenizerError, match=r'does not match family "qwen3"'):
        tn.Renderer("qwen3", shared_tokenizer("llama3"), force=True)
    with pytest.raises(tn.TokenizerError, match="does not exist"):
        tn.Renderer("qwen3", tmp_path / "nope")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(tn.TokenizerError, match="cannot load tokenizer"):
        tn.Renderer("qwen3", bad)
    with pytest.raises(tn.TemplateError, match="no family port is proven equal to it"):
        tn.Renderer("qwen3", shared_tokenizer("qwen3"), chat_template="{{ messages }}")


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "robot", "content": "x"}], 'message 0: role: unknown role "robot"'),
        ([{"content": "x"}], "role is missing"),
        ([{"role": "user", "content": 3}], "content must be a string or null, got int"),
        ([{"role": "user"}], "a user message needs a string content"),
        (
            [{"role": "user", "content": "x", "tool_calls": []}],
            "only assistant messages carry tool_calls",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                }
            ],
            'arguments of "f" are not valid JSON',
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "name is missing",
        ),
    ],
)
def test_bad_messages_raise_typed_errors(messages: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(tn.InvalidMessageError, match=match):
        renderer("qwen3").render(messages)


def test_bad_family_specific_messages() -> None:
    two_calls = {
        "role": "assistant",
        "tool_calls": [{"function": {"name": "f", "arguments": {}}}] * 2,
    }
    with pytest.raises(tn.InvalidMessageError, match="exactly one tool call"):
        renderer("llama3").render([{"role": "user", "content": "x"}, two_calls], date_string=DATE)
    dict_args = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    with pytest.raises(tn.InvalidMessageError, match="JSON string"):
        renderer("deepseek-r1").render([{"role": "user", "content": "x"}, dict_args])
    with pytest.raises(TypeError, match="messages must be a list"):
        renderer("qwen3").render("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"messages\[0\].content: expected a JSON-like value"):
        renderer("qwen3").render([{"role": "user", "content": object()}])


def test_token_ids_outside_the_vocabulary() -> None:
    r = renderer("qwen3")
    with pytest.raises(
        tn.TokenIdError, match="token id 999999 at position 1 is outside the vocabulary"
    ):
        r.parse([1, 999999])
    with pytest.raises(tn.TokenIdError, match="token id -1"):
        r.bridge(np.array([5, -1], np.int64), [{"role": "user", "content": "x"}])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["qwen3", "qwen2.5", "llama3", "deepseek-r1"]),
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"])},
            optional={
                "content": json_values,
                "tool_calls": json_values,
                "reasoning_content": json_values,
            },
        ),
        max_size=5,
    ),
    st.one_of(st.none(), st.lists(json_values, max_size=2)),
    st.lists(st.integers(-(2**40), 2**40), max_size=30),
)
def test_garbage_never_crashes(
    family: str, messages: list[Any], tools: Any, ids: list[int]
) -> None:
    r = renderer(family)
    for call in (
        lambda: r.render(messages, tools=tools, add_generation_prompt=True, date_string=DATE),
        lambda: r.bridge(ids, messages),
        lambda: r.parse(ids),
    ):
        try:
            call()
        except (tn.TreadleNativeError, TypeError):
            pass  # typed errors are fine; a panic (BaseException) or anything else is not
