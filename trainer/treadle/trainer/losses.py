"""Per-token losses over packed tensors, selected by ``[trainer.loss] kind``.

The trainer knows nothing of the algorithm that produced the advantages (GRPO, RLOO,
SFT...): a loss reads only the trainer's log-probabilities of the packed tokens and the
batch's ``loss_mask``, ``advantages`` and ``behaviour_logprobs``. Shape legend:
B = micro-batches in one forward, L = tokens per micro-batch. Notation per loss token t:
``lp`` = trainer logprob, ``lp_b`` = behaviour (sampling) logprob, ``A`` = advantage,
``r = exp(lp - lp_b)`` the importance ratio (its gradient flows through ``lp`` only).

- ``pg`` (default): ``ℓ = -r·A + c·(lp - lp_b)²``, counted only where the two
  probabilities agree within ``mask_ratio``: ``1/mask_ratio <= r <= mask_ratio``; other
  loss tokens are masked (ℓ = 0) and counted in ``num_masked``. ``c`` =
  ``log_ratio_coef``.
- ``ppo``: clipped surrogate ``ℓ = -min(r·A, clip(r, 1-ε, 1+ε)·A)``, ε = ``clip_eps``.
- ``sft``: cross-entropy ``ℓ = -lp``.

Normalisation: per token over the GLOBAL batch. The step's loss is
``Σ_t ℓ_t / N`` where the sum runs over every loss token of every micro-batch on every
rank and ``N`` is their count (``BatchReady.num_loss_tokens``); masked tokens contribute
0 but stay in ``N``, so a micro-batch's contribution does not depend on the others.
This module returns the SUM of ℓ over one micro-batch; the trainer divides by ``N``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from treadle.trainer.spec import LossSection


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss terms. Sums run over its loss tokens."""

    loss_sum: torch.Tensor  # scalar, Σ ℓ_t (with gradient)
    num_masked: torch.Tensor  # scalar, loss tokens excluded by the pg divergence mask
    ratio_sum: torch.Tensor  # scalar, Σ r_t (no gradient)
    num_clipped: torch.Tensor  # scalar, ppo: tokens where the clipped term was chosen


def token_losses(
    cfg: LossSection,
    logprobs_BL: torch.Tensor,
    behaviour_logprobs_BL: torch.Tensor,
    advantages_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
) -> LossTerms:
    """The loss terms of ``cfg.kind`` (see the module docstring)."""
    mask_BL = loss_mask_BL.bool()
    zero = torch.zeros((), dtype=torch.float32, device=logprobs_BL.device)
    # 0 off the loss tokens, so exp() never sees values from unrelated positions
    log_ratio_BL = torch.where(mask_BL, logprobs_BL - behaviour_logprobs_BL, zero)
    with torch.no_grad():
        ratio_sum = torch.where(mask_BL, log_ratio_BL.detach().exp(), zero).sum()
    if cfg.kind == "sft":
        loss_BL = torch.where(mask_BL, -logprobs_BL, zero)
        return LossTerms(loss_BL.sum(), zero, ratio_sum, zero)
    if cfg.kind == "pg":
        bound = math.log(cfg.mask_ratio)
        keep_BL = mask_BL & (log_ratio_BL.detach().abs() <= bound)
        kept_log_ratio_BL = torch.where(keep_BL, log_ratio_BL, zero)
        ratio_BL = kept_log_ratio_BL.exp()
        loss_BL = -ratio_BL * advantages_BL + cfg.log_ratio_coef * kept_log_ratio_BL.square()
        loss_BL = torch.where(keep_BL, loss_BL, zero)
        num_masked = (mask_BL & ~keep_BL).sum().to(torch.float32)
        return LossTerms(loss_BL.sum(), num_masked, ratio_sum, zero)
    if cfg.kind == "ppo":
        ratio_BL = log_ratio_BL.exp()
        unclipped_BL = ratio_BL * advantages_BL
        clipped_BL = ratio_BL.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * advantages_BL
        surrogate_BL = torch.minimum(unclipped_BL, clipped_BL)
        loss_BL = torch.where(mask_BL, -surrogate_BL, zero)
        num_clipped = (mask_BL & (clipped_BL < unclipped_BL)).sum().to(torch.float32)
        return LossTerms(loss_BL.sum(), zero, ratio_sum, num_clipped)
    raise ValueError(f"unknown loss kind {cfg.kind!r}")
