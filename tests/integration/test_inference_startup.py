"""How the inference service starts and fails: a bad model folder is a clear config
error, no model means control plane only, and a vLLM that dies takes the service down
with vLLM's last log lines."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from testkit.inference import start_inference
from treadle.inference.engine import plan_launch
from treadle.inference.spec import SPEC, InferenceSection
from treadle.proto.v1 import common_pb2, inference_service_pb2
from treadle.services.rpc import check_health, open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.services.tiny_model import build_tiny_model

pytestmark = pytest.mark.integration


def test_inference_nonexistent_model_fails_startup_with_one_clear_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "treadle.inference", "--inference.model", str(missing)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        f"inference.model: Value error, no such model folder; got {str(missing)!r} "
        "(set in flag --inference.model)"
    ) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_inference_without_a_model_serves_only_its_control_plane(
    tmp_path: Path, nats_url: str, free_port: int
) -> None:
    grpc_port = free_port
    argv = [
        sys.executable, "-m", "treadle.inference", "--nats.url", nats_url,
        "--run.output_dir", str(tmp_path), "--inference.grpc.port", str(grpc_port),
    ]  # fmt: skip
    proc = ManagedProcess("inference", argv, tmp_path / "inference.log").start()

    async def main() -> None:
        target = f"127.0.0.1:{grpc_port}"
        for _ in range(300):
            if await check_health(target, SPEC.control.full_name):
                break
            assert proc.poll() is None, proc.failure("died")
            await asyncio.sleep(0.1)
        async with open_channel(target, [SPEC.control]) as channel:
            stub = SPEC.stub(channel)
            status = await stub.GetStatus(common_pb2.GetStatusRequest())
            assert status.policy_version == -1
            assert "inference.model is not set" in status.info.message
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.UpdateWeights(
                    inference_service_pb2.UpdateWeightsRequest(policy_version=1)
                )
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    try:
        asyncio.run(main())
    finally:
        assert proc.stop(30) == 0


@pytest.mark.slow
def test_inference_fails_with_vllms_last_log_lines_when_vllm_cannot_start(
    tmp_path: Path, nats_url: str
) -> None:
    model = build_tiny_model(tmp_path / "m")
    proc, _, _ = start_inference(
        tmp_path,
        nats_url,
        model,
        "badvllm",
        "--inference.extra_vllm_args",
        '["--no-such-vllm-flag"]',
    )
    assert proc.proc is not None
    assert proc.proc.wait(timeout=300) == 1
    log = proc.log_file.read_text()
    assert "inference failed: vllm-" in log
    assert "died during startup (exited with code" in log
    assert "--- last lines of vllm-" in log
    assert "unrecognized arguments: --no-such-vllm-flag" in log


@pytest.mark.slow
def test_inference_vllm_routes_need_scale_out_and_dev_mode(tmp_path: Path, free_port: int) -> None:
    # the service's own launch plan works (every other inference test); here the same
    # plan without --enable-scale-out and VLLM_SERVER_DEV_MODE shows what they enable
    model = build_tiny_model(tmp_path / "m")
    cfg = InferenceSection(model=model, http_port=free_port, dtype="float32", max_model_len=256)
    plan = plan_launch(cfg, weights=model, device="cpu", token="")
    argv = [a for a in plan.argv if a != "--enable-scale-out"]
    env = plan.env | {"VLLM_SERVER_DEV_MODE": "0"}
    proc = ManagedProcess("vllm", argv, tmp_path / "vllm.log", env=env).start()
    url = f"http://127.0.0.1:{free_port}"
    try:
        deadline = time.monotonic() + 300
        while not _answers(url + "/health"):
            assert proc.poll() is None, proc.failure("died")
            assert time.monotonic() < deadline, "vLLM never answered"
            time.sleep(0.5)
        body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}}
        resp = httpx.post(url + "/inference/v1/generate", json=body, timeout=60)
        assert resp.status_code == 403
        assert "--enable-scale-out" in resp.text
        for path in (
            "/pause",
            "/resume",
            "/update_weight_version",
            "/collective_rpc",
            "/reset_prefix_cache",
        ):
            assert httpx.post(url + path, json={}, timeout=60).status_code == 404, path
        assert httpx.get(url + "/weight_info", timeout=60).status_code == 404
    finally:
        proc.stop(30)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
