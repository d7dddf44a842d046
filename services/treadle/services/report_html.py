"""Plots and one self-contained HTML page of a run, written into its folder.

    RunData (report.py) ──▶ <run dir>/plots/<name>.png   one per PLOTS entry whose metrics exist
                        └─▶ <run dir>/report.html         at a glance, the plots (inlined as
                                                          base64), a table per service, the config

A plot whose metrics the run did not record is skipped with a note (an SFT run has no
reward). Plots need matplotlib (``treadle-services[report]``); without it the page is
still written, with the tables and a note saying what to install. Drawing uses
matplotlib's object API on the Agg canvas: no pyplot state, no display.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from treadle.services.report import RunData, Series, fmt, glance, service_rows, window

REPORT_EXTRA = "pip install 'treadle-services[report]'"


@dataclass(frozen=True)
class Line:
    service: str
    key: str
    label: str
    style: str = "-"


@dataclass(frozen=True)
class Panel:
    ylabel: str
    lines: tuple[Line, ...]
    bars: bool = False  # per-step counts drawn as bars


@dataclass(frozen=True)
class Plot:
    name: str  # file name without .png
    title: str
    panels: tuple[Panel, ...]
    missing: str  # why a run may lack it


PLOTS = (
    Plot("reward", "Reward per step (orchestrator batches)", (
        Panel("reward", (Line("orchestrator", "reward_mean", "mean"),
                         Line("orchestrator", "reward_max", "max", ":"))),
    ), "no reward_mean from the orchestrator (an SFT run, or no batch was cut)"),
    Plot("eval", "Held-out reward per evaluation round (orchestrator.eval)", (
        Panel("reward", (Line("orchestrator", "eval/reward_mean", "mean"),
                         Line("orchestrator", "eval/pass@1", "pass@1", "--"))),
    ), "no eval/reward_mean from the orchestrator (orchestrator.eval is off)"),
    Plot("kl", "KL / mismatch between the sampling and the trained policy (trainer)", (
        Panel("KL", (Line("trainer", "mismatch_kl", "mismatch KL"),
                     Line("trainer", "kl", "KL"))),
    ), "no mismatch_kl from the trainer (no on-policy tokens, or an SFT run)"),
    Plot("loss", "Loss (trainer)", (
        Panel("loss", (Line("trainer", "loss", "loss"),)),
    ), "no loss from the trainer"),
    Plot("throughput", "Throughput", (
        Panel("tokens/s", (Line("trainer", "tokens_per_s", "trainer tokens/s"),)),
        Panel("rollouts/s", (Line("orchestrator", "rollouts_per_s", "rollouts/s completed"),)),
    ), "no tokens_per_s (trainer) nor rollouts_per_s (orchestrator)"),
    Plot("rollout_latency", "Rollout latency per batch (percentiles over its rollouts)", (
        Panel("end to end (s)", (Line("orchestrator", "rollout_e2e_s_p50", "p50"),
                                 Line("orchestrator", "rollout_e2e_s_p90", "p90", "--"),
                                 Line("orchestrator", "rollout_e2e_s_p99", "p99", ":"))),
        Panel("parts, p90 (s)", (Line("orchestrator", "rollout_queue_s_p90", "queue"),
                                 Line("orchestrator", "rollout_generation_s_p90", "generation"),
                                 Line("orchestrator", "rollout_env_s_p90", "environment"))),
    ), "no rollout_*_s percentiles from the orchestrator"),
    Plot("policy_lag", "Policy lag (steps between sampling and training) and staleness drops", (
        Panel("lag (steps)", (Line("orchestrator", "policy_lag_mean", "batch mean"),
                              Line("orchestrator", "policy_lag_max", "batch max", ":"),
                              Line("trainer", "policy_lag_mean", "mean over trained tokens", "--"))),
        Panel("samples dropped", (Line("orchestrator", "num_samples_dropped_stale", "stale"),),
              bars=True),
    ), "no policy_lag_mean (orchestrator or trainer)"),
)  # fmt: skip


@dataclass
class Drawn:
    """What write_report produced."""

    html: Path
    plots: dict[str, Path] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # plots skipped, and why


def _present(data: RunData, panel: Panel) -> list[tuple[Line, Series]]:
    return [(ln, s) for ln in panel.lines if (s := data.series(ln.service, ln.key)) is not None]


def _rolling(v: np.ndarray, w: int) -> np.ndarray:
    """Trailing mean over ``w`` points (fewer at the start)."""
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, v.size + 1)
    lo = np.maximum(0, idx - w)
    return (c[idx] - c[lo]) / (idx - lo)


def _draw(data: RunData, plot: Plot, panels: list[Panel]) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 2.6 + 1.9 * len(panels)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    fig.suptitle(plot.title)
    for ax, panel in zip(axes, panels, strict=True):
        for ln, s in _present(data, panel):
            ok = np.isfinite(s.values)
            x, y = s.steps[ok], s.values[ok]
            label = f"{ln.label}" if ln.service in ln.label else f"{ln.label} ({ln.service})"
            if panel.bars:
                ax.bar(x, y, width=0.8, label=label, alpha=0.7)
                continue
            ax.plot(x, y, ln.style, marker="." if x.size < 40 else None, label=label)
            if ln.key == "reward_mean":
                std = data.series("orchestrator", "reward_std")
                if std is not None and np.array_equal(std.steps, s.steps):
                    sd = std.values[ok]
                    ax.fill_between(x, y - sd, y + sd, alpha=0.15, label="mean ± std")
                w = window(y.size)
                if w > 1:
                    ax.plot(x, _rolling(y, w), "-", linewidth=2.5, alpha=0.8,
                            label=f"mean, trailing {w} steps")  # fmt: skip
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    axes[-1].set_xlabel("step")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def draw_plots(data: RunData, out_dir: Path) -> tuple[dict[str, bytes], list[str]]:
    """PNG bytes of each plot the run has metrics for (also written to ``out_dir``), and
    a note per plot skipped. No matplotlib: no plots, one note naming the extra."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return {}, [f"plots skipped: matplotlib is not installed ({REPORT_EXTRA})"]
    pngs: dict[str, bytes] = {}
    notes: list[str] = []
    for plot in PLOTS:
        panels = [p for p in plot.panels if _present(data, p)]
        if not panels:
            notes.append(f"{plot.name}: skipped, {plot.missing}")
            continue
        png = _draw(data, plot, panels)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{plot.name}.png").write_bytes(png)
        pngs[plot.name] = png
    return pngs, notes


CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { padding: 0.2em 0.7em; border-bottom: 1px solid #ddd; text-align: right; }
th:first-child, td:first-child { text-align: left; }
.glance td { text-align: left; }
img { max-width: 100%; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.85em; }
.note { color: #a15c00; }
"""


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def render_html(data: RunData, pngs: dict[str, bytes], notes: list[str]) -> str:
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Treadle run {e(data.name)}</title><style>{CSS}</style></head><body>",
        f"<h1>Run {e(data.name)}</h1>",
        f"<p>{e(str(data.run_dir))} · {data.num_records} metric records from "
        f"{e(', '.join(data.services) or 'no service')} · report written "
        f"{datetime.now().isoformat(timespec='seconds')}</p>",
        "<h2>At a glance</h2>",
        _table(["", ""], [[label, text] for label, text in glance(data)], "glance"),
        "<h2>Plots</h2>",
    ]
    for plot in PLOTS:
        if plot.name in pngs:
            b64 = base64.b64encode(pngs[plot.name]).decode("ascii")
            parts.append(
                f'<figure><img alt="{e(plot.title)}" src="data:image/png;base64,{b64}">'
                f"<figcaption>{e(plot.title)}</figcaption></figure>"
            )
    parts += [f'<p class="note">{e(n)}</p>' for n in notes]
    parts.append("<h2>Per service</h2>")
    for service in data.services:
        rows, zeros = service_rows(data, service)
        parts.append(f"<h3>{e(service)}</h3>")
        cells = [
            [r.key, *(fmt(c) for c in (r.first, r.last_window, r.mean, r.min, r.max, r.last))]
            for r in rows
        ]
        parts.append(_table(["metric", "first", "last", "mean", "min", "max", "final"], cells))
        if zeros:
            parts.append(f"<p>0 throughout: {e(', '.join(zeros))}</p>")
    parts.append(
        "<p>first, last: means over the first and last quarter of a series' steps (at most "
        "20 each); *_total counters: final value only.</p>"
    )
    parts.append("<h2>Config</h2>")
    parts.append(
        f"<pre>{e(data.config_toml)}</pre>"
        if data.config_toml is not None
        else "<p>no config.toml in the run folder</p>"
    )
    if data.logs:
        parts.append("<h2>Logs</h2>")
        rows_l = [
            [name, str(size), (errs[-1][:160] if errs else "")] for name, size, errs in data.logs
        ]
        parts.append(_table(["log", "bytes", "last error line"], rows_l))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(data: RunData, *, plots: bool = True) -> Drawn:
    """Write ``plots/*.png`` and ``report.html`` into the run folder."""
    pngs, notes = draw_plots(data, data.run_dir / "plots") if plots else ({}, [])
    page = data.run_dir / "report.html"
    page.write_text(render_html(data, pngs, notes), encoding="utf-8")
    return Drawn(page, {n: data.run_dir / "plots" / f"{n}.png" for n in pngs}, notes)


def describe(drawn: Drawn) -> str:
    """Lines for the terminal: what was written, and what was skipped."""
    lines: list[str] = []
    if drawn.plots:
        folder = next(iter(drawn.plots.values())).parent
        lines.append(f"plots: {folder}/ ({', '.join(p.name for p in drawn.plots.values())})")
    lines += [f"  {n}" for n in drawn.notes]
    lines.append(f"report: {drawn.html}")
    return "\n".join(lines)
