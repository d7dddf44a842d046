"""The native side of conformance: building `treadle_native.Renderer` for a target, rendering
a corpus case with it, and comparing the result with the Hugging Face oracle.

Renderer construction follows the extension's API: `Renderer(family, tokenizer_path)` for a
family's default template, `Renderer(family, tokenizer_path, chat_template=text)` for a
variant, and, when the family renderer refuses a variant it cannot express, the generic
`Renderer("jinja", tokenizer_path, chat_template=text, bos_token=..., eos_token=...)`.
Renderers are built once per target. The oracle lives in `oracle.py`.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from treadle_native.conformance.corpus import Case

from .oracle import hf_render
from .targets import target


def missing_renderer() -> str | None:
    """Why the native renderer cannot be checked, or None when it can."""
    try:
        import treadle_native
    except ImportError as e:
        return f"treadle_native cannot be imported ({e}); build it with `make test` or maturin"
    if not hasattr(treadle_native, "Renderer"):
        return (
            f"treadle_native {getattr(treadle_native, '__version__', '?')} "
            f"({treadle_native.__file__}) has no Renderer: the native chat renderer is not built yet"
        )
    return None


@dataclass(frozen=True)
class NativeRenderer:
    renderer: Any  # treadle_native.Renderer
    construction: str  # how it was built, for reports


@functools.cache
def native_renderer(name: str) -> NativeRenderer:
    """The native renderer of a target, built once."""
    import treadle_native

    t = target(name)
    path = str(t.tokenizer_dir)
    template = t.chat_template
    if template is None:
        return NativeRenderer(treadle_native.Renderer(t.family, path), f'Renderer("{t.family}")')
    try:
        r = treadle_native.Renderer(t.family, path, chat_template=template)
        return NativeRenderer(r, f'Renderer("{t.family}", chat_template={t.template_file})')
    except ValueError as refused:  # TreadleNativeError: the family cannot express this variant
        specials = {
            k: v for k in ("bos_token", "eos_token") if (v := t.special_token(k)) is not None
        }
        r = treadle_native.Renderer("jinja", path, chat_template=template, **specials)
        return NativeRenderer(
            r,
            f'Renderer("jinja", chat_template={t.template_file}) '
            f"({t.family} refused: {type(refused).__name__})",
        )


@functools.cache
def generic_renderer(name: str) -> NativeRenderer:
    """The generic minijinja renderer on the target's template (the family-independent fallback)."""
    import treadle_native

    t = target(name)
    specials = {k: v for k in ("bos_token", "eos_token") if (v := t.special_token(k)) is not None}
    template = {"chat_template": t.chat_template} if t.chat_template is not None else {}
    r = treadle_native.Renderer("jinja", str(t.tokenizer_dir), **template, **specials)
    return NativeRenderer(r, 'Renderer("jinja")')


def render_native(name: str, case: Case, *, generic: bool = False) -> Any:
    """Render a case with the target's native renderer (inputs copied, never mutated);
    `generic` uses the minijinja fallback instead of the family renderer."""
    built = generic_renderer(name) if generic else native_renderer(name)
    return built.renderer.render(
        copy.deepcopy(case.messages),
        tools=copy.deepcopy(case.tools),
        add_generation_prompt=case.add_generation_prompt,
        **case.template_kwargs,
    )


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """Index of the first position where `a` and `b` differ (length included), else None."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Outcome:
    case_id: str
    kinds: tuple[str, ...]
    passed: bool
    first_token_diff: int | None  # first differing token position, None if equal or errored
    detail: str  # empty when passed
    prefix_stable: bool | None = (
        None  # generic renderer: whether the conversation was prefix-stable
    )


def compare(name: str, case: Case, *, generic: bool = False) -> Outcome:
    """Render a case both ways and say whether text, token ids and array lengths agree.

    A native error is reported as a failed outcome rather than raised, so that a report can
    list every failing case.
    """
    hf = hf_render(name, case)
    try:
        out = render_native(name, case, generic=generic)
        ids = out.token_ids.tolist()
        lengths = {
            len(out.token_ids),
            len(out.message_index),
            len(out.loss_mask),
            len(out.is_content),
        }
        text = out.text
    except Exception as e:  # report boundary: a native error is a failed case
        return Outcome(case.id, case.kinds, False, None, f"{type(e).__name__}: {e}")
    problems = []
    token_diff = first_difference(hf.token_ids, ids)
    if token_diff is not None:
        want = hf.token_ids[token_diff] if token_diff < len(hf.token_ids) else "end"
        got = ids[token_diff] if token_diff < len(ids) else "end"
        problems.append(f"token {token_diff}: hf {want} vs native {got}")
    char_diff = first_difference(hf.text, text)
    if char_diff is not None:
        problems.append(f"text differs at char {char_diff}")
    if len(lengths) != 1:
        problems.append(f"array lengths differ: {sorted(lengths)}")
    return Outcome(
        case.id, case.kinds, not problems, token_diff, "; ".join(problems), out.prefix_stable
    )
