"""Shared prompts: a group's samples of one prompt computed once up to where they differ.

A GRPO step holds ``group_size`` samples of each prompt. Their prompt tokens have the
same hidden states in every sample (same tokens, same positions, causal attention), so
the trainer computes them once: ``regroup`` puts the documents that open with the same
prompt into the same micro-batch, and ``share_prefixes`` turns a micro-batch into a
compact row, each shared prefix once and then each document's own rest (its positions
continuing the prefix's), whose attention lets a rest see its prefix
(``models.attention.segment_layout``). Scores come back to the packed layout through
``SharedPrefixes.expand``. Exact up to float summation order: a prefix's forward is
every copy's, and its gradient the sum of the copies' (autograd adds up the gradients
of the keys and values that several rests read).

A document's shareable prefix ends one token before its first loss token: the token
before a loss token predicts it, so it stays in the rest, and every scored token is
predicted from inside its own document's rest. Documents share a prefix only when those
tokens are equal (a group's prompt); all others stay whole.

Shape legend: L = tokens of the packed micro-batch, C = tokens of the compact row, E =
segments of the compact row, D = documents.

Only for ``sdpa`` attention (any row length, any mask). The policy's and the reference
model's forwards run on the compact row (``scores``); the loss and the metrics keep the
packed layout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from treadle.trainer.batch import PackedMicroBatch
from treadle.trainer.models.attention import DocumentLayout, segment_layout
from treadle.trainer.policy import Policy, TokenScores

# per-token arrays of a PackedMicroBatch (first axis L), cut and joined per document
_ARRAYS = (
    "input_ids_L",
    "position_ids_L",
    "loss_mask_L",
    "advantages_L",
    "behaviour_logprobs_L",
    "policy_versions_L",
    "teacher_ids_LK",
    "teacher_logprobs_LK",
    "teacher_weight_L",
)


@dataclass(frozen=True)
class _Doc:
    mb: PackedMicroBatch
    start: int
    length: int
    shared: int  # leading tokens it may share: up to the token before its first loss token
    key: bytes  # those tokens


def _documents(mb: PackedMicroBatch) -> list[_Doc]:
    cu, ids = mb.cu_seqlens_D1, mb.input_ids_L
    docs = []
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        on = np.flatnonzero(mb.loss_mask_L[start:end])
        # >= 0: a checked batch has no loss token first in a document
        shared = int(on[0]) - 1 if on.size else 0
        docs.append(_Doc(mb, start, end - start, shared, ids[start : start + shared].tobytes()))
    return docs


def _groups(docs: list[_Doc]) -> list[list[_Doc]]:
    """Documents with the same shareable prefix together (in first-seen order); a
    document with none, or with a prefix no other shares, alone."""
    by_key: dict[bytes, list[_Doc]] = defaultdict(list)
    alone: list[list[_Doc]] = []
    for d in docs:
        if d.shared > 0:
            by_key[d.key].append(d)
        else:
            alone.append([d])
    return list(by_key.values()) + alone


def _cost(group: list[_Doc]) -> int:
    """Tokens the group takes in a compact row."""
    if len(group) == 1:
        return group[0].length
    return group[0].shared + sum(d.length - d.shared for d in group)


def _join(docs: list[_Doc], like: PackedMicroBatch, index: int) -> PackedMicroBatch:
    """A micro-batch of ``docs``, packed back to back (no padding)."""
    fields: dict[str, npt.NDArray | None] = {}
    for name in _ARRAYS:
        parts = [getattr(d.mb, name) for d in docs]
        if any(p is None for p in parts):
            fields[name] = None
            continue
        fields[name] = np.concatenate(
            [p[d.start : d.start + d.length] for p, d in zip(parts, docs, strict=True)]
        )
    cu = np.concatenate([[0], np.cumsum([d.length for d in docs])]).astype(np.int32)
    return replace(like, index=index, cu_seqlens_D1=cu, **fields)  # type: ignore[arg-type]


def regroup(mbs: list[PackedMicroBatch]) -> list[PackedMicroBatch]:
    """``mbs``' documents (one rank's micro-batches of one update), repacked into as many
    micro-batches so that documents sharing a prompt sit together: groups, largest
    compact size first, each into the micro-batch with the fewest compact tokens (the
    largest groups split in two while there are fewer groups than micro-batches). The
    loss is a sum over documents, so only float summation order changes. ``mbs``
    unchanged (trimmed) when nothing is shared, when they disagree on whether they carry
    teacher arrays, or when a micro-batch would get more compact tokens than the
    largest one now holds."""
    mbs = [m.trimmed() for m in mbs]
    if len(mbs) < 2 or len({m.teacher_ids_LK is None for m in mbs}) > 1:
        return mbs
    groups = _groups([d for m in mbs for d in _documents(m)])
    if all(len(g) == 1 for g in groups):
        return mbs
    capacity = max(m.num_tokens for m in mbs)
    while len(groups) < len(mbs):  # every micro-batch gets documents: split the largest
        big = max(groups, key=len)
        if len(big) < 2:
            return mbs
        groups.remove(big)
        groups += [big[: len(big) // 2], big[len(big) // 2 :]]
    bins: list[list[_Doc]] = [[] for _ in mbs]
    load = [0] * len(mbs)
    for g in sorted(groups, key=_cost, reverse=True):
        b = min(range(len(bins)), key=load.__getitem__)
        bins[b].extend(g)
        load[b] += _cost(g)
    if max(load) > capacity:
        return mbs
    return [_join(docs, mb, mb.index) for docs, mb in zip(bins, mbs, strict=True)]


@dataclass(frozen=True)
class SharedPrefixes:
    """A micro-batch as a compact row (see the module docstring)."""

    input_ids_C: npt.NDArray[np.int32]
    position_ids_C: npt.NDArray[np.int32]
    from_packed_C: npt.NDArray[np.int64]  # a packed token each compact token computes
    to_compact_L: npt.NDArray[np.int64]  # the compact token computing each packed one
    start_E: npt.NDArray[np.int64]
    len_E: npt.NDArray[np.int64]
    prefix_E: npt.NDArray[np.int64]  # the segment a segment continues, or -1

    def layout(self, device: torch.device) -> DocumentLayout:
        return segment_layout(
            torch.from_numpy(self.start_E).to(device),
            torch.from_numpy(self.len_E).to(device),
            torch.from_numpy(self.prefix_E).to(device),
        )

    def expand(self, scores: TokenScores) -> TokenScores:
        """The compact row's scores at each packed token (a shared prefix token's, for
        each of its copies)."""
        idx = torch.from_numpy(self.to_compact_L).to(scores.logprobs_BL.device)

        def back(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.index_select(1, idx)

        logprobs = back(scores.logprobs_BL)
        assert logprobs is not None
        return TokenScores(logprobs, back(scores.entropy_BL), back(scores.topk_logprobs_BLK))


def scores(
    policy: Policy,
    ids_BL: torch.Tensor,
    pos_BL: torch.Tensor,
    shared: SharedPrefixes | None,
    *,
    topk_ids_BLK: torch.Tensor | None = None,
    **kw: Any,
) -> TokenScores:
    """``policy.scores`` of a packed micro-batch, computed on its compact row when
    ``shared`` (each shared prompt once), at every packed token either way."""
    if shared is None:
        return policy.scores(ids_BL, pos_BL, topk_ids_BLK=topk_ids_BLK, **kw)
    src_C = torch.from_numpy(shared.from_packed_C).to(ids_BL.device)
    got = policy.scores(
        ids_BL.index_select(1, src_C),
        pos_BL.index_select(1, src_C),
        topk_ids_BLK=None if topk_ids_BLK is None else topk_ids_BLK.index_select(1, src_C),
        layout=shared.layout(ids_BL.device),
        **kw,
    )
    return shared.expand(got)


def share_prefixes(mb: PackedMicroBatch) -> SharedPrefixes | None:
    """``mb`` (trimmed: no padding) as a compact row, or None when no two of its
    documents share a prompt."""
    groups = _groups(_documents(mb))
    if all(len(g) == 1 for g in groups):
        return None
    ids, pos, src = mb.input_ids_L, mb.position_ids_L, []
    to_compact = np.empty(mb.num_tokens, dtype=np.int64)
    start_E: list[int] = []
    len_E: list[int] = []
    prefix_E: list[int] = []
    at = 0

    def segment(first: int, count: int, prefix: int) -> int:
        nonlocal at
        src.append(np.arange(first, first + count))
        to_compact[first : first + count] = np.arange(at, at + count)
        start_E.append(at)
        len_E.append(count)
        prefix_E.append(prefix)
        at += count
        return len(start_E) - 1

    for g in groups:
        if len(g) == 1:
            segment(g[0].start, g[0].length, -1)
            continue
        n = g[0].shared
        p = segment(g[0].start, n, -1)
        for d in g:
            if d is not g[0]:
                to_compact[d.start : d.start + n] = to_compact[g[0].start : g[0].start + n]
            segment(d.start + n, d.length - n, p)
    from_packed = np.concatenate(src)
    return SharedPrefixes(
        input_ids_C=ids[from_packed],
        position_ids_C=pos[from_packed],
        from_packed_C=from_packed,
        to_compact_L=to_compact,
        start_E=np.asarray(start_E, dtype=np.int64),
        len_E=np.asarray(len_E, dtype=np.int64),
        prefix_E=np.asarray(prefix_E, dtype=np.int64),
    )
