"""Where test assets live: the repository, ../shared (real tokenizers), tests/assets."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = REPO_ROOT / "tests" / "assets"
SHARED = REPO_ROOT.parent / "shared"
SHARED_TOKENIZERS = SHARED / "tokenizers"

# family folder under ../shared/tokenizers for each family the renderers support
TOKENIZER_FAMILIES = {
    "qwen3": "qwen3",
    "qwen2.5": "qwen2.5-instruct",
    "llama3": "llama-3.2-instruct",
    "deepseek-r1": "deepseek-r1-distill-qwen",
}


def shared_tokenizer(family: str) -> Path:
    """Folder of a real tokenizer in ../shared/tokenizers (FileNotFoundError if absent)."""
    path = SHARED_TOKENIZERS / TOKENIZER_FAMILIES[family]
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path} has no tokenizer.json (is ../shared beside the checkout?)")
    return path
