"""The comparison and report machinery, driven by a fake native renderer.

These run whether or not treadle_native has a Renderer: the fake replays the oracle's
output, optionally corrupted, so the checks see both passing and failing cases.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from native.conformance import compare as compare_mod
from native.conformance import make_table
from native.conformance.compare import NativeRenderer, compare, first_difference, missing_renderer
from native.conformance.oracle import hf_render
from treadle_native.conformance.corpus import Case, cases

CASE = Case("qwen3/probe", ("basic",), [{"role": "user", "content": "Hello world"}], None, True)


def fake_output(text: str, ids: list[int], extra_array_len: int = 0) -> SimpleNamespace:
    n = len(ids)
    return SimpleNamespace(
        text=text,
        token_ids=np.array(ids, dtype=np.int32),
        message_index=np.full(n + extra_array_len, -1, dtype=np.int32),
        loss_mask=np.zeros(n, dtype=np.uint8),
        is_content=np.zeros(n, dtype=np.uint8),
        prefix_stable=None,
    )


def replay(corrupt: bool = False) -> Any:
    def render(name: str, case: Case, *, generic: bool = False) -> SimpleNamespace:
        hf = hf_render(name, case)
        ids = list(hf.token_ids)
        if corrupt and case.id.endswith("q00-float-arguments"):
            ids[3] += 1
        return fake_output(hf.text, ids)

    return render


def test_first_difference_finds_position_and_length_mismatch() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert first_difference("abc", "abd") == 2


def test_compare_passes_identical_output(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compare_mod, "render_native", replay())
    outcome = compare("qwen3", CASE)
    assert outcome.passed
    assert outcome.detail == ""


def test_compare_reports_first_differing_token(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = hf_render("qwen3", CASE)
    wrong = [*hf.token_ids[:2], 0, *hf.token_ids[3:]]
    monkeypatch.setattr(
        compare_mod, "render_native", lambda n, c, **kw: fake_output(hf.text, wrong)
    )
    outcome = compare("qwen3", CASE)
    assert not outcome.passed
    assert outcome.first_token_diff == 2
    assert outcome.detail == f"token 2: hf {hf.token_ids[2]} vs native 0"


def test_compare_reports_text_and_array_length_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    hf = hf_render("qwen3", CASE)
    out = fake_output(hf.text + "!", hf.token_ids, extra_array_len=1)
    monkeypatch.setattr(compare_mod, "render_native", lambda n, c, **kw: out)
    outcome = compare("qwen3", CASE)
    assert outcome.first_token_diff is None
    assert outcome.detail == (
        f"text differs at char {len(hf.text)}; array lengths differ: "
        f"[{len(hf.token_ids)}, {len(hf.token_ids) + 1}]"
    )


def test_compare_reports_native_errors_as_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(name: str, case: Case, **kw: Any) -> None:
        raise ValueError("no such role")

    monkeypatch.setattr(compare_mod, "render_native", boom)
    outcome = compare("qwen3", CASE)
    assert not outcome.passed
    assert outcome.detail == "ValueError: no such role"


def test_missing_renderer_names_the_missing_attribute(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = SimpleNamespace(__version__="0.0.0", __file__="/x/treadle_native/__init__.py")
    monkeypatch.setitem(sys.modules, "treadle_native", stub)
    assert missing_renderer() == (
        "treadle_native 0.0.0 (/x/treadle_native/__init__.py) has no Renderer: "
        "the native chat renderer is not built yet"
    )
    monkeypatch.setattr(stub, "Renderer", object, raising=False)
    assert missing_renderer() is None


def test_make_table_refuses_without_renderer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(make_table, "missing_renderer", lambda: "treadle_native has no Renderer")
    out = tmp_path / "CONFORMANCE.md"
    assert make_table.main(["--out", str(out)]) == 2
    assert not out.exists()
    assert "treadle_native has no Renderer" in capsys.readouterr().err


def test_make_table_writes_pass_table_and_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(make_table, "missing_renderer", lambda: None)
    monkeypatch.setattr(compare_mod, "render_native", replay(corrupt=True))
    monkeypatch.setattr(make_table, "native_renderer", lambda n: NativeRenderer(None, "Fake()"))
    out = tmp_path / "CONFORMANCE.md"
    argv = ["--out", str(out), "--n", "30", "--targets", "qwen3", "llama3"]
    argv += ["--bridge-n", "0", "--foreign-n", "0"]  # the fake renderer cannot bridge
    assert make_table.main(argv) == 1  # one corrupted case per target
    report = out.read_text(encoding="utf-8")
    qwen_float = next(c for c in cases("qwen3", 30) if c.id.endswith("q00-float-arguments"))
    kinds_row = next(line for line in report.splitlines() if line.startswith("| qwen3 |"))
    assert kinds_row.endswith("| **29/30** |")
    assert "| **all** |" in report
    assert "**58/60**" in report
    assert (
        f"- `{qwen_float.id}` ({', '.join(qwen_float.kinds)}): first differing token 3;" in report
    )
    assert "| qwen3 | `Fake()` | `../shared/tokenizers/qwen3` | `aeb13307" in report
    assert "python tests/native/conformance/make_table.py --out" in report
