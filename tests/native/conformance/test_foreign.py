"""The generic renderer on foreign chat templates (TRL's reference templates) vs transformers.

Every case transformers renders must render to the same text and token ids; every case
transformers rejects must be rejected (a `TreadleNativeError`), never rendered. Templates
with `{% generation %}` blocks must give transformers' `assistant_masks` exactly. Bridges
must never return ids that differ from the full re-render, and must succeed wherever the
re-render keeps the previous ids (`bridging.py`), on the foreign templates and the family
targets alike. Skipped when trl is not installed (it is a dev dependency).
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from native.conformance.compare import native_renderer as family_renderer
from native.conformance.foreign import (
    foreign_targets,
    hf_assistant_mask,
    hf_render,
    native_render,
    native_renderer,
)
from native.conformance.oracle import hf_render as family_hf_render
from native.conformance.targets import TARGET_NAMES, target
from treadle_native.conformance.bridging import bridge_outcomes
from treadle_native.conformance.corpus import Case, cases

NUM_CASES = 40
TARGETS = foreign_targets()
ALL = [(t, c) for t in TARGETS for c in cases("generic", NUM_CASES)]
pytestmark = pytest.mark.skipif(not TARGETS, reason="trl (dev dependency) is not installed")


def _ids(t, c):  # type: ignore[no-untyped-def]
    return f"{t.name}:{c.id}"


@pytest.mark.parametrize(("t", "case"), ALL, ids=[_ids(t, c) for t, c in ALL])
def test_foreign_template_renders_as_transformers(t, case: Case) -> None:  # type: ignore[no-untyped-def]
    import treadle_native

    try:
        hf = hf_render(t, case)
    except Exception:  # the template rejects the case: so must the native renderer
        with pytest.raises(treadle_native.TreadleNativeError):
            native_render(t, case)
        return
    out = native_render(t, case)
    assert out.text == hf.text
    assert out.token_ids.tolist() == hf.token_ids


GENERATION = [(t, c) for t, c in ALL if t.has_generation]


@pytest.mark.parametrize(("t", "case"), GENERATION, ids=[_ids(t, c) for t, c in GENERATION])
def test_generation_blocks_give_transformers_assistant_masks(t, case: Case) -> None:  # type: ignore[no-untyped-def]
    try:
        want = hf_assistant_mask(t, case)
    except Exception:
        pytest.skip("transformers rejects the case")
    out = native_render(t, case)
    assert native_renderer(t.name).loss_mask_convention == "generation"
    assert out.loss_mask.tolist() == want


def _foreign_bridges(t) -> Counter[str]:  # type: ignore[no-untyped-def]
    from native.conformance.foreign import hf_tokenizer

    tok = hf_tokenizer(t.folder)
    total: Counter[str] = Counter()
    for case in cases("generic", NUM_CASES):

        def render(msgs, agp, case=case):  # type: ignore[no-untyped-def]
            text = tok.apply_chat_template(
                msgs, tools=case.tools, add_generation_prompt=agp, tokenize=False,
                chat_template=t.template_text, **case.template_kwargs,
            )  # fmt: skip
            return list(tok(text, add_special_tokens=False)["input_ids"])

        total += bridge_outcomes(native_renderer(t.name), render, case)
    return total


@pytest.mark.parametrize("t", TARGETS, ids=[t.name for t in TARGETS])
def test_foreign_bridges_are_exact(t) -> None:  # type: ignore[no-untyped-def]
    counts = _foreign_bridges(t)
    assert counts["wrong"] == 0, counts
    eligible = counts["ok"] + counts["missed"]
    assert counts["ok"] >= 0.99 * eligible, counts


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_family_bridges_are_exact(name: str) -> None:
    from treadle_native.conformance.corpus import Case as C

    total: Counter[str] = Counter()
    for case in cases(name, 80):

        def render(msgs, agp, case=case):  # type: ignore[no-untyped-def]
            c = C(case.id, case.kinds, msgs, case.tools, agp, case.template_kwargs)
            return family_hf_render(name, c).token_ids

        total += bridge_outcomes(family_renderer(name).renderer, render, case)
    assert total["wrong"] == 0, total


def _prompt_split_disagreements(r, case: Case) -> list[str]:  # type: ignore[no-untyped-def]
    """Where the render with the generation prompt attributes the tokens it shares with
    the render without it differently (the generic renderer renders the conversation
    once for both where the template's prompt is proved to be a top-level tail)."""
    import treadle_native

    def render(agp: bool):  # type: ignore[no-untyped-def]
        return r.render(
            copy.deepcopy(case.messages), tools=copy.deepcopy(case.tools),
            add_generation_prompt=agp, **case.template_kwargs,
        )  # fmt: skip

    try:
        with_prompt, without = render(True), render(False)
    except treadle_native.TreadleNativeError:
        return []
    if not (with_prompt.prefix_stable and without.prefix_stable):
        return []
    if not with_prompt.text.startswith(without.text):
        return []
    a, b = with_prompt.token_ids.tolist(), without.token_ids.tolist()
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    exact = n == len(b)  # the text without the prompt ends at a token boundary of the text with it
    if not exact:
        n = max(0, n - 1)  # the last shared token may join the prompt's first characters
    out = []
    for field in ("message_index", "loss_mask", "is_content"):
        x, y = getattr(with_prompt, field)[:n].tolist(), getattr(without, field)[:n].tolist()
        if x != y:
            at = next(i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q)
            out.append(f"{case.id}: {field} differs at token {at} ({x[at]} vs {y[at]})")
    # the generation prompt is scaffold: no message owns it
    prompt = with_prompt.message_index[len(b) :].tolist() if exact else []
    if any(m != -1 for m in prompt):
        out.append(f"{case.id}: the generation prompt is attributed to messages {prompt}")
    return out


@pytest.mark.parametrize("t", TARGETS, ids=[t.name for t in TARGETS])
def test_foreign_render_with_the_prompt_attributes_as_without(t) -> None:  # type: ignore[no-untyped-def]
    r = native_renderer(t.name)
    bad = [d for case in cases("generic", NUM_CASES) for d in _prompt_split_disagreements(r, case)]
    assert bad == []


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_family_templates_render_with_the_prompt_attribute_as_without(name: str) -> None:
    import treadle_native

    tgt = target(name)
    r = treadle_native.Renderer("jinja", str(tgt.tokenizer_dir), chat_template=tgt.template_text)
    bad = [d for case in cases(name, 80) for d in _prompt_split_disagreements(r, case)]
    assert bad == []
