"""`treadle report <run dir>`: what a run left behind, in one screen.

Reads ``config.toml``, ``stack.json``, ``metrics.jsonl`` (one JSON object per line with
at least ``step``) and ``logs/`` of a run folder. Never modifies anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from treadle.services.errors import ConfigError
from treadle.services.supervisor import tail


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else str(v)
    return str(v)


def summarize(run_dir: Path) -> str:
    """A text report of ``run_dir``; ConfigError if it is not a run folder."""
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a directory (expected outputs/<run>)")
    markers = ["config.toml", "stack.json", "metrics.jsonl", "logs"]
    if not any((run_dir / m).exists() for m in markers):
        raise ConfigError(
            f"{run_dir} does not look like a Treadle run folder (none of {', '.join(markers)})"
        )
    lines = [f"run folder: {run_dir}"]
    stack = run_dir / "stack.json"
    if stack.exists():
        doc = json.loads(stack.read_text())
        lines.append(f"nats: {doc['nats']['url']}")
        for name, s in doc.get("services", {}).items():
            lines.append(f"  {name:<13} pid {s['pid']}  grpc {s['grpc']}")
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = []
        bad = 0
        for raw in metrics.read_text().splitlines():
            if not raw.strip():
                continue
            try:
                rows.append(json.loads(raw))
            except json.JSONDecodeError:
                bad += 1
        lines.append(
            f"metrics: {len(rows)} records" + (f" ({bad} unreadable lines)" if bad else "")
        )
        if rows:
            last = rows[-1]
            first = rows[0]
            for key in sorted(k for k in last if isinstance(last[k], int | float)):
                start = first.get(key)
                arrow = (
                    f"{_fmt(start)} -> "
                    if isinstance(start, int | float) and start != last[key]
                    else ""
                )
                lines.append(f"  {key:<28} {arrow}{_fmt(last[key])}")
    else:
        lines.append("metrics: none recorded (metrics.jsonl absent)")
    logs = run_dir / "logs"
    if logs.is_dir():
        lines.append("logs:")
        for log_file in sorted(logs.glob("*.log")):
            errors = [
                ln
                for ln in tail(log_file, 400).splitlines()
                if " ERROR " in ln or "Traceback" in ln
            ]
            note = (
                f"  {len(errors)} error lines; last: {errors[-1].strip()[:120]}" if errors else ""
            )
            lines.append(f"  {log_file.name:<24} {log_file.stat().st_size:>9} bytes{note}")
    return "\n".join(lines)
