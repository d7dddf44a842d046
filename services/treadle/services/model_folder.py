"""What services other than the trainer and inference read from a Hugging Face model
folder's ``config.json``: the vocabulary size and the context length.

The launcher hands the vocabulary size to the orchestrator, which refuses rollouts whose
token ids fall outside it; the env runner bounds every model call by the context length.
Reading never raises: a folder without a usable ``config.json`` gives None, and the
service that loads the model says what is wrong with it. Not here: loading weights or
checking architectures (the trainer's ``models/hf.py`` and inference's spec do that).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"


def model_config(path: Path | str) -> dict[str, Any] | None:
    """``config.json`` of the model folder ``path`` (or of the folder holding the file
    ``path``, e.g. its tokenizer.json); None when there is none or it is unreadable."""
    path = Path(path).expanduser()
    folder = path if path.is_dir() else path.parent
    try:
        doc = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def _positive_int(config: dict[str, Any] | None, key: str) -> int | None:
    """``config[key]`` (or the text model's, for a multimodal config) when a positive integer."""
    if config is None:
        return None
    text = config.get("text_config")
    for doc in (config, text if isinstance(text, dict) else {}):
        v = doc.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def vocab_size(path: Path | str) -> int | None:
    """Rows of the model's embedding: every token id it samples or trains on is below it."""
    return _positive_int(model_config(path), "vocab_size")


def context_length(path: Path | str) -> int | None:
    """Tokens the model attends over, prompt + completion (``max_position_embeddings``)."""
    return _positive_int(model_config(path), "max_position_embeddings")
