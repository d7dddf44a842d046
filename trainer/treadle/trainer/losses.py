"""Per-token losses over packed tensors, selected by ``[trainer.loss] kind``.

The trainer knows nothing of the algorithm that produced the advantages (GRPO, RLOO,
SFT, a plug-in...): a loss reads only the trainer's log-probabilities of the packed
tokens and the batch's ``loss_mask``, ``advantages`` and ``behaviour_logprobs`` (plus,
when asked for, each token's document, the reference policy's log-probabilities and a
teacher's top-k).
Shape legend: B = micro-batches in one forward, L = tokens per micro-batch. Notation per
loss token t: ``lp`` = trainer logprob, ``lp_b`` = behaviour (sampling) logprob,
``lp_ref`` = reference logprob, ``A`` = advantage, ``r = exp(lp - lp_b)`` the importance
ratio (its gradient flows through ``lp`` only), ``sg`` = stop-gradient.

Kinds (each registers itself in ``KINDS``):

- ``pg`` (default): ``ℓ = -r·A + c·(lp - lp_b)²``, counted only where the two
  probabilities agree within ``mask_ratio``: ``1/mask_ratio <= r <= mask_ratio``; other
  loss tokens are masked (ℓ = 0) and counted in ``num_masked``. ``c`` =
  ``log_ratio_coef``.
- ``tis``: truncated importance sampling, ``ℓ = -sg(min(r, C)/r)·r·A``: its value is
  ``-min(r, C)·A`` and its gradient ``-min(r, C)·A·∇lp`` (the policy gradient with the
  importance weight capped at ``C`` = ``tis_cap``); tokens with ``r > C`` are counted
  in ``num_truncated``. Nothing is masked.
- ``ppo``: clipped surrogate ``ℓ = -min(r·A, clip(r, 1-ε, 1+ε)·A)``, ε = ``clip_eps``.
- ``sft``: cross-entropy ``ℓ = -lp``.

Corrections that combine with any kind but ``sft``:

- ``sequence_mask = "geometric" | "mean"``: a document (one sample) whose ratio --
  ``exp(mean(lp - lp_b))`` or ``mean(r)`` over its loss tokens -- falls outside
  ``[1/sequence_mask_ratio, sequence_mask_ratio]`` is masked whole (ℓ = 0 on each of its
  tokens, counted in ``num_seq_masked`` and ``num_masked``).

and with every kind:

- ``kl_coef = β > 0``: a penalty ``β·k3`` per loss token that is not masked, with the
  k3 estimator of KL(trainer || reference) ``k3 = exp(lp_ref - lp) - (lp_ref - lp) - 1``
  (>= 0; gradient through ``lp``). The reference is a frozen copy of the initial weights
  the trainer holds (``trainer.loss.reference_model``). ``kl_ref_sum`` = Σ k3 over loss
  tokens (no gradient), for the ``kl_ref`` metric.

Tokens that were not sampled: a loss token whose policy version is -1 in an RL batch (a
demonstration, ``[orchestrator.demos]``) has no behaviour logprob, so no importance ratio:
the ``pg``/``tis``/``ppo`` term, the sequence mask, the KL penalty and the ratio
statistics skip it (``sampled_BL``), and it trains through the teacher term alone -- its
one-hot "top-k" makes that term the cross-entropy ``-lp`` of the demonstrated token.
``num_policy`` counts the tokens the kind's term applies to (every loss token for
``sft``).

and, when the batch carries a teacher's top-k (top-k distillation, orchestrator algorithm
``distill-topk``): a term ``w·KL(q || p)`` per loss token with weight ``w > 0``, where q is
the teacher's distribution over its k most likely tokens there, renormalized, and p the
trainer's untempered logprobs of the same ids (not renormalized: the term is
``Σ_j q_j (log q_j - log p_j) >= 0``, 0 only when the student puts all its mass on those k
tokens in the teacher's proportions). Its gradient moves the whole distribution, not only
the sampled token's logprob. ``teacher_kl_sum`` = Σ KL over those tokens (no gradient).

Normalisation: per token over the GLOBAL batch. The step's loss is
``Σ_t ℓ_t / N`` where the sum runs over every loss token of every micro-batch on every
rank and ``N`` is their count (``BatchReady.num_loss_tokens``); masked tokens contribute
0 but stay in ``N``, so a micro-batch's contribution does not depend on the others.
This module returns the SUM of ℓ over one micro-batch; the trainer divides by ``N``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from treadle.trainer.spec import LossSection


def _zero() -> torch.Tensor:
    return torch.zeros(())


@dataclass(frozen=True)
class LossTerms:
    """One micro-batch's loss terms. Sums run over its loss tokens."""

    loss_sum: torch.Tensor  # scalar, Σ ℓ_t (with gradient)
    num_masked: torch.Tensor  # scalar, loss tokens masked (pg ratio band, sequence mask)
    ratio_sum: torch.Tensor  # scalar, Σ r_t (no gradient)
    num_clipped: torch.Tensor  # scalar, ppo: tokens where the clipped term was chosen
    num_truncated: torch.Tensor = field(default_factory=_zero)  # tis: tokens with r > C
    num_seq_masked: torch.Tensor = field(default_factory=_zero)  # tokens of masked documents
    kl_ref_sum: torch.Tensor = field(default_factory=_zero)  # Σ k3 to the reference (no grad)
    teacher_kl_sum: torch.Tensor = field(default_factory=_zero)  # Σ top-k KL (no grad)
    num_teacher: torch.Tensor = field(default_factory=_zero)  # tokens with the top-k term
    num_policy: torch.Tensor = field(default_factory=_zero)  # tokens with the kind's term


@dataclass(frozen=True)
class TeacherTopK:
    """The top-k distillation term's inputs (all [B, L, K] but the weights, [B, L])."""

    student_BLK: torch.Tensor  # the student's logprobs of the teacher's top-k ids (grad)
    teacher_BLK: torch.Tensor  # the teacher's logprobs of them
    weight_BL: torch.Tensor  # w per token, 0 where the term does not apply


@dataclass(frozen=True)
class _Tokens:
    """What a kind reads (all [B, L]); ``keep_BL``: loss tokens not masked so far."""

    logprobs_BL: torch.Tensor
    log_ratio_BL: torch.Tensor  # lp - lp_b on loss tokens, 0 elsewhere (with gradient)
    advantages_BL: torch.Tensor
    keep_BL: torch.Tensor


@dataclass(frozen=True)
class _Surrogate:
    loss_BL: torch.Tensor  # ℓ per token, 0 off ``keep_BL``
    keep_BL: torch.Tensor  # tokens that count (the kind may mask more)
    num_clipped: torch.Tensor | None = None
    num_truncated: torch.Tensor | None = None


KindFn = Callable[[LossSection, _Tokens], _Surrogate]
KINDS: dict[str, KindFn] = {}


def _kind(name: str) -> Callable[[KindFn], KindFn]:
    def register(fn: KindFn) -> KindFn:
        KINDS[name] = fn
        return fn

    return register


@_kind("sft")
def _sft(cfg: LossSection, t: _Tokens) -> _Surrogate:
    return _Surrogate(torch.where(t.keep_BL, -t.logprobs_BL, 0.0), t.keep_BL)


@_kind("pg")
def _pg(cfg: LossSection, t: _Tokens) -> _Surrogate:
    bound = math.log(cfg.mask_ratio)
    keep_BL = t.keep_BL & (t.log_ratio_BL.detach().abs() <= bound)
    kept_log_ratio_BL = torch.where(keep_BL, t.log_ratio_BL, 0.0)
    loss_BL = (
        -kept_log_ratio_BL.exp() * t.advantages_BL + cfg.log_ratio_coef * kept_log_ratio_BL.square()
    )
    return _Surrogate(torch.where(keep_BL, loss_BL, 0.0), keep_BL)


@_kind("tis")
def _tis(cfg: LossSection, t: _Tokens) -> _Surrogate:
    log_cap = math.log(cfg.tis_cap)
    lr_BL = t.log_ratio_BL
    weight_BL = lr_BL.detach().clamp(max=log_cap).exp()  # min(r, C), no gradient
    # exp(lr - sg(lr)) is 1 with gradient ∇lp: value -min(r, C)·A, gradient -min(r, C)·A·∇lp
    # (sg(min(r, C)/r)·r written so that a huge r never becomes inf·0)
    loss_BL = torch.where(
        t.keep_BL, -weight_BL * (lr_BL - lr_BL.detach()).exp() * t.advantages_BL, 0.0
    )
    truncated = (t.keep_BL & (lr_BL.detach() > log_cap)).sum().to(torch.float32)
    return _Surrogate(loss_BL, t.keep_BL, num_truncated=truncated)


@_kind("ppo")
def _ppo(cfg: LossSection, t: _Tokens) -> _Surrogate:
    ratio_BL = t.log_ratio_BL.exp()
    unclipped_BL = ratio_BL * t.advantages_BL
    clipped_BL = ratio_BL.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * t.advantages_BL
    surrogate_BL = torch.minimum(unclipped_BL, clipped_BL)
    loss_BL = torch.where(t.keep_BL, -surrogate_BL, 0.0)
    num_clipped = (t.keep_BL & (clipped_BL < unclipped_BL)).sum().to(torch.float32)
    return _Surrogate(loss_BL, t.keep_BL, num_clipped=num_clipped)


def document_ids(cu_seqlens_D1: npt.NDArray[np.int32], num_tokens: int) -> npt.NDArray[np.int64]:
    """[L] index of the document each token belongs to (-1 on padding)."""
    cu = np.asarray(cu_seqlens_D1, dtype=np.int64)
    out = np.full(num_tokens, -1, dtype=np.int64)
    if cu.size > 1:
        out[: cu[-1]] = np.repeat(np.arange(cu.size - 1), np.diff(cu))
    return out


def sequence_keep(
    cfg: LossSection, log_ratio_BL: torch.Tensor, mask_BL: torch.Tensor, doc_ids_BL: torch.Tensor
) -> torch.Tensor:
    """[B, L] bool: False on every token of a document whose sequence ratio (the
    geometric or arithmetic mean over its loss tokens) is outside the band."""
    doc_BL = doc_ids_BL.clamp(min=0).long()
    num_docs = int(doc_BL.max()) + 1 if doc_BL.numel() else 1
    lr_BL = log_ratio_BL.detach().to(torch.float64)
    value_BL = lr_BL if cfg.sequence_mask == "geometric" else lr_BL.exp()
    on_BL = mask_BL & (doc_ids_BL >= 0)
    zeros_BD = torch.zeros(doc_BL.shape[0], num_docs, dtype=torch.float64, device=doc_BL.device)
    sums_BD = zeros_BD.scatter_add(1, doc_BL, torch.where(on_BL, value_BL, 0.0))
    counts_BD = zeros_BD.scatter_add(1, doc_BL, on_BL.to(torch.float64))
    mean_BD = sums_BD / counts_BD.clamp(min=1.0)
    ratio_BD = mean_BD.exp() if cfg.sequence_mask == "geometric" else mean_BD
    bound = cfg.sequence_mask_ratio
    ok_BD = (ratio_BD >= 1.0 / bound) & (ratio_BD <= bound)  # moot where a doc has no loss token
    return ok_BD.gather(1, doc_BL)


def token_losses(
    cfg: LossSection,
    logprobs_BL: torch.Tensor,
    behaviour_logprobs_BL: torch.Tensor,
    advantages_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    *,
    doc_ids_BL: torch.Tensor | None = None,
    reference_logprobs_BL: torch.Tensor | None = None,
    teacher: TeacherTopK | None = None,
    sampled_BL: torch.Tensor | None = None,
) -> LossTerms:
    """The loss terms of ``cfg.kind`` with ``cfg``'s corrections (module docstring).
    ``doc_ids_BL`` (document of each token, -1 on padding) is needed by the sequence
    mask, ``reference_logprobs_BL`` by the KL penalty; ``sampled_BL`` (bool, the tokens the
    behaviour policy drew) keeps every other loss token out of all but ``sft`` and the
    teacher term (None: every loss token was sampled)."""
    if cfg.kind not in KINDS:
        raise ValueError(f"unknown loss kind {cfg.kind!r}; known: {', '.join(sorted(KINDS))}")
    mask_BL = loss_mask_BL.bool()
    # the tokens the kind's term applies to (a demonstration has no behaviour logprob)
    policy_BL = mask_BL if sampled_BL is None or cfg.kind == "sft" else mask_BL & sampled_BL
    zero = torch.zeros((), dtype=torch.float32, device=logprobs_BL.device)
    # 0 off those tokens, so exp() never sees values from unrelated positions
    log_ratio_BL = torch.where(policy_BL, logprobs_BL - behaviour_logprobs_BL, zero)
    with torch.no_grad():
        ratio_sum = torch.where(policy_BL, log_ratio_BL.detach().exp(), zero).sum()
    keep_BL = policy_BL
    num_seq_masked = zero
    if cfg.sequence_mask != "off" and cfg.kind != "sft":
        if doc_ids_BL is None:
            raise ValueError("trainer.loss.sequence_mask needs each token's document (doc_ids_BL)")
        keep_BL = policy_BL & sequence_keep(cfg, log_ratio_BL, policy_BL, doc_ids_BL)
        num_seq_masked = (policy_BL & ~keep_BL).sum().to(torch.float32)
    out = KINDS[cfg.kind](cfg, _Tokens(logprobs_BL, log_ratio_BL, advantages_BL, keep_BL))
    loss_BL = out.loss_BL
    kl_ref_sum = zero
    if cfg.kl_coef > 0:
        if reference_logprobs_BL is None:
            raise ValueError("trainer.loss.kl_coef > 0 needs the reference logprobs")
        d_BL = torch.where(policy_BL, reference_logprobs_BL - logprobs_BL, zero)
        k3_BL = d_BL.exp() - d_BL - 1.0
        loss_BL = loss_BL + cfg.kl_coef * torch.where(out.keep_BL, k3_BL, zero)
        kl_ref_sum = torch.where(policy_BL, k3_BL.detach(), zero).sum()
    teacher_kl_sum, num_teacher = zero, zero
    if teacher is not None:
        on_BL = mask_BL & (teacher.weight_BL > 0)
        log_q_BLK = torch.log_softmax(teacher.teacher_BLK, dim=-1)  # renormalized over K
        kl_BL = (log_q_BLK.exp() * (log_q_BLK - teacher.student_BLK)).sum(-1)
        loss_BL = loss_BL + torch.where(on_BL, teacher.weight_BL * kl_BL, zero)
        teacher_kl_sum = torch.where(on_BL, kl_BL.detach(), zero).sum()
        num_teacher = on_BL.sum().to(torch.float32)
    return LossTerms(
        loss_sum=loss_BL.sum(),
        num_masked=(policy_BL & ~out.keep_BL).sum().to(torch.float32),
        ratio_sum=ratio_sum,
        num_clipped=out.num_clipped if out.num_clipped is not None else zero,
        num_truncated=out.num_truncated if out.num_truncated is not None else zero,
        num_seq_masked=num_seq_masked,
        kl_ref_sum=kl_ref_sum,
        teacher_kl_sum=teacher_kl_sum,
        num_teacher=num_teacher,
        num_policy=policy_BL.sum().to(torch.float32),
    )
