"""Foreign chat templates: the reference templates TRL ships, for the generic renderer.

TRL's wheel (a dev dependency, Apache-2.0) carries `trl/chat_templates/*.jinja`: the chat
templates of many model families (Qwen 2.5-3.x, Llama 3.x, DeepSeek, Gemma, GLM, GPT-OSS,
Nemotron, Phi, Cohere, LFM, ...) and their `*_training` variants with `{% generation %}`
blocks. They are read from the installed package, never copied into this repository (their
models' licenses vary). Each is paired with the closest real tokenizer we have offline; a
template of another family uses the Qwen3 tokenizer as a *stand-in*: the rendered text is
still compared character for character, and the token ids with that tokenizer on both sides.

This module says where the templates are and renders cases both ways; the corpus is
`corpus.cases("generic")`, the tests are `test_foreign.py`, the table `make_table.py`.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.paths import shared_tokenizer
from treadle_native.conformance.corpus import Case

# template file prefix -> shared tokenizer folder (first match wins); others: qwen3 stand-in
TOKENIZER_FOR = (
    ("qwen2_5", "qwen2.5"),
    ("qwen", "qwen3"),
    ("llama3", "llama3"),
    ("deepseek_r1", "deepseek-r1"),
)


@dataclass(frozen=True)
class ForeignTarget:
    name: str  # "trl/<file stem>"
    path: Path  # the .jinja file
    folder: str  # shared tokenizer key
    stand_in: bool  # the tokenizer is not the template's model family's

    @property
    def template_text(self) -> str:
        return _read(self.path)

    @property
    def tokenizer_dir(self) -> Path:
        return shared_tokenizer(self.folder)

    def template_sha256(self) -> str:
        return hashlib.sha256(self.template_text.encode("utf-8")).hexdigest()

    @property
    def has_generation(self) -> bool:
        return "generation" in self.template_text and "endgeneration" in self.template_text


def trl_templates_dir() -> Path | None:
    """`trl/chat_templates` of the installed trl package, or None."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "chat_templates"
    return path if path.is_dir() else None


@functools.cache
def foreign_targets() -> tuple[ForeignTarget, ...]:
    folder = trl_templates_dir()
    if folder is None:
        return ()
    out = []
    for path in sorted(folder.glob("*.jinja")):
        stem = path.stem
        tok = next((t for prefix, t in TOKENIZER_FOR if stem.startswith(prefix)), None)
        out.append(ForeignTarget(f"trl/{stem}", path, tok or "qwen3", tok is None))
    return tuple(out)


def foreign_target(name: str) -> ForeignTarget:
    for t in foreign_targets():
        if t.name == name:
            return t
    raise ValueError(f"unknown foreign template {name!r}")


@functools.cache
def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@functools.cache
def hf_tokenizer(folder: str) -> Any:
    from transformers import AutoTokenizer

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return AutoTokenizer.from_pretrained(str(shared_tokenizer(folder)), local_files_only=True)
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class HF:
    text: str
    token_ids: list[int]


def hf_render(t: ForeignTarget, case: Case, **extra: Any) -> HF:
    """transformers' text and ids (raises what the template raises)."""
    tok = hf_tokenizer(t.folder)
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        text = tok.apply_chat_template(
            copy.deepcopy(case.messages),
            tools=copy.deepcopy(case.tools),
            add_generation_prompt=case.add_generation_prompt,
            tokenize=False,
            chat_template=t.template_text,
            **case.template_kwargs,
            **extra,
        )
    finally:
        logger.setLevel(level)
    return HF(text, list(tok(text, add_special_tokens=False)["input_ids"]))


def hf_assistant_mask(t: ForeignTarget, case: Case) -> list[int]:
    """transformers' `assistant_masks` for a case (templates with generation blocks)."""
    tok = hf_tokenizer(t.folder)
    out = tok.apply_chat_template(
        copy.deepcopy(case.messages),
        tools=copy.deepcopy(case.tools),
        add_generation_prompt=case.add_generation_prompt,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=t.template_text,
        **case.template_kwargs,
    )
    return list(out["assistant_masks"])


@functools.cache
def native_renderer(name: str) -> Any:
    import treadle_native

    t = foreign_target(name)
    return treadle_native.Renderer("jinja", str(t.tokenizer_dir), chat_template=t.template_text)


def native_render(t: ForeignTarget, case: Case) -> Any:
    return native_renderer(t.name).render(
        copy.deepcopy(case.messages),
        tools=copy.deepcopy(case.tools),
        add_generation_prompt=case.add_generation_prompt,
        **case.template_kwargs,
    )
