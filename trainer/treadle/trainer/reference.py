"""What some losses read besides the batch: each token's document (the sequence mask)
and the reference policy's log-probabilities (the KL penalty).

The reference is the cheapest correct source the trainer has: a frozen copy of the
initial weights (``trainer.loss.reference_model``, default ``trainer.model``), built
like the policy (sharded the same way under several ranks), never updated, never
checkpointed (a resumed run rebuilds it from the same folder). It costs the memory of
one more model without gradients or optimizer state, and one more forward per
micro-batch, and exists only while ``trainer.loss.kl_coef > 0``.

Shape legend: B = 1 micro-batch per forward, L = tokens per micro-batch.

Not here: the loss formulas (``losses.py``).
"""

from __future__ import annotations

import logging

import torch

from treadle.trainer.batch import PackedMicroBatch
from treadle.trainer.distributed import Topology
from treadle.trainer.errors import ModelFolderError
from treadle.trainer.losses import document_ids
from treadle.trainer.models.hf import DTYPES
from treadle.trainer.policy import Policy, build_policy
from treadle.trainer.prefix import SharedPrefixes, scores
from treadle.trainer.spec import TrainerSection

log = logging.getLogger(__name__)


def build_reference(
    section: TrainerSection, policy: Policy, device: torch.device, topology: Topology
) -> Policy | None:
    """The frozen reference policy when the loss has a KL penalty, else None."""
    if section.loss.kl_coef == 0:
        return None
    folder = section.loss.reference_model or section.model
    assert folder is not None
    reference = build_policy(
        folder,
        family=section.family,
        attention=section.attention,
        device=device,
        dtype=DTYPES[section.dtype],
        topology=topology,
    )
    if reference.hf.vocab_size != policy.hf.vocab_size:
        raise ModelFolderError(
            f"trainer.loss.reference_model = {folder}: vocabulary of {reference.hf.vocab_size} "
            f"tokens, the policy's has {policy.hf.vocab_size} (the KL penalty compares the "
            "two on the same token ids: use a model with the policy's tokenizer)"
        )
    reference.model.eval()
    for p in reference.model.parameters():
        p.requires_grad_(False)
    log.info("[startup] KL reference: frozen copy of %s (kl_coef %g)", folder, section.loss.kl_coef)
    return reference


def loss_extras(
    section: TrainerSection,
    reference: Policy | None,
    mb: PackedMicroBatch,
    ids_BL: torch.Tensor,
    pos_BL: torch.Tensor,
    temperature: float,
    shared: SharedPrefixes | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword arguments of ``token_losses`` beyond the batch's arrays, for what
    ``section.loss`` asks for; the reference's forward on ``shared``'s compact row when
    given (as the policy's)."""
    extras: dict[str, torch.Tensor] = {}
    if section.loss.sequence_mask != "off":
        doc_L = document_ids(mb.cu_seqlens_D1, mb.num_tokens)
        extras["doc_ids_BL"] = torch.from_numpy(doc_L)[None].to(ids_BL.device)
    if reference is not None:
        with torch.no_grad():
            ref = scores(reference, ids_BL, pos_BL, shared, with_entropy=False,
                         temperature=temperature)  # fmt: skip
        extras["reference_logprobs_BL"] = ref.logprobs_BL.detach()
    return extras
