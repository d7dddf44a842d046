"""Trainer losses against hand-computed values and gradients (see treadle.trainer.losses)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from treadle.trainer.losses import document_ids, token_losses
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


def previous_pg(
    cfg: LossSection, lp: torch.Tensor, lp_b: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pg loss as it was before the losses became a registry (reference)."""
    mask_BL = mask.bool()
    zero = torch.zeros(())
    log_ratio = torch.where(mask_BL, lp - lp_b, zero)
    keep = mask_BL & (log_ratio.detach().abs() <= math.log(cfg.mask_ratio))
    kept = torch.where(keep, log_ratio, zero)
    loss = -kept.exp() * adv + cfg.log_ratio_coef * kept.square()
    return torch.where(keep, loss, zero).sum(), (mask_BL & ~keep).sum().to(torch.float32)  # fmt: skip


def test_losses_pg_equals_the_previous_formula_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    lp_b = -torch.rand(2, 64, generator=g) * 4
    lp0 = lp_b + torch.randn(2, 64, generator=g) * 0.5  # some ratios leave the band
    adv = torch.randn(2, 64, generator=g)
    mask = (torch.rand(2, 64, generator=g) > 0.3).to(torch.uint8)
    cfg = LossSection(kind="pg", log_ratio_coef=0.05)
    lp_new, lp_old = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    terms = token_losses(cfg, lp_new, lp_b, adv, mask)
    old_loss, old_masked = previous_pg(cfg, lp_old, lp_b, adv, mask)
    assert 0 < old_masked.item() < mask.sum().item()
    assert torch.equal(terms.loss_sum, old_loss)
    assert torch.equal(terms.num_masked, old_masked)
    terms.loss_sum.backward()
    old_loss.backward()
    assert lp_new.grad is not None
    assert lp_old.grad is not None
    assert torch.equal(lp_new.grad, lp_old.grad)


def test_losses_tis_truncates_the_importance_weight_value_and_gradient() -> None:
    # r1 = 1.25 > cap 1.2: weight 1.2; r2 = 0.8: weight 0.8
    lp = leaf()
    terms = token_losses(LossSection(kind="tis", tis_cap=1.2), lp, LP_B, ADV, MASK)
    assert terms.loss_sum.item() == pytest.approx(-1.2 * 2.0 - 0.8 * -1.0, rel=1e-6)
    assert terms.num_truncated.item() == 1
    assert terms.num_masked.item() == 0
    terms.loss_sum.backward()
    assert lp.grad is not None
    # d/dlp = -min(r, C)·A: the truncated token's gradient does not grow with its ratio
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.2 * 2.0, 0.8], rel=1e-5)
    lp = leaf()  # a cap above every ratio: the importance-weighted policy gradient
    terms = token_losses(LossSection(kind="tis", tis_cap=2.0), lp, LP_B, ADV, MASK)
    terms.loss_sum.backward()
    assert terms.num_truncated.item() == 0
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, -1.25 * 2.0, 0.8], rel=1e-5)


def test_losses_tis_huge_ratio_is_capped_and_finite() -> None:
    lp = torch.tensor([[0.0, -0.1]], requires_grad=True)
    lp_b = torch.tensor([[0.0, -200.0]])  # ratio exp(199.9) would overflow float32
    terms = token_losses(
        LossSection(kind="tis", tis_cap=3.0), lp, lp_b, torch.tensor([[0.0, 1.0]]),
        torch.tensor([[0, 1]]),
    )  # fmt: skip
    terms.loss_sum.backward()
    assert terms.loss_sum.item() == pytest.approx(-3.0)
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([0.0, -3.0])


# two documents of 3 tokens each (first token of each is a prompt token)
DOCS = torch.tensor([[0, 0, 0, 1, 1, 1, -1]])  # -1: padding
MASK2 = torch.tensor([[0, 1, 1, 0, 1, 1, 0]], dtype=torch.uint8)
ADV2 = torch.tensor([[0.0, 1.0, 1.0, 0.0, -1.0, 2.0, 0.0]])
LP_B2 = torch.full((1, 7), -2.0)


def lp_with_ratios(ratios: list[float]) -> torch.Tensor:
    return (LP_B2 + torch.tensor([ratios]).log()).requires_grad_(True)


@pytest.mark.parametrize(
    ("mode", "ratios", "masked_doc"),
    [
        # doc 1: r = 3 and 2, geometric mean sqrt(6) = 2.45 > 2: masked whole
        ("geometric", [1, 1.25, 0.8, 1, 3.0, 2.0, 1], 1),
        # doc 1: r = 3.5 and 0.5: geometric sqrt(1.75) = 1.32 kept, mean 2.0 > 1.9 masked
        ("geometric", [1, 1.25, 0.8, 1, 3.5, 0.5, 1], None),
        ("mean", [1, 1.25, 0.8, 1, 3.5, 0.5, 1], 1),
        # doc 0: r = 0.5 and 0.5, both means 0.5 < 1/1.9
        ("mean", [1, 0.5, 0.5, 1, 1.0, 1.0, 1], 0),
    ],
)
def test_losses_sequence_mask_masks_whole_documents(
    mode: str, ratios: list[float], masked_doc: int | None
) -> None:
    cfg = LossSection(kind="pg", mask_ratio=10.0, log_ratio_coef=0.0, sequence_mask=mode,
                      sequence_mask_ratio=1.9)  # fmt: skip
    lp = lp_with_ratios(ratios)
    terms = token_losses(cfg, lp, LP_B2, ADV2, MASK2, doc_ids_BL=DOCS)
    r = torch.tensor(ratios)
    kept = MASK2[0].bool() & (DOCS[0] != masked_doc)
    assert terms.loss_sum.item() == pytest.approx(float(-(r * ADV2[0])[kept].sum()), rel=1e-5)
    assert terms.num_seq_masked.item() == (0 if masked_doc is None else 2)
    assert terms.num_masked.item() == terms.num_seq_masked.item()
    terms.loss_sum.backward()
    assert lp.grad is not None
    expected = torch.where(kept, -r * ADV2[0], 0.0)
    assert lp.grad[0].tolist() == pytest.approx(expected.tolist(), rel=1e-5)


def test_losses_sequence_mask_combines_with_tis_and_ppo() -> None:
    ratios = [1, 1.25, 0.8, 1, 3.0, 2.0, 1]  # doc 1 masked (geometric 2.45 > 2)
    for kind in ("tis", "ppo"):
        lp = lp_with_ratios(ratios)
        cfg = LossSection(kind=kind, sequence_mask="geometric", tis_cap=5.0, clip_eps=0.5)
        terms = token_losses(cfg, lp, LP_B2, ADV2, MASK2, doc_ids_BL=DOCS)
        terms.loss_sum.backward()
        assert terms.num_seq_masked.item() == 2, kind
        assert lp.grad is not None
        assert lp.grad[0, 4:].abs().sum().item() == 0.0, kind  # nothing from doc 1
        assert lp.grad[0, 1:3].abs().sum().item() > 0.0, kind


def test_losses_sequence_mask_needs_document_ids() -> None:
    with pytest.raises(ValueError, match="needs each token's document"):
        token_losses(LossSection(sequence_mask="mean"), leaf(), LP_B, ADV, MASK)


def test_losses_kl_penalty_to_the_reference_value_and_gradient() -> None:
    lp = leaf()
    lp_ref = torch.tensor([[5.0, math.log(0.4), math.log(0.4)]])  # token 0 is not a loss token
    beta = 0.5
    terms = token_losses(
        LossSection(kind="sft", kl_coef=beta), lp, LP_B, ADV, MASK, reference_logprobs_BL=lp_ref
    )
    d1, d2 = math.log(0.4 / 0.5), math.log(0.4 / 0.2)  # lp_ref - lp
    k1, k2 = math.exp(d1) - d1 - 1, math.exp(d2) - d2 - 1
    ce = -(math.log(0.5) + math.log(0.2))
    assert terms.loss_sum.item() == pytest.approx(ce + beta * (k1 + k2), rel=1e-6)
    assert terms.kl_ref_sum.item() == pytest.approx(k1 + k2, rel=1e-6)
    terms.loss_sum.backward()
    assert lp.grad is not None
    # d/dlp [-lp + β(e^d - d - 1)], d = lp_ref - lp: -1 + β(1 - e^d)
    expected = [0.0, -1 + beta * (1 - 0.8), -1 + beta * (1 - 2.0)]
    assert lp.grad[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_losses_kl_penalty_is_zero_at_the_reference_and_skips_masked_tokens() -> None:
    lp = leaf()
    terms = token_losses(LossSection(kind="pg", kl_coef=1.0, log_ratio_coef=0.0), lp, LP_B,
                         ADV, MASK, reference_logprobs_BL=LP.detach())  # fmt: skip
    assert terms.kl_ref_sum.item() == 0.0
    assert terms.loss_sum.item() == pytest.approx(-1.25 * 2.0 + 0.8, rel=1e-6)
    # token 1 masked by the pg band: no penalty there, but it is still measured
    lp = leaf()
    lp_ref = torch.tensor([[0.0, math.log(0.25), math.log(0.2)]])
    terms = token_losses(LossSection(kind="pg", mask_ratio=1.24, kl_coef=1.0), lp, LP_B, ADV,
                         MASK, reference_logprobs_BL=lp_ref)  # fmt: skip
    d1 = math.log(0.25 / 0.5)
    assert terms.loss_sum.item() == 0.0  # both tokens masked
    assert terms.kl_ref_sum.item() == pytest.approx(math.exp(d1) - d1 - 1, rel=1e-6)
    with pytest.raises(ValueError, match="needs the reference logprobs"):
        token_losses(LossSection(kl_coef=0.1), leaf(), LP_B, ADV, MASK)


def test_losses_config_refuses_settings_that_would_be_ignored() -> None:
    with pytest.raises(ValueError, match="sft' has none: set sequence_mask = 'off'"):
        LossSection(kind="sft", sequence_mask="geometric")
    with pytest.raises(ValueError, match=r"reference_model is set but trainer\.loss\.kl_coef is 0"):
        LossSection(reference_model="x")  # type: ignore[arg-type]


def test_losses_document_ids_from_cu_seqlens() -> None:
    ids = document_ids(np.array([0, 3, 5], np.int32), 8)
    assert ids.tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    assert document_ids(np.array([0], np.int32), 2).tolist() == [-1, -1]
