"""pass@k from k samples per task: the unbiased estimator (Chen et al. 2021) and the ks
reported for a given k. Used by ``treadle eval`` and evaluation during training."""

from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """The ks reported for n samples per task: 1, 2, 4, ... and n."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    if ks[-1] != n:
        ks.append(n)
    return ks
