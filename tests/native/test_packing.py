"""treadle_native.first_fit_decreasing against a slow pure-Python reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treadle_native


def reference_ffd(lengths: list[int], seq_len: int) -> list[int]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[int] = []
    out = [0] * len(lengths)
    for i in order:
        bin_ = next((b for b, r in enumerate(room) if r >= lengths[i]), None)
        if bin_ is None:
            room.append(seq_len)
            bin_ = len(room) - 1
        room[bin_] -= lengths[i]
        out[i] = bin_
    return out


def test_packing_known_example() -> None:
    out = treadle_native.first_fit_decreasing(np.array([4, 6, 5, 5, 3], dtype=np.int64), 10)
    assert out.dtype == np.uint32
    assert out.tolist() == [0, 0, 1, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 512), max_size=300), st.integers(512, 2048))
def test_packing_matches_reference(lengths: list[int], seq_len: int) -> None:
    out = treadle_native.first_fit_decreasing(np.array(lengths, dtype=np.int64), seq_len)
    assert out.tolist() == reference_ffd(lengths, seq_len)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=300), st.integers(300, 1000))
def test_packing_never_overfills(lengths: list[int], seq_len: int) -> None:
    out = treadle_native.first_fit_decreasing(np.array(lengths, dtype=np.int64), seq_len)
    used = np.bincount(out, weights=lengths)
    assert (used <= seq_len).all()
    assert (used > 0).all()  # no empty bins are opened


def test_packing_errors_are_typed() -> None:
    with pytest.raises(
        treadle_native.SequenceTooLongError, match="sample 1 has 11 tokens, more than seq_len 10"
    ):
        treadle_native.first_fit_decreasing(np.array([3, 11], dtype=np.int64), 10)
    with pytest.raises(treadle_native.TreadleNativeError, match="seq_len must be positive"):
        treadle_native.first_fit_decreasing(np.array([3], dtype=np.int64), 0)
    with pytest.raises(treadle_native.TreadleNativeError, match="negative length"):
        treadle_native.first_fit_decreasing(np.array([-3], dtype=np.int64), 10)
    assert issubclass(treadle_native.TreadleNativeError, ValueError)


def test_packing_rejects_wrong_dtype_without_crashing() -> None:
    with pytest.raises(TypeError):
        treadle_native.first_fit_decreasing(np.array([1.5, 2.0]), 10)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        treadle_native.first_fit_decreasing([1, 2], 10)  # type: ignore[arg-type]


def test_packing_accepts_strided_views() -> None:
    lengths = np.arange(40, dtype=np.int64)[::2]
    assert not lengths.flags.c_contiguous
    assert treadle_native.first_fit_decreasing(lengths, 100).tolist() == reference_ffd(
        lengths.tolist(), 100
    )
