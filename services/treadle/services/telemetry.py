"""OpenTelemetry setup per service and context propagation across NATS and gRPC.

``setup_telemetry`` installs the process-wide tracer and meter providers: OTLP/gRPC
export when ``telemetry.otlp_endpoint`` is set, spans as JSON lines when
``telemetry.traces_file`` is set, otherwise tracing stays off (no-op). Context travels
as W3C ``traceparent``/``tracestate`` in NATS headers and gRPC metadata through
``inject``/``extract`` below, so one trace follows a rollout across services.

Code obtains tracers with ``tracer(__name__)`` at use time, so whatever provider is
installed (including a test's in-memory one) is the one that records.

Spans cost CPU where rollouts are many, so a rollout records few: the bus's own
producer/consumer spans are off unless ``telemetry.messaging_spans`` is set (the context
still travels in the headers, so a handler's spans join the publisher's trace), and a span
that stands for a client call (``absorbing_calls``: a model call) records the call made
inside it on itself instead of a child span per HTTP call.

A rollout is one trace: the orchestrator starts it at dispatch (``new_trace``), NATS
headers carry it to the env runner, ``InferenceClient`` carries it to vLLM
(``traceparent``; vLLM exports its request spans when the inference service gives it the
OTLP endpoint), and the completion brings it back. Work on many rollouts (a batch, the
trainer step on it, the policy it publishes) is a trace of its own whose batch span
links every rollout it holds (``link_to``).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
    SpanProcessor,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from treadle.services.sections import TelemetrySection

log = logging.getLogger(__name__)

# a batch span links every rollout it holds (the SDK keeps 128 links by default)
MAX_SPAN_LINKS = 16384


class JsonLinesSpanExporter(SpanExporter):
    """Writes each finished span as one JSON object per line (for runs without a collector)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            self._file.write(json.dumps(json.loads(span.to_json()), separators=(",", ":")) + "\n")
        self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._file.close()


@dataclass
class Telemetry:
    """Handles to what setup_telemetry installed; ``shutdown`` flushes exporters."""

    tracer_provider: TracerProvider | None
    meter_provider: Any | None

    def shutdown(self) -> None:
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def setup_telemetry(
    service: str,
    cfg: TelemetrySection,
    *,
    instance_id: str = "",
    extra_processors: Sequence[SpanProcessor] = (),
) -> Telemetry:
    """Install tracer/meter providers for this process according to ``cfg``."""
    resource = Resource.create(
        {"service.name": f"treadle-{service}", "service.instance.id": instance_id or service}
    )
    set_messaging_spans(cfg.messaging_spans)
    processors: list[SpanProcessor] = list(extra_processors)
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processors.append(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=True))
        )
    elif cfg.traces_file:
        path = Path(str(cfg.traces_file).replace("{service}", service))
        processors.append(BatchSpanProcessor(JsonLinesSpanExporter(path)))
    tracer_provider = None
    if processors:
        tracer_provider = TracerProvider(
            resource=resource,
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            span_limits=SpanLimits(max_links=MAX_SPAN_LINKS),
        )
        for p in processors:
            tracer_provider.add_span_processor(p)
        trace.set_tracer_provider(tracer_provider)
    meter_provider = None
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=cfg.otlp_endpoint, insecure=True),
            export_interval_millis=cfg.metrics_interval_s * 1000,
        )
        meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
        metrics.set_meter_provider(meter_provider)
    where = cfg.otlp_endpoint or (str(cfg.traces_file) if cfg.traces_file else "off")
    log.info("[startup] telemetry: traces -> %s", where)
    return Telemetry(tracer_provider, meter_provider)


_tracers: dict[tuple[str, int], trace.Tracer] = {}
_messaging_spans = False


def tracer(name: str) -> trace.Tracer:
    """Tracer of a module, from whatever provider is installed now. Cached: the SDK builds a
    new Tracer on every get_tracer, a third of a span's cost where spans are many."""
    provider = trace.get_tracer_provider()
    key = (name, id(provider))
    found = _tracers.get(key)
    if found is None:
        found = _tracers[key] = provider.get_tracer(name)
    return found


_absorbing: contextvars.ContextVar[trace.Span | None] = contextvars.ContextVar(
    "treadle_absorbing_span", default=None
)


@contextlib.contextmanager
def absorbing_calls(span: trace.Span) -> Iterator[trace.Span]:
    """Inside the block, client calls made directly in ``span`` (it is the current span)
    record themselves on it -- attributes, and an event per failed attempt -- instead of
    starting a client span each (``absorbing_span``); their traceparent is ``span``'s, so
    the server's span becomes its child. One span per model call instead of two."""
    token = _absorbing.set(span)
    try:
        yield span
    finally:
        _absorbing.reset(token)


def absorbing_span() -> trace.Span | None:
    """The span a client call should record itself on: the ``absorbing_calls`` span while
    it is the current, recording span; None otherwise (the call starts its own span)."""
    span = _absorbing.get()
    if span is None or not span.is_recording() or trace.get_current_span() is not span:
        return None
    return span


def messaging_spans() -> bool:
    """Whether the bus records a producer span per publish and a consumer span per
    delivery (``telemetry.messaging_spans``). Either way the trace context travels in the
    message headers and the handler runs inside it."""
    return _messaging_spans


def set_messaging_spans(on: bool) -> None:
    global _messaging_spans
    _messaging_spans = on


@contextlib.contextmanager
def in_context(ctx: otel_context.Context) -> Iterator[trace.Span]:
    """Run the block inside ``ctx`` (e.g. extracted from headers) without a span of its own;
    yields the context's span (a non-recording one: its methods do nothing)."""
    token = otel_context.attach(ctx)
    try:
        yield trace.get_current_span(ctx)
    finally:
        otel_context.detach(token)


def meter(name: str) -> metrics.Meter:
    """Meter of a module, resolved through whatever provider is installed."""
    return metrics.get_meter(name)


def inject(carrier: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Write the current trace context into a headers/metadata mapping (returns it)."""
    propagate.inject(carrier)
    return carrier


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context:
    """Trace context carried by headers/metadata (empty context when none)."""
    return propagate.extract(dict(carrier or {}))


def current_trace_id() -> str:
    """Hex trace id of the current span, '' when there is none."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def new_trace() -> otel_context.Context:
    """A context without a span: a span started in it begins a trace of its own."""
    return otel_context.Context()


def link_to(carrier: Mapping[str, str] | None) -> trace.Link | None:
    """A link to the span whose context ``carrier`` (headers) holds; None when none."""
    ctx = trace.get_current_span(extract(carrier)).get_span_context()
    return trace.Link(ctx) if ctx.is_valid else None
