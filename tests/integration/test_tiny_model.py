"""The tiny-model builder writes real HF checkpoints that transformers loads as Qwen3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from testkit.paths import shared_tokenizer
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.integration


def load(path: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    return model


def test_tiny_model_bpe_loads_and_renders_its_chat_template(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 64
    model = load(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    tok = AutoTokenizer.from_pretrained(path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse: hello"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) == 3  # special tokens are single ids, never split
    assert tok.decode(ids) == text  # byte-level: lossless
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), cfg["vocab_size"])
    assert cfg["vocab_size"] % 64 == 0
    assert cfg["vocab_size"] >= len(tok)
    assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tiny_model_with_real_qwen3_tokenizer_and_tied_embeddings(
    tmp_path: Path, shared_tokenizers: Path
) -> None:
    path = build_tiny_model(
        tmp_path / "q3",
        tokenizer=shared_tokenizer("qwen3"),
        spec=TinyModelSpec(tie_word_embeddings=True),
    )
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load(path)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [
        9707,
        1879,
    ]  # real Qwen ids
    assert model.config.vocab_size >= len(tok) == 151669


def test_tiny_model_with_the_packaged_qwen3_tokenizer(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "pkg", tokenizer="qwen3", spec=TinyModelSpec(num_layers=1))
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.convert_tokens_to_ids("<think>") == 151667
    load(path)


def test_tiny_model_with_the_llama_tokenizer(tmp_path: Path, shared_tokenizers: Path) -> None:
    path = build_tiny_model(
        tmp_path / "llama", tokenizer=shared_tokenizer("llama3"), spec=TinyModelSpec(num_layers=1)
    )
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|begin_of_text|>")
    assert json.loads((path / "config.json").read_text())[
        "bos_token_id"
    ] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    load(path)


def test_tiny_model_rejects_a_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"must contain tokenizer\.json"):
        build_tiny_model(tmp_path / "x", tokenizer=tmp_path)


def test_tiny_model_rejects_bad_head_layout(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        build_tiny_model(tmp_path / "x", spec=TinyModelSpec(num_heads=3, num_kv_heads=2))
