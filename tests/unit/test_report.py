"""`treadle report`: per-service summary (reward first), plots and one self-contained page.

The metrics lines are synthesized in the shapes ``progress.Progress`` writes
(``{"time", "service", "step", ...values}``), interleaved across services as a real
run's are: the orchestrator, trainer and inference service each report on their own.
"""

from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.services.cli import main
from treadle.services.report import load_run, summary_text, window

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STEPS = 40


def reward_at(step: int) -> float:
    return 0.05 + 0.01 * step


def loss_at(step: int) -> float:
    return 2.0 / step


def rl_rows(steps: int = STEPS) -> list[dict[str, Any]]:
    """An RL run's records, in the order a real run writes them (inference first)."""
    rows: list[dict[str, Any]] = [
        {
            "time": 0.0,
            "service": "inference",
            "step": 0,
            "policy_version": 0.0,
            "vllm_start_s": 61.0,
        }
    ]
    for s in range(1, steps + 1):
        rows.append({
            "time": s + 0.1, "service": "orchestrator", "step": s,
            "reward_mean": reward_at(s), "reward_std": 0.05, "reward_max": reward_at(s) + 0.2,
            "num_samples": 16.0, "num_samples_dropped_stale": float(s % 4 == 0),
            "policy_lag_mean": 0.5, "policy_lag_max": 1.0, "rollouts_per_s": 3.0,
            "dropped_stale_total": float(s // 4), "bus_refused_total": 0.0,
            "rollout_e2e_s_p50": 1.0, "rollout_e2e_s_p90": 2.0 + s / 100, "rollout_e2e_s_p99": 4.0,
            "rollout_queue_s_p90": 0.1, "rollout_generation_s_p90": 1.5, "rollout_env_s_p90": 0.02,
        })  # fmt: skip
        rows.append({
            "time": s + 0.5, "service": "trainer", "step": s, "loss": loss_at(s),
            "mismatch_kl": 0.001 * s, "tokens_per_s": 1900.0 + s, "policy_lag_mean": 0.4,
        })  # fmt: skip
        rows.append({"time": s + 0.6, "service": "inference", "step": s,
                     "policy_version": float(s), "update_s": 0.2})  # fmt: skip
    return rows


def write_run(run: Path, rows: list[dict[str, Any]], extra: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + extra)
    (run / "config.toml").write_text('[run]\nname = "myrun"\n# a <b>tag</b> & more\n')
    return run


def glance_line(out: str, label: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(label + " "))


def test_report_puts_reward_first_from_the_orchestrator_series(tmp_path: Path) -> None:
    out = summary_text(load_run(write_run(tmp_path / "r", rl_rows())))
    body = out.split("\n\n", 1)[1]
    assert body.startswith("reward ")  # the first thing after the header
    w = window(STEPS)
    rewards = np.array([reward_at(s) for s in range(1, STEPS + 1)])
    line = glance_line(out, "reward")
    assert f"mean {rewards.mean():.3g} over {STEPS} steps" in line
    assert f"first {w}: {rewards[:w].mean():.4g} -> last {w}: {rewards[-w:].mean():.4g}" in line
    assert f"best {rewards.max():.4g} at step {STEPS}" in line
    losses = np.array([loss_at(s) for s in range(1, STEPS + 1)])
    loss = glance_line(out, "loss")
    assert f"first {w}: {losses[:w].mean():.4g} -> last {w}: {losses[-w:].mean():.4g}" in loss


def test_report_tables_are_per_service_with_headline_metrics_first(tmp_path: Path) -> None:
    out = summary_text(load_run(write_run(tmp_path / "r", rl_rows())))
    sections = {s.split(":", 1)[0]: s for s in out.split("\n\n") if ": " in s.split("\n", 1)[0]}
    orch = sections["orchestrator"].splitlines()
    keys = [ln.split()[0] for ln in orch[2:] if ln.startswith("  ") and not ln.startswith("  0 ")]
    assert keys[:3] == ["reward_mean", "reward_std", "reward_max"]
    assert keys.index("rollout_e2e_s_p99") < keys.index("num_samples")  # headline before the rest
    assert "0 throughout: bus_refused_total" in sections["orchestrator"]
    # the trainer's policy lag is its own series, not mixed with the orchestrator's
    trainer = {ln.split()[0]: ln.split()[1:] for ln in sections["trainer"].splitlines()[2:]}
    assert trainer["policy_lag_mean"] == ["0.4"] * 6
    # a *_total counter shows its final value only
    total = next(ln for ln in orch if ln.split()[0] == "dropped_stale_total").split()[1:]
    assert total == ["-", "-", "-", "0", str(STEPS // 4), str(STEPS // 4)]
    assert sections["inference"].startswith(f"inference: {STEPS + 1} steps (0-{STEPS})")


def test_report_keeps_the_latest_record_of_a_repeated_step(tmp_path: Path) -> None:
    rows = rl_rows(4)
    # a resumed trainer trains step 4 again and reports it a second time
    rows.append({"time": 99.0, "service": "trainer", "step": 4, "loss": 7.0})
    data = load_run(write_run(tmp_path / "r", rows, extra="not json\n{}\n"))
    loss = data.metrics["trainer"]["loss"]
    assert loss.steps.tolist() == [1, 2, 3, 4]
    assert loss.values.tolist() == [loss_at(1), loss_at(2), loss_at(3), 7.0]
    assert data.num_bad_lines == 2  # unparsable, and a record without a service


def test_report_writes_plots_and_one_self_contained_page(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "r", rl_rows())
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    names = ["reward", "kl", "loss", "throughput", "rollout_latency", "policy_lag"]
    for name in names:
        assert (run / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC), name
    assert f"report: {run / 'report.html'}" in out
    page = (run / "report.html").read_text()
    inlined = [
        base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    ]
    assert inlined == [(run / "plots" / f"{n}.png").read_bytes() for n in names]
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing fetched from elsewhere
    assert "# a &lt;b&gt;tag&lt;/b&gt; &amp; more" in page  # the config, escaped
    assert "<td>reward_mean</td>" in page
    assert page.index("<h2>At a glance</h2>") < page.index("<h2>Plots</h2>")


def test_report_skips_a_plot_whose_metrics_a_run_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An SFT run: the trainer's loss and the orchestrator's counts, no reward or KL."""
    rows: list[dict[str, Any]] = []
    for s in range(1, 6):
        rows.append({"time": s, "service": "orchestrator", "step": s, "num_samples": 8.0})
        rows.append({"time": s, "service": "trainer", "step": s, "loss": loss_at(s),
                     "tokens_per_s": 500.0})  # fmt: skip
    run = write_run(tmp_path / "sft", rows)
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert glance_line(out, "reward").split(None, 1)[1].startswith("none recorded")
    assert "reward: skipped, no reward_mean from the orchestrator" in out
    assert "rollout_latency: skipped" in out
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["loss.png", "throughput.png"]
    assert "reward: skipped" in (run / "report.html").read_text()


def test_report_without_metrics_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "crashed"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "trainer.log").write_text("12:00:01 ERROR   trainer boom\n")
    assert main(["report", str(run)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"treadle: error: {run} has no metrics to report (metrics.jsonl is absent): "
        "metrics are recorded by `treadle rl`/`sft` as the run goes"
    ]
    assert "1 error lines; last: 12:00:01 ERROR   trainer boom" in captured.out
    assert not (run / "report.html").exists()


def test_report_without_matplotlib_writes_the_page_and_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    run = write_run(tmp_path / "r", rl_rows(4))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    note = "plots skipped: matplotlib is not installed (pip install 'treadle-services[report]')"
    assert note in out
    assert not (run / "plots").exists()
    page = (run / "report.html").read_text()
    assert note.replace("'", "&#x27;") in page
    assert "<td>reward_mean</td>" in page


def eval_rows(steps: list[int]) -> list[dict[str, Any]]:
    """The orchestrator's evaluation rounds (orchestrator.eval): eval/ keys at their steps."""
    return [{"time": s + 0.7, "service": "orchestrator", "step": s,
             "eval/reward_mean": 0.1 + s / 100, "eval/pass@1": s / 100,
             "eval/num_rollouts": 20.0, "eval/num_rollouts_error": float(s == 20),
             "eval/policy_version": float(s)} for s in steps]  # fmt: skip


def test_report_shows_held_out_reward_over_the_eval_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "r", rl_rows() + eval_rows([0, 10, 20, 30, 40]))
    assert main(["report", str(run), "--no-write"]) == 0
    out = capsys.readouterr().out
    line = glance_line(out, "eval reward")
    assert "step 0: 0.1 -> step 40: 0.5 (+0.4) over 5 rounds; best 0.5 at step 40" in line
    assert "pass@1 0 -> 0.4" in line
    assert "1 error rollouts" in line
    # the training reward is still per batch: the eval rows at the same steps merge beside it
    mean = np.mean([reward_at(s) for s in range(1, STEPS + 1)])
    assert (
        glance_line(out, "reward")
        .split(None, 1)[1]
        .startswith(f"mean {mean:.3g} over {STEPS} steps")
    )
    orch = out.split("\norchestrator: ", 1)[1]
    assert orch.startswith(f"{STEPS + 1} steps (0-{STEPS})")
    assert "eval/reward_mean" in orch.split("eval/pass@1")[0]  # headline keys lead
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert (run / "plots" / "eval.png").read_bytes().startswith(PNG_MAGIC)
    assert "eval: skipped" not in out


def test_report_without_eval_rounds_skips_the_eval_plot_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "r", rl_rows(4))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert (
        "eval: skipped, no eval/reward_mean from the orchestrator (orchestrator.eval is off)" in out
    )
    assert "eval reward" not in out


def test_report_shows_each_environment_s_reward_of_a_run_with_several(tmp_path: Path) -> None:
    rows = rl_rows(8)
    for row in rows:
        if row["service"] == "orchestrator":  # countdown in even steps only
            s = row["step"]
            row |= {"env/reverse_text/reward_mean": 0.5 + 0.01 * s,
                    "env/reverse_text/num_groups": 3.0, "env/countdown/num_groups": float(s % 2 == 0)}  # fmt: skip
            if s % 2 == 0:
                row["env/countdown/reward_mean"] = 0.1
    out = summary_text(load_run(write_run(tmp_path / "r", rows)))
    assert "mean 0.1 over 4 steps; first 1: 0.1 -> last 1: 0.1; 4 groups" in glance_line(
        out, "countdown reward"
    )
    line = glance_line(out, "reverse_text reward")
    assert "mean 0.545 over 8 steps; first 2: 0.515 -> last 2: 0.575; 24 groups" in line
    assert "env/countdown/reward_mean" in out.split("\norchestrator: ", 1)[1]  # in the table too
    one = summary_text(load_run(write_run(tmp_path / "one", rl_rows(8))))
    assert " reward " not in one.replace("eval reward", "")  # one environment: no such lines
