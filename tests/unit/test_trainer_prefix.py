"""Shared prompts (``treadle.trainer.prefix``): grouping, the compact row, and the
attention over a shared prefix against computing every copy. The trainer-level check
(loss, metrics, gradients, weights) is in test_trainer_core.py."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from testkit.trainer import make_batch
from treadle.trainer.batch import PackedMicroBatch, decode_micro_batch
from treadle.trainer.models.attention import BlockCausalSDPA, segment_layout
from treadle.trainer.prefix import regroup, share_prefixes

VOCAB = 500


def docs_of(mb: PackedMicroBatch) -> list[tuple[bytes, bytes]]:
    """Each document's (tokens, loss mask), to compare sets of documents."""
    cu = mb.cu_seqlens_D1.tolist()
    return [
        (mb.input_ids_L[a:b].tobytes(), mb.loss_mask_L[a:b].tobytes())
        for a, b in itertools.pairwise(cu)
    ]


def micro_batches(**kw: object) -> list[PackedMicroBatch]:
    batch = make_batch(1, vocab_size=VOCAB, **kw)  # type: ignore[arg-type]
    return [decode_micro_batch(mb, VOCAB) for mb in batch.micro_batches]


def test_attention_over_a_shared_prefix_equals_attending_each_copy() -> None:
    """Forward and gradients (q, k, v) of the compact row equal those of the documents
    written out whole, the prefix's gradient the sum over its copies'."""
    torch.manual_seed(0)
    N, NKV, H = 4, 2, 8
    # segments: prefix A (5), two rests of A (4, 6), a plain document (7), prefix B (3),
    # one rest of B (2)
    lens = [5, 4, 6, 7, 3, 2]
    prefix = [-1, 0, 0, -1, -1, 4]
    start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    T = sum(lens)
    q = torch.randn(1, T, N, H, requires_grad=True)
    k = torch.randn(1, T, NKV, H, requires_grad=True)
    v = torch.randn(1, T, NKV, H, requires_grad=True)
    layout = segment_layout(
        torch.tensor(start), torch.tensor(lens), torch.tensor(prefix), max_buckets=2
    )
    out = BlockCausalSDPA(BlockCausalSDPA.Config())(
        q, k, v, attention_masks=layout, enable_gqa=True
    )
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]  # type: ignore[union-attr]

    # reference: every document whole (the prefix copied in front of each rest), causal
    ref = torch.zeros_like(out)
    ref_grads = [torch.zeros_like(x) for x in (q, k, v)]
    for e, n in enumerate(lens):
        rows = list(range(start[e], start[e] + n))
        if prefix[e] >= 0:
            p = prefix[e]
            rows = list(range(start[p], start[p] + lens[p])) + rows
        idx = torch.tensor(rows)
        xs = [x.detach()[0, idx].clone().requires_grad_(True) for x in (q, k, v)]
        o = F.scaled_dot_product_attention(
            *(x.transpose(0, 1)[None] for x in xs), is_causal=True, enable_gqa=True
        )[0].transpose(0, 1)
        own = slice(len(rows) - n, len(rows))  # this segment's own tokens
        ref[0, idx[own]] = o[own].detach()
        (o[own] * weight[0, idx[own]]).sum().backward()
        for g, x in zip(ref_grads, xs, strict=True):
            g[0].index_add_(0, idx, x.grad)  # type: ignore[arg-type]
    torch.testing.assert_close(out.detach(), ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_a_compact_row_holds_each_shared_prompt_once_and_maps_every_token_back() -> None:
    # 3 prompts x 3 samples, all in one micro-batch; prompts of 10, 12 and 8 tokens
    lengths = (16, 17, 18, 20, 19, 21, 11, 12, 13)
    prompts = (10, 10, 10, 12, 12, 12, 8, 8, 8)
    (mb,) = micro_batches(lengths=lengths, prompts=prompts, group_size=3, seq_len=256)
    mb = mb.trimmed()
    shared = share_prefixes(mb)
    assert shared is not None
    # a prompt of p tokens shares p - 1 (the last one predicts the first sampled token)
    assert shared.input_ids_C.size == sum(lengths) - 2 * (9 + 11 + 7)
    # every packed token is computed by a compact token with its id and position
    np.testing.assert_array_equal(shared.input_ids_C[shared.to_compact_L], mb.input_ids_L)
    np.testing.assert_array_equal(shared.position_ids_C[shared.to_compact_L], mb.position_ids_L)
    np.testing.assert_array_equal(
        shared.to_compact_L[shared.from_packed_C], np.arange(shared.input_ids_C.size)
    )
    # every scored token (and the one predicting it) is its own, not shared
    scored = np.flatnonzero(mb.loss_mask_L)
    for t in np.concatenate([scored, scored - 1]):
        assert np.sum(shared.to_compact_L == shared.to_compact_L[t]) == 1
    assert sorted(shared.prefix_E.tolist()).count(-1) == 3  # 3 prefixes, 9 rests
    assert len(shared.prefix_E) == 12


def test_prompts_that_differ_in_a_token_or_share_nothing_stay_whole() -> None:
    (mb,) = micro_batches(lengths=(16, 16, 9), prompts=(10, 10, 1), group_size=1, seq_len=64)
    mb = mb.trimmed()
    assert share_prefixes(mb) is None  # random prompts; a prompt of one token
    ids = mb.input_ids_L.copy()
    ids[16 : 16 + 10] = ids[:10]
    ids[16 + 8] = (ids[8] + 1) % VOCAB  # the same prompt but for its 9th token
    assert share_prefixes(replace(mb, input_ids_L=ids)) is None
    ids[16 + 8] = ids[8]
    ids[16 + 9] = (ids[9] + 1) % VOCAB  # only the token before the first sampled one differs
    shared = share_prefixes(replace(mb, input_ids_L=ids))
    assert shared is not None
    assert shared.input_ids_C.size == 41 - 9


def test_regroup_puts_a_prompts_samples_together_keeping_every_document() -> None:
    lengths = tuple(30 + (i % 5) for i in range(24))
    prompts = tuple(20 + (i // 4) for i in range(24))
    mbs = micro_batches(lengths=lengths, prompts=prompts, group_size=4, seq_len=200)
    assert 2 <= len(mbs) < 6  # fewer micro-batches than prompts: no prompt is split
    out = regroup(mbs)
    assert len(out) == len(mbs)
    assert [m.index for m in out] == [m.index for m in mbs]
    before = sorted(d for m in mbs for d in docs_of(m))
    assert sorted(d for m in out for d in docs_of(m)) == before
    for m in out:  # each prompt's 4 samples in one micro-batch, computed within the old size
        shared = share_prefixes(m)
        assert shared is not None
        assert shared.input_ids_C.size <= max(x.num_tokens_used for x in mbs)
        firsts = [d[0][:4] for d in docs_of(m)]
        assert all(firsts.count(f) == 4 for f in firsts)
        np.testing.assert_array_equal(
            m.position_ids_L,
            np.concatenate(
                [
                    np.arange(b - a)
                    for a, b in zip(m.cu_seqlens_D1[:-1], m.cu_seqlens_D1[1:], strict=False)
                ]
            ),
        )


def test_regroup_with_fewer_prompts_than_micro_batches_fills_each() -> None:
    lengths = tuple(30 + (i % 5) for i in range(16))
    prompts = tuple(20 + (i // 8) for i in range(16))
    mbs = micro_batches(lengths=lengths, prompts=prompts, group_size=8, seq_len=96)
    assert len(mbs) >= 3
    out = regroup(mbs)
    assert len(out) == len(mbs)
    assert all(m.cu_seqlens_D1.size > 1 for m in out)
    assert sorted(d for m in out for d in docs_of(m)) == sorted(d for m in mbs for d in docs_of(m))


@pytest.mark.parametrize("why", ["nothing shared", "one micro-batch", "teacher rows on some"])
def test_regroup_leaves_the_micro_batches_as_they_are(why: str) -> None:
    if why == "nothing shared":
        mbs = micro_batches(lengths=(30,) * 12, seq_len=96)
    elif why == "one micro-batch":
        mbs = micro_batches(lengths=(30,) * 3, prompts=(20,) * 3, group_size=3, seq_len=96)
    else:
        mbs = micro_batches(lengths=(30,) * 12, prompts=(20,) * 12, group_size=4, seq_len=96)
        k = np.zeros((mbs[0].num_tokens, 2), dtype=np.int32)
        mbs[0] = replace(mbs[0], teacher_ids_LK=k, teacher_logprobs_LK=k.astype(np.float32),
                         teacher_weight_L=np.zeros(mbs[0].num_tokens, dtype=np.float32))  # fmt: skip
    out = regroup(mbs)
    assert [docs_of(m) for m in out] == [docs_of(m) for m in mbs]


def test_multi_turn_documents_share_only_what_precedes_their_first_sampled_turn() -> None:
    """A loss mask with gaps (a tool result between two sampled turns): the prefix stops
    before the first sampled turn, later turns and the gap stay in each rest."""
    (mb,) = micro_batches(lengths=(30, 34), prompts=(10, 10), group_size=2, seq_len=64)
    mb = mb.trimmed()
    mask = mb.loss_mask_L.copy()
    for start in (0, 30):
        mask[start + 15 : start + 20] = 0  # an environment's turn between two sampled ones
    shared = share_prefixes(replace(mb, loss_mask_L=mask))
    assert shared is not None
    assert shared.input_ids_C.size == 64 - 9
    assert shared.len_E.tolist() == [9, 21, 25]
    np.testing.assert_array_equal(shared.input_ids_C[shared.to_compact_L], mb.input_ids_L)
