"""Fixtures shared by every test: real servers on free ports, test assets, the gpu skip.

Servers started here (nats-server, SeaweedFS) live in temporary directories and are
stopped by pid when the session ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.paths import SHARED_TOKENIZERS
from testkit.seaweed import SeaweedS3
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port as _free_port


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # files with slow tests first, each file's tests in their own order: pytest-xdist hands
    # out whole files in this order, so the long ones start early and the short ones fill
    # in at the end instead of one long file running alone last
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture
def free_port() -> int:
    """A free loopback TCP port."""
    return _free_port()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A real nats-server with JetStream for the whole session."""
    root = tmp_path_factory.mktemp("nats")
    server = EmbeddedNats(root / "store", root / "nats-server.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    assert nats_server.url
    return nats_server.url


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """A real S3 API (SeaweedFS `weed mini`) that checks request signatures."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_tokenizers() -> Path:
    """../shared/tokenizers (real tokenizer files with chat templates)."""
    if not SHARED_TOKENIZERS.is_dir():
        pytest.fail(f"{SHARED_TOKENIZERS} is missing: ../shared must sit beside the checkout")
    return SHARED_TOKENIZERS


@pytest.fixture(scope="session")
def _span_exporter_session() -> Any:
    """Install (once per process) an SDK tracer provider that records spans in memory."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # e.g. `treadle eval` run in this process first
        current.add_span_processor(SimpleSpanProcessor(exporter))
        return exporter
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another tracer provider was installed before the test kit's")
    return exporter


@pytest.fixture
def span_exporter(_span_exporter_session: Any) -> Any:
    """In-memory span exporter, emptied for this test."""
    _span_exporter_session.clear()
    return _span_exporter_session
