"""A group's identical first calls as one n-sample request (env_runner/siblings.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from treadle.env_runner.siblings import SiblingCalls
from treadle.proto.v1 import rollout_pb2
from treadle.services.inference_client import GenerateResult
from treadle.services.inference_pool import InferencePool

NEVER = 3600.0  # a window no test waits out: a test that needs it to end would hang


def result(k: int, prompt: Any) -> GenerateResult:
    return GenerateResult(
        token_ids=np.asarray([100 + k], dtype=np.int32),
        logprobs=np.asarray([-0.1 * (k + 1)], dtype=np.float32),
        policy_versions=np.asarray([7], dtype=np.int32),
        finish_reason="stop", stop_reason=None,
        prompt_token_ids=np.asarray(prompt, dtype=np.int32), request_id=f"r{k}",
    )  # fmt: skip


class Recorder:
    """A generator that records each request: ("one" | n, prompt, kwargs)."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple[Any, list[int], dict[str, Any]]] = []
        self.fail = fail  # the first ``fail`` requests raise
        self.served = 0

    def _count(self) -> None:
        self.served += 1
        if self.served <= self.fail:
            raise ConnectionError(f"request {self.served} failed")

    async def generate(self, prompt_ids: Any, **kw: Any) -> GenerateResult:
        self.calls.append(("one", list(prompt_ids), kw))
        await asyncio.sleep(0)
        self._count()
        return result(self.served * 10, prompt_ids)

    async def generate_n(self, prompt_ids: Any, n: int, **kw: Any) -> list[GenerateResult]:
        self.calls.append((n, list(prompt_ids), kw))
        await asyncio.sleep(0)
        self._count()
        return [result(k, prompt_ids) for k in range(n)]


def request(group: str, index: int, size: int, seed: int | None = None) -> Any:
    sampling = rollout_pb2.SamplingParams(temperature=1.0, max_tokens=8)
    if seed is not None:
        sampling.seed = seed
    return rollout_pb2.RolloutRequested(rollout_id=f"{group}-{index:03d}", group_id=group,
                                        group_index=index, group_size=size, sampling=sampling)  # fmt: skip


async def first_calls(calls: SiblingCalls, inner: Any, prompts: list[list[int]], size: int,
                      **kw: Any) -> list[GenerateResult]:  # fmt: skip
    """One rollout per prompt, of one group of ``size``, each making its first call."""
    gens = [calls.bind(request("g", i, size), inner) for i in range(len(prompts))]
    try:
        return await asyncio.wait_for(
            asyncio.gather(*(g.generate(p, max_tokens=8, temperature=1.0, **kw)
                             for g, p in zip(gens, prompts, strict=True))), 10)  # fmt: skip
    finally:
        for g in gens:
            calls.release(g)


def test_a_groups_equal_first_calls_are_one_request_and_each_rollout_gets_its_own_sample() -> None:
    inner = Recorder()
    calls = SiblingCalls(NEVER)  # the group is complete: nothing waits for the window
    got = asyncio.run(first_calls(calls, inner, [[1, 2, 3]] * 4, size=4))
    assert inner.calls == [(4, [1, 2, 3], {"max_tokens": 8, "temperature": 1.0})]
    assert sorted(int(r.token_ids[0]) for r in got) == [100, 101, 102, 103]  # no sample twice
    assert not calls._groups  # forgotten once its rollouts are done


def test_calls_with_other_prompts_or_settings_are_not_merged_and_none_waits() -> None:
    inner = Recorder()
    got = asyncio.run(first_calls(SiblingCalls(NEVER), inner, [[1], [1], [2], [1]], size=4))
    assert sorted((c[0], c[1]) for c in inner.calls if c[0] != "one") == [(3, [1])]
    assert [c[1] for c in inner.calls if c[0] == "one"] == [[2]]
    assert [r.prompt_token_ids.tolist() for r in got] == [[1], [1], [2], [1]]

    async def two_settings() -> None:
        calls = SiblingCalls(NEVER)
        a, b = (calls.bind(request("h", i, 2), inner) for i in range(2))
        await asyncio.wait_for(asyncio.gather(a.generate([5], max_tokens=8),
                                              b.generate([5], max_tokens=9)), 10)  # fmt: skip

    inner.calls.clear()
    asyncio.run(two_settings())
    assert sorted(c[2]["max_tokens"] for c in inner.calls) == [8, 9]
    assert all(c[0] == "one" for c in inner.calls)


def test_siblings_that_do_not_come_are_waited_for_only_the_window() -> None:
    inner = Recorder()
    # a group of 8 of which this runner holds 3 (the rest on other runners)
    asyncio.run(first_calls(SiblingCalls(0.05), inner, [[4, 4]] * 3, size=8))
    assert [c[0] for c in inner.calls] == [3]


def test_later_turns_and_seeded_calls_go_alone_at_once() -> None:
    inner = Recorder()

    async def main() -> None:
        calls = SiblingCalls(NEVER)
        gens = [calls.bind(request("g", i, 2), inner) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(g.generate([1], max_tokens=8) for g in gens)), 10)
        # the second turn of one rollout: its sibling will not make one now
        await asyncio.wait_for(gens[0].generate([1, 100, 2], max_tokens=8), 10)
        seeded = SiblingCalls(NEVER).bind(request("s", 0, 2, seed=3), inner)
        assert seeded is inner  # a fixed seed: n samples would not be the seed's samples
        for g in gens:
            calls.release(g)

    asyncio.run(main())
    assert [c[0] for c in inner.calls] == [2, "one"]


def test_a_rollout_that_ends_before_its_first_call_is_not_waited_for() -> None:
    inner = Recorder()

    async def main() -> None:
        calls = SiblingCalls(NEVER)
        gens = [calls.bind(request("g", i, 3), inner) for i in range(3)]
        waiting = asyncio.gather(*(g.generate([9], max_tokens=8) for g in gens[:2]))
        await asyncio.sleep(0.01)
        calls.release(gens[2])  # e.g. its environment raised before the model was called
        await asyncio.wait_for(waiting, 10)
        for g in gens[:2]:
            calls.release(g)
        assert not calls._groups

    asyncio.run(main())
    assert [c[0] for c in inner.calls] == [2]


def test_a_failed_request_fails_each_callers_call_and_their_retries_go_alone() -> None:
    inner = Recorder(fail=1)

    async def main() -> list[Any]:
        calls = SiblingCalls(NEVER)
        gens = [calls.bind(request("g", i, 3), inner) for i in range(3)]
        first = await asyncio.gather(*(g.generate([1], max_tokens=8) for g in gens),
                                     return_exceptions=True)  # fmt: skip
        assert all(isinstance(e, ConnectionError) for e in first)
        return await asyncio.wait_for(
            asyncio.gather(*(g.generate([1], max_tokens=8) for g in gens)), 10
        )

    again = asyncio.run(main())
    assert [c[0] for c in inner.calls] == [3, "one", "one", "one"]
    assert len({int(r.token_ids[0]) for r in again}) == 3


def test_nothing_is_shared_without_generate_n_a_group_of_one_or_a_zero_window() -> None:
    class Plain:
        async def generate(self, prompt_ids: Any, **kw: Any) -> Any:
            raise AssertionError("not called")

    plain, inner = Plain(), Recorder()
    assert SiblingCalls(NEVER).bind(request("g", 0, 8), plain) is plain
    assert SiblingCalls(NEVER).bind(request("g", 0, 1), inner) is inner
    assert SiblingCalls(0).bind(request("g", 0, 8), inner) is inner
    with pytest.raises(ValueError, match="window_s"):
        SiblingCalls(-1)


def test_siblings_served_together_keep_their_later_turns_on_the_same_replica() -> None:
    async def main() -> list[str | None]:
        pool = InferencePool(["http://127.0.0.1:1", "http://127.0.0.1:2"], probe_interval_s=0)
        served: list[str] = []

        async def generate_n(self: Any, prompt_ids: Any, n: int, **kw: Any) -> Any:
            served.append(self.base_url)
            return [result(k, prompt_ids) for k in range(n)]

        for replica in pool.replicas:
            replica.client.generate_n = generate_n.__get__(replica.client)  # type: ignore[method-assign]
        calls = SiblingCalls(NEVER)
        pins = [pool.for_rollout(f"g-{i}") for i in range(3)]
        gens = [calls.bind(request("g", i, 3), p) for i, p in enumerate(pins)]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(g.generate([1], max_tokens=4) for g in gens)), 10
            )
        finally:
            await pool.aclose()
        assert len(served) == 1
        return [p.replica.url if p.replica else None for p in pins]

    urls = asyncio.run(main())
    assert urls[0] is not None
    assert urls == [urls[0]] * 3


def test_each_rollouts_model_call_span_says_it_shared_a_request_and_links_the_one_that_sent_it(
    span_exporter: Any,
) -> None:
    from treadle.services.telemetry import absorbing_calls, tracer

    async def main() -> None:
        calls = SiblingCalls(NEVER)
        gens = [calls.bind(request("g", i, 3), Recorder()) for i in range(3)]

        async def call(g: Any) -> None:
            with (
                tracer(__name__).start_as_current_span("model_call") as span,
                absorbing_calls(span),
            ):
                await g.generate([1, 2], max_tokens=8)

        await asyncio.wait_for(asyncio.gather(*(call(g) for g in gens)), 10)

    asyncio.run(main())
    spans = [s for s in span_exporter.get_finished_spans() if s.name == "model_call"]
    assert len(spans) == 3
    sent = [s for s in spans if "treadle.generate.request_of" not in s.attributes]
    assert len(sent) == 1  # the rollout whose call went out: vLLM's span is in its trace
    for s in spans:
        assert s.attributes["gen_ai.request.choice.count"] == 3
        assert s.attributes["gen_ai.usage.completion_tokens"] == 1
        if s is not sent[0]:
            assert s.attributes["treadle.generate.request_of"] == "g-000"
            assert [link.context.span_id for link in s.links] == [sent[0].context.span_id]


def test_a_caller_cancelled_while_it_waits_leaves_its_siblings_served_and_nothing_behind() -> None:
    inner = Recorder()

    async def main() -> None:
        calls = SiblingCalls(NEVER)
        a, b, c = (calls.bind(request("g", i, 3), inner) for i in range(3))
        cut = asyncio.ensure_future(a.generate([3], max_tokens=8))  # its rollout times out
        kept = asyncio.ensure_future(b.generate([3], max_tokens=8))
        await asyncio.sleep(0.01)
        cut.cancel()
        calls.release(a)
        calls.release(c)  # never called: the batch goes out with the two that did
        got = await asyncio.wait_for(kept, 10)
        assert got.prompt_token_ids.tolist() == [3]
        assert cut.cancelled()
        calls.release(b)
        await asyncio.sleep(0)
        assert not calls._groups
        assert not calls._tasks

    asyncio.run(main())
    assert [c[0] for c in inner.calls] == [2]
