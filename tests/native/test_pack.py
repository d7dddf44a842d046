"""treadle_native.pack: the MicroBatch contract of batch.proto, checked as properties.

Shapes: S samples, T input tokens, M micro-batches of N = seq_len tokens, R ranks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treadle_native
from testkit.packing import PackInputs, make_pack_inputs

LENGTHS = st.lists(st.integers(1, 150), max_size=60)
SEQ_LEN = st.integers(16, 128)
RANKS = st.integers(1, 6)
PER_TOKEN_FIELDS = (
    ("input_ids", np.int32),
    ("position_ids", np.int32),
    ("loss_mask", np.uint8),
    ("advantages", np.float32),
    ("behaviour_logprobs", np.float32),
    ("policy_versions", np.int32),
)


def doc_lengths(b: treadle_native.PackedBatch, m: int) -> npt.NDArray[np.int64]:
    return np.diff(b.micro_batch_cu_seqlens(m)).astype(np.int64)


def micro_batch_costs(b: treadle_native.PackedBatch, hidden_size: int | None) -> np.ndarray:
    """Cost of every micro-batch as the cost model defines it (0 for padding)."""
    costs = []
    for m in range(b.num_micro_batches):
        lengths_D = doc_lengths(b, m).astype(np.float64)
        if hidden_size is None:
            costs.append(lengths_D.sum())
        else:
            costs.append((lengths_D + lengths_D**2 / (6 * hidden_size)).sum())
    return np.array(costs, dtype=np.float64)


def test_pack_known_example() -> None:
    # first fit decreasing: 5 -> bin 0, 3 -> bin 0 (now full), 2 -> bin 1
    b = treadle_native.pack(
        np.array([3, 5, 2], dtype=np.int64),
        np.array([11, 12, 13, 21, 22, 23, 24, 25, 31, 32], dtype=np.int32),
        np.array([0, 1, 1, 0, 1, 1, 0, 1, 0, 1], dtype=np.uint8),
        np.array([0.5, 1.5, 2.5], dtype=np.float32),  # per sample
        -np.arange(1, 11, dtype=np.float32),
        np.array([-1, 4, 4, -1, 5, 5, -1, 5, -1, 6], dtype=np.int32),
        seq_len=8,
        pad_token_id=7,
    )
    assert (b.num_micro_batches, b.num_ranks, b.micro_batches_per_rank) == (2, 1, 2)
    assert b.input_ids.tolist() == [[11, 12, 13, 21, 22, 23, 24, 25], [31, 32, 7, 7, 7, 7, 7, 7]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert b.advantages.tolist() == [[0, 0.5, 0.5, 0, 1.5, 1.5, 0, 1.5], [0, 2.5, 0, 0, 0, 0, 0, 0]]
    assert b.behaviour_logprobs.tolist() == [
        [0, -2, -3, 0, -5, -6, 0, -8],
        [0, -10, 0, 0, 0, 0, 0, 0],
    ]
    assert b.policy_versions.tolist() == [
        [-1, 4, 4, -1, 5, 5, -1, 5],
        [-1, 6, -1, -1, -1, -1, -1, -1],
    ]
    assert b.cu_seqlens.tolist() == [0, 3, 8, 0, 2]
    assert b.cu_seqlens_offsets.tolist() == [0, 3, 5]
    assert b.sample_index.tolist() == [0, 1, 2]
    assert b.sample_index_offsets.tolist() == [0, 2, 3]
    assert b.rank.tolist() == [0, 0]
    assert b.index.tolist() == [0, 1]
    assert b.num_docs.tolist() == [2, 1]
    assert b.num_tokens_used.tolist() == [8, 2]
    assert b.num_loss_tokens.tolist() == [5, 1]
    assert b.sample_micro_batch.tolist() == [0, 0, 1]
    assert b.sample_offset.tolist() == [0, 3, 0]
    assert b.micro_batch_cu_seqlens(1).tolist() == [0, 2]
    assert b.micro_batch_sample_index(0).tolist() == [0, 1]
    assert repr(b) == (
        "PackedBatch(num_samples=3, num_micro_batches=2, num_ranks=1, micro_batches_per_rank=2, seq_len=8)"
    )


@settings(max_examples=100, deadline=None)
@given(LENGTHS, SEQ_LEN, RANKS)
def test_pack_arrays_have_contract_shapes_and_dtypes(
    lengths: list[int], seq_len: int, num_ranks: int
) -> None:
    b = make_pack_inputs(lengths).pack(seq_len=seq_len, num_ranks=num_ranks)
    M, S = b.num_micro_batches, len(lengths)
    assert (b.seq_len, b.num_ranks, b.num_samples) == (seq_len, num_ranks, S)
    for name, dtype in PER_TOKEN_FIELDS:
        arr = getattr(b, name)
        assert arr.dtype == dtype, name
        assert arr.shape == (M, seq_len), name
        assert arr.flags.c_contiguous, name
    assert b.cu_seqlens.dtype == np.int32
    assert b.cu_seqlens.shape == (M + S,)
    assert b.sample_index.dtype == np.int32
    assert sorted(b.sample_index.tolist()) == list(range(S))
    for offsets in (b.cu_seqlens_offsets, b.sample_index_offsets):
        assert offsets.dtype == np.int64
        assert offsets.shape == (M + 1,)
    for name in ("rank", "index", "num_docs", "num_tokens_used", "num_loss_tokens"):
        assert getattr(b, name).dtype == np.int32, name
        assert getattr(b, name).shape == (M,), name
    for name in (
        "sample_micro_batch",
        "sample_offset",
        "sample_num_tokens",
        "sample_num_tokens_dropped",
    ):
        assert getattr(b, name).dtype == np.int64, name
        assert getattr(b, name).shape == (S,), name
    assert b.sample_truncated.dtype == np.bool_
    assert b.sample_truncated.shape == (S,)
    assert b.num_loss_tokens.tolist() == b.loss_mask.sum(axis=1).tolist()


@settings(max_examples=100, deadline=None)
@given(LENGTHS, SEQ_LEN, RANKS)
def test_pack_unpack_is_lossless(lengths: list[int], seq_len: int, num_ranks: int) -> None:
    inputs = make_pack_inputs(lengths)
    b = inputs.pack(seq_len=seq_len, num_ranks=num_ranks)
    kept = inputs.kept_index(seq_len)
    on_loss = inputs.loss_mask == 1
    expected: dict[str, np.ndarray] = {
        "input_ids": inputs.token_ids[kept],
        "loss_mask": inputs.loss_mask[kept],
        "advantages": np.where(on_loss, inputs.advantages, 0)[kept],
        "behaviour_logprobs": np.where(on_loss, inputs.behaviour_logprobs, 0)[kept],
        "policy_versions": inputs.policy_versions[kept],
        "position_ids": np.concatenate(
            [np.arange(k) for k in np.minimum(inputs.lengths, seq_len)] or [np.zeros(0)]
        ),
    }
    for name, dtype in PER_TOKEN_FIELDS:
        flat, lengths_S = b.unpack(getattr(b, name))
        assert flat.dtype == dtype, name
        np.testing.assert_array_equal(flat, expected[name].astype(dtype), err_msg=name)
        np.testing.assert_array_equal(lengths_S, np.minimum(inputs.lengths, seq_len))
    # other dtypes round-trip too (trainer logprobs may come as float64)
    flat64, _ = b.unpack(b.advantages.astype(np.float64))
    assert flat64.dtype == np.float64
    np.testing.assert_array_equal(flat64, expected["advantages"].astype(np.float64))


@settings(max_examples=60, deadline=None)
@given(LENGTHS, SEQ_LEN, RANKS)
def test_pack_documents_never_mix_in_attention(
    lengths: list[int], seq_len: int, num_ranks: int
) -> None:
    inputs = make_pack_inputs(lengths)
    b = inputs.pack(seq_len=seq_len, num_ranks=num_ranks, pad_token_id=0)
    causal_NN = np.tri(seq_len, dtype=bool)
    for m in range(b.num_micro_batches):
        cu = b.micro_batch_cu_seqlens(m).astype(np.int64)
        docs = b.micro_batch_sample_index(m).astype(np.int64)
        used = int(b.num_tokens_used[m])
        assert cu[0] == 0
        assert cu[-1] == used
        assert (np.diff(cu) > 0).all()
        # document id per token, rebuilt from cu_seqlens alone (padding: len(docs))
        doc_N = np.searchsorted(cu[1:], np.arange(seq_len), side="right")
        # the token itself says which sample it came from (ids are 1 + flat input index)
        sample_of_token = inputs.sample_of_token(b.input_ids[m, :used].astype(np.int64) - 1)
        np.testing.assert_array_equal(sample_of_token, docs[doc_N[:used]])
        # positions restart at 0 per document and follow the sample's own order
        np.testing.assert_array_equal(b.position_ids[m, :used], np.arange(used) - cu[doc_N[:used]])
        token_pos = b.input_ids[m, :used].astype(np.int64) - 1 - inputs.starts[sample_of_token]
        np.testing.assert_array_equal(token_pos, b.position_ids[m, :used])
        # a block-causal mask from cu_seqlens never lets a token see another document
        mask_NN = causal_NN & (doc_N[:, None] == doc_N[None, :])
        q, k = np.nonzero(mask_NN[:used, :used])
        assert (sample_of_token[q] == sample_of_token[k]).all()
        assert not mask_NN[:used, used:].any()
        # the tail is padding
        assert (b.input_ids[m, used:] == 0).all()
        assert (b.policy_versions[m, used:] == -1).all()
        assert (b.position_ids[m, used:] == 0).all()
        assert (b.loss_mask[m, used:] == 0).all()
        assert (b.advantages[m, used:] == 0).all()
        assert (b.behaviour_logprobs[m, used:] == 0).all()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 300), max_size=80),
    st.integers(64, 512),
    st.integers(1, 8),
    st.sampled_from([None, 4, 64]),
)
def test_pack_ranks_get_equal_counts_and_balanced_loads(
    lengths: list[int], seq_len: int, num_ranks: int, hidden_size: int | None
) -> None:
    inputs = make_pack_inputs(lengths)
    cost = (
        {"cost": "tokens"} if hidden_size is None else {"cost": "flops", "hidden_size": hidden_size}
    )
    b = inputs.pack(seq_len=seq_len, num_ranks=num_ranks, **cost)
    K = b.micro_batches_per_rank
    # lockstep: every rank has K micro-batches, ordered by (rank, index)
    assert b.num_micro_batches == K * num_ranks
    np.testing.assert_array_equal(b.rank, np.repeat(np.arange(num_ranks), K))
    np.testing.assert_array_equal(b.index, np.tile(np.arange(K), num_ranks))
    for r in range(num_ranks):
        np.testing.assert_array_equal(b.rank_micro_batches(r), np.arange(r * K, (r + 1) * K))
    # the real micro-batches are exactly the first-fit-decreasing bins; padding fills the rest
    kept = np.minimum(inputs.lengths, seq_len)
    num_bins = int(treadle_native.first_fit_decreasing(kept, seq_len).max()) + 1 if lengths else 0
    real = b.num_docs > 0
    assert int(real.sum()) == num_bins
    assert b.num_micro_batches - num_bins < num_ranks
    # costliest first within a rank, padding last
    costs_M = micro_batch_costs(b, hidden_size)
    for r in range(num_ranks):
        assert (np.diff(costs_M[r * K : (r + 1) * K]) <= 1e-9).all()
    # longest-processing-time bound: max load <= ideal + max cost * (1 - 1/R)
    if num_bins:
        loads_R = np.bincount(b.rank, weights=costs_M, minlength=num_ranks)
        ideal = costs_M.sum() / num_ranks
        assert loads_R.max() <= ideal + costs_M.max() * (1 - 1 / num_ranks) + 1e-6


def test_pack_flops_cost_weighs_long_documents() -> None:
    # bins [8], [2, 2, 2, 2], [1, 1] on two ranks. By tokens (8, 8, 2) the small bin joins
    # the long document on the tie; by flops the long document costs more, so it does not.
    inputs = make_pack_inputs([8, 2, 2, 2, 2, 1, 1])
    by_tokens = inputs.pack(seq_len=8, num_ranks=2)
    by_flops = inputs.pack(seq_len=8, num_ranks=2, cost="flops", hidden_size=1)

    def rank_of(b: treadle_native.PackedBatch, sample: int) -> int:
        return int(b.rank[b.sample_micro_batch[sample]])

    assert rank_of(by_tokens, 5) == rank_of(by_tokens, 0)
    assert rank_of(by_flops, 5) == rank_of(by_flops, 1) != rank_of(by_flops, 0)


def test_pack_right_truncation_keeps_the_head_and_flags_it() -> None:
    inputs = make_pack_inputs([10, 3, 8, 25])
    b = inputs.pack(seq_len=8)
    assert b.sample_truncated.tolist() == [True, False, False, True]
    assert b.sample_num_tokens_dropped.tolist() == [2, 0, 0, 17]
    assert b.sample_num_tokens.tolist() == [8, 3, 8, 8]
    flat, _ = b.unpack(b.input_ids)
    np.testing.assert_array_equal(flat, inputs.token_ids[inputs.kept_index(8)])
    assert flat[:8].tolist() == list(range(1, 9))  # the first 8 tokens of sample 0


def test_pack_error_truncation_raises() -> None:
    inputs = make_pack_inputs([8, 9])
    assert inputs.pack(seq_len=9, truncation="error").sample_truncated.tolist() == [False, False]
    with pytest.raises(treadle_native.SequenceTooLongError, match="sample 1 has 9 tokens"):
        inputs.pack(seq_len=8, truncation="error")


@settings(max_examples=60, deadline=None)
@given(LENGTHS, SEQ_LEN, RANKS)
def test_pack_per_sample_advantages_broadcast_like_per_token(
    lengths: list[int], seq_len: int, num_ranks: int
) -> None:
    inputs = make_pack_inputs(lengths)
    adv_S = np.random.default_rng(1).standard_normal(len(lengths)).astype(np.float32)
    per_sample = dataclasses.replace(inputs, advantages=adv_S).pack(
        seq_len=seq_len, num_ranks=num_ranks
    )
    adv_T = np.repeat(adv_S, inputs.lengths)
    per_token = dataclasses.replace(inputs, advantages=adv_T).pack(
        seq_len=seq_len, num_ranks=num_ranks
    )
    for name, _ in PER_TOKEN_FIELDS:
        np.testing.assert_array_equal(
            getattr(per_sample, name), getattr(per_token, name), err_msg=name
        )
    flat, lengths_S = per_sample.unpack(per_sample.advantages)
    on_loss = inputs.loss_mask[inputs.kept_index(seq_len)] == 1
    np.testing.assert_array_equal(flat, np.where(on_loss, np.repeat(adv_S, lengths_S), 0))


def test_pack_pads_with_pad_token_and_empty_micro_batches() -> None:
    # three full micro-batches on two ranks: rank 1 gets one padding micro-batch, last
    b = make_pack_inputs([4, 4, 4]).pack(seq_len=4, num_ranks=2, pad_token_id=50256)
    assert b.num_docs.tolist() == [1, 1, 1, 0]
    assert (b.rank.tolist(), b.index.tolist()) == ([0, 0, 1, 1], [0, 1, 0, 1])
    assert b.input_ids[3].tolist() == [50256] * 4
    assert b.policy_versions[3].tolist() == [-1] * 4
    assert not b.position_ids[3].any()
    assert not b.loss_mask[3].any()
    assert not b.advantages[3].any()
    assert not b.behaviour_logprobs[3].any()
    assert b.micro_batch_cu_seqlens(3).tolist() == [0]
    assert b.micro_batch_sample_index(3).tolist() == []
    assert (b.num_tokens_used[3], b.num_loss_tokens[3]) == (0, 0)


def test_pack_zero_length_sample_is_rejected() -> None:
    with pytest.raises(treadle_native.TreadleNativeError, match="sample 1 has length 0"):
        make_pack_inputs([3, 0, 2]).pack(seq_len=8)


def test_pack_empty_input_gives_no_micro_batches() -> None:
    b = make_pack_inputs([]).pack(seq_len=16, num_ranks=4)
    assert (b.num_micro_batches, b.micro_batches_per_rank, b.num_samples) == (0, 0, 0)
    assert b.input_ids.shape == (0, 16)
    assert b.cu_seqlens_offsets.tolist() == [0]
    assert b.rank_micro_batches(3).tolist() == []
    flat, lengths = b.unpack(np.zeros((0, 16), dtype=np.float32))
    assert flat.shape == (0,)
    assert lengths.shape == (0,)


def test_pack_outputs_are_read_only() -> None:
    b = make_pack_inputs([5, 3]).pack(seq_len=8)
    for name, _ in PER_TOKEN_FIELDS:
        arr = getattr(b, name)
        assert not arr.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            arr[0, 0] = 1
    assert not b.cu_seqlens.flags.writeable
    assert not b.sample_truncated.flags.writeable
    with pytest.raises(AttributeError):
        b.input_ids = np.zeros((1, 8), dtype=np.int32)  # type: ignore[misc]
    with pytest.raises(TypeError):
        treadle_native.PackedBatch()  # no constructor: only pack() makes one


def test_pack_accepts_strided_and_unaligned_inputs() -> None:
    inputs = make_pack_inputs([7, 12, 3, 9])
    expected = inputs.pack(seq_len=16, num_ranks=2)
    strided_ids = np.repeat(inputs.token_ids, 2)[::2]
    raw = b"\0" + inputs.behaviour_logprobs.tobytes()
    unaligned_lp = np.frombuffer(raw, dtype=np.float32, offset=1)  # read-only and unaligned
    assert not strided_ids.flags.c_contiguous
    assert not unaligned_lp.flags.aligned
    got = dataclasses.replace(inputs, token_ids=strided_ids, behaviour_logprobs=unaligned_lp).pack(
        seq_len=16, num_ranks=2
    )
    for name, _ in PER_TOKEN_FIELDS:
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    # unpack takes Fortran-ordered values as well
    values = np.asfortranarray(expected.advantages)
    np.testing.assert_array_equal(
        expected.unpack(values)[0], expected.unpack(expected.advantages)[0]
    )
    unaligned_lengths = np.frombuffer(b"\0" + inputs.lengths.tobytes(), dtype=np.int64, offset=1)
    np.testing.assert_array_equal(
        treadle_native.first_fit_decreasing(unaligned_lengths, 16),
        treadle_native.first_fit_decreasing(inputs.lengths, 16),
    )


@settings(max_examples=40, deadline=None)
@given(LENGTHS, SEQ_LEN, RANKS, st.booleans())
def test_pack_single_thread_matches_parallel(
    lengths: list[int], seq_len: int, num_ranks: int, flops: bool
) -> None:
    inputs = make_pack_inputs(lengths)
    cost = {"cost": "flops", "hidden_size": 8} if flops else {}
    parallel = inputs.pack(seq_len=seq_len, num_ranks=num_ranks, **cost)
    single = inputs.pack(seq_len=seq_len, num_ranks=num_ranks, parallel=False, **cost)
    for name in dir(parallel):
        value = getattr(parallel, name)
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(value, getattr(single, name), err_msg=name)


def test_pack_is_deterministic() -> None:
    inputs: PackInputs = make_pack_inputs(np.random.default_rng(3).integers(1, 500, 300).tolist())
    a = inputs.pack(seq_len=1024, num_ranks=4, cost="flops", hidden_size=64)
    b = inputs.pack(seq_len=1024, num_ranks=4, cost="flops", hidden_size=64)
    np.testing.assert_array_equal(a.sample_micro_batch, b.sample_micro_batch)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
