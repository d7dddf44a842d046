"""Training samples from rollouts: one per root->leaf branch of the message graph.

A sample's arrays are the concatenation of its branch's nodes' arrays (tokens exactly as
sampled; nothing is re-tokenized). The loss mask is the sampled mask; logprobs and
policy versions are the per-token provenance recorded by the env runner.

``checked_samples`` is the sanity check every rollout passes before anything of it is
trained (a RolloutCompleted is data from outside the orchestrator: a buggy runner or a
forged message): a consistent node graph, arrays of one length per node, token ids in
[0, vocab_size), a 0/1 sampled mask, finite logprobs, sampled tokens' policy versions
in [0, max_policy_version] (no version the trainer has not published yet), a finite
reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array
from treadle.services.errors import DecodeError

if TYPE_CHECKING:
    from treadle.orchestrator.algorithms import TopK

Kind = rollout_pb2.RolloutStatus.Kind
MAX_NODES = 4096  # per rollout; a branch walk is O(leaves x depth)


class InvalidRollout(DecodeError):
    """A rollout that decodes but fails the sanity checks; it is never trained."""


@dataclass
class Sample:
    rollout_id: str
    leaf_node_id: int
    token_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] uint8, 1 on sampled tokens
    logprobs: np.ndarray  # [n] float32, sampling logprobs (0 where loss_mask = 0)
    policy_versions: np.ndarray  # [n] int32, -1 where not sampled
    advantage: float = 0.0  # used when ``advantages`` is None (broadcast on loss tokens)
    advantages: np.ndarray | None = None  # [n] float32, per token (the algorithm's output)
    # self-distillation: the branch's prompt rendered with privileged context; a teacher
    # scores privileged_ids + token_ids[num_replaced:] (Rollout.privileged_prompts)
    privileged_ids: np.ndarray | None = None
    num_replaced: int = 0
    # top-k distillation (algorithms.TopK): the teacher's top-k at each token, and the
    # weight of the trainer's term over them
    teacher_topk: TopK | None = None
    teacher_weight: float = 0.0

    @classmethod
    def written(
        cls, rollout_id: str, token_ids: np.ndarray, loss_mask: np.ndarray, **extra: Any
    ) -> Sample:
        """A conversation the policy did not sample (an SFT row, a demonstration): no
        sampling logprobs, policy version -1 on every token; ``extra``: the other fields."""
        n = int(np.asarray(token_ids).size)
        return cls(rollout_id, 0, token_ids, loss_mask, np.zeros(n, np.float32),
                   np.full(n, -1, np.int32), **extra)  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    @property
    def min_policy_version(self) -> int:
        sampled = self.policy_versions[self.loss_mask == 1]
        return int(sampled.min()) if sampled.size else -1


def trainable(rollout: rollout_pb2.Rollout) -> bool:
    """OK and truncated rollouts train; errors and cancellations do not."""
    return rollout.status.kind in (Kind.KIND_OK, Kind.KIND_TRUNCATED)


def rollout_samples(rollout: rollout_pb2.Rollout) -> list[Sample]:
    """Every root->leaf branch of ``rollout`` as a sample (DecodeError if inconsistent)."""
    nodes = list(rollout.nodes)
    where = f"rollout {rollout.rollout_id}"
    parents = {n.node_id: n.parent_id for n in nodes}
    for i, n in enumerate(nodes):
        if n.node_id != i:
            raise DecodeError(f"{where}: nodes[{i}].node_id is {n.node_id}")
        if n.parent_id >= i:
            raise DecodeError(
                f"{where}: node {i} has parent {n.parent_id}, which does not come before it"
            )
    has_child = {p for p in parents.values() if p >= 0}
    privileged = _privileged_prompts(rollout, where)
    samples = []
    for leaf in (n.node_id for n in nodes if n.node_id not in has_child):
        path = []
        node_id = leaf
        while node_id >= 0:
            path.append(nodes[node_id])
            node_id = nodes[node_id].parent_id
        path.reverse()
        ids, mask, lps, versions = [], [], [], []
        for n in path:
            tok = to_array(
                n.token_ids, field=f"{where} node {n.node_id} token_ids", expect_dtype="int32"
            )
            k = tok.size
            ids.append(tok)
            mask.append(
                to_array(
                    n.sampled_mask,
                    field=f"{where} node {n.node_id} sampled_mask",
                    expect_dtype="uint8",
                    expect_len=k,
                )
            )
            lps.append(
                to_array(
                    n.logprobs,
                    field=f"{where} node {n.node_id} logprobs",
                    expect_dtype="float32",
                    expect_len=k,
                )
            )
            versions.append(
                to_array(
                    n.policy_versions,
                    field=f"{where} node {n.node_id} policy_versions",
                    expect_dtype="int32",
                    expect_len=k,
                )
            )
        sample = Sample(
            rollout.rollout_id,
            leaf,
            np.concatenate(ids).astype(np.int32, copy=False),
            np.concatenate(mask).astype(np.uint8, copy=False),
            np.concatenate(lps).astype(np.float32, copy=False),
            np.concatenate(versions).astype(np.int32, copy=False),
        )
        if sample.num_tokens == 0:
            continue
        if path[0].node_id in privileged:
            sample.num_replaced, sample.privileged_ids = privileged[path[0].node_id]
            first_sampled = np.flatnonzero(sample.loss_mask)
            if sample.num_replaced > (
                first_sampled[0] if first_sampled.size else sample.num_tokens
            ):
                raise DecodeError(
                    f"{where}: the privileged prompt of node {path[0].node_id} replaces "
                    f"{sample.num_replaced} tokens, past the branch's first sampled token"
                )
        if not np.isfinite(sample.logprobs[sample.loss_mask == 1]).all():
            raise DecodeError(f"{where}: non-finite sampling logprobs on sampled tokens")
        samples.append(sample)
    return samples


def _privileged_prompts(
    rollout: rollout_pb2.Rollout, where: str
) -> dict[int, tuple[int, np.ndarray]]:
    """root node id -> (num_replaced, ids) of the rollout's privileged prompts."""
    out: dict[int, tuple[int, np.ndarray]] = {}
    for p in rollout.privileged_prompts:
        field = f"{where} privileged prompt of node {p.root_node_id}"
        if not 0 <= p.root_node_id < len(rollout.nodes):
            raise DecodeError(f"{field}: no such node")
        if rollout.nodes[p.root_node_id].parent_id != -1:
            raise DecodeError(f"{field}: the node is not a root")
        ids = to_array(p.token_ids, field=f"{field} token_ids", expect_dtype="int32")
        if p.num_replaced < 0 or ids.size == 0:
            raise DecodeError(f"{field}: empty, or replaces {p.num_replaced} tokens")
        out[p.root_node_id] = (int(p.num_replaced), ids)
    return out


def checked_samples(
    rollout: rollout_pb2.Rollout, *, max_policy_version: int, vocab_size: int | None
) -> list[Sample]:
    """``rollout_samples`` after the sanity checks (module doc); InvalidRollout if any fails."""
    where = f"rollout {rollout.rollout_id[:80]!r}"
    if len(rollout.nodes) > MAX_NODES:
        raise InvalidRollout(f"{where}: {len(rollout.nodes)} nodes (at most {MAX_NODES})")
    if not math.isfinite(rollout.reward):
        raise InvalidRollout(f"{where}: reward is {rollout.reward}")
    try:
        samples = rollout_samples(rollout)
    except InvalidRollout:
        raise
    except DecodeError as e:
        raise InvalidRollout(str(e)) from None
    for smp in samples:
        ids, mask = smp.token_ids, smp.loss_mask
        if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
            raise InvalidRollout(
                f"{where}: token ids span [{ids.min()}, {ids.max()}], outside the vocabulary "
                f"[0, {vocab_size if vocab_size is not None else 'inf'})"
            )
        extra = smp.privileged_ids
        if extra is not None and (
            extra.min() < 0 or (vocab_size is not None and extra.max() >= vocab_size)
        ):
            raise InvalidRollout(f"{where}: a privileged prompt holds ids outside the vocabulary")
        if mask.size and mask.max() > 1:
            raise InvalidRollout(f"{where}: sampled_mask holds {mask.max()} (0 or 1 only)")
        sampled = smp.policy_versions[mask == 1]
        if sampled.size and (sampled.min() < 0 or sampled.max() > max_policy_version):
            raise InvalidRollout(
                f"{where}: sampled tokens carry policy versions [{sampled.min()}, "
                f"{sampled.max()}], outside the published versions [0, {max_policy_version}]"
            )
    return samples
