"""Where rollouts spent their time: percentiles in a step's metrics, and OpenTelemetry
histograms as completions arrive.

From each rollout's ``RolloutTiming`` (requested by the orchestrator, started and
finished by an env runner):

    rollout_e2e_s         finished_at - requested_at  (queue + generation + env + reward)
    rollout_queue_s       started_at - requested_at   (waiting in ROLLOUT_REQUESTS)
    rollout_generation_s  generation_s                (waiting on inference, all calls)
    rollout_env_s         env_s                       (environment and tool code)
    rollout_reward_s      reward_s                    (reward functions)

``rollout_latency_stats`` gives each as ``<name>_p50``, ``_p90`` and ``_p99`` (seconds)
over a batch's rollouts. ``LatencyInstruments`` records the same spans, per completion,
as OpenTelemetry histograms (``treadle.rollout.e2e`` and so on, in seconds), plus the
policy lag of every trained sample and the samples dropped as stale, with the run, the
environment and the rollout's status as attributes; they are exported when the
orchestrator's telemetry has an OTLP endpoint (no-ops otherwise).

Time to first token is not among them: the token route answers a call whole, not
streamed, and carries no per-request timings, so the env runner cannot see it. vLLM
measures it: the ``llm_request`` span of each model call (in the rollout's trace) has it
as ``gen_ai.latency.time_to_first_token``, and vLLM's Prometheus ``/metrics`` as the
histogram ``vllm:time_to_first_token_seconds``.

The two wall-clock spans compare stamps of two machines, so clock skew between them
shows up there; the others are measured on the env runner alone. A rollout without the
stamps a span needs is left out of that span. This module only computes and records;
the loop decides when.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import metrics

from treadle.proto.v1 import rollout_pb2
from treadle.services import telemetry

PERCENTILES = (50, 90, 99)
# seconds: a tool call of milliseconds up to a rollout of many minutes
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0,
                   100.0, 250.0, 500.0, 1000.0)  # fmt: skip
LAG_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)  # policy versions
SPANS = {
    "rollout_e2e_s": ("treadle.rollout.e2e", "requested until scored (all of the below)"),
    "rollout_queue_s": ("treadle.rollout.queue_wait", "waiting for an env runner"),
    "rollout_generation_s": ("treadle.rollout.generation", "waiting on inference, all calls"),
    "rollout_env_s": ("treadle.rollout.env", "environment and tool code"),
    "rollout_reward_s": ("treadle.rollout.reward", "reward functions"),
}
_STATUS = {
    rollout_pb2.RolloutStatus.Kind.KIND_OK: "ok",
    rollout_pb2.RolloutStatus.Kind.KIND_TRUNCATED: "truncated",
    rollout_pb2.RolloutStatus.Kind.KIND_ERROR: "error",
}


def _seconds(later: Timestamp, earlier: Timestamp) -> float | None:
    """``later - earlier`` in seconds; None when either stamp is unset (zero)."""
    if not (later.seconds or later.nanos) or not (earlier.seconds or earlier.nanos):
        return None
    return (later.seconds - earlier.seconds) + (later.nanos - earlier.nanos) / 1e9


def rollout_spans(r: rollout_pb2.Rollout) -> dict[str, float]:
    """The time spans of one rollout (seconds), keyed as in ``SPANS``; those it lacks the
    stamps for are left out."""
    if not r.HasField("timing"):
        return {}
    t = r.timing
    out: dict[str, float] = {}
    e2e = _seconds(t.finished_at, t.requested_at)
    queue = _seconds(t.started_at, t.requested_at)
    if e2e is not None:
        out["rollout_e2e_s"] = e2e
    if queue is not None:
        out["rollout_queue_s"] = queue
    if t.HasField("started_at") and t.HasField("finished_at"):
        out["rollout_generation_s"] = t.generation_s
        out["rollout_env_s"] = t.env_s
        out["rollout_reward_s"] = t.reward_s
    return out


def rollout_latency_stats(rollouts: Iterable[rollout_pb2.Rollout]) -> dict[str, float]:
    """Percentiles of the rollouts' time spans; empty when none carries timing."""
    spans: dict[str, list[float]] = {name: [] for name in SPANS}
    for r in rollouts:
        for name, value in rollout_spans(r).items():
            spans[name].append(value)
    stats: dict[str, float] = {}
    for name, values in spans.items():
        if not values:
            continue
        qs = np.percentile(np.asarray(values, dtype=np.float64), PERCENTILES)
        for p, q in zip(PERCENTILES, qs, strict=True):
            stats[f"{name}_p{p}"] = float(q)
    return stats


class LatencyInstruments:
    """The orchestrator's rollout histograms and counters (OpenTelemetry metrics)."""

    def __init__(self, run: str, meter: metrics.Meter | None = None):
        self.run = run
        m = meter or telemetry.meter(__name__)
        self.spans = {
            key: m.create_histogram(name, unit="s", description=what,
                                    explicit_bucket_boundaries_advisory=SECONDS_BUCKETS)
            for key, (name, what) in SPANS.items()
        }  # fmt: skip
        self.policy_lag = m.create_histogram(
            "treadle.sample.policy_lag", unit="{policy_version}",
            description="policy versions between a trained sample's oldest token and the "
                        "policy it trains", explicit_bucket_boundaries_advisory=LAG_BUCKETS,
        )  # fmt: skip
        self.stale = m.create_counter(
            "treadle.sample.stale_dropped", unit="{sample}",
            description="samples dropped because their oldest token is too old",
        )  # fmt: skip

    def record_rollout(self, r: rollout_pb2.Rollout) -> None:
        """One completed rollout's time spans."""
        attrs = {"treadle.run": self.run, "treadle.env": r.env,
                 "treadle.rollout.status": _STATUS.get(r.status.kind, "unknown")}  # fmt: skip
        for name, value in rollout_spans(r).items():
            self.spans[name].record(value, attrs)

    def record_samples(self, env: str, lags: Iterable[int], num_stale: int) -> None:
        """A batch's trained samples (their policy lags) and the stale ones dropped."""
        attrs = {"treadle.run": self.run, "treadle.env": env}
        for lag in lags:
            self.policy_lag.record(lag, attrs)
        if num_stale:
            self.stale.add(num_stale, attrs)
