"""Logging setup: JSON lines with the trace id, text for people."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from treadle.services.logs import setup_logging
from treadle.services.sections import LogSection


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_logs_json_lines_carry_service_and_trace_id(
    tmp_path: Path, span_exporter: Any, restore_root_logger: None
) -> None:
    log_file = tmp_path / "svc.log"
    setup_logging("trainer", LogSection(format="json", level="INFO"), file=log_file)
    log = logging.getLogger("treadle.test")
    log.debug("hidden below INFO")
    with trace.get_tracer("t").start_as_current_span("step") as span:
        log.info("[startup] ready on %d", 42)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    rows = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert [r["msg"] for r in rows] == ["[startup] ready on 42", "failed"]
    assert rows[0]["service"] == "trainer"
    assert rows[0]["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert "trace_id" not in rows[1]
    assert "ValueError: boom" in rows[1]["exc"]


def test_logs_text_format(tmp_path: Path, restore_root_logger: None) -> None:
    log_file = tmp_path / "svc.log"
    setup_logging("env_runner", LogSection(), file=log_file)
    logging.getLogger("x").warning("disk almost full")
    line = log_file.read_text().strip()
    assert line.endswith("WARNING env_runner  disk almost full")
