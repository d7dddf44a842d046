"""Inputs for ``treadle_native.pack`` in tests, with every token traceable to its sample.

Token ids are ``1 + (index of the token in the flat input)``, so a packed token names the
sample and position it came from (0 stays free for padding). Masks, advantages,
logprobs and policy versions are random per token, seeded. Shapes: S samples, T tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

import treadle_native


@dataclass(frozen=True)
class PackInputs:
    """Flat per-token arrays of S samples, in the dtypes ``pack`` takes."""

    lengths: npt.NDArray[np.int64]  # [S]
    token_ids: npt.NDArray[np.int32]  # [T]
    loss_mask: npt.NDArray[np.uint8]  # [T]
    advantages: npt.NDArray[np.float32]  # [T] (or [S] when per sample)
    behaviour_logprobs: npt.NDArray[np.float32]  # [T]
    policy_versions: npt.NDArray[np.int32]  # [T], -1 where loss_mask = 0

    @property
    def starts(self) -> npt.NDArray[np.int64]:
        """First token of each sample in the flat arrays.  # [S]"""
        return (np.cumsum(self.lengths) - self.lengths).astype(np.int64)

    def sample_of_token(self, flat_index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Sample holding each flat input token."""
        return np.searchsorted(np.cumsum(self.lengths), flat_index, side="right").astype(np.int64)

    def kept_index(self, seq_len: int) -> npt.NDArray[np.int64]:
        """Flat input index of every token kept by right truncation, in sample order."""
        kept = np.minimum(self.lengths, seq_len)
        return np.concatenate(
            [np.arange(s, s + k, dtype=np.int64) for s, k in zip(self.starts, kept, strict=True)]
            or [np.zeros(0, dtype=np.int64)]
        )

    def pack(self, **kwargs: Any) -> treadle_native.PackedBatch:
        """``treadle_native.pack`` of these inputs with the given keyword arguments."""
        return treadle_native.pack(
            self.lengths,
            self.token_ids,
            self.loss_mask,
            self.advantages,
            self.behaviour_logprobs,
            self.policy_versions,
            **kwargs,
        )


def make_pack_inputs(lengths: Sequence[int], seed: int = 0) -> PackInputs:
    """Traceable inputs for samples of the given lengths."""
    rng = np.random.default_rng(seed)
    lengths_S = np.asarray(lengths, dtype=np.int64).reshape(-1)
    num_tokens = int(lengths_S.sum())
    loss_mask = (rng.random(num_tokens) < 0.6).astype(np.uint8)
    return PackInputs(
        lengths=lengths_S,
        token_ids=np.arange(1, num_tokens + 1, dtype=np.int32),
        loss_mask=loss_mask,
        advantages=rng.standard_normal(num_tokens).astype(np.float32),
        behaviour_logprobs=-rng.exponential(1.0, num_tokens).astype(np.float32),
        policy_versions=np.where(loss_mask == 1, rng.integers(0, 5, num_tokens), -1).astype(
            np.int32
        ),
    )
