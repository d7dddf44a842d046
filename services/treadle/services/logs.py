"""Logging setup: stdlib ``logging`` only, configured once per process.

Text for people (``12:00:01 INFO  trainer  [startup] ...``) or JSON lines for log
pipelines, both carrying the current trace id when a span is active. Every handler
masks secrets (``redact.RedactFilter``: URL passwords, registered secret values), and a
log file is created readable by its owner only.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from opentelemetry import trace

from treadle.services.redact import RedactFilter
from treadle.services.sections import LogSection


def _trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, service, logger, msg, trace_id, exc."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if tid := _trace_id():
            doc["trace_id"] = tid
        if record.exc_info:
            doc["exc"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__("%(asctime)s %(levelname)-7s " + service + "  %(message)s", "%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        tid = _trace_id()
        return f"{line}  trace={tid[:16]}" if tid else line


def _drop_ssl_eof_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("returning true from eof_received()")


def setup_logging(service: str, cfg: LogSection | None = None, *, file: Path | None = None) -> None:
    """Configure the root logger for ``service`` (stderr, plus ``file`` when given)."""
    cfg = cfg or LogSection()
    formatter: logging.Formatter = (
        JsonFormatter(service) if cfg.format == "json" else TextFormatter(service)
    )
    formatter.converter = time.localtime
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        handlers.append(logging.FileHandler(file, encoding="utf-8"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        h.setFormatter(formatter)
        h.addFilter(RedactFilter())
        root.addHandler(h)
    root.setLevel(cfg.level)
    # asyncio's TLS transport warns on every server-side close of a NATS TLS connection
    logging.getLogger("asyncio").addFilter(_drop_ssl_eof_warning)
    # chatty third-party loggers stay at WARNING unless we debug
    for noisy in ("nats", "urllib3", "grpc", "asyncio", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(
            logging.DEBUG if cfg.level == "DEBUG" else logging.WARNING
        )
