"""What services read from a model folder's config.json: never an exception, None when
it cannot be told."""

from __future__ import annotations

import json
from pathlib import Path

from treadle.services.model_folder import context_length, vocab_size


def _folder(tmp_path: Path, config: object) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_model_folder_context_length_from_the_folder_or_its_tokenizer_file(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"max_position_embeddings": 4096})
    assert context_length(folder) == 4096
    assert context_length(folder / "tokenizer.json") == 4096


def test_model_folder_reads_a_multimodal_model_s_text_config(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"text_config": {"max_position_embeddings": 8192}})
    assert context_length(folder) == 8192


def test_model_folder_unusable_config_is_none(tmp_path: Path) -> None:
    assert context_length(tmp_path / "missing") is None
    assert context_length(_folder(tmp_path, {"max_position_embeddings": "4096"})) is None
    (tmp_path / "model" / "config.json").write_text("[" * 100_000)
    assert context_length(tmp_path / "model") is None
    (tmp_path / "model" / "config.json").write_bytes(b"\xff\xfe")
    assert context_length(tmp_path / "model") is None
    (tmp_path / "model" / "config.json").write_text("[1]")
    assert context_length(tmp_path / "model") is None


def test_model_folder_vocab_size(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"vocab_size": 151936, "text_config": {"vocab_size": 7}})
    assert vocab_size(folder) == 151936
    assert vocab_size(folder / "tokenizer.json") == 151936
    (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 7}}))
    assert vocab_size(folder) == 7
    (folder / "config.json").write_text(json.dumps({"vocab_size": True}))
    assert vocab_size(folder) is None
