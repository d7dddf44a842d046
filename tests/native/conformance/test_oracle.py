"""Checks of the oracle itself: does transformers render what the templates say?

The oracle (`oracle.py`) is transformers 5.x. These tests hold it against two simpler
references, so that a renderer built from the templates and the `tokenizers` library alone
can match it:

- the templates rendered with plain jinja2, set up as ../shared/tokenizers/README.md says
  (sandboxed environment, trim_blocks + lstrip_blocks, loopcontrols, a `tojson` that keeps
  non-ASCII, `raise_exception`, a fixed `strftime_now`, bos/eos from tokenizer_config);
- the `tokenizers` library encoding the rendered text (no added special tokens).

Where transformers departs from the plain template (it drops message keys whose value is
None, and copies `reasoning`/`thinking` into `reasoning_content`), a test pins the
difference: the corpus avoids those inputs, and a renderer has to know about them.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from native.conformance.oracle import hf_render
from native.conformance.targets import TARGET_NAMES, target
from treadle_native.conformance.corpus import Case, cases

FIXED_DATE = "26 Jul 2024"
ALL_CASES = [(t, c) for t in TARGET_NAMES for c in cases(t)]


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def readme_template(name: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: FIXED_DATE
    return env.from_string(target(name).template_text)


def readme_render(name: str, case: Case) -> str:
    """Render a case with plain jinja2, exactly as the shared tokenizers README describes."""
    t = target(name)
    specials = {k: v for k in ("bos_token", "eos_token") if (v := t.special_token(k)) is not None}
    return readme_template(name).render(
        messages=case.messages,
        tools=case.tools,
        add_generation_prompt=case.add_generation_prompt,
        **specials,
        **case.template_kwargs,
    )


@functools.cache
def raw_tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(target(name).tokenizer_dir / "tokenizer.json"))


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=[c.id for _, c in ALL_CASES])
def test_oracle_text_matches_plain_jinja2(name: str, case: Case) -> None:
    assert readme_render(name, case) == hf_render(name, case).text


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=[c.id for _, c in ALL_CASES])
def test_oracle_token_ids_match_tokenizers_library(name: str, case: Case) -> None:
    hf = hf_render(name, case)
    assert raw_tokenizer(name).encode(hf.text, add_special_tokens=False).ids == hf.token_ids


def test_oracle_applies_variant_template() -> None:
    prompt = Case("probe", ("generation_prompt",), [{"role": "user", "content": "Hi"}], None, True)
    assert hf_render("deepseek-r1", prompt).text.endswith("<｜Assistant｜>")
    assert hf_render("deepseek-r1-think", prompt).text.endswith("<｜Assistant｜><think>\n")


def test_oracle_llama_prints_the_given_date() -> None:
    case = Case(
        "probe",
        ("basic",),
        [{"role": "user", "content": "Hi"}],
        None,
        True,
        {"date_string": "29 Feb 2028"},
    )
    for name in ("llama3", "llama3.1"):
        assert "Today Date: 29 Feb 2028\n\n" in hf_render(name, case).text


def test_oracle_drops_none_content_so_deepseek_tool_calls_raise() -> None:
    # DeepSeek's template writes tool calls only for `content is none`; transformers 5 drops
    # None-valued keys first, so the key is missing and the template fails on it, while
    # the plain template renders the calls. Tool calls therefore never reach a DeepSeek
    # prompt through transformers, and the corpus carries none with content None.
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    case = Case(
        "probe",
        ("tool_calls",),
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok"},
        ],
    )
    plain = readme_render("deepseek-r1", case)
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n" in plain
    with pytest.raises(jinja2.exceptions.UndefinedError, match="has no attribute 'content'"):
        hf_render("deepseek-r1", case)


def test_oracle_copies_reasoning_alias_into_reasoning_content() -> None:
    # transformers fills reasoning_content from a `reasoning` (or `thinking`) key; the plain
    # template ignores those keys. The corpus uses reasoning_content only.
    case = Case(
        "probe",
        ("thinking",),
        [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning": "R"}],
    )
    assert "<think>\nR\n</think>\n\nA" in hf_render("qwen3", case).text
    assert "<think>\n\n</think>\n\nA" in readme_render("qwen3", case)
