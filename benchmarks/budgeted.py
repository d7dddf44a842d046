"""Run a `treadle` job for a wall-clock budget and read what it trained (shared by the
benchmarks that compare methods at equal time: vs_trl.py, distillation.py).

    run = run_budgeted(argv, run_dir, log, budget_s, clock="first_metrics")
    model = final_model(run_dir, base_model, run.steps)

``clock``: "launch" counts the budget from the process start (its startup is part of
it), "first_metrics" from the first row of ``run_dir/metrics.jsonl`` (startup apart).
When the budget ends the job gets SIGINT (a clean stop; SIGKILL after 120 s). A job
stopped on its budget has no ``final_model``: the last policy it published is exported
from its object store instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parents[1]


def treadle_exe() -> str:
    return str(Path(sys.executable).parent / "treadle")


def rl_run_overrides(name: str, model: Path, seed: int, steps: int) -> dict[str, Any]:
    """The settings of a `treadle rl` run of ``model`` (policy, inference and tokenizer),
    named, seeded and ``steps`` long."""
    m = str(model)
    return {
        "run.name": name,
        "inference.model": m,
        "trainer.model": m,
        "env_runner.tokenizer": m,
        "orchestrator.seed": seed,
        "trainer.seed": seed,
        "trainer.max_steps": steps,
        "orchestrator.max_steps": steps,
    }


def overrides(values: dict[str, Any]) -> list[str]:
    """``--section.key value`` flags."""
    out: list[str] = []
    for k, v in values.items():
        out += [f"--{k}", str(v)]
    return out


@dataclass
class BudgetedRun:
    launched: float
    first_metrics: float | None
    ended: float
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def trainer_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("service") == "trainer" and "tokens" in r]

    @property
    def steps(self) -> int:
        return max((int(r["step"]) for r in self.trainer_rows), default=0)


def run_budgeted(
    argv: list[str],
    run_dir: Path,
    log_path: Path,
    budget_s: float | None,
    *,
    clock: Literal["launch", "first_metrics"] = "first_metrics",
) -> BudgetedRun:
    """Run ``argv`` (in the repository root) until it ends or its budget does."""
    print("$ " + " ".join(argv), flush=True)
    metrics = run_dir / "metrics.jsonl"
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        first: float | None = None
        while proc.poll() is None:
            time.sleep(0.5)
            if first is None and metrics.exists() and metrics.stat().st_size > 0:
                first = time.monotonic()
            start = t0 if clock == "launch" else first
            if budget_s is not None and start is not None and time.monotonic() - start >= budget_s:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
        ended = time.monotonic()
    rows = []
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return BudgetedRun(t0, first, ended, rows)


def final_model(run_dir: Path, base: Path, step: int) -> Path:
    """The job's final model, or the policy of ``step`` exported from its store."""
    model = run_dir / "final_model"
    if not (model / "config.json").exists():
        from treadle.services.export import export_model, policy_prefix
        from treadle.services.objectstore import LocalObjectStore

        export_model(LocalObjectStore(run_dir / "store"), policy_prefix(step), base, model)
    return model
