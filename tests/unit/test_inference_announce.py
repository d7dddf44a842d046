"""What an inference replica announces (``[inference] announce``): the URL and control
address the other nodes reach it at."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from treadle.inference.service import InferenceApp
from treadle.inference.spec import InferenceSection
from treadle.services.sections import GrpcSection


@pytest.mark.parametrize(
    ("section", "url", "grpc"),
    [
        (dict(http_host="127.0.0.1"), "http://127.0.0.1:8123", "127.0.0.1:50051"),
        (dict(http_host="0.0.0.0", grpc=GrpcSection(host="0.0.0.0")),
         f"http://{socket.gethostname()}:8123", f"{socket.gethostname()}:50051"),
        (dict(http_host="0.0.0.0", advertise_host="gpu-3.internal"),
         "http://gpu-3.internal:8123", "gpu-3.internal:50051"),
        (dict(http_host="::1", grpc=GrpcSection(host="::1")), "http://[::1]:8123", "[::1]:50051"),
    ],
)  # fmt: skip
def test_the_announcement_names_where_others_reach_the_replica(
    section: dict[str, object], url: str, grpc: str
) -> None:
    inference = InferenceSection(announce=True, http_port=8123, served_model_name="m", **section)
    app = InferenceApp.__new__(InferenceApp)
    app.ctx = SimpleNamespace(
        config=SimpleNamespace(inference=inference), grpc_port=50051, bus=None
    )
    announcer = app.announcer()
    assert (announcer.announcement.url, announcer.announcement.grpc) == (url, grpc)
    assert announcer.announcement.model == "m"
    assert announcer.key == f"inference-{socket.gethostname()}-8123".replace(".", "_")
