"""The minimal env runner's rollout: token-exact nodes, provenance, rewards, statuses."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import load_environments
from treadle.env_runner.envs.reverse_text import lcs_ratio
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array
from treadle.services.errors import ConfigError
from treadle.services.inference_client import InferenceRequestError

Kind = rollout_pb2.RolloutStatus.Kind
ErrorKind = rollout_pb2.RolloutStatus.ErrorKind


class FakeGenerator(ScriptedGenerator):
    """Answers with fixed token ids at policy version 3 (the request's)."""

    def __init__(self, answer_ids: list[int], fail_times: int = 0):
        super().__init__([answer_ids], fail_times=fail_times, version=3)


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def request(
    text: str = "hello", env: str = "reverse_text", task_json: str | None = None
) -> rollout_pb2.RolloutRequested:
    return rollout_pb2.RolloutRequested(
        rollout_id="r1", group_id="g", env=env, task_id="t", task_json=task_json or json.dumps({"text": text}),
        sampling=rollout_pb2.SamplingParams(max_tokens=16, temperature=1.0), policy_version=3,
    )  # fmt: skip


def run(
    req: rollout_pb2.RolloutRequested,
    gen: FakeGenerator,
    renderer: treadle_native.Renderer,
    env: Any = "default",
) -> rollout_pb2.Rollout:
    envs = load_environments(["reverse_text"], {})
    rc = RolloutContext(renderer, gen, "runner-1", attempts=2)
    return asyncio.run(run_rollout(req, envs["reverse_text"] if env == "default" else env, rc))


def test_rollout_nodes_are_the_rendered_prompt_plus_sampled_ids(
    renderer: treadle_native.Renderer,
) -> None:
    answer = encode_qwen3("<think>\n\n</think>\n\nolleh<|im_end|>")
    gen = FakeGenerator(answer)
    r = run(request("hello"), gen, renderer)
    assert r.status.kind == Kind.KIND_OK
    assert r.reward == pytest.approx(1.0)
    prompt = renderer.render(
        load_environments(["reverse_text"], {})["reverse_text"].prompt({"text": "hello"}),
        add_generation_prompt=True,
    )
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    assert ids == prompt.token_ids.tolist() + answer  # token-exact: nothing re-encoded
    assert gen.calls[0] == prompt.token_ids.tolist()
    mask = np.concatenate([to_array(n.sampled_mask) for n in r.nodes])
    assert mask.sum() == len(answer)
    assert mask[-len(answer) :].all()
    versions = np.concatenate([to_array(n.policy_versions) for n in r.nodes])
    assert set(versions[mask == 1].tolist()) == {3}
    assert set(versions[mask == 0].tolist()) == {-1}
    assert [n.role for n in r.nodes] == [
        rollout_pb2.ROLE_SYSTEM,
        rollout_pb2.ROLE_USER,
        rollout_pb2.ROLE_ASSISTANT,
    ]
    assert [n.parent_id for n in r.nodes] == [-1, 0, 1]
    assert r.nodes[-1].content == "olleh"
    assert (r.min_policy_version, r.max_policy_version) == (3, 3)


def test_rollout_without_stop_token_is_truncated(renderer: treadle_native.Renderer) -> None:
    r = run(request("hello"), FakeGenerator(encode_qwen3("oll")), renderer)
    assert r.status.kind == Kind.KIND_TRUNCATED
    assert r.status.truncation == rollout_pb2.RolloutStatus.Truncation.TRUNCATION_MAX_TOKENS
    assert 0 < r.reward < 1


def test_rollout_model_calls_fit_in_the_model_s_context_length(
    renderer: treadle_native.Renderer,
) -> None:
    """sampling.max_tokens is 16; with 5 tokens of room after the prompt the call asks for
    5, and a prompt that fills the context is a MAX_TOTAL_TOKENS truncation, not a call."""
    envs = load_environments(["reverse_text"], {})
    prompt = renderer.render(
        envs["reverse_text"].prompt({"text": "hello"}), add_generation_prompt=True
    )
    for room, calls in ((5, [5]), (0, [])):
        gen = FakeGenerator(encode_qwen3("olleh<|im_end|>"))
        rc = RolloutContext(renderer, gen, "runner-1", max_model_len=len(prompt.token_ids) + room)
        r = asyncio.run(run_rollout(request("hello"), envs["reverse_text"], rc))
        assert [kw["max_tokens"] for kw in gen.sampling] == calls
        if not room:
            assert r.status.kind == Kind.KIND_TRUNCATED
            assert (
                r.status.truncation
                == rollout_pb2.RolloutStatus.Truncation.TRUNCATION_MAX_TOTAL_TOKENS
            )
            assert "context length" in r.status.message


def test_rollout_errors_are_statuses(renderer: treadle_native.Renderer) -> None:
    ok = encode_qwen3("x<|im_end|>")
    assert (
        run(request(task_json="[1, 2]"), FakeGenerator(ok), renderer).status.error_kind
        == ErrorKind.ERROR_KIND_INVALID_REQUEST
    )
    assert (
        run(request(), FakeGenerator(ok), renderer, env=None).status.error_kind
        == ErrorKind.ERROR_KIND_INVALID_REQUEST
    )
    assert (
        run(request(task_json='{"no_text": 1}'), FakeGenerator(ok), renderer).status.error_kind
        == ErrorKind.ERROR_KIND_INVALID_REQUEST  # a row missing a declared field
    )
    failing = FakeGenerator(ok, fail_times=5)
    r = run(request(), failing, renderer)
    assert r.status.error_kind == ErrorKind.ERROR_KIND_INFERENCE
    assert len(failing.calls) == 2  # bounded attempts
    flaky = FakeGenerator(ok, fail_times=1)
    assert run(request(), flaky, renderer).status.kind == Kind.KIND_OK

    class Broken:
        name = "broken"

        def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"role": "user", "content": "hi"}]

        def reward(self, task: dict[str, Any], completion: str) -> float:
            raise ZeroDivisionError("boom")

    r = run(request(), FakeGenerator(ok), renderer, env=Broken())
    assert r.status.error_kind == ErrorKind.ERROR_KIND_REWARD
    assert "ZeroDivisionError" in r.status.message


class RefusingGenerator(ScriptedGenerator):
    """Inference that answers every call with an HTTP error."""

    def __init__(self, status: int, message: str):
        super().__init__(["x"])
        self.error = InferenceRequestError(f"HTTP {status}: {message}", status)

    async def generate(self, prompt_ids: Any, **kw: Any) -> Any:
        self.calls.append(list(prompt_ids))
        raise self.error


@pytest.mark.parametrize(
    ("status", "message", "calls", "kind", "detail"),
    [
        # the conversation outgrew the model: a truncated (trainable) rollout, asked once
        (400, "The decoder prompt (length 1199) is longer than the maximum model length of "
              "1024.", 1, Kind.KIND_TRUNCATED, "no longer fits the model's context"),
        (400, "This model's maximum context length is 512 tokens.", 1, Kind.KIND_TRUNCATED,
         "no longer fits"),
        # another refusal: an inference error, not asked again
        (400, "top_k must be -1 or at least 1", 1, Kind.KIND_ERROR, "inference refused the call"),
        # overload and server errors are retried
        (429, "too many requests", 2, Kind.KIND_ERROR, "failed 2 times"),
        (503, "engine restarting", 2, Kind.KIND_ERROR, "failed 2 times"),
    ],
)  # fmt: skip
def test_inference_refusals_are_not_retried_and_a_full_context_truncates(
    renderer: treadle_native.Renderer, status: int, message: str, calls: int, kind: int,
    detail: str,
) -> None:  # fmt: skip
    gen = RefusingGenerator(status, message)
    r = run(request(), gen, renderer)
    assert r.status.kind == kind
    assert detail in r.status.message
    assert len(gen.calls) == calls
    if kind == Kind.KIND_TRUNCATED:
        assert (
            r.status.truncation == rollout_pb2.RolloutStatus.Truncation.TRUNCATION_MAX_TOTAL_TOKENS
        )


def test_reverse_text_reward_gives_partial_credit() -> None:
    assert lcs_ratio("olleh", "olleh") == 1.0
    assert lcs_ratio("", "") == 1.0
    assert lcs_ratio("oleh", "olleh") == pytest.approx(2 * 4 / 9)
    assert lcs_ratio("xyz", "olleh") == 0.0


def test_unknown_environment_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown environment 'nope'"):
        load_environments(["nope"], {})
    with pytest.raises(ConfigError, match="cannot import"):
        load_environments(["x"], {"x": "no.such.module:ENV"})


def test_rollouts_run_blocking_rewards_side_by_side_in_the_runners_executor(
    renderer: treadle_native.Renderer,
) -> None:
    """Environment code runs in the runner's own pool (sized to its concurrency): 12
    rewards that each block until all 12 are running at once all complete (asyncio's
    default pool has min(32, cpus + 4) threads: too few on a small machine)."""
    from concurrent.futures import ThreadPoolExecutor

    n = 12
    barrier = threading.Barrier(n, timeout=30)
    threads: set[str] = set()

    class Blocking:
        name = "blocking"

        def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"role": "user", "content": task["text"]}]

        def reward(self, task: dict[str, Any], completion: str) -> float:
            threads.add(threading.current_thread().name)
            barrier.wait()  # BrokenBarrierError (an error status) unless all n run at once
            return 1.0

    gen = FakeGenerator(encode_qwen3("ok<|im_end|>"))
    with ThreadPoolExecutor(n, thread_name_prefix="env") as pool:
        rc = RolloutContext(renderer, gen, "runner-1", executor=pool)

        async def all_rollouts() -> list[rollout_pb2.Rollout]:
            env = Blocking()
            return await asyncio.gather(*(run_rollout(request(), env, rc) for _ in range(n)))

        rollouts = asyncio.run(all_rollouts())
    assert [r.status.kind for r in rollouts] == [Kind.KIND_OK] * n
    assert len(threads) == n
    assert all(t.startswith("env") for t in threads)
