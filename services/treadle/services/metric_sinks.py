"""Optional copies of a run's metrics for TensorBoard and Weights & Biases.

The process that follows the METRICS stream (`treadle rl`/`sft`, ``progress.py``) hands
every service's MetricsReport to the sinks that ``[telemetry]`` turns on, beside
``metrics.jsonl``:

    MetricsReport ──▶ metrics.jsonl
                  ├─▶ TensorBoard  <run dir>/tensorboard/events.out.tfevents.*   scalar "<service>/<key>"
                  └─▶ W&B          run "<run name>", "<service>/<key>" over "<service>/step"

Each service keeps its own step axis (the inference service reports by policy version,
the orchestrator may be a step ahead of the trainer), so W&B gets one step metric per
service rather than the global ``step`` that would drop out-of-order points. Both are
off by default; a sink whose package is missing is a ConfigError naming the extra to
install, raised before a run starts (``require_sinks``). A sink that fails mid-run is
logged and dropped; the run and metrics.jsonl go on. This module writes nothing else.
"""

from __future__ import annotations

import importlib.util
import logging
import tomllib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from treadle.services.errors import ConfigError
from treadle.services.sections import TelemetrySection

log = logging.getLogger(__name__)

# key -> (module to import, extra of treadle-services that installs it)
PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


class MetricSink(Protocol):
    """Where a copy of each MetricsReport goes."""

    name: str

    def write(self, service: str, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        """One report: ``values`` of ``service`` at its ``step`` (wall time in Unix seconds)."""
        ...

    def close(self) -> None:
        """Flush and release; called once."""
        ...


def _missing(key: str) -> str | None:
    """The error for sink ``key`` when its package is not installed, else None."""
    module, extra = PACKAGES[key]
    if importlib.util.find_spec(module) is not None:
        return None
    return (
        f"telemetry.{key} = true needs the {module!r} package, which is not installed: "
        f"pip install 'treadle-services[{extra}]'"
    )


def require_sinks(cfg: TelemetrySection) -> None:
    """ConfigError naming the extra to install for each enabled sink whose package is missing."""
    errors = [e for key in PACKAGES if getattr(cfg, key) and (e := _missing(key))]
    if errors:
        raise ConfigError("; ".join(errors))


class TensorBoardSink:
    """Scalars in a TensorBoard event file (the ``tensorboard`` package's writer; no torch)."""

    name = "tensorboard"

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir))
        self.logdir = logdir

    def write(self, service: str, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        summary = self._summary(
            value=[
                self._summary.Value(tag=f"{service}/{key}", simple_value=float(v))
                for key, v in sorted(values.items())
            ]
        )
        self._writer.add_event(self._event(wall_time=wall_time, step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run; its files go to ``<run dir>/wandb`` (``offline-run-*`` offline).

    The W&B run id is kept in ``<run dir>/wandb/treadle-run-id`` so that a resumed Treadle
    run goes on logging into the same W&B run."""

    name = "wandb"

    def __init__(self, cfg: TelemetrySection, run_name: str, run_dir: Path, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "treadle-run-id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self._services: set[str] = set()
        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity,
            name=run_name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=cfg.wandb_mode,
            config=config,
            # the launcher's stdout is the run's progress; W&B must not capture it
            settings=wandb.Settings(console="off"),
        )
        self.run_dir = Path(self._run.dir).parent  # .../wandb/<offline-run-...|run-...>

    def write(self, service: str, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        axis = f"{service}/step"
        if service not in self._services:
            self._run.define_metric(axis)
            self._run.define_metric(f"{service}/*", step_metric=axis)
            self._services.add(service)
        row = {f"{service}/{key}": float(v) for key, v in values.items()}
        self._run.log({axis: step, **row})

    def close(self) -> None:
        self._run.finish()


def open_sinks(
    cfg: TelemetrySection, run_name: str, run_dir: Path, config: dict[str, Any]
) -> list[MetricSink]:
    """The sinks ``cfg`` turns on (``config``: the run's resolved config, secrets masked)."""
    require_sinks(cfg)
    sinks: list[MetricSink] = []
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if cfg.wandb:
            sinks.append(WandbSink(cfg, run_name, run_dir, config))
    except BaseException:
        close_sinks(sinks)
        raise
    for sink in sinks:
        log.info("[startup] metrics also go to %s", sink.name)
    return sinks


def open_run_sinks(cfg: TelemetrySection, run_name: str, run_dir: Path) -> list[MetricSink]:
    """``open_sinks`` with the run folder's resolved ``config.toml`` (secrets masked) as config."""
    resolved = run_dir / "config.toml"
    config = tomllib.loads(resolved.read_text()) if resolved.exists() else {}
    return open_sinks(cfg, run_name, run_dir, config)


def close_sinks(sinks: list[MetricSink]) -> None:
    """Close every sink; one that fails to is logged, the others still close."""
    while sinks:
        sink = sinks.pop()
        try:
            sink.close()
        except Exception as e:  # a third-party sink's failure must not stop the run
            log.warning("metrics sink %s did not close cleanly: %r", sink.name, e)
