"""Where the rollouts of a batch spent their time, as percentiles in the step's metrics.

From each rollout's ``RolloutTiming`` (requested by the orchestrator, started and
finished by an env runner):

    rollout_e2e_s         finished_at - requested_at  (queue + generation + env + reward)
    rollout_queue_s       started_at - requested_at   (waiting in ROLLOUT_REQUESTS)
    rollout_generation_s  generation_s                (waiting on inference, all calls)
    rollout_env_s         env_s                       (environment and tool code)

each as ``<name>_p50``, ``_p90`` and ``_p99`` (seconds). The two wall-clock spans
compare stamps of two machines, so clock skew between them shows up there; the other
two are measured on the env runner alone. A rollout without the stamps a span needs is
left out of that span. This module only computes; the loop reports.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.proto.v1 import rollout_pb2

PERCENTILES = (50, 90, 99)


def _seconds(later: Timestamp, earlier: Timestamp) -> float | None:
    """``later - earlier`` in seconds; None when either stamp is unset (zero)."""
    if not (later.seconds or later.nanos) or not (earlier.seconds or earlier.nanos):
        return None
    return (later.seconds - earlier.seconds) + (later.nanos - earlier.nanos) / 1e9


def rollout_latency_stats(rollouts: Iterable[rollout_pb2.Rollout]) -> dict[str, float]:
    """Percentiles of the rollouts' time spans; empty when none carries timing."""
    spans: dict[str, list[float]] = {
        "rollout_e2e_s": [],
        "rollout_queue_s": [],
        "rollout_generation_s": [],
        "rollout_env_s": [],
    }
    for r in rollouts:
        if not r.HasField("timing"):
            continue
        t = r.timing
        e2e = _seconds(t.finished_at, t.requested_at)
        queue = _seconds(t.started_at, t.requested_at)
        if e2e is not None:
            spans["rollout_e2e_s"].append(e2e)
        if queue is not None:
            spans["rollout_queue_s"].append(queue)
        if t.HasField("started_at") and t.HasField("finished_at"):
            spans["rollout_generation_s"].append(t.generation_s)
            spans["rollout_env_s"].append(t.env_s)
    stats: dict[str, float] = {}
    for name, values in spans.items():
        if not values:
            continue
        qs = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
        for p, q in zip(PERCENTILES, qs, strict=True):
            stats[f"{name}_p{p}"] = float(q)
    return stats
