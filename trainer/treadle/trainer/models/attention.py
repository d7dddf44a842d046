"""Attention over packed documents: which TorchTitan inner attention a model uses, and
the masks that keep tokens from attending across document boundaries.

Shape legend: B = batch (micro-batches, 1 here), L = tokens per micro-batch (seq_len),
N = heads, H = head dim.

Backends:
- ``sdpa``: ``BlockCausalSDPA`` below, ``F.scaled_dot_product_attention`` with an explicit
  boolean block-causal mask built from position ids (a document starts where the
  position is 0). Runs forward and backward on CPU; memory is O(L^2) per micro-batch.
- ``flex`` / ``varlen``: TorchTitan's kernels (FlexAttention with a block mask,
  flash varlen with cu_seqlens), built by ``Decoder.get_attention_masks`` from the same
  positions. GPU only (their backward fails on CPU).

Not here: the model layers themselves (TorchTitan's GQAttention calls the inner
attention chosen here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module

AttentionBackend = Literal["sdpa", "flex", "varlen"]


def block_causal_mask(positions_BL: torch.Tensor) -> torch.Tensor:
    """Boolean mask [B, 1, L, L]: True where query i may attend key j — j <= i and both in
    the same document (documents start where ``positions_BL`` is 0; padding positions are
    0 too, so each padding token is a document of one)."""
    doc_BL = torch.cumsum((positions_BL == 0).to(torch.int32), dim=1)
    same_doc_BLL = doc_BL[:, :, None] == doc_BL[:, None, :]
    L = positions_BL.shape[1]
    causal_LL = torch.ones(L, L, dtype=torch.bool, device=positions_BL.device).tril()
    return (same_doc_BLL & causal_LL)[:, None, :, :]


class BlockCausalSDPA(Module):
    """Inner attention: SDPA with an explicit block-causal mask (``block_causal_mask``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__()

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: torch.Tensor,
        scale: float | None = None,
        enable_gqa: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, torch.Tensor) or attention_masks.dtype != torch.bool:
            raise TypeError("BlockCausalSDPA needs the boolean mask of block_causal_mask()")
        out_BNLH = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            attn_mask=attention_masks,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        return out_BNLH.transpose(1, 2)


def inner_attention_config(backend: AttentionBackend) -> Module.Config:
    """The TorchTitan inner-attention config of ``backend``."""
    if backend == "sdpa":
        return BlockCausalSDPA.Config()
    if backend == "flex":
        return FlexAttention.Config()
    if backend == "varlen":
        return VarlenAttention.Config()
    raise ValueError(f"unknown attention backend {backend!r}: use sdpa, flex or varlen")


def resolve_backend(requested: str, device: torch.device) -> AttentionBackend:
    """``auto`` -> flex on CUDA, sdpa elsewhere; explicit choices are checked."""
    if requested == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if requested in ("flex", "varlen") and device.type != "cuda":
        raise ValueError(
            f"trainer.attention = {requested!r} needs a CUDA device (its backward fails on "
            f"{device.type}); use 'sdpa' or 'auto'"
        )
    if requested not in ("sdpa", "flex", "varlen"):
        raise ValueError(f"unknown attention backend {requested!r}")
    return requested  # type: ignore[return-value]


def attention_masks(model: Any, backend: AttentionBackend, positions_BL: torch.Tensor) -> Any:
    """The ``attention_masks`` argument of the model's forward for ``positions_BL``."""
    if backend == "sdpa":
        return block_causal_mask(positions_BL)
    return model.get_attention_masks(positions_BL)
