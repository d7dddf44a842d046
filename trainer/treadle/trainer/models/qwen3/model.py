"""Qwen3 (dense): the TorchTitan model config derived from a Hugging Face ``config.json``.

Same layers as TorchTitan's own Qwen3 flavors (GQA with per-head q/k RMSNorm, CosSin
RoPE, SwiGLU), sized and parameterised by the HF file instead of a named flavor.
Not here: MoE variants (``Qwen3MoeForCausalLM``) — refused with a clear error.
"""

from __future__ import annotations

from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock

from treadle.trainer.errors import ModelFolderError
from treadle.trainer.models.attention import AttentionBackend, inner_attention_config
from treadle.trainer.models.family import SKIP_INIT
from treadle.trainer.models.hf import HFModelConfig


def rope_theta(hf: HFModelConfig, default: float) -> float:
    """``rope_theta`` (top level, or inside ``rope_parameters`` in newer config files)."""
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or default)


def model_config(hf: HFModelConfig, attention: AttentionBackend) -> Qwen3Model.Config:
    """Qwen3Model.Config with the shapes and constants of ``hf``."""
    if hf.get("num_experts") or hf.get("num_experts_per_tok"):
        raise ModelFolderError(f"{hf.folder}: Qwen3 MoE models are not supported yet")
    if hf.get("attention_bias"):
        raise ModelFolderError(f"{hf.folder}: attention_bias = true is not a Qwen3 layout")
    if hf.get("rope_scaling"):
        raise ModelFolderError(
            f"{hf.folder}: rope_scaling {hf.get('rope_scaling')} is not supported"
        )
    dim = int(hf.require("hidden_size"))
    n_heads = int(hf.require("num_attention_heads"))
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab_size = hf.vocab_size
    eps = float(hf.get("rms_norm_eps") or 1e-6)
    rope = CosSinRoPE.Config(
        dim=head_dim,
        max_seq_len=int(hf.require("max_position_embeddings")),
        theta=rope_theta(hf, 1_000_000.0),
    )

    def norm(size: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=size, eps=eps)

    layers = [
        Qwen3TransformerBlock.Config(
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
                qk_norm=norm(head_dim),
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
    return Qwen3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        norm=norm(dim),
        enable_weight_tying=bool(hf.get("tie_word_embeddings", False)),
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size),
        layers=layers,
    )
