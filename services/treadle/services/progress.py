"""Live progress of a run: follow the METRICS stream, write metrics.jsonl, print a line per step.

    METRICS (every service's MetricsReport) ──▶ outputs/<run>/metrics.jsonl (one JSON object per report)
                                             ├─▶ stdout: step 12/200  reward 0.43  loss 0.12  kl 0.0012 ...
                                             └─▶ TensorBoard / W&B when [telemetry] turns them on (metric_sinks.py)

A line is printed when the trainer reports a step, with the newest orchestrator values
(reward, policy lag) beside it, and one when the orchestrator reports an evaluation round
(``eval/`` keys: held-out reward, pass@1, the policy version evaluated). Each JSON line is ``{"time", "service", "step", ...values}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.proto.v1 import metrics_pb2
from treadle.services.bus import Bus, Delivery
from treadle.services.errors import TreadleError
from treadle.services.metric_sinks import MetricSink
from treadle.services.sections import NatsSection

log = logging.getLogger(__name__)

SHOWN = [
    ("reward", "orchestrator", "reward_mean", "{:.3f}"),
    ("loss", "trainer", "loss", "{:.4f}"),
    ("kl", "trainer", "mismatch_kl", "{:.4f}"),
    ("lag", "orchestrator", "policy_lag_mean", "{:.2f}"),
    ("tok/s", "trainer", "tokens_per_s", "{:.0f}"),
]


class Progress:
    def __init__(
        self, path: Path, job: str, max_steps: int | None, sinks: Sequence[MetricSink] = ()
    ):
        self.path = path
        self.sinks = list(sinks)
        self.job = job
        self.max_steps = max_steps
        self.latest: dict[str, dict[str, float]] = {}
        self.started = time.monotonic()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def record(self, report: metrics_pb2.MetricsReport) -> str | None:
        """Append the report to metrics.jsonl; the progress line to print, if any."""
        row: dict[str, Any] = {
            "time": report.time.ToDatetime().timestamp() if report.HasField("time") else time.time()
        }
        row |= {"service": report.service, "step": report.step, **dict(report.values)}
        # strict JSON: a non-finite value (a NaN loss) is written as null, never NaN/Infinity
        row = {
            k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()
        }
        self.file.write(json.dumps(row, allow_nan=False) + "\n")
        self.file.flush()
        self._to_sinks(report.service, report.step, row["time"], dict(report.values))
        # merged: a report of some keys (an eval row) leaves the others' newest values
        self.latest.setdefault(report.service, {}).update(report.values)
        if "eval/reward_mean" in report.values:
            return self._eval_line(report.step, dict(report.values))
        if report.service != "trainer":
            return None
        total = f"/{self.max_steps}" if self.max_steps else ""
        parts = [f"[{self.job}] step {report.step}{total}"]
        for label, service, key, fmt in SHOWN:
            value = self.latest.get(service, {}).get(key)
            if value is not None:
                parts.append(f"{label} {fmt.format(value)}")
        elapsed = int(time.monotonic() - self.started)
        parts.append(f"{elapsed // 60}m{elapsed % 60:02d}s")
        return "  ".join(parts)

    def _eval_line(self, step: int, v: dict[str, float]) -> str:
        parts = [f"[{self.job}] eval at step {step}", f"reward {v['eval/reward_mean']:.3f}"]
        if "eval/pass@1" in v:
            parts.append(f"pass@1 {v['eval/pass@1']:.3f}")
        parts.append(f"{int(v.get('eval/num_rollouts', 0))} rollouts")
        if v.get("eval/num_rollouts_error"):
            parts.append(f"{int(v['eval/num_rollouts_error'])} errors")
        parts.append(f"policy {int(v.get('eval/policy_version', -1))}")
        return "  ".join(parts)

    def _to_sinks(
        self, service: str, step: int, wall_time: float, values: dict[str, float]
    ) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(service, step, wall_time, values)
            except Exception as e:  # a third-party sink's failure must not stop the run
                log.warning("metrics sink %s failed, no longer used: %r", sink.name, e)
                self.sinks.remove(sink)

    def close(self) -> None:
        """Close metrics.jsonl (the sinks belong to whoever opened them)."""
        self.file.close()


async def follow_metrics(
    cfg: Any,
    nats: NatsSection,
    path: Path,
    job: str,
    max_steps: int | None,
    sinks: Sequence[MetricSink] = (),
) -> None:
    """Follow METRICS until cancelled (``nats``: how the launcher connects, as admin);
    each report also goes to ``sinks``, which the caller closes."""
    progress = Progress(path, job, max_steps, sinks)
    bus = await Bus.connect(nats, cfg.run.name, name="treadle-launcher", role="admin")
    stop = asyncio.Event()
    try:
        await bus.ensure_streams()
        consumer = await bus.consumer(
            "METRICS", "launcher", bus.subjects.metrics_any, metrics_pb2.MetricsReport
        )

        async def handle(report: metrics_pb2.MetricsReport, d: Delivery) -> None:
            line = progress.record(report)
            if line:
                print(line, flush=True)

        await consumer.run(handle, stop, fetch_timeout_s=0.5)
    except TreadleError as e:
        log.warning("live progress unavailable: %s", e)
    finally:
        stop.set()
        progress.close()
        await bus.close()
