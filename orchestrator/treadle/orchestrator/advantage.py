"""Advantages from rewards, per group (the *algorithm*; the trainer only sees the result).

- ``grpo``: reward minus the group mean (optionally divided by the group's std);
- ``rloo``: reward minus the mean of the *other* rollouts of the group;
- ``sft``: 1 for every sample (imitation of the kept rollouts).
"""

from __future__ import annotations

import numpy as np


def group_advantages(
    rewards: np.ndarray, method: str, *, normalize: bool = False, eps: float = 1e-6
) -> np.ndarray:
    """Advantages of one group's rewards (float64 [n] -> float32 [n])."""
    r = np.asarray(rewards, dtype=np.float64)
    n = r.size
    if method == "sft":
        return np.ones(n, dtype=np.float32)
    if n < 2:
        raise ValueError(f"advantage {method!r} needs at least 2 rollouts in a group, got {n}")
    if method == "grpo":
        adv = r - r.mean()
        if normalize:
            adv = adv / (r.std() + eps)
    elif method == "rloo":
        adv = r - (r.sum() - r) / (n - 1)
    else:
        raise ValueError(f"unknown advantage method {method!r}")
    return adv.astype(np.float32)
