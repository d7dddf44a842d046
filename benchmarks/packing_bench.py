"""Packing throughput: treadle_native.first_fit_decreasing vs a pure-Python first fit.

    .venv/bin/python benchmarks/packing_bench.py [--samples 20000] [--seq-len 8192]

Both pack the same lengths (log-normal, like RL rollouts) in the same run; the report
gives tokens/s of each and their ratio. Results are checked to be identical.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import treadle_native


def python_ffd(lengths: list[int], seq_len: int) -> list[int]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[int] = []
    out = [0] * len(lengths)
    for i in order:
        b = next((j for j, r in enumerate(room) if r >= lengths[i]), -1)
        if b < 0:
            room.append(seq_len)
            b = len(room) - 1
        room[b] -= lengths[i]
        out[i] = b
    return out


def best_of(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(6.0, 1.0, args.samples), 1, args.seq_len).astype(np.int64)
    tokens = int(lengths.sum())
    as_list = lengths.tolist()
    native = treadle_native.first_fit_decreasing(lengths, args.seq_len)
    reference = python_ffd(as_list, args.seq_len)
    assert native.tolist() == reference, "native and Python packings differ"
    t_native = best_of(
        lambda: treadle_native.first_fit_decreasing(lengths, args.seq_len), args.repeats
    )
    t_python = best_of(lambda: python_ffd(as_list, args.seq_len), max(1, args.repeats // 2))
    bins = int(native.max()) + 1
    print(f"{args.samples} samples, {tokens} tokens, seq_len {args.seq_len}, {bins} bins "
          f"(fill {tokens / (bins * args.seq_len):.1%})")  # fmt: skip
    print(
        f"native first_fit_decreasing : {tokens / t_native / 1e6:10.1f} M tokens/s  ({t_native * 1e3:.2f} ms)"
    )
    print(
        f"pure-Python first fit       : {tokens / t_python / 1e6:10.1f} M tokens/s  ({t_python * 1e3:.2f} ms)"
    )
    print(f"ratio native / Python       : {t_python / t_native:10.1f}x")


if __name__ == "__main__":
    main()
