"""What an inference replica announces (``[inference] announce``): the URL and control
address the other nodes reach it at, and under control-plane TLS the name its
certificate is checked against when it is dialled by address."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from treadle.inference.service import InferenceApp
from treadle.inference.spec import InferenceSection
from treadle.services.credentials import cert_names, generate
from treadle.services.discovery import Announcer, advertised_host, route_address
from treadle.services.sections import ControlSection, GrpcSection, NatsSection

HOST = socket.gethostname()


def announcer(inference: InferenceSection, nats_url: str, control: ControlSection) -> Announcer:
    app = InferenceApp.__new__(InferenceApp)
    app.ctx = SimpleNamespace(
        config=SimpleNamespace(inference=inference, nats=NatsSection(url=nats_url),
                               control=control),
        grpc_port=50051, bus=None,
    )  # fmt: skip
    return app.announcer()


@pytest.mark.parametrize(
    ("section", "nats_url", "url", "grpc"),
    [
        (dict(http_host="127.0.0.1"), "nats://10.9.9.9:4222", "http://127.0.0.1:8123",
         "127.0.0.1:50051"),
        # a wildcard bind: the address of this machine's route to NATS (here, loopback)
        (dict(http_host="0.0.0.0", grpc=GrpcSection(host="0.0.0.0")), "tls://127.0.0.1:4222",
         "http://127.0.0.1:8123", "127.0.0.1:50051"),
        # ... and when NATS's name does not resolve, the hostname
        (dict(http_host="0.0.0.0", grpc=GrpcSection(host="0.0.0.0")), "nats://nats.invalid:4222",
         f"http://{HOST}:8123", f"{HOST}:50051"),
        (dict(http_host="0.0.0.0", advertise_host="gpu-3.internal"), "nats://127.0.0.1:4222",
         "http://gpu-3.internal:8123", "gpu-3.internal:50051"),
        (dict(http_host="::1", grpc=GrpcSection(host="::1")), "nats://127.0.0.1:4222",
         "http://[::1]:8123", "[::1]:50051"),
    ],
)  # fmt: skip
def test_the_announcement_names_where_others_reach_the_replica(
    section: dict[str, object], nats_url: str, url: str, grpc: str
) -> None:
    inference = InferenceSection(announce=True, http_port=8123, served_model_name="m", **section)
    a = announcer(inference, nats_url, ControlSection())
    assert (a.announcement.url, a.announcement.grpc) == (url, grpc)
    assert a.announcement.model == "m"
    assert a.announcement.tls_name == ""  # no TLS: nothing to verify
    assert a.key == f"inference-{HOST}-8123".replace(".", "_")


def test_under_tls_the_announcement_names_a_name_of_the_replica_s_certificate(
    tmp_path: Path,
) -> None:
    creds = generate(tmp_path / "creds", "ann", hosts=["inference"])
    control = ControlSection(tls_cert=creds.cert, tls_key=creds.key, tls_ca=creds.ca)
    names = cert_names(creds.cert.read_bytes())
    assert "inference" in names
    assert "127.0.0.1" in names
    elsewhere = InferenceSection(announce=True, http_port=8123, advertise_host="10.1.2.3")
    a = announcer(elsewhere, "nats://127.0.0.1:4222", control)
    assert a.announcement.grpc == "10.1.2.3:50051"
    assert a.announcement.tls_name == names[0]  # 10.1.2.3 is not in it: dial by a name it has
    listed = InferenceSection(announce=True, http_port=8123, http_host="127.0.0.1",
                              grpc=GrpcSection(host="127.0.0.1"))  # fmt: skip
    assert announcer(listed, "nats://127.0.0.1:4222", control).announcement.tls_name == ""


def test_advertised_host_rules() -> None:
    assert advertised_host("10.0.0.4", None, "127.0.0.1") == "10.0.0.4"
    assert advertised_host("0.0.0.0", "node-7", "127.0.0.1") == "node-7"
    assert advertised_host("0.0.0.0", None, "127.0.0.1") == "127.0.0.1"
    assert advertised_host("::", None, None) == HOST
    assert route_address("127.0.0.1", 4222) == "127.0.0.1"
    assert route_address("nats.invalid", 4222) is None
