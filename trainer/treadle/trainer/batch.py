"""A step's packed micro-batches: decoded from the ``Batch`` protobuf and checked.

Shape legend: L = tokens per micro-batch (``MicroBatch.num_tokens`` = seq_len; after
``trimmed``, up to the last document), D = documents in a micro-batch.

``check_batch`` validates EVERY micro-batch of the step (not only this rank's), so all
ranks reach the same verdict on a bad batch without talking to each other.

Not here: fetching the payload (``trainer.py``), losses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from treadle.proto.v1 import batch_pb2
from treadle.services.codecs import to_array
from treadle.services.errors import DecodeError
from treadle.trainer.errors import BadBatchError


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch's per-token arrays (read-only numpy views of the protobuf bytes)."""

    rank: int
    index: int
    input_ids_L: npt.NDArray[np.int32]
    position_ids_L: npt.NDArray[np.int32]
    cu_seqlens_D1: npt.NDArray[np.int32]  # [D + 1]
    loss_mask_L: npt.NDArray[np.uint8]
    advantages_L: npt.NDArray[np.float32]
    behaviour_logprobs_L: npt.NDArray[np.float32]
    policy_versions_L: npt.NDArray[np.int32]
    # top-k distillation (all None when the batch carries none): the teacher's top-k
    # tokens and logprobs at each token, the weight of the trainer's term there
    teacher_ids_LK: npt.NDArray[np.int32] | None = None
    teacher_logprobs_LK: npt.NDArray[np.float32] | None = None
    teacher_weight_L: npt.NDArray[np.float32] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_L.size)

    @property
    def num_tokens_used(self) -> int:
        return int(self.cu_seqlens_D1[-1]) if self.cu_seqlens_D1.size else 0

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask_L.sum())

    def trimmed(self) -> PackedMicroBatch:
        """This micro-batch cut after its last document (one token kept when it holds
        none). The padding it drops is in no document (each padding token attends to
        itself alone) and off the loss mask, so every kept token's logprob and the
        gradients are those of the whole micro-batch; the model just does not compute
        the padding. Only for attention that takes any length (``sdpa``); a compiled
        kernel (flex, varlen) would see a new shape each step."""
        n = max(self.num_tokens_used, 1)
        if n >= self.num_tokens:
            return self
        return replace(
            self,
            input_ids_L=self.input_ids_L[:n],
            position_ids_L=self.position_ids_L[:n],
            loss_mask_L=self.loss_mask_L[:n],
            advantages_L=self.advantages_L[:n],
            behaviour_logprobs_L=self.behaviour_logprobs_L[:n],
            policy_versions_L=self.policy_versions_L[:n],
            teacher_ids_LK=None if self.teacher_ids_LK is None else self.teacher_ids_LK[:n],
            teacher_logprobs_LK=None
            if self.teacher_logprobs_LK is None
            else self.teacher_logprobs_LK[:n],
            teacher_weight_L=None if self.teacher_weight_L is None else self.teacher_weight_L[:n],
        )


def decode_micro_batch(mb: batch_pb2.MicroBatch, vocab_size: int) -> PackedMicroBatch:
    """Decode and check one MicroBatch; BadBatchError naming the field on any problem."""
    where = f"micro-batch (rank {mb.rank}, index {mb.index})"
    try:
        arrays = {
            "input_ids": to_array(mb.input_ids, field=f"{where}.input_ids", expect_dtype="int32"),
            "position_ids": to_array(
                mb.position_ids, field=f"{where}.position_ids", expect_dtype="int32"
            ),
            "loss_mask": to_array(mb.loss_mask, field=f"{where}.loss_mask", expect_dtype="uint8"),
            "advantages": to_array(
                mb.advantages, field=f"{where}.advantages", expect_dtype="float32"
            ),
            "behaviour_logprobs": to_array(
                mb.behaviour_logprobs, field=f"{where}.behaviour_logprobs", expect_dtype="float32"
            ),
            "policy_versions": to_array(
                mb.policy_versions, field=f"{where}.policy_versions", expect_dtype="int32"
            ),
        }
        cu = to_array(mb.cu_seqlens, field=f"{where}.cu_seqlens", expect_dtype="int32")
    except DecodeError as e:
        raise BadBatchError(str(e)) from None
    lengths = {name: int(a.size) for name, a in arrays.items()}
    if len(set(lengths.values())) != 1 or mb.num_tokens not in lengths.values():
        raise BadBatchError(
            f"{where}: per-token arrays disagree in length ({lengths}; num_tokens {mb.num_tokens})"
        )
    num_tokens = mb.num_tokens
    if num_tokens < 1:
        raise BadBatchError(f"{where}: num_tokens is {num_tokens}")
    ids, pos, mask = arrays["input_ids"], arrays["position_ids"], arrays["loss_mask"]
    if cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] > num_tokens:
        raise BadBatchError(
            f"{where}: cu_seqlens {cu.tolist()[:8]}... must start at 0, increase, end <= {num_tokens}"
        )
    starts, ends = cu[:-1], cu[1:]
    expected_pos = np.zeros(num_tokens, dtype=np.int64)
    for first, end in zip(starts, ends, strict=True):
        expected_pos[first:end] = np.arange(end - first)
    if not np.array_equal(pos, expected_pos):
        raise BadBatchError(
            f"{where}: position_ids do not restart at 0 at each cu_seqlens boundary "
            "(and stay 0 on padding)"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise BadBatchError(
            f"{where}: token ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
            f"[0, {vocab_size})"
        )
    if np.any(mask > 1):
        raise BadBatchError(f"{where}: loss_mask holds values other than 0 and 1")
    if mask[starts].any() or mask[int(cu[-1]) :].any():
        raise BadBatchError(
            f"{where}: loss_mask is 1 on a document's first token or on padding "
            "(nothing predicts those tokens)"
        )
    teacher = _teacher_topk(mb, where, vocab_size, mask) if mb.teacher_top_k else (None,) * 3
    return PackedMicroBatch(
        rank=mb.rank,
        index=mb.index,
        input_ids_L=ids,
        position_ids_L=pos,
        cu_seqlens_D1=cu,
        loss_mask_L=mask,
        advantages_L=arrays["advantages"],
        behaviour_logprobs_L=arrays["behaviour_logprobs"],
        policy_versions_L=arrays["policy_versions"],
        teacher_ids_LK=teacher[0],
        teacher_logprobs_LK=teacher[1],
        teacher_weight_L=teacher[2],
    )


def _teacher_topk(
    mb: batch_pb2.MicroBatch, where: str, vocab_size: int, mask: npt.NDArray[np.uint8]
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """The micro-batch's teacher top-k arrays, checked: [num_tokens, k] ids in the
    vocabulary and finite logprobs <= 0 where the weight is > 0; weights finite, >= 0 and
    0 off the loss mask."""
    k, n = mb.teacher_top_k, mb.num_tokens
    try:
        ids = to_array(mb.teacher_topk_ids, field=f"{where}.teacher_topk_ids", expect_dtype="int32")
        lps = to_array(
            mb.teacher_topk_logprobs, field=f"{where}.teacher_topk_logprobs", expect_dtype="float32"
        )
        weight = to_array(
            mb.teacher_weight, field=f"{where}.teacher_weight", expect_dtype="float32"
        )
    except DecodeError as e:
        raise BadBatchError(str(e)) from None
    if k < 0 or ids.shape != (n, k) or lps.shape != (n, k) or weight.shape != (n,):
        raise BadBatchError(
            f"{where}: teacher top-k arrays of shapes {ids.shape}, {lps.shape} and weights "
            f"{weight.shape}; expected ({n}, {k}) and ({n},)"
        )
    if not np.isfinite(weight).all() or (weight < 0).any() or (weight[mask == 0] != 0).any():
        raise BadBatchError(
            f"{where}: teacher_weight must be finite, >= 0, and 0 off the loss mask"
        )
    on = weight > 0
    if (ids[on] < 0).any() or (ids[on] >= vocab_size).any():
        raise BadBatchError(
            f"{where}: teacher top-k token ids outside the vocabulary [0, {vocab_size})"
        )
    if not np.isfinite(lps[on]).all() or (lps[on] > 0).any():
        raise BadBatchError(f"{where}: teacher top-k logprobs must be finite and <= 0")
    return ids, lps, weight


def check_batch(
    batch: batch_pb2.Batch, *, step: int, num_ranks: int, vocab_size: int
) -> list[PackedMicroBatch]:
    """Every micro-batch of ``batch``, decoded and checked, ordered by (rank, index)."""
    if batch.step != step:
        raise BadBatchError(f"the Batch payload is of step {batch.step}, BatchReady says {step}")
    mbs = [decode_micro_batch(mb, vocab_size) for mb in batch.micro_batches]
    for mb in mbs:
        if not 0 <= mb.rank < num_ranks:
            raise BadBatchError(f"micro-batch rank {mb.rank} outside [0, {num_ranks})")
    return sorted(mbs, key=lambda m: (m.rank, m.index))
