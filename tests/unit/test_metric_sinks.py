"""TensorBoard and W&B copies of the run's metrics: what the METRICS follower (Progress)
records reaches each sink, read back with the sink's own reader (TensorBoard's event
accumulator; the W&B offline run file, record by record). W&B runs offline: no network.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from treadle.proto.v1 import metrics_pb2
from treadle.services import metric_sinks
from treadle.services.errors import ConfigError
from treadle.services.metric_sinks import (
    TensorBoardSink,
    WandbSink,
    close_sinks,
    open_run_sinks,
    require_sinks,
)
from treadle.services.progress import Progress
from treadle.services.sections import TelemetrySection

REPORTS = [
    ("inference", 0, {"policy_version": 0.0, "vllm_start_s": 61.5}),
    ("orchestrator", 1, {"reward_mean": 0.25, "policy_lag_mean": 0.0}),
    ("orchestrator", 2, {"reward_mean": 0.5, "policy_lag_mean": 1.0}),
    ("trainer", 1, {"loss": 0.75, "mismatch_kl": 0.001}),  # arrives after orchestrator step 2
    ("trainer", 2, {"loss": 0.5, "mismatch_kl": 0.002}),
]


def record_all(progress: Progress) -> None:
    for service, step, values in REPORTS:
        progress.record(metrics_pb2.MetricsReport(service=service, step=step, values=values))


def expected(service: str, key: str) -> list[tuple[int, float]]:
    return [(step, v[key]) for s, step, v in REPORTS if s == service and key in v]


def test_tensorboard_sink_writes_scalars_tensorboard_reads(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="treadle-services[tensorboard] not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(tmp_path / "tensorboard")
    progress = Progress(tmp_path / "metrics.jsonl", "rl", 2, [sink])
    record_all(progress)
    progress.close()
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = {f"{s}/{k}" for s, _, values in REPORTS for k in values}
    assert set(acc.Tags()["scalars"]) == tags
    for tag in tags:
        service, key = tag.split("/")
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert got == [(step, pytest.approx(v)) for step, v in expected(service, key)], tag


def wandb_records(run_file: Path) -> list[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): a ':W&B' header, then a log of
    32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | kind (1) | data``, kind
    1 a whole record, 2/3/4 its first/middle/last part; each record a protobuf Record.
    A history item's key is ``key``, or ``nested_key`` for a key with '/' in it."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        kind = data[pos + 6] if left >= 7 else 0
        if kind == 0:  # block trailer or zero padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def test_wandb_sink_offline_run_holds_the_metrics_and_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = pytest.importorskip("wandb", reason="treadle-services[wandb] not installed")
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(var, value)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var))
    run_dir = tmp_path / "outputs" / "myrun"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text('[run]\nname = "myrun"\n\n[trainer]\nmax_steps = 2\n')
    cfg = TelemetrySection(wandb=True, wandb_project="treadle-test")
    try:
        sinks = open_run_sinks(cfg, "myrun", run_dir)
        assert [s.name for s in sinks] == ["wandb"]
        sink = sinks[0]
        assert isinstance(sink, WandbSink)
        progress = Progress(run_dir / "metrics.jsonl", "rl", 2, sinks)
        record_all(progress)
        progress.close()
        close_sinks(sinks)
    finally:
        wandb.teardown()  # stops the W&B service process this test started
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline == [sink.run_dir]
    records = wandb_records(next(offline[0].glob("run-*.wandb")))
    rows = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    for service, step, values in REPORTS:  # every report, on its service's own step axis
        assert any(
            row.get(f"{service}/step") == step
            and all(math.isclose(row[f"{service}/{k}"], v) for k, v in values.items())
            for row in rows
        ), (service, step)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.display_name, run.project) == ("myrun", "treadle-test")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["trainer"] == {"max_steps": 2}
    assert (run_dir / "wandb" / "treadle-run-id").read_text().strip() == run.run_id


def test_an_enabled_sink_without_its_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(metric_sinks.PACKAGES, "wandb", ("treadle_no_such_module", "wandb"))
    require_sinks(TelemetrySection())  # off: nothing to check
    with pytest.raises(ConfigError) as e:
        open_run_sinks(TelemetrySection(wandb=True), "myrun", tmp_path)
    assert str(e.value) == (
        "telemetry.wandb = true needs the 'treadle_no_such_module' package, which is not "
        "installed: pip install 'treadle-services[wandb]'"
    )
    assert not (tmp_path / "wandb").exists()


class Broken:
    name = "broken"

    def write(self, service: str, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        raise RuntimeError("disk full")

    def close(self) -> None:
        pass


class Kept:
    name = "kept"

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def write(self, service: str, step: int, wall_time: float, values: Mapping[str, float]) -> None:
        self.seen.append((service, step))

    def close(self) -> None:
        pass


def test_a_failing_sink_is_dropped_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kept = Kept()
    progress = Progress(tmp_path / "metrics.jsonl", "rl", 2, [Broken(), kept])
    with caplog.at_level(logging.WARNING):
        record_all(progress)
    progress.close()
    assert kept.seen == [(s, step) for s, step, _ in REPORTS]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == len(REPORTS)
    assert caplog.text.count("metrics sink broken failed, no longer used") == 1
