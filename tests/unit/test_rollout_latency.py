"""Rollout latency percentiles of a batch, from each rollout's RolloutTiming."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from treadle.orchestrator.latency import LatencyInstruments, rollout_latency_stats
from treadle.proto.v1 import rollout_pb2


def stamp(seconds: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(round(seconds * 1e9))
    return t


def timed(
    requested: float, started: float, finished: float, gen: float, env: float, reward: float = 0.0
) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(rollout_id=f"r{requested}", env="reverse_text")
    r.timing.requested_at.CopyFrom(stamp(requested))
    r.timing.started_at.CopyFrom(stamp(started))
    r.timing.finished_at.CopyFrom(stamp(finished))
    r.timing.generation_s = gen
    r.timing.env_s = env
    r.timing.reward_s = reward
    return r


def test_rollout_latency_percentiles_of_each_span() -> None:
    base = 1_790_000_000.0
    spans = [(0.5 * i, 1.0 + i, 0.1 * i) for i in range(1, 11)]  # (queue, work, env)
    rollouts = [
        timed(base, base + q, base + q + work, gen=work - 2 * env, env=env, reward=env)
        for q, work, env in spans
    ]
    rollouts.append(rollout_pb2.Rollout(rollout_id="untimed"))  # no timing: left out
    stats = rollout_latency_stats(rollouts)
    columns = {
        "rollout_e2e_s": [q + w for q, w, _ in spans],
        "rollout_queue_s": [q for q, _, _ in spans],
        "rollout_generation_s": [w - 2 * e for _, w, e in spans],
        "rollout_env_s": [e for _, _, e in spans],
        "rollout_reward_s": [e for _, _, e in spans],
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


def test_latency_instruments_record_each_span_with_run_and_env() -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    inst = LatencyInstruments("run-a", provider.get_meter("test"))
    base = 1_790_000_000.0
    ok = timed(base, base + 0.5, base + 3.0, gen=2.0, env=0.25, reward=0.125)
    ok.status.kind = rollout_pb2.RolloutStatus.Kind.KIND_OK
    failed = timed(base, base + 1.0, base + 1.5, gen=0.0, env=0.5)
    failed.status.kind = rollout_pb2.RolloutStatus.Kind.KIND_ERROR
    inst.record_rollout(ok)
    inst.record_rollout(failed)
    inst.record_rollout(rollout_pb2.Rollout(rollout_id="untimed", env="reverse_text"))
    inst.record_samples("reverse_text", [0, 1, 1], num_stale=2)
    points: dict[tuple[str, str], Any] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for metric in data.resource_metrics[0].scope_metrics[0].metrics:
        for point in metric.data.data_points:
            assert point.attributes["treadle.run"] == "run-a"
            assert point.attributes["treadle.env"] == "reverse_text"
            points[(metric.name, str(point.attributes.get("treadle.rollout.status", "")))] = point
    e2e = points[("treadle.rollout.e2e", "ok")]
    assert (e2e.count, e2e.sum) == (1, pytest.approx(3.0))
    assert points[("treadle.rollout.queue_wait", "error")].sum == pytest.approx(1.0)
    assert points[("treadle.rollout.generation", "ok")].sum == pytest.approx(2.0)
    assert points[("treadle.rollout.env", "ok")].sum == pytest.approx(0.25)
    assert points[("treadle.rollout.reward", "ok")].sum == pytest.approx(0.125)
    assert sum(p.count for (name, _), p in points.items() if name == "treadle.rollout.e2e") == 2
    lag = points[("treadle.sample.policy_lag", "")]
    assert (lag.count, lag.sum) == (3, 2)
    assert points[("treadle.sample.stale_dropped", "")].value == 2
