"""Helpers for the inference service tests: a running service, trainer-like policy
publication (perturbed weights + probe), and float32 reference logprobs from transformers."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testkit.procs import wait_healthy
from treadle.inference.spec import SPEC
from treadle.proto.v1 import common_pb2
from treadle.services.inference_client import GenerateResult, InferenceClient
from treadle.services.objectstore import ObjectStore
from treadle.services.ports import free_port
from treadle.services.rpc import open_channel
from treadle.services.supervisor import ManagedProcess

PROBE_IDS = (11, 42, 7, 300, 5, 96, 18, 250, 3, 77, 150, 9)


def reference_logprobs(model_dir: Path, token_ids: Sequence[int]) -> list[float]:
    """log p(token_ids[i+1] | token_ids[..i]) from transformers in float32 (len - 1 values)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, token_ids[i + 1]]) for i in range(len(token_ids) - 1)]


def perturbed_copy(src: Path, dst: Path, *, scale: float) -> Path:
    """A new policy folder (model.safetensors + config.json): the output head of ``src``
    scaled by ``scale`` (the embedding matrix when the model ties them)."""
    from safetensors.numpy import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    tensors[key] = (tensors[key] * np.float32(scale)).astype(np.float32)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def publish_policy(
    store: ObjectStore, version: int, folder: Path, probe_ids: Sequence[int] = PROBE_IDS
) -> common_pb2.ObjectRef:
    """What the trainer does after step ``version``: publish the folder with its probe."""
    probe = {"token_ids": list(probe_ids), "logprobs": reference_logprobs(folder, probe_ids)}
    return store.publish_dir(
        f"policies/v{version:06d}",
        {"model.safetensors": folder / "model.safetensors", "config.json": folder / "config.json"},
        {"policy_version": version, "format": "hf-safetensors", "probe": probe},
    )


@dataclass
class RunningInference:
    """An inference service process started by a test."""

    process: ManagedProcess
    grpc_target: str
    http_url: str
    run_dir: Path
    store_root: Path
    run_name: str
    model: Path

    @property
    def vllm_log(self) -> Path:
        return self.run_dir / "logs" / f"vllm-{self.http_url.rsplit(':', 1)[1]}.log"

    def log_text(self) -> str:
        return self.process.log_file.read_text(errors="replace")


def start_inference(
    tmp_path: Path, nats_url: str, model: Path, run_name: str, *extra: str
) -> tuple[ManagedProcess, int, int]:
    """Start ``python -m treadle.inference`` (not waiting for it); (process, http port, gRPC port)."""
    http_port, grpc_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "treadle.inference",
        "--nats.url", nats_url,
        "--run.name", run_name,
        "--run.output_dir", str(tmp_path),
        "--object_store.root", str(tmp_path / "store"),
        "--inference.model", str(model),
        "--inference.dtype", "float32",
        "--inference.max_model_len", "1024",
        "--inference.http_port", str(http_port),
        "--inference.grpc.port", str(grpc_port),
        *extra,
    ]  # fmt: skip
    proc = ManagedProcess("inference", argv, tmp_path / "inference.log").start()
    return proc, http_port, grpc_port


def wait_serving(
    tmp_path: Path, nats_url: str, model: Path, run_name: str, *extra: str
) -> RunningInference:
    """Start the service and wait until its gRPC health says SERVING (vLLM up, v0 served)."""
    proc, http_port, grpc_port = start_inference(tmp_path, nats_url, model, run_name, *extra)
    target = f"127.0.0.1:{grpc_port}"

    try:
        asyncio.run(wait_healthy(proc, target, SPEC.control.full_name))
    except BaseException:
        proc.stop()
        raise
    return RunningInference(
        proc,
        target,
        f"http://127.0.0.1:{http_port}",
        tmp_path / run_name,
        tmp_path / "store",
        run_name,
        model,
    )


async def generate_until(
    served: RunningInference, version: int, prompt: Sequence[int], timeout_s: float = 600
) -> list[GenerateResult]:
    """Generate in a loop (two requests at a time) until the service reports ``version``,
    then a little longer; returns every result. Requests caught by a restart of vLLM are
    retried by the client, so every one of them completes."""
    results: list[GenerateResult] = []
    done = asyncio.Event()

    async def worker(client: InferenceClient, seed: int) -> None:
        while not done.is_set():
            results.append(await client.generate(prompt, max_tokens=32, seed=seed, ignore_eos=True))
            seed += 2

    async with (
        InferenceClient(served.http_url, timeout_s=timeout_s, max_retries=1000) as client,
        open_channel(served.grpc_target, [SPEC.control]) as channel,
    ):
        workers = [asyncio.create_task(worker(client, s)) for s in (0, 1)]
        deadline = time.monotonic() + timeout_s
        stub = SPEC.stub(channel)
        while (await stub.GetStatus(common_pb2.GetStatusRequest())).policy_version != version:
            assert time.monotonic() < deadline, f"version {version} never served"
            assert not any(w.done() for w in workers), [w.exception() for w in workers if w.done()]
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        done.set()
        await asyncio.gather(*workers)
    return results
