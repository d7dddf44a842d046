"""An in-process OpenTelemetry collector for tests: an OTLP/gRPC receiver that keeps
every span it is sent (and accepts metrics), on a free loopback port; and
``trace_of_a_trained_rollout``, which follows one rollout's trace through every service."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)
        self.metric_services: set[str] = set()  # service.name of every metrics export
        self.metric_names: set[tuple[str, str]] = set()  # (service.name, metric name)
        # the last value of every cumulative sum (counter) data point, keyed by
        # (service.name, service.instance.id, metric name, sorted attribute items)
        self.sums: dict[tuple[str, str, str, tuple[tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            with self._lock:
                for rm in request.resource_metrics:
                    svc = _service(rm.resource)
                    instance = _attr(rm.resource, "service.instance.id")
                    self.metric_services.add(svc)
                    for m in (m for sm in rm.scope_metrics for m in sm.metrics):
                        self.metric_names.add((svc, m.name))
                        if m.WhichOneof("data") != "sum":
                            continue
                        for p in m.sum.data_points:
                            attrs = tuple(
                                sorted((a.key, a.value.string_value) for a in p.attributes)
                            )
                            value = p.as_double if p.HasField("as_double") else float(p.as_int)
                            self.sums[(svc, instance, m.name, attrs)] = value
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for rs in request.resource_spans:
            service = _service(rs.resource)
            with self._lock:
                for ss in rs.scope_spans:
                    self.spans += [(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> Receiver:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self._server = server
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def services(self) -> set[str]:
        """service.name of every process that sent spans."""
        with self._lock:
            return {svc for svc, _ in self.spans}

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(0)


def _service(resource: Any) -> str:
    return _attr(resource, "service.name")


def _attr(resource: Any, key: str) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == key), "")


@dataclass
class RolloutTrace:
    """One trained rollout's trace and the trace of the batch that trained it."""

    rollout_id: str
    rollout: list[tuple[str, Any]]  # (service.name, span) of the rollout's trace
    batch: list[tuple[str, Any]]  # (service.name, span) of its batch's trace

    def services(self) -> set[str]:
        """Every service that has a span in either trace."""
        return {svc for svc, _ in self.rollout + self.batch}

    def names(self, which: str, service: str) -> set[str]:
        """Span names of ``service`` in the ``which`` ("rollout" or "batch") trace."""
        return {s.name for svc, s in getattr(self, which) if svc == service}


def trace_of_a_trained_rollout(receiver: Receiver) -> RolloutTrace | None:
    """A rollout whose trace the receiver holds from its dispatch through a model call
    that vLLM traced, and whose batch span (linked to it) has the trainer's step in its
    trace; None when no rollout got that far."""
    with receiver._lock:
        spans = list(receiver.spans)
    by_trace: dict[bytes, list[tuple[str, Any]]] = {}
    for svc, span in spans:
        by_trace.setdefault(span.trace_id, []).append((svc, span))
    for svc, batch in spans:
        if batch.name != "batch" or svc != "treadle-orchestrator":
            continue
        batch_trace = by_trace[batch.trace_id]
        if not any(s.name == "train_step" for _, s in batch_trace):
            continue
        for link in batch.links:
            rollout_trace = by_trace.get(link.trace_id, [])
            names = {s.name for _, s in rollout_trace}
            if {"dispatch", "rollout", "llm_request"} <= names:
                dispatch = next(s for _, s in rollout_trace if s.name == "dispatch")
                rid = next(a.value.string_value for a in dispatch.attributes
                           if a.key == "treadle.rollout_id")  # fmt: skip
                return RolloutTrace(rid, rollout_trace, batch_trace)
    return None


def parent_of(spans: list[tuple[str, Any]], span: Any) -> tuple[str, Any] | None:
    """The (service.name, span) among ``spans`` that is ``span``'s parent."""
    return next(((svc, s) for svc, s in spans if s.span_id == span.parent_span_id), None)
