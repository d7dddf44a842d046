"""Loss masks cross-checked against a second implementation: the `renderers` package.

Where its Qwen3 renderer produces the same ids as ours (and so as HF), its assistant loss
mask must equal ours token for token. It is an oracle for mask semantics only; where it
disagrees with HF on ids, HF wins and the case is not compared.
"""

from __future__ import annotations

import pytest

import treadle_native as tn
from native.conformance.targets import target
from treadle_native.conformance.corpus import cases

renderers = pytest.importorskip("renderers")


def test_masks_match_the_renderers_package_on_qwen3() -> None:
    from transformers import AutoTokenizer

    t = target("qwen3")
    theirs = renderers.create_renderer(
        AutoTokenizer.from_pretrained(t.tokenizer_dir), renderers.Qwen3RendererConfig()
    )
    ours = tn.Renderer("qwen3", t.tokenizer_dir)
    compared = 0
    for case in cases("qwen3")[:160]:
        if case.add_generation_prompt:
            continue
        sample = renderers.build_training_sample(theirs, case.messages, tools=case.tools)
        out = ours.render(case.messages, tools=case.tools, **case.template_kwargs)
        if list(sample.token_ids) != out.token_ids.tolist():
            continue
        assert [int(x) for x in sample.loss_mask] == out.loss_mask.tolist(), case.id
        compared += 1
    assert compared >= 50  # the comparison must actually happen
