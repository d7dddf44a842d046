"""`treadle report <run dir>`: what a run left behind, per service, reward first.

Reads ``config.toml``, ``stack.json``, ``metrics.jsonl`` and ``logs/`` of a run folder.
``metrics.jsonl`` holds one JSON object per MetricsReport, ``{"time", "service",
"step", ...values}``, from every service (progress.py): the orchestrator reports each
batch it cuts (reward, policy lag, staleness drops, rollout latency percentiles), the
trainer each step it trains (loss, mismatch KL, throughput), the inference service each
policy version it serves; with ``[orchestrator.eval]`` the orchestrator also reports each
evaluation round on held-out tasks at its step (``eval/`` keys: reward, pass@k, ...), and
with several environments each one's share of a batch (``env/<env>/`` keys: reward,
groups, ...). Each service is its own series: a step's record replaces an
earlier one of the same service and step (a resumed run repeats steps).

    metrics.jsonl ──▶ load_run ──▶ RunData ──▶ summarize: text (at a glance, then a table per service)
                                           └──▶ report_html.write_report: plots/*.png + report.html

This module reads and summarizes; ``report_html`` draws and writes the page.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from treadle.services.errors import ConfigError
from treadle.services.supervisor import tail

MARKERS = ["config.toml", "stack.json", "metrics.jsonl", "logs"]

# the keys people look at first, in this order; the rest of a service's keys follow sorted
HEADLINE = [
    "reward_mean",
    "reward_std",
    "reward_max",
    "eval/reward_mean",
    "eval/pass@1",
    "loss",
    "mismatch_kl",
    "tokens_per_s",
    "rollouts_per_s",
    "rollout_e2e_s_p50",
    "rollout_e2e_s_p90",
    "rollout_e2e_s_p99",
    "rollout_queue_s_p90",
    "rollout_generation_s_p90",
    "rollout_env_s_p90",
    "policy_lag_mean",
    "policy_lag_max",
    "num_samples_dropped_stale",
    "dropped_stale_total",
]
SERVICE_ORDER = ["orchestrator", "trainer", "inference"]


@dataclass
class Series:
    """One metric of one service over its steps (sorted by step, one value per step)."""

    steps: np.ndarray  # [n] int64
    values: np.ndarray  # [n] float64; NaN where the record had null (a non-finite value)

    @property
    def finite(self) -> np.ndarray:
        return self.values[np.isfinite(self.values)]


@dataclass
class RunData:
    """What a run folder holds; ``metrics[service][key]`` is a Series."""

    run_dir: Path
    name: str
    config_toml: str | None
    stack: dict[str, Any] | None
    num_records: int = 0
    num_bad_lines: int = 0
    metrics: dict[str, dict[str, Series]] = field(default_factory=dict)
    logs: list[tuple[str, int, list[str]]] = field(default_factory=list)  # name, bytes, errors

    def series(self, service: str, key: str) -> Series | None:
        s = self.metrics.get(service, {}).get(key)
        return s if s is not None and s.finite.size else None

    @property
    def services(self) -> list[str]:
        known = [s for s in SERVICE_ORDER if s in self.metrics]
        return known + sorted(s for s in self.metrics if s not in SERVICE_ORDER)


def _is_cumulative(key: str) -> bool:
    """Counters that only grow over a run (``*_total``): their last value is what counts."""
    return key.endswith("_total")


def load_run(run_dir: Path) -> RunData:
    """Read ``run_dir``; ConfigError if it is not a run folder."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (expected outputs/<run>)")
    if not any((run_dir / m).exists() for m in MARKERS):
        raise ConfigError(
            f"{run_dir} does not look like a Treadle run folder (none of {', '.join(MARKERS)})"
        )
    config = run_dir / "config.toml"
    stack = run_dir / "stack.json"
    data = RunData(
        run_dir=run_dir,
        name=run_dir.name,
        config_toml=config.read_text() if config.is_file() else None,
        stack=json.loads(stack.read_text()) if stack.is_file() else None,
    )
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        _read_metrics(metrics, data)
    logs = run_dir / "logs"
    if logs.is_dir():
        for log_file in sorted(logs.glob("*.log")):
            errors = [
                ln.strip()
                for ln in tail(log_file, 400).splitlines()
                if " ERROR " in ln or "Traceback" in ln
            ]
            data.logs.append((log_file.name, log_file.stat().st_size, errors))
    return data


def _read_metrics(path: Path, data: RunData) -> None:
    # service -> step -> key -> value (a later record of a step overrides an earlier one)
    points: dict[str, dict[int, dict[str, float]]] = {}
    for raw in path.read_text(errors="replace").splitlines():
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            service, step = str(row["service"]), int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            data.num_bad_lines += 1
            continue
        data.num_records += 1
        at = points.setdefault(service, {}).setdefault(step, {})
        for key, v in row.items():
            if key in ("time", "service", "step"):
                continue
            if v is None:
                at[key] = math.nan
            elif isinstance(v, int | float) and not isinstance(v, bool):
                at[key] = float(v)
    for service, by_step in points.items():
        steps = sorted(by_step)
        keys = sorted({k for values in by_step.values() for k in values})
        data.metrics[service] = {}
        for key in keys:
            have = [s for s in steps if key in by_step[s]]
            data.metrics[service][key] = Series(
                np.array(have, dtype=np.int64),
                np.array([by_step[s][key] for s in have], dtype=np.float64),
            )


def window(n: int) -> int:
    """Points in the first and last windows compared for a series of ``n`` points."""
    return max(1, min(20, n // 4))


def fmt(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3g}"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.0f}"


@dataclass
class Row:
    """One metric's summary in a service's table (NaN: not applicable)."""

    key: str
    n: int
    first: float  # mean of the first window
    last_window: float  # mean of the last window
    mean: float
    min: float
    max: float
    last: float
    window: int


def row_of(key: str, s: Series) -> Row:
    v = s.finite
    w = window(v.size)
    nan = math.nan
    if _is_cumulative(key):
        return Row(key, v.size, nan, nan, nan, float(v.min()), float(v.max()), float(v[-1]), w)
    return Row(
        key,
        v.size,
        float(v[:w].mean()),
        float(v[-w:].mean()),
        float(v.mean()),
        float(v.min()),
        float(v.max()),
        float(v[-1]),
        w,
    )


def ordered_keys(keys: list[str]) -> list[str]:
    head = [k for k in HEADLINE if k in keys]
    return head + sorted(k for k in keys if k not in HEADLINE)


def service_rows(data: RunData, service: str) -> tuple[list[Row], list[str]]:
    """The service's rows (headline keys first) and the keys that were 0 throughout."""
    rows: list[Row] = []
    zeros: list[str] = []
    for key in ordered_keys(list(data.metrics.get(service, {}))):
        s = data.series(service, key)
        if s is None:
            continue
        if key not in HEADLINE and not np.any(s.finite):
            zeros.append(key)
            continue
        rows.append(row_of(key, s))
    return rows, zeros


def glance(data: RunData) -> list[tuple[str, str]]:
    """(label, sentence) pairs: what the run achieved, reward first; only what was recorded."""
    out: list[tuple[str, str]] = []
    reward = data.series("orchestrator", "reward_mean")
    if reward is not None:
        v, steps = reward.finite, reward.steps[np.isfinite(reward.values)]
        w = window(v.size)
        first, last = float(v[:w].mean()), float(v[-w:].mean())
        best = int(np.argmax(v))
        out.append((
            "reward",
            f"mean {fmt(float(v.mean()))} over {v.size} steps; first {w}: {fmt(first)} -> "
            f"last {w}: {fmt(last)} ({'+' if last >= first else ''}{fmt(last - first)}); "
            f"best {fmt(float(v[best]))} at step {int(steps[best])}",
        ))  # fmt: skip
    else:
        out.append(("reward", "none recorded (an SFT run, or no batch was cut)"))
    for env, env_reward in _env_rewards(data):
        r = row_of(f"env/{env}/reward_mean", env_reward)
        groups = data.series("orchestrator", f"env/{env}/num_groups")
        trained = f"; {int(groups.finite.sum())} groups" if groups is not None else ""
        out.append((
            f"{env} reward",
            f"mean {fmt(r.mean)} over {r.n} steps; first {r.window}: {fmt(r.first)} -> "
            f"last {r.window}: {fmt(r.last_window)}{trained}",
        ))  # fmt: skip
    held_out = data.series("orchestrator", "eval/reward_mean")
    if held_out is not None:
        out.append(("eval reward", _eval_sentence(data, held_out)))
    for label, service, key in [
        ("loss", "trainer", "loss"),
        ("mismatch KL", "trainer", "mismatch_kl"),
    ]:
        s = data.series(service, key)
        if s is not None:
            r = row_of(key, s)
            out.append((
                label,
                f"first {r.window}: {fmt(r.first)} -> last {r.window}: {fmt(r.last_window)}; "
                f"mean {fmt(r.mean)}, max {fmt(r.max)}",
            ))  # fmt: skip
    parts = []
    for service, key, unit in [("trainer", "tokens_per_s", "tokens/s trained"),
                               ("orchestrator", "rollouts_per_s", "rollouts/s completed")]:  # fmt: skip
        s = data.series(service, key)
        if s is not None:
            parts.append(f"{fmt(float(s.finite.mean()))} {unit}")
    if parts:
        out.append(("throughput", ", ".join(parts) + " (mean over steps)"))
    pct = [(p, data.series("orchestrator", f"rollout_e2e_s_p{p}")) for p in (50, 90, 99)]
    if all(s is not None for _, s in pct):
        text = "  ".join(f"p{p} {fmt(float(s.finite.mean()))}s" for p, s in pct if s is not None)
        out.append(("rollout latency", f"end to end {text} (mean of the batches' percentiles)"))
    lag = data.series("orchestrator", "policy_lag_mean")
    if lag is not None:
        lag_max = data.series("orchestrator", "policy_lag_max")
        most = f", max {fmt(float(lag_max.finite.max()))}" if lag_max is not None else ""
        out.append(("policy lag", f"mean {fmt(float(lag.finite.mean()))} steps{most}"))
    stale = data.series("orchestrator", "num_samples_dropped_stale")
    if stale is not None:
        kept = data.series("orchestrator", "num_samples")
        of = f" (of {int(kept.finite.sum() + stale.finite.sum())})" if kept is not None else ""
        out.append(("stale drops", f"{int(stale.finite.sum())} samples dropped as too old{of}"))
    return out


def _env_rewards(data: RunData) -> list[tuple[str, Series]]:
    """(environment, its reward_mean series) of a run with several environments
    (``env/<env>/reward_mean``), sorted by name."""
    out = []
    for key in sorted(data.metrics.get("orchestrator", {})):
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "env" and parts[2] == "reward_mean":
            s = data.series("orchestrator", key)
            if s is not None:
                out.append((parts[1], s))
    return out


def _eval_sentence(data: RunData, s: Series) -> str:
    """Held-out reward over the evaluation rounds: first -> last, best, pass@1."""
    ok = np.isfinite(s.values)
    v, steps = s.values[ok], s.steps[ok]
    best = int(np.argmax(v))
    text = (
        f"step {int(steps[0])}: {fmt(float(v[0]))} -> step {int(steps[-1])}: {fmt(float(v[-1]))} "
        f"({'+' if v[-1] >= v[0] else ''}{fmt(float(v[-1] - v[0]))}) over {v.size} rounds; "
        f"best {fmt(float(v[best]))} at step {int(steps[best])}"
    )
    pass1 = data.series("orchestrator", "eval/pass@1")
    if pass1 is not None:
        p = pass1.finite
        text += f"; pass@1 {fmt(float(p[0]))} -> {fmt(float(p[-1]))}"
    errors = data.series("orchestrator", "eval/num_rollouts_error")
    if errors is not None and errors.finite.sum():
        text += f"; {int(errors.finite.sum())} error rollouts"
    return text


def summarize(run_dir: Path) -> str:
    """A text report of ``run_dir``; ConfigError if it is not a run folder."""
    return summary_text(load_run(run_dir))


def summary_text(data: RunData) -> str:
    lines = [f"run folder: {data.run_dir}"]
    if data.stack is not None:
        lines.append(f"nats: {data.stack.get('nats', {}).get('url', '?')}")
        for name, s in data.stack.get("services", {}).items():
            lines.append(f"  {name:<13} pid {s.get('pid')}  grpc {s.get('grpc')}")
    bad = f" ({data.num_bad_lines} unreadable lines)" if data.num_bad_lines else ""
    if data.num_records:
        lines.append(
            f"metrics: {data.num_records} records from {', '.join(data.services) or 'no service'}{bad}"
        )
        lines.append("")
        width = max(len(label) for label, _ in glance(data))
        lines += [f"{label:<{width}}  {text}" for label, text in glance(data)]
        for service in data.services:
            rows, zeros = service_rows(data, service)
            steps = np.unique(np.concatenate([s.steps for s in data.metrics[service].values()]))
            span = f"{len(steps)} steps ({steps[0]}-{steps[-1]})" if steps.size else "no steps"
            lines.append("")
            lines.append(f"{service}: {span}")
            header = ["first", "last", "mean", "min", "max", "final"]
            lines.append(f"  {'':<34}" + "".join(f"{h:>10}" for h in header))
            for r in rows:
                cells = [r.first, r.last_window, r.mean, r.min, r.max, r.last]
                lines.append(f"  {r.key:<34}" + "".join(f"{fmt(c):>10}" for c in cells))
            if zeros:
                lines.append(f"  0 throughout: {', '.join(zeros)}")
        lines.append("")
        lines.append(
            "(first, last: means over the first and last quarter of a series' steps, at most "
            "20 each; *_total counters: final value only)"
        )
    else:
        lines.append(f"metrics: none recorded{bad or ' (metrics.jsonl absent or empty)'}")
    if data.logs:
        lines.append("logs:")
        for name, size, errors in data.logs:
            note = f"  {len(errors)} error lines; last: {errors[-1][:120]}" if errors else ""
            lines.append(f"  {name:<24} {size:>9} bytes{note}")
    return "\n".join(lines)
