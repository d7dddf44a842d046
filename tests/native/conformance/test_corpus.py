"""The conformance corpus: size, kind coverage, determinism, validity under the HF oracle."""

from __future__ import annotations

import json
from typing import Any

import pytest

from native.conformance.oracle import hf_render, hf_tokenizer
from native.conformance.targets import TARGET_NAMES
from treadle_native.conformance.corpus import KINDS, Case, cases
from treadle_native.conformance.dialects import DIALECTS

# added tokens that cases may carry in message text: reasoning tags, and Qwen's tool-response
# tags (a user turn wrapped in them is not a query for Qwen3's reasoning rules)
ALLOWED_ADDED_TOKENS = {"<think>", "</think>", "<tool_response>", "</tool_response>"}
RENDERER_KWARGS = {"enable_thinking", "date_string"}

CORPUS = {t: cases(t) for t in TARGET_NAMES}
ALL_CASES = [(t, c) for t in TARGET_NAMES for c in CORPUS[t]]


def strings(value: Any) -> list[str]:
    """Every string inside a JSON-like value (keys included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [*strings(k), *strings(v)]]
    if isinstance(value, list | tuple):
        return [s for v in value for s in strings(v)]
    return []


def case_strings(case: Case) -> list[str]:
    return strings(case.messages) + strings(case.tools or [])


def arguments(case: Case) -> list[Any]:
    """Every tool call's arguments, JSON strings decoded."""
    out = []
    for m in case.messages:
        for call in m.get("tool_calls") or []:
            args = call["function"]["arguments"]
            out.append(json.loads(args) if isinstance(args, str) else args)
    return out


def stresses_whitespace(s: str) -> bool:
    """Whitespace at an edge, whitespace-only, or runs a renderer might collapse."""
    return s != s.strip() or any(w in s for w in ("\r\n", "\t", "\n\n", "\n ", "  "))


def walk(value: Any) -> list[Any]:
    out = [value]
    if isinstance(value, dict):
        out += [x for v in value.values() for x in walk(v)]
    elif isinstance(value, list):
        out += [x for v in value for x in walk(v)]
    return out


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_has_at_least_200_cases(target: str) -> None:
    assert len(CORPUS[target]) >= 200


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_covers_every_kind(target: str) -> None:
    counts = {k: sum(k in c.kinds for c in CORPUS[target]) for k in KINDS}
    assert {k: n for k, n in counts.items() if n < 10} == {}


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_is_deterministic(target: str) -> None:
    again = cases(target)
    assert [(c.id, c.kinds, c.fingerprint()) for c in again] == [
        (c.id, c.kinds, c.fingerprint()) for c in CORPUS[target]
    ]
    other_seed = cases(target, seed=1)
    assert [c.fingerprint() for c in other_seed] != [c.fingerprint() for c in again]


def test_corpus_returns_n_cases() -> None:
    assert len(cases("qwen3", n=7)) == 7
    assert len(cases("llama3", n=300)) == 300


def test_corpus_rejects_unknown_target() -> None:
    with pytest.raises(ValueError, match="unknown conformance target 'gpt2'"):
        cases("gpt2")


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_ids_are_unique(target: str) -> None:
    ids = [c.id for c in CORPUS[target]]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith(f"{target}/") for i in ids)


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_kinds_match_content(target: str) -> None:
    renders_reasoning = DIALECTS[target].renders_reasoning
    for c in CORPUS[target]:
        texts = case_strings(c)
        if "unicode" in c.kinds:
            assert any(not s.isascii() for s in texts), c.id
        if "empty" in c.kinds:
            assert "" in texts or c.tools == [] or {} in arguments(c), c.id
        if "whitespace" in c.kinds:
            assert any(stresses_whitespace(s) for s in texts), c.id
        if "long" in c.kinds:
            assert max(map(len, texts)) >= 2500, c.id
        if "tool_calls" in c.kinds:
            assert any(m["role"] == "tool" or m.get("tool_calls") for m in c.messages), c.id
        if "thinking" in c.kinds:
            reasoning = [m for m in c.messages if "reasoning_content" in m or "think>" in str(m)]
            # Qwen3 writes an empty think block into a final assistant turn by itself
            empty_block = renders_reasoning and c.messages[-1]["role"] == "assistant"
            assert reasoning or empty_block or "enable_thinking" in c.template_kwargs, c.id


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_has_no_control_tokens_in_text(target: str) -> None:
    added = set(hf_tokenizer(target).added_tokens_encoder) - ALLOWED_ADDED_TOKENS
    found = {(c.id, t) for c in CORPUS[target] for s in case_strings(c) for t in added if t in s}
    assert found == set()


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_template_kwargs_are_renderer_arguments(target: str) -> None:
    dialect = DIALECTS[target]
    for c in CORPUS[target]:
        assert set(c.template_kwargs) <= RENDERER_KWARGS, c.id
        assert ("date_string" in c.template_kwargs) == dialect.needs_date, c.id
        if not dialect.thinking_switch:
            assert "enable_thinking" not in c.template_kwargs, c.id


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_tool_arguments_are_json_objects(target: str) -> None:
    dialect = DIALECTS[target]
    for c in CORPUS[target]:
        for m in c.messages:
            for call in m.get("tool_calls") or []:
                args = call["function"]["arguments"]
                if isinstance(args, str):
                    assert isinstance(json.loads(args), dict), c.id
                else:
                    assert dialect.arguments_as_dict, c.id
                    assert isinstance(args, dict), c.id


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_tool_arguments_cover_json_values(target: str) -> None:
    all_args = [a for c in CORPUS[target] for a in arguments(c)]
    values = [v for a in all_args for v in walk(a)]
    assert any(isinstance(v, float) for v in values)
    assert {} in all_args
    assert any(isinstance(v, dict) for a in all_args for v in a.values())
    assert any(isinstance(v, str) and not v.isascii() for v in values)


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_tool_arguments_come_as_dict_and_string(target: str) -> None:
    forms = {
        type(call["function"]["arguments"])
        for c in CORPUS[target]
        for m in c.messages
        for call in m.get("tool_calls") or []
    }
    assert forms == ({dict, str} if DIALECTS[target].arguments_as_dict else {str})


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_has_parallel_calls_where_supported(target: str) -> None:
    widths = {
        len(m["tool_calls"]) for c in CORPUS[target] for m in c.messages if m.get("tool_calls")
    }
    if DIALECTS[target].parallel_tool_calls:
        assert max(widths) >= 2
    else:
        assert widths == {1}


@pytest.mark.parametrize("target", TARGET_NAMES)
def test_corpus_has_generation_prompt_on_and_off(target: str) -> None:
    flags = [c.add_generation_prompt for c in CORPUS[target] if "generation_prompt" in c.kinds]
    assert True in flags
    assert False in flags


@pytest.mark.parametrize(("target", "case"), ALL_CASES, ids=[c.id for _, c in ALL_CASES])
def test_corpus_case_renders_under_oracle(target: str, case: Case) -> None:
    hf = hf_render(target, case)
    assert hf.text
    assert len(hf.token_ids) > 0
