"""The Hugging Face oracle: what `transformers` renders and tokenizes for a corpus case.

`hf_render(target, case)` is the reference the native renderer is held to: the target's
tokenizer loaded with `transformers.AutoTokenizer`, `apply_chat_template(..., tokenize=False)`
with the case's tools, generation-prompt flag and template kwargs (the variant template
passed as `chat_template=` where the target has one), then `tokenizer(text,
add_special_tokens=False)` because the templates write BOS themselves.

Tokenizers are loaded once per target and results are cached per case content, so a test
session renders each case once however many tests look at it. This module does not
generate cases (`corpus.py`) or call the native renderer (`compare.py`).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from treadle_native.conformance.corpus import Case

from .targets import target as get_target


@dataclass(frozen=True)
class HFRendered:
    text: str  # the rendered prompt
    token_ids: list[int]  # [num_tokens], the text encoded without added special tokens


@functools.cache
def hf_tokenizer(target: str) -> Any:
    """The transformers tokenizer of a target, loaded once."""
    from transformers import AutoTokenizer

    t = get_target(target)
    # transformers warns that DeepSeek's tokenizer_class does not match its tokenizer.json;
    # the fast backend it falls back to is the one we want, so keep the log quiet.
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(t.tokenizer_dir), local_files_only=True)
    finally:
        logger.setLevel(level)


def hf_render(target: str, case: Case) -> HFRendered:
    """Render and tokenize `case` exactly as transformers does for `target`.

    Raises whatever the template raises (e.g. jinja2 TemplateError) for an invalid case.
    """
    key = (target, case.fingerprint())
    if key not in _CACHE:
        _CACHE[key] = _render(target, case)
    return _CACHE[key]


_CACHE: dict[tuple[str, str], HFRendered] = {}


def _render(target: str, case: Case) -> HFRendered:
    tokenizer = hf_tokenizer(target)
    override = get_target(target).chat_template
    kwargs: dict[str, Any] = dict(case.template_kwargs)
    if override is not None:
        kwargs["chat_template"] = override
    text = tokenizer.apply_chat_template(
        case.messages,
        tools=case.tools,
        add_generation_prompt=case.add_generation_prompt,
        tokenize=False,
        **kwargs,
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return HFRendered(text, list(ids))
