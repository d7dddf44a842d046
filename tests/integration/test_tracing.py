"""One trace follows work across services: a NATS publish -> consume, then a gRPC call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from treadle.proto.v1 import common_pb2, rollout_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from treadle.services import telemetry
from treadle.services.bus import Bus, Delivery
from treadle.services.rpc import open_channel, start_server
from treadle.services.sections import NatsSection
from treadle.services.telemetry import JsonLinesSpanExporter, current_trace_id

pytestmark = pytest.mark.integration

TRAINER = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerControl"]


class RecordingTrainer(trainer_service_pb2_grpc.TrainerControlServicer):
    def __init__(self) -> None:
        self.trace_ids: list[str] = []

    async def GetStatus(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        self.trace_ids.append(current_trace_id())
        return trainer_service_pb2.TrainerStatus(step=1)


@pytest.fixture(params=[True, False], ids=["messaging-spans", "no-messaging-spans"])
def messaging(request: pytest.FixtureRequest) -> Any:
    """telemetry.messaging_spans on (the bus's publish/process spans) and off (default)."""
    telemetry.set_messaging_spans(request.param)
    yield request.param
    telemetry.set_messaging_spans(False)


def test_trace_id_crosses_nats_and_grpc(nats_url: str, span_exporter: Any, messaging: bool) -> None:
    servicer = RecordingTrainer()

    async def main() -> str:
        server = await start_server(
            "127.0.0.1",
            0,
            [(trainer_service_pb2_grpc.add_TrainerControlServicer_to_server, servicer, TRAINER)],
        )
        # a run of its own per mode: the server's duplicate window would drop a second "t1"
        bus = await Bus.connect(NatsSection(url=nats_url), "tracing" if messaging else "tracingoff")
        await bus.ensure_streams()
        tracer = trace.get_tracer("test")
        with tracer.start_as_current_span("orchestrator.dispatch"):
            origin = current_trace_id()
            await bus.publish(
                bus.subjects.rollouts_requested("echo"),
                rollout_pb2.RolloutRequested(rollout_id="t1"),
                msg_id="t1",
            )
        assert current_trace_id() == ""  # nothing leaks outside the span
        done = asyncio.Event()

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            async with open_channel(f"127.0.0.1:{server.port}", [TRAINER]) as channel:
                await trainer_service_pb2_grpc.TrainerControlStub(channel).GetStatus(
                    common_pb2.GetStatusRequest()
                )
            done.set()

        consumer = await bus.consumer(
            "ROLLOUT_REQUESTS",
            "tracer",
            bus.subjects.rollouts_requested_any,
            rollout_pb2.RolloutRequested,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(handler, stop, fetch_timeout_s=0.2))
        await asyncio.wait_for(done.wait(), 20)
        stop.set()
        await task
        await bus.close()
        await server.stop(0)
        return origin

    origin = asyncio.run(main())
    assert origin
    assert servicer.trace_ids == [origin]  # the gRPC server ran inside the publisher's trace
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    server_span = spans["treadle.proto.v1.TrainerControl/GetStatus"]
    assert format(server_span.context.trace_id, "032x") == origin
    assert server_span.kind == trace.SpanKind.SERVER
    if not messaging:  # no spans of the bus's own; the handler's call is the dispatch's child
        assert not any(n.startswith(("publish ", "process ")) for n in spans)
        assert server_span.parent is not None
        assert server_span.parent.span_id == spans["orchestrator.dispatch"].context.span_id
        return
    publish = spans["publish treadle.tracing.rollouts.requested.echo"]
    process = spans["process treadle.tracing.rollouts.requested.echo"]
    for span in (publish, process, server_span):
        assert format(span.context.trace_id, "032x") == origin
    assert process.parent is not None
    assert process.parent.span_id == publish.context.span_id
    assert server_span.parent is not None
    assert server_span.parent.span_id == process.context.span_id
    assert process.kind == trace.SpanKind.CONSUMER


def test_traces_file_exporter_writes_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "traces" / "svc.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("outer"), tracer.start_as_current_span("inner"):
        pass
    provider.shutdown()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["inner", "outer"]
    assert rows[0]["context"]["trace_id"] == rows[1]["context"]["trace_id"]
