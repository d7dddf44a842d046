"""treadle_native.pack on bad input: typed exceptions naming the problem, never a crash.

A panic or abort in the extension would kill the interpreter (or raise PanicException,
a BaseException that none of the ``except`` clauses here catch), failing the test.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treadle_native
from testkit.packing import make_pack_inputs

INPUTS = make_pack_inputs([3, 2])  # 5 tokens


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        (
            "lengths",
            np.array([3, 2], dtype=np.int32),
            "lengths must be a 1-D numpy array of int64, got int32",
        ),
        (
            "token_ids",
            np.arange(5, dtype=np.int64),
            "token_ids must be a 1-D numpy array of int32, got int64",
        ),
        (
            "loss_mask",
            np.ones(5, dtype=bool),
            "loss_mask must be a 1-D numpy array of uint8, got bool",
        ),
        ("advantages", np.ones(5), "advantages must be a 1-D numpy array of float32, got float64"),
        ("behaviour_logprobs", np.ones(5, dtype=np.float16), "of float32, got float16"),
        ("policy_versions", np.ones(5, dtype=np.uint32), "of int32, got uint32"),
        (
            "token_ids",
            np.arange(5, dtype=np.int32).reshape(5, 1),
            r"got int32 array of shape \[5, 1\]",
        ),
        ("token_ids", [1, 2, 3, 4, 5], "token_ids must be a 1-D numpy array of int32, got list"),
        ("lengths", None, "got NoneType"),
        ("token_ids", np.arange(5, dtype=">i4"), "must be a 1-D numpy array of int32"),
    ],
)
def test_pack_wrong_dtype_or_ndim_raises_type_error(name: str, value: Any, expected: str) -> None:
    with pytest.raises(TypeError, match=expected):
        dataclasses.replace(INPUTS, **{name: value}).pack(seq_len=8)


@pytest.mark.parametrize(
    ("name", "what"),
    [
        ("token_ids", "token_ids (sum of lengths)"),
        ("loss_mask", "loss_mask"),
        ("advantages", "advantages (one per token, or one per sample = 2)"),
        ("behaviour_logprobs", "behaviour_logprobs"),
        ("policy_versions", "policy_versions"),
    ],
)
def test_pack_length_mismatch_raises_shape_error(name: str, what: str) -> None:
    short = getattr(INPUTS, name)[:4]
    with pytest.raises(
        treadle_native.ShapeError, match=re.escape(f"{what}: expected 5 elements, got 4")
    ):
        dataclasses.replace(INPUTS, **{name: short}).pack(seq_len=8)


@pytest.mark.parametrize(
    ("lengths", "error", "match"),
    [
        ([3, -2], treadle_native.TreadleNativeError, "sample 1 has a negative length"),
        ([5, 0], treadle_native.TreadleNativeError, "sample 1 has length 0"),
        ([2**62, 2], treadle_native.ShapeError, "token_ids"),
        ([2**63 - 1] * 3, treadle_native.TreadleNativeError, "sum of lengths overflows"),
        ([-(2**63), 5], treadle_native.TreadleNativeError, "negative length"),
    ],
)
def test_pack_bad_lengths_raise_typed_errors(
    lengths: list[int], error: type[Exception], match: str
) -> None:
    bad = dataclasses.replace(INPUTS, lengths=np.array(lengths, dtype=np.int64))
    with pytest.raises(error, match=match):
        bad.pack(seq_len=8)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, treadle_native.TreadleNativeError, "seq_len must be positive"),
        ({"seq_len": -5}, treadle_native.TreadleNativeError, "seq_len must be positive"),
        (
            {"seq_len": 2**31},
            treadle_native.TreadleNativeError,
            "position_ids and cu_seqlens are int32",
        ),
        ({"seq_len": 2**64}, OverflowError, None),
        (
            {"seq_len": 8, "num_ranks": 0},
            treadle_native.TreadleNativeError,
            "num_ranks must be in 1",
        ),
        (
            {"seq_len": 8, "num_ranks": -1},
            treadle_native.TreadleNativeError,
            "num_ranks must be in 1",
        ),
        (
            {"seq_len": 8, "num_ranks": 2**40},
            treadle_native.TreadleNativeError,
            "num_ranks must be in 1",
        ),
        ({"seq_len": 2**31 - 1, "num_ranks": 2}, treadle_native.TreadleNativeError, "token slots"),
        ({"seq_len": 8, "cost": "time"}, treadle_native.TreadleNativeError, "unknown cost model"),
        ({"seq_len": 8, "cost": "flops"}, treadle_native.TreadleNativeError, "needs hidden_size"),
        (
            {"seq_len": 8, "cost": "flops", "hidden_size": 0},
            treadle_native.TreadleNativeError,
            "hidden_size",
        ),
        ({"seq_len": 8, "hidden_size": 64}, treadle_native.TreadleNativeError, "only applies to"),
        (
            {"seq_len": 8, "truncation": "left"},
            treadle_native.TreadleNativeError,
            "unknown truncation",
        ),
        ({"seq_len": 8, "truncation": None}, TypeError, "truncation"),
        ({"seq_len": 8, "pad_token_id": 2**31}, OverflowError, None),
        ({"seq_len": "8"}, TypeError, "seq_len"),
        ({}, TypeError, "seq_len"),
    ],
)
def test_pack_bad_config_raises_typed_errors(
    kwargs: dict[str, Any], error: type[Exception], match: str | None
) -> None:
    with pytest.raises(error, match=match):
        INPUTS.pack(**kwargs)


def test_pack_non_finite_values_off_the_loss_become_zero() -> None:
    adv = INPUTS.advantages.copy()
    lp = INPUTS.behaviour_logprobs.copy()
    off = np.flatnonzero(INPUTS.loss_mask == 0)
    adv[off], lp[off] = np.nan, -np.inf
    b = dataclasses.replace(INPUTS, advantages=adv, behaviour_logprobs=lp).pack(seq_len=8)
    assert np.isfinite(b.advantages).all()
    assert np.isfinite(b.behaviour_logprobs).all()
    assert (b.advantages[b.loss_mask == 0] == 0).all()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("advantages", np.nan, "advantage is NaN on a loss token"),
        ("advantages", np.inf, "advantage is inf on a loss token"),
        ("behaviour_logprobs", -np.inf, "behaviour_logprob is -inf on a loss token"),
    ],
)
def test_pack_non_finite_values_on_the_loss_are_rejected(
    field: str, value: float, match: str
) -> None:
    inputs = make_pack_inputs([4, 6, 5], seed=2)
    token = int(np.flatnonzero(inputs.loss_mask)[-1])  # a loss token of the last sample
    values = getattr(inputs, field).copy()
    values[token] = value
    sample, position = 2, token - 10
    with pytest.raises(
        treadle_native.TreadleNativeError, match=f"sample {sample}, token {position}: {match}"
    ):
        dataclasses.replace(inputs, **{field: values}).pack(seq_len=8, parallel=False)


def test_pack_nan_per_sample_advantage_is_rejected() -> None:
    with pytest.raises(
        treadle_native.TreadleNativeError, match=r"sample 1, token \d+: advantage is NaN"
    ):
        dataclasses.replace(INPUTS, advantages=np.array([0.5, np.nan], dtype=np.float32)).pack(
            seq_len=8
        )


def test_pack_loss_mask_must_be_0_or_1() -> None:
    mask = INPUTS.loss_mask.copy()
    mask[3] = 255
    with pytest.raises(
        treadle_native.TreadleNativeError, match="sample 1, token 0: loss_mask is 255"
    ):
        dataclasses.replace(INPUTS, loss_mask=mask).pack(seq_len=8)


def test_pack_only_kept_tokens_are_validated() -> None:
    # the NaN sits on a loss token that right truncation drops: it never reaches the batch
    inputs = make_pack_inputs([12])
    adv = inputs.advantages.copy()
    mask = inputs.loss_mask.copy()
    mask[10], adv[10] = 1, np.nan
    b = dataclasses.replace(inputs, advantages=adv, loss_mask=mask).pack(seq_len=8)
    assert b.sample_truncated.tolist() == [True]
    assert np.isfinite(b.advantages).all()


def test_unpack_bad_values_raise_typed_errors() -> None:
    b = INPUTS.pack(seq_len=8)  # one micro-batch
    with pytest.raises(treadle_native.ShapeError, match=r"values of shape \[1, 7\]"):
        b.unpack(np.zeros((1, 7), dtype=np.float32))
    with pytest.raises(treadle_native.ShapeError, match="must be \\[num_micro_batches, seq_len\\]"):
        b.unpack(np.zeros(8, dtype=np.float32))
    with pytest.raises(TypeError, match="float32, float64, int32, int64 or uint8, got float16"):
        b.unpack(np.zeros((1, 8), dtype=np.float16))  # type: ignore[type-var]
    with pytest.raises(TypeError, match="got list"):
        b.unpack([[0.0] * 8])  # type: ignore[arg-type]


def test_packed_batch_bad_ids_raise_typed_errors() -> None:
    b = INPUTS.pack(seq_len=8, num_ranks=2)
    for rank in (-1, 2, 2**62):
        with pytest.raises(treadle_native.TreadleNativeError, match=f"rank {rank} is out of range"):
            b.rank_micro_batches(rank)
    for m in (-1, b.num_micro_batches):
        with pytest.raises(
            treadle_native.TreadleNativeError, match=f"micro-batch {m} is out of range"
        ):
            b.micro_batch_cu_seqlens(m)
        with pytest.raises(
            treadle_native.TreadleNativeError, match=f"micro-batch {m} is out of range"
        ):
            b.micro_batch_sample_index(m)


ODD_DTYPES = [np.int64, np.int32, np.uint8, np.float32, np.float64, np.int8, np.bool_]
ODD_INTS = st.integers(-3, 40) | st.sampled_from([0, 2**31, 2**62, -(2**63), 2**63 - 1])


def odd_array(data: st.DataObject, dtype: Any, size: int) -> np.ndarray:
    """Mostly the right dtype and size, sometimes not; values include NaN, inf and 255."""
    dtype = data.draw(st.sampled_from([dtype] * 6 + ODD_DTYPES))
    size = data.draw(st.sampled_from([size] * 6 + [0, max(size - 1, 0), size + 1]))
    if np.issubdtype(dtype, np.floating):
        elements = st.floats(allow_nan=True, allow_infinity=True, width=32)
    elif dtype == np.bool_:
        elements = st.booleans()
    else:
        info = np.iinfo(dtype)
        elements = st.integers(max(info.min, -3), min(info.max, 255)) | st.just(int(info.max))
    return np.array(data.draw(st.lists(elements, min_size=size, max_size=size)), dtype=dtype)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_pack_garbage_never_crashes(data: st.DataObject) -> None:
    num_samples = data.draw(st.integers(0, 6))
    lengths = data.draw(st.lists(ODD_INTS, min_size=num_samples, max_size=num_samples))
    lengths_arr = np.array(lengths, dtype=np.int64)
    num_tokens = data.draw(st.sampled_from([int(np.clip(lengths_arr, 0, 60).sum()), 0, 7]))
    kwargs: dict[str, Any] = {
        "seq_len": data.draw(st.integers(-2, 50) | st.sampled_from([2**31, 2**63 - 1])),
        "num_ranks": data.draw(st.integers(-1, 5) | st.sampled_from([2**31, 2**62])),
        "truncation": data.draw(st.sampled_from(["right", "error", "middle"])),
        "pad_token_id": data.draw(st.integers(-5, 5)),
        "parallel": data.draw(st.booleans()),
    }
    if data.draw(st.booleans()):
        kwargs |= {"cost": "flops", "hidden_size": data.draw(st.integers(-1, 4096))}
    args: tuple[Any, ...] = (
        data.draw(st.sampled_from([lengths_arr, lengths_arr.astype(np.int32)])),
        odd_array(data, np.int32, num_tokens),
        odd_array(data, np.uint8, num_tokens),
        odd_array(data, np.float32, data.draw(st.sampled_from([num_tokens, num_samples]))),
        odd_array(data, np.float32, num_tokens),
        odd_array(data, np.int32, num_tokens),
    )
    try:
        b = treadle_native.pack(*args, **kwargs)
    except (TypeError, OverflowError, treadle_native.TreadleNativeError):
        return  # typed rejection; any other exception fails the test
    # accepted: then the contract holds
    seq_len = kwargs["seq_len"]
    assert b.input_ids.shape == (b.num_micro_batches, seq_len)
    assert b.num_micro_batches == b.micro_batches_per_rank * kwargs["num_ranks"]
    assert np.isfinite(b.advantages).all()
    assert np.isfinite(b.behaviour_logprobs).all()
    assert set(np.unique(b.loss_mask).tolist()) <= {0, 1}
    flat, lengths_S = b.unpack(b.input_ids)
    np.testing.assert_array_equal(lengths_S, np.minimum(lengths_arr, seq_len))
    assert flat.shape == (int(lengths_S.sum()),)
