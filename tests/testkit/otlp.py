"""An in-process OpenTelemetry collector for tests: an OTLP/gRPC receiver that keeps
every span it is sent (and accepts metrics), on a free loopback port."""

from __future__ import annotations

import threading
from concurrent import futures
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
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            with self._lock:
                self.metric_services |= {_service(rm.resource) for rm in request.resource_metrics}
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
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")
