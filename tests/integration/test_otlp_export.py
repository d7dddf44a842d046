"""A service exports its spans over OTLP/gRPC to a collector (an in-process receiver here),
joined to the caller's trace through gRPC metadata."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from testkit.otlp import Receiver
from treadle.proto.v1 import common_pb2, trainer_service_pb2_grpc
from treadle.services.ports import free_port
from treadle.services.rpc import check_health, open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.services.telemetry import current_trace_id
from treadle.trainer.spec import SPEC as TRAINER

pytestmark = pytest.mark.integration


def test_service_exports_spans_over_otlp(tmp_path: Path, nats_url: str, span_exporter: Any) -> None:
    receiver = Receiver().start()
    port = free_port()
    argv = [
        "python", "-m", "treadle.trainer", "--nats.url", nats_url, "--run.output_dir", str(tmp_path),
        "--trainer.grpc.port", str(port), "--telemetry.otlp_endpoint", receiver.endpoint,
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
        receiver.stop()
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
