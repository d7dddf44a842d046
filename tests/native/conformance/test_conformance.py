"""treadle_native.Renderer against Hugging Face, token for token, on the whole corpus.

For every target and corpus case the native renderer must produce the same text and the
same token ids as `transformers` (`oracle.py`), with its four per-token arrays aligned.
Skipped, with the reason, only while the extension has no `Renderer`.
`make_table.py` runs the same comparison and writes native/CONFORMANCE.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from native.conformance.compare import missing_renderer, render_native
from native.conformance.oracle import hf_render
from native.conformance.targets import TARGET_NAMES
from treadle_native.conformance.corpus import Case, cases

ALL_CASES = [(t, c) for t in TARGET_NAMES for c in cases(t)]
IDS = [c.id for _, c in ALL_CASES]

pytestmark = pytest.mark.skipif(missing_renderer() is not None, reason=str(missing_renderer()))

_native: dict[str, Any] = {}


def native(name: str, case: Case) -> Any:
    """The native rendering of a case, once per session."""
    if case.id not in _native:
        _native[case.id] = render_native(name, case)
    return _native[case.id]


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=IDS)
def test_renderer_text_matches_hf(name: str, case: Case) -> None:
    assert native(name, case).text == hf_render(name, case).text


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=IDS)
def test_renderer_token_ids_match_hf(name: str, case: Case) -> None:
    assert native(name, case).token_ids.tolist() == hf_render(name, case).token_ids


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=IDS)
def test_renderer_arrays_are_aligned(name: str, case: Case) -> None:
    out = native(name, case)
    n = len(out.token_ids)
    assert (len(out.message_index), len(out.loss_mask), len(out.is_content)) == (n, n, n)
    assert out.token_ids.dtype == np.int32
    assert out.message_index.dtype == np.int32
    assert out.loss_mask.dtype == np.uint8
    assert out.is_content.dtype == np.uint8
    assert set(out.loss_mask.tolist()) <= {0, 1}
    assert set(out.is_content.tolist()) <= {0, 1}
    assert ((out.message_index >= -1) & (out.message_index < len(case.messages))).all()
    trained = {int(i) for i in out.message_index[out.loss_mask == 1]}
    assert -1 not in trained
    assert {case.messages[i]["role"] for i in trained} <= {"assistant"}


@pytest.mark.parametrize(("name", "case"), ALL_CASES, ids=IDS)
def test_generic_renderer_matches_hf(name: str, case: Case) -> None:
    out = render_native(name, case, generic=True)
    hf = hf_render(name, case)
    assert out.text == hf.text
    assert out.token_ids.tolist() == hf.token_ids
    assert out.prefix_stable in (True, False)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_auto_selects_each_targets_port_and_names_the_target(name: str) -> None:
    """Every template a port is registered for is a conformance target, and "auto" picks
    that port for it (the registry in native/core/src/render/select.rs is backed here)."""
    import treadle_native
    from native.conformance.targets import target

    t = target(name)
    kwargs = {"chat_template": t.chat_template} if t.chat_template is not None else {}
    r = treadle_native.Renderer("auto", str(t.tokenizer_dir), **kwargs)
    assert r.family == t.family
    assert f"(conformance target {name})" in r.selection
