"""Packing throughput, native against straightforward Python/numpy, measured in one run.

    .venv/bin/python benchmarks/packing_bench.py [--samples 20000] [--seq-len 8192]
        [--pack-samples 4096] [--num-ranks 8] [--repeats 5]

1. ``first_fit_decreasing`` vs a pure-Python first fit on the same lengths.
2. The full ``pack`` (truncation, bins, rank balancing, every [M, seq_len] tensor,
   cu_seqlens and sample_index) on one thread (``parallel=False``) and on rayon's pool,
   vs a numpy implementation of the same packing (pure-Python first fit and
   longest-processing-time assignment, vectorized numpy fill).

Lengths are log-normal, like RL rollouts. Results are checked to be identical before
anything is timed; times are the best of ``--repeats``. Tokens/s counts packed
(non-padding) tokens. Times include faulting in the fresh output memory (22 bytes per
token slot), which the kernel dominates on small or virtualized machines; with glibc,
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (transparent huge pages for large allocations)
cuts that cost severalfold.
"""

from __future__ import annotations

import argparse
import heapq
import os
import time
from typing import Any

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


def numpy_pack(
    lengths: np.ndarray,
    token_ids: np.ndarray,
    loss_mask: np.ndarray,
    advantages: np.ndarray,
    behaviour_logprobs: np.ndarray,
    policy_versions: np.ndarray,
    seq_len: int,
    num_ranks: int,
    pad_token_id: int = 0,
) -> dict[str, np.ndarray]:
    """The same packing as ``treadle_native.pack`` (token cost, right truncation)."""
    num_samples = len(lengths)
    kept = np.minimum(lengths, seq_len)
    starts = np.cumsum(lengths) - lengths
    # bins by first fit decreasing, then longest processing time onto ranks
    bins = np.array(python_ffd(kept.tolist(), seq_len), dtype=np.int64)
    num_bins = int(bins.max()) + 1 if num_samples else 0
    bin_cost = np.bincount(bins, weights=kept, minlength=num_bins).tolist()
    per_rank = -(-num_bins // num_ranks)
    heap = [(0.0, r) for r in range(num_ranks)]
    filled = [0] * num_ranks
    slot = np.zeros(num_bins, dtype=np.int64)
    for b in sorted(range(num_bins), key=lambda b: (-bin_cost[b], b)):
        load, r = heapq.heappop(heap)
        slot[b] = r * per_rank + filled[r]
        filled[r] += 1
        if filled[r] < per_rank:
            heapq.heappush(heap, (load + bin_cost[b], r))
    num_mb = per_rank * num_ranks
    # each sample's micro-batch and offset: documents in ascending sample order
    micro_batch = slot[bins]
    order = np.lexsort((np.arange(num_samples), micro_batch))
    ends = np.cumsum(kept[order])
    group_start = np.searchsorted(micro_batch[order], micro_batch[order], side="left")
    before = np.concatenate([[0], ends])[group_start]
    offset = np.empty(num_samples, dtype=np.int64)
    offset[order] = ends - kept[order] - before
    # scatter every kept token to its slot in the flat [M * seq_len] tensors
    total = int(kept.sum())
    position = np.arange(total) - np.repeat(np.cumsum(kept) - kept, kept)
    src = np.repeat(starts, kept) + position
    dst = np.repeat(micro_batch * seq_len + offset, kept) + position
    on_loss = loss_mask[src] != 0
    if advantages.size == num_samples and advantages.size != token_ids.size:
        advantages = np.repeat(advantages, lengths)
    out = {
        "input_ids": np.full(num_mb * seq_len, pad_token_id, dtype=np.int32),
        "position_ids": np.zeros(num_mb * seq_len, dtype=np.int32),
        "loss_mask": np.zeros(num_mb * seq_len, dtype=np.uint8),
        "advantages": np.zeros(num_mb * seq_len, dtype=np.float32),
        "behaviour_logprobs": np.zeros(num_mb * seq_len, dtype=np.float32),
        "policy_versions": np.full(num_mb * seq_len, -1, dtype=np.int32),
    }
    out["input_ids"][dst] = token_ids[src]
    out["position_ids"][dst] = position
    out["loss_mask"][dst] = loss_mask[src]
    out["advantages"][dst] = np.where(on_loss, advantages[src], 0)
    out["behaviour_logprobs"][dst] = np.where(on_loss, behaviour_logprobs[src], 0)
    out["policy_versions"][dst] = policy_versions[src]
    for name in list(out):
        out[name] = out[name].reshape(num_mb, seq_len)
    # ragged: documents and boundaries per micro-batch
    num_docs = np.bincount(micro_batch, minlength=num_mb)
    out["sample_index"] = order.astype(np.int32)
    cu = [np.concatenate([[0], np.cumsum(kept[order[a:b]])]) for a, b in _runs(num_docs)]
    out["cu_seqlens"] = np.concatenate(cu or [np.zeros(0)]).astype(np.int32)
    out["sample_micro_batch"] = micro_batch
    out["sample_offset"] = offset
    return out


def _runs(counts: np.ndarray) -> list[tuple[int, int]]:
    ends = np.cumsum(counts)
    return list(zip((ends - counts).tolist(), ends.tolist(), strict=True))


def best_of(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_ffd(args: argparse.Namespace, rng: np.random.Generator) -> None:
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
    print(f"first_fit_decreasing: {args.samples} samples, {tokens} tokens, seq_len {args.seq_len}, "
          f"{bins} bins (fill {tokens / (bins * args.seq_len):.1%})")  # fmt: skip
    print(
        f"native first_fit_decreasing : {tokens / t_native / 1e6:10.1f} M tokens/s  ({t_native * 1e3:.2f} ms)"
    )
    print(
        f"pure-Python first fit       : {tokens / t_python / 1e6:10.1f} M tokens/s  ({t_python * 1e3:.2f} ms)"
    )
    print(f"ratio native / Python       : {t_python / t_native:10.1f}x")


def bench_pack(args: argparse.Namespace, rng: np.random.Generator) -> None:
    num_samples, seq_len, num_ranks = args.pack_samples, args.seq_len, args.num_ranks
    lengths = np.clip(rng.lognormal(7.0, 1.0, num_samples), 1, seq_len).astype(np.int64)
    num_tokens = int(lengths.sum())
    loss_mask = (rng.random(num_tokens) < 0.7).astype(np.uint8)
    inputs = (
        lengths,
        rng.integers(0, 150_000, num_tokens, dtype=np.int32),
        loss_mask,
        rng.standard_normal(num_samples).astype(np.float32),  # per sample, broadcast
        -rng.exponential(1.0, num_tokens).astype(np.float32),
        np.where(loss_mask == 1, 7, -1).astype(np.int32),
    )

    def native(parallel: bool) -> treadle_native.PackedBatch:
        return treadle_native.pack(*inputs, seq_len=seq_len, num_ranks=num_ranks, parallel=parallel)

    b = native(parallel=True)
    ref = numpy_pack(*inputs, seq_len=seq_len, num_ranks=num_ranks)
    for name, expected in ref.items():
        assert np.array_equal(getattr(b, name), expected), f"native and numpy {name} differ"
    assert np.array_equal(native(parallel=False).input_ids, b.input_ids)
    num_mb, per_rank = b.num_micro_batches, b.micro_batches_per_rank
    del b, ref  # time every implementation from the same allocator state

    t_single = best_of(lambda: native(parallel=False), args.repeats)
    t_all = best_of(lambda: native(parallel=True), args.repeats)
    t_numpy = best_of(
        lambda: numpy_pack(*inputs, seq_len=seq_len, num_ranks=num_ranks),
        max(1, args.repeats // 2),
    )
    threads = os.environ.get("RAYON_NUM_THREADS") or str(os.cpu_count())
    print(
        f"\npack: {num_samples} samples, {num_tokens} tokens, seq_len {seq_len}, {num_ranks} ranks, "
        f"{num_mb} micro-batches ({per_rank} per rank, fill {num_tokens / (num_mb * seq_len):.1%})"
    )
    print(f"{'implementation':<34}{'ms':>9}{'M tokens/s':>13}{'vs numpy':>10}")
    for label, t in (
        ("native pack, 1 thread", t_single),
        (f"native pack, rayon ({threads} threads)", t_all),
        ("numpy/Python pack", t_numpy),
    ):
        print(f"{label:<34}{t * 1e3:9.1f}{num_tokens / t / 1e6:13.1f}{t_numpy / t:9.1f}x")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--samples", type=int, default=20_000, help="samples for first_fit_decreasing")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--pack-samples", type=int, default=4096, help="samples for pack")
    p.add_argument("--num-ranks", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    bench_ffd(args, rng)
    bench_pack(args, rng)


if __name__ == "__main__":
    main()
