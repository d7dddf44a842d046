"""A service exports its spans over OTLP/gRPC to a collector (an in-process receiver here),
joined to the caller's trace through gRPC metadata."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from treadle.proto.v1 import common_pb2, trainer_service_pb2_grpc
from treadle.services.ports import free_port
from treadle.services.rpc import check_health, open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.services.telemetry import current_trace_id
from treadle.trainer.spec import SPEC as TRAINER

pytestmark = pytest.mark.integration


class Receiver(
    trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer
):
    def __init__(self) -> None:
        self.spans: list[tuple[str, Any]] = []  # (service.name, span)

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            return metrics_service_pb2.ExportMetricsServiceResponse()
        for rs in request.resource_spans:
            service = next(
                a.value.string_value for a in rs.resource.attributes if a.key == "service.name"
            )
            for ss in rs.scope_spans:
                self.spans += [(service, s) for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


def test_service_exports_spans_over_otlp(tmp_path: Path, nats_url: str, span_exporter: Any) -> None:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port = free_port()
    argv = [
        "python", "-m", "treadle.trainer", "--nats.url", nats_url, "--run.output_dir", str(tmp_path),
        "--trainer.grpc.port", str(port), "--telemetry.otlp_endpoint", f"http://127.0.0.1:{otlp_port}",
    ]  # fmt: skip
    import sys

    argv[0] = sys.executable
    proc = ManagedProcess("trainer", argv, tmp_path / "trainer.log").start()
    target = f"127.0.0.1:{port}"

    async def call() -> str:
        deadline = time.monotonic() + 30
        while not await check_health(target):
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
        with trace.get_tracer("test").start_as_current_span("caller"):
            async with open_channel(target, [TRAINER.control]) as channel:
                await trainer_service_pb2_grpc.TrainerControlStub(channel).GetStatus(
                    common_pb2.GetStatusRequest()
                )
            return current_trace_id()

    try:
        trace_id = asyncio.run(call())
    finally:
        assert proc.stop(grace_s=20) == 0  # shutdown flushes the exporter
        server.stop(0)
    exported = [
        (svc, s)
        for svc, s in receiver.spans
        if s.name == "treadle.proto.v1.TrainerControl/GetStatus"
    ]
    assert len(exported) == 1
    service, span = exported[0]
    assert service == "treadle-trainer"
    assert span.trace_id.hex() == trace_id
    assert not [s for _, s in receiver.spans if "Health" in s.name]  # health probes are not traced
