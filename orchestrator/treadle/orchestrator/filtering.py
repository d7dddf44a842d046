"""Online difficulty filtering: which completed groups are worth training.

A group whose trainable rollouts all got the same reward teaches nothing to a
baseline algorithm (every advantage is 0), and a group that almost always passes or
almost always fails teaches little. ``[orchestrator.filter]`` refuses such groups:

- ``zero_variance`` (on by default): every trainable reward equal;
- the pass-rate band: the fraction of trainable rollouts with reward >=
  ``pass_reward`` outside [``min_pass_rate``, ``max_pass_rate``] (off at [0, 1]).

``action`` decides what a refusal does: ``keep`` trains the group anyway (refusals are
only counted), ``drop`` cuts the step's batch without it, ``resample`` removes it before
the batch is cut so that a new group (the next task) takes its place. Every refusal is
counted per step (``num_groups_zero_variance``, ``num_groups_outside_pass_rate``) and
in total (``groups_filtered_total``).

Not here: the loop's bookkeeping of removed groups (``loop.py``).
"""

from __future__ import annotations

import numpy as np

from treadle.orchestrator.spec import FilterSection

ZERO_VARIANCE = "zero_variance"
OUTSIDE_PASS_RATE = "outside_pass_rate"
REASONS = (ZERO_VARIANCE, OUTSIDE_PASS_RATE)


def refusal(rewards: np.ndarray, cfg: FilterSection) -> str:
    """Why the filter refuses a group with these trainable rewards ([R] float), or ""."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return ""
    if cfg.zero_variance and float(r.max() - r.min()) == 0.0:
        return ZERO_VARIANCE
    rate = float(np.mean(r >= cfg.pass_reward))
    if not cfg.min_pass_rate <= rate <= cfg.max_pass_rate:
        return OUTSIDE_PASS_RATE
    return ""
