"""Llama 3 (3, 3.1, 3.2): the TorchTitan model config derived from a Hugging Face
``config.json``.

Same layers as TorchTitan's own Llama 3 flavors (GQA, complex RoPE with the "llama3"
frequency scaling, SwiGLU), sized and parameterised by the HF file.
Not here: other rope scalings (yarn, dynamic) — refused with a clear error.
"""

from __future__ import annotations

from torchtitan.models.common import ComplexRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.llama3 import Llama3Model
from torchtitan.models.llama3.model import Llama3TransformerBlock

from treadle.trainer.errors import ModelFolderError
from treadle.trainer.models.attention import AttentionBackend, inner_attention_config
from treadle.trainer.models.family import SKIP_INIT
from treadle.trainer.models.hf import HFModelConfig


def rope_config(hf: HFModelConfig, head_dim: int) -> ComplexRoPE.Config:
    """ComplexRoPE.Config of ``hf``: theta and, for Llama 3.1+, the "llama3" scaling."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or {
        k: v for k, v in params.items() if k != "rope_theta"
    }
    theta = float(hf.get("rope_theta") or params.get("rope_theta") or 500_000.0)
    max_seq_len = int(hf.require("max_position_embeddings"))
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return ComplexRoPE.Config(dim=head_dim, max_seq_len=max_seq_len, theta=theta)
    if kind != "llama3":
        raise ModelFolderError(f"{hf.folder}: rope scaling {kind!r} is not supported")
    return ComplexRoPE.Config(
        dim=head_dim,
        max_seq_len=max_seq_len,
        theta=theta,
        scaling="llama",
        scaling_factor=float(scaling.get("factor", 8.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def model_config(hf: HFModelConfig, attention: AttentionBackend) -> Llama3Model.Config:
    """Llama3Model.Config with the shapes and constants of ``hf``."""
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ModelFolderError(f"{hf.folder}: biases in attention/MLP are not a Llama 3 layout")
    dim = int(hf.require("hidden_size"))
    n_heads = int(hf.require("num_attention_heads"))
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab_size = hf.vocab_size
    eps = float(hf.get("rms_norm_eps") or 1e-5)
    rope = rope_config(hf, head_dim)

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=eps)

    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                wqkv_param_init=SKIP_INIT,
                wo_param_init=SKIP_INIT,
                inner_attention=inner_attention_config(attention),
                fuse_qkv=False,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=int(hf.require("intermediate_size")),
                w1_param_init=SKIP_INIT,
                w2w3_param_init=SKIP_INIT,
            ),
        )
        for _ in range(int(hf.require("num_hidden_layers")))
    ]
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size),
        layers=layers,
    )
