"""Packed batches: samples -> `treadle_native.pack` -> a `Batch` in the object store and
the `BatchReady` that announces it.

The orchestrator owns the algorithm (advantages are already on the samples); the
trainer only reads packed tensors. Samples that carry a teacher's top-k (top-k
distillation) add their rows to the micro-batch where their tokens were packed. Every array keeps the dtype and length DESIGN.md's
batch contract gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import treadle_native
from treadle.orchestrator.samples import Sample
from treadle.proto.v1 import batch_pb2
from treadle.services.codecs import to_token_array


@dataclass
class BuiltBatch:
    batch: batch_pb2.Batch
    ready: batch_pb2.BatchReady  # without `data` (set once the Batch is stored)
    num_truncated: int


def build_batch(
    step: int,
    samples: list[Sample],
    *,
    seq_len: int,
    num_ranks: int,
    pad_token_id: int,
    temperature: float = 1.0,
) -> BuiltBatch:
    """Pack ``samples`` for ``num_ranks`` ranks of ``seq_len`` tokens into a Batch."""
    if not samples:
        raise ValueError(f"step {step}: no samples to pack")
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int64)
    token_ids = np.concatenate([s.token_ids for s in samples]).astype(np.int32, copy=False)
    loss_mask = np.concatenate([s.loss_mask for s in samples]).astype(np.uint8, copy=False)
    if any(s.advantages is not None for s in samples):  # per token
        advantages = np.concatenate(
            [s.advantages if s.advantages is not None else np.full(s.num_tokens, s.advantage)
             for s in samples]
        ).astype(np.float32, copy=False)  # fmt: skip
    else:  # one per sample, broadcast by pack
        advantages = np.array([s.advantage for s in samples], dtype=np.float32)
    logprobs = np.concatenate([s.logprobs for s in samples]).astype(np.float32, copy=False)
    versions = np.concatenate([s.policy_versions for s in samples]).astype(np.int32, copy=False)
    packed = treadle_native.pack(
        lengths,
        token_ids,
        loss_mask,
        advantages,
        logprobs,
        versions,
        seq_len=seq_len,
        num_ranks=num_ranks,
        pad_token_id=pad_token_id,
    )
    top_k = top_k_of(samples)
    batch = batch_pb2.Batch(step=step)
    for i, s in enumerate(samples):
        batch.samples.append(
            batch_pb2.SampleRef(
                rollout_id=s.rollout_id,
                leaf_node_id=s.leaf_node_id,
                num_tokens=int(packed.sample_num_tokens[i]),
                truncated=bool(packed.sample_truncated[i]),
                num_tokens_dropped=int(packed.sample_num_tokens_dropped[i]),
            )
        )
    ready = batch_pb2.BatchReady(
        step=step, num_ranks=num_ranks, seq_len=seq_len, temperature=temperature
    )
    for m in range(packed.num_micro_batches):
        mb = batch_pb2.MicroBatch(
            rank=int(packed.rank[m]),
            index=int(packed.index[m]),
            num_tokens=seq_len,
            input_ids=to_token_array(packed.input_ids[m]),
            position_ids=to_token_array(packed.position_ids[m]),
            cu_seqlens=to_token_array(packed.micro_batch_cu_seqlens(m)),
            loss_mask=to_token_array(packed.loss_mask[m]),
            advantages=to_token_array(packed.advantages[m]),
            behaviour_logprobs=to_token_array(packed.behaviour_logprobs[m]),
            policy_versions=to_token_array(packed.policy_versions[m]),
            sample_index=to_token_array(packed.micro_batch_sample_index(m)),
        )
        if top_k:
            _put_teacher_topk(
                mb, samples, top_k, packed.micro_batch_cu_seqlens(m),
                packed.micro_batch_sample_index(m),
            )  # fmt: skip
        batch.micro_batches.append(mb)
        ready.layout.append(
            batch_pb2.MicroBatchLayout(
                rank=mb.rank,
                index=mb.index,
                num_docs=int(packed.num_docs[m]),
                num_tokens_used=int(packed.num_tokens_used[m]),
                num_loss_tokens=int(packed.num_loss_tokens[m]),
            )
        )
    ready.rollout_ids.extend(sorted({s.rollout_id for s in samples}))
    ready.num_samples = len(samples)
    ready.num_tokens = int(packed.num_tokens_used.sum())
    ready.num_loss_tokens = int(packed.num_loss_tokens.sum())
    sampled = versions[(loss_mask == 1) & (versions >= 0)]  # not a demonstration's tokens
    ready.min_policy_version = int(sampled.min()) if sampled.size else -1
    ready.max_policy_version = int(sampled.max()) if sampled.size else -1
    ready.created_at.GetCurrentTime()
    return BuiltBatch(batch, ready, int(packed.sample_truncated.sum()))


def top_k_of(samples: list[Sample]) -> int:
    """The k of the samples' teacher top-k (0: none carries one); one k per batch."""
    ks = {s.teacher_topk.k for s in samples if s.teacher_topk is not None and s.teacher_weight}
    if len(ks) > 1:
        raise ValueError(f"samples carry teacher top-k of several k ({sorted(ks)}) in one batch")
    return ks.pop() if ks else 0


def _put_teacher_topk(
    mb: batch_pb2.MicroBatch, samples: list[Sample], k: int, cu: np.ndarray, docs: np.ndarray
) -> None:
    """The micro-batch's teacher top-k rows and weights, each document's from its sample
    (a truncated sample keeps its head: its first tokens are the document's)."""
    ids = np.zeros((mb.num_tokens, k), dtype=np.int32)
    lps = np.zeros((mb.num_tokens, k), dtype=np.float32)
    weight = np.zeros(mb.num_tokens, dtype=np.float32)
    for d, i in enumerate(docs):
        s = samples[int(i)]
        if s.teacher_topk is None or not s.teacher_weight:
            continue
        a, b = int(cu[d]), int(cu[d + 1])
        ids[a:b] = s.teacher_topk.ids[: b - a]
        lps[a:b] = s.teacher_topk.logprobs[: b - a]
        weight[a:b] = np.where(s.loss_mask[: b - a] == 1, np.float32(s.teacher_weight), 0)
    mb.teacher_top_k = k
    mb.teacher_topk_ids.CopyFrom(to_token_array(ids))
    mb.teacher_topk_logprobs.CopyFrom(to_token_array(lps))
    mb.teacher_weight.CopyFrom(to_token_array(weight))


def batch_media_type() -> str:
    return "application/x-protobuf; type=treadle.proto.v1.Batch"
