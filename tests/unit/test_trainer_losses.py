"""Trainer losses against hand-computed values (see treadle.trainer.losses)."""

from __future__ import annotations

import math

import pytest
import torch

from treadle.trainer.losses import token_losses
from treadle.trainer.spec import LossSection

# three tokens: a prompt token (mask 0) and two sampled tokens
LP = torch.tensor([[-9.0, math.log(0.5), math.log(0.2)]], requires_grad=True)
LP_B = torch.tensor([[0.0, math.log(0.4), math.log(0.25)]])
ADV = torch.tensor([[0.0, 2.0, -1.0]])
MASK = torch.tensor([[0, 1, 1]], dtype=torch.uint8)


def leaf() -> torch.Tensor:
    return LP.detach().clone().requires_grad_(True)


def test_losses_pg_ratio_penalty_and_gradient() -> None:
    lp = leaf()
    terms = token_losses(LossSection(kind="pg", log_ratio_coef=0.1), lp, LP_B, ADV, MASK)
    r1, r2 = 0.5 / 0.4, 0.2 / 0.25  # 1.25, 0.8
    l1 = -r1 * 2.0 + 0.1 * math.log(r1) ** 2
    l2 = -r2 * -1.0 + 0.1 * math.log(r2) ** 2
    assert terms.loss_sum.item() == pytest.approx(l1 + l2, rel=1e-6)
    assert terms.num_masked.item() == 0
    assert terms.ratio_sum.item() == pytest.approx(r1 + r2, rel=1e-6)
    terms.loss_sum.backward()
    assert lp.grad is not None
    # d/dlp (-r A + c log r^2) = -r A + 2 c log r
    expected = [0.0, -r1 * 2.0 + 0.2 * math.log(r1), r2 + 0.2 * math.log(r2)]
    assert lp.grad[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_losses_pg_masks_tokens_whose_probabilities_diverge() -> None:
    lp = leaf()
    # mask_ratio 1.24: token 1 (ratio 1.25) diverges, token 2 (ratio 0.8 = 1/1.25) too
    terms = token_losses(LossSection(kind="pg", mask_ratio=1.24), lp, LP_B, ADV, MASK)
    assert terms.num_masked.item() == 2
    assert terms.loss_sum.item() == 0.0
    terms = token_losses(
        LossSection(kind="pg", mask_ratio=1.26, log_ratio_coef=0.0), lp, LP_B, ADV, MASK
    )
    assert terms.num_masked.item() == 0
    assert terms.loss_sum.item() == pytest.approx(-1.25 * 2.0 + 0.8, rel=1e-6)


def test_losses_pg_masked_token_with_huge_ratio_stays_finite() -> None:
    lp = torch.tensor([[0.0, -0.1]], requires_grad=True)
    lp_b = torch.tensor([[0.0, -200.0]])  # ratio exp(199.9) would overflow float32
    terms = token_losses(
        LossSection(kind="pg"), lp, lp_b, torch.tensor([[0.0, 1.0]]), torch.tensor([[0, 1]])
    )
    terms.loss_sum.backward()
    assert terms.num_masked.item() == 1
    assert terms.loss_sum.item() == 0.0
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all()


def test_losses_ppo_clips_the_ratio() -> None:
    lp = leaf()
    terms = token_losses(LossSection(kind="ppo", clip_eps=0.1), lp, LP_B, ADV, MASK)
    # token 1: r=1.25, A=2 -> min(2.5, 1.1*2=2.2) = 2.2 (clipped)
    # token 2: r=0.8, A=-1 -> min(-0.8, 0.9*-1=-0.9) = -0.9 (clipped)
    assert terms.loss_sum.item() == pytest.approx(-(2.2) + 0.9, rel=1e-6)
    assert terms.num_clipped.item() == 2
    terms.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad.abs().sum().item() == 0.0  # both clipped: no gradient


def test_losses_ppo_unclipped_gradient_is_ratio_times_advantage() -> None:
    lp = leaf()
    terms = token_losses(LossSection(kind="ppo", clip_eps=0.5), lp, LP_B, ADV, MASK)
    assert terms.loss_sum.item() == pytest.approx(-(1.25 * 2.0) - (0.8 * 1.0) * -1, rel=1e-6)
    terms.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, -2.5, 0.8], rel=1e-5)


def test_losses_sft_is_cross_entropy_on_loss_tokens() -> None:
    lp = leaf()
    terms = token_losses(LossSection(kind="sft"), lp, LP_B, ADV, MASK)
    assert terms.loss_sum.item() == pytest.approx(-(math.log(0.5) + math.log(0.2)), rel=1e-6)
    terms.loss_sum.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == [0.0, -1.0, -1.0]
