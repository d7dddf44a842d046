"""The native encoder against tokenizers, on texts hypothesis draws.

GPT-style byte-level BPE tokenizers (every shared one: Qwen3, Qwen2.5, DeepSeek's Qwen
distill, Llama 3) are encoded by the core's direct encoder (`native/core/src/fastbpe.rs`),
not by tokenizers; every id the renderers return for them comes from it. Here any text
(all of Unicode, added tokens spliced in, runs of one character) is put in a message,
rendered, and the render's ids must be what tokenizers gives for the render's text.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import treadle_native as tn
from testkit.paths import SHARED_TOKENIZERS

FOLDERS = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5-instruct",
    "deepseek-r1": "deepseek-r1-distill-qwen",
    "llama3": "llama-3.2-instruct",
}


@cache
def pair(family: str) -> tuple[tn.Renderer, Tokenizer, list[str]]:
    folder: Path = SHARED_TOKENIZERS / FOLDERS[family]
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    added = [t.content for t in raw.get_added_tokens_decoder().values()]
    return tn.Renderer(family, folder), raw, added


def texts(added: list[str]) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
        st.sampled_from(added),
        st.builds(
            lambda c, n: c * n,
            st.sampled_from([" ", "\n", "=", "7", "é", "😀", "\u0301"]),
            st.integers(1, 400),
        ),
        st.sampled_from(["'s", " don't", "\r\n", "Ġ", "e\u0301", "\u00c5", "\ufb01", "\u3000"]),
    )
    return st.lists(piece, max_size=12).map("".join)


@pytest.mark.parametrize("family", sorted(FOLDERS))
def test_render_ids_are_tokenizers_ids_for_any_text(family: str) -> None:
    renderer, raw, added = pair(family)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=texts(added))
    def check(text: str) -> None:
        ours = renderer.render([{"role": "user", "content": text}])
        theirs = raw.encode(ours.text, add_special_tokens=False).ids
        assert ours.token_ids.tolist() == theirs

    check()
