"""Rollout latency percentiles of a batch, from each rollout's RolloutTiming."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.orchestrator.latency import rollout_latency_stats
from treadle.proto.v1 import rollout_pb2


def stamp(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(round(seconds * 1e9))
    return t


def timed(
    requested: float, started: float, finished: float, gen: float, env: float
) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(rollout_id=f"r{requested}")
    r.timing.requested_at.CopyFrom(stamp(requested))
    r.timing.started_at.CopyFrom(stamp(started))
    r.timing.finished_at.CopyFrom(stamp(finished))
    r.timing.generation_s = gen
    r.timing.env_s = env
    return r


def test_rollout_latency_percentiles_of_each_span() -> None:
    base = 1_790_000_000.0
    spans = [(0.5 * i, 1.0 + i, 0.1 * i) for i in range(1, 11)]  # (queue, work, env)
    rollouts = [
        timed(base, base + q, base + q + work, gen=work - env, env=env) for q, work, env in spans
    ]
    rollouts.append(rollout_pb2.Rollout(rollout_id="untimed"))  # no timing: left out
    stats = rollout_latency_stats(rollouts)
    columns = {
        "rollout_e2e_s": [q + w for q, w, _ in spans],
        "rollout_queue_s": [q for q, _, _ in spans],
        "rollout_generation_s": [w - e for _, w, e in spans],
        "rollout_env_s": [e for _, _, e in spans],
    }
    assert set(stats) == {f"{n}_p{p}" for n in columns for p in (50, 90, 99)}
    for name, values in columns.items():
        for p in (50, 90, 99):
            assert stats[f"{name}_p{p}"] == pytest.approx(np.percentile(values, p), abs=1e-6)


def test_rollout_latency_of_rollouts_without_timing_is_empty() -> None:
    r = rollout_pb2.Rollout(rollout_id="a")
    r.timing.generation_s = 1.0  # timing set, but never started or finished
    assert rollout_latency_stats([r, rollout_pb2.Rollout(rollout_id="b")]) == {}
    assert rollout_latency_stats([]) == {}
