"""The env runner service as a real process: `treadle serve env_runner` against a real
nats-server and a fake inference server (tests/testkit/env_runner.py).

What is proved: a runner SIGKILLed mid-rollout causes redeliveries and loses or doubles
nothing (RolloutCompleted carries Nats-Msg-Id = rollout_id; requests are acked only after
it is published); max_concurrency bounds the model calls in flight; in-progress heartbeats
keep a rollout longer than ack_wait from being redelivered; each rollout is one trace
with a span per model call, tool call and reward.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace

from testkit.env_runner import (
    SEARCH_TASK,
    FakeInference,
    make_request,
    num_messages,
    publish_requests,
    read_completed,
    reverse_task,
    start_runner,
    wait_for,
)
from testkit.paths import shared_tokenizer
from treadle.proto.v1 import rollout_pb2
from treadle.services.bus import Bus
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess
from treadle.services.telemetry import current_trace_id

pytestmark = pytest.mark.integration

OK = rollout_pb2.RolloutStatus.Kind.KIND_OK
Completed = list[tuple[str, rollout_pb2.RolloutCompleted]]  # (Nats-Msg-Id, message), in order
TIMEOUT_S = 60.0  # generous: a loaded 2-core machine starts a runner in seconds, not this


@pytest.fixture
def qwen3(shared_tokenizers: Path) -> Path:
    return shared_tokenizer("qwen3")


def run_name(what: str) -> str:
    return f"envrunner-{what}-{uuid.uuid4().hex[:8]}"


def tag(i: int) -> str:
    return reverse_task(i)["text"]


def assert_each_completed_once(
    completed: Completed, requests: list[rollout_pb2.RolloutRequested]
) -> None:
    per_id = Counter(done.rollout.rollout_id for _, done in completed)
    wanted = Counter(r.rollout_id for r in requests)
    lost = sorted(set(wanted) - set(per_id))
    doubled = sorted(k for k, n in per_id.items() if n > 1)
    unexpected = sorted(set(per_id) - set(wanted))
    assert (lost, doubled, unexpected) == ([], [], []), (
        f"lost {lost}, completed more than once {doubled}, never requested {unexpected}"
    )
    for msg_id, done in completed:
        assert msg_id == done.rollout.rollout_id, "Nats-Msg-Id must be the rollout_id"
        assert done.rollout.status.kind == OK, done.rollout.status


async def wait_all_done(
    bus: Bus, requests: list[rollout_pb2.RolloutRequested], what: str, runner: ManagedProcess
) -> None:
    """Until every request has a completion and none is left unacked in the work queue."""

    async def done() -> bool:
        return (
            await num_messages(bus, "ROLLOUTS") >= len(requests)
            and await num_messages(bus, "ROLLOUT_REQUESTS") == 0
        )

    async def seen() -> str:
        return (
            f"{await num_messages(bus, 'ROLLOUTS')} of {len(requests)} completions published, "
            f"{await num_messages(bus, 'ROLLOUT_REQUESTS')} requests not acked"
        )

    await wait_for(what, done, TIMEOUT_S, runner, detail=seen)


def test_env_runner_killed_mid_rollout_loses_and_doubles_nothing(
    tmp_path: Path, nats_url: str, qwen3: Path
) -> None:
    n, concurrency = 20, 4
    fake = FakeInference(qwen3, delay_s=0.3)
    run = run_name("kill")
    requests = [make_request("reverse_text", i, reverse_task(i)) for i in range(n)]
    by_tag = {tag(i): r.rollout_id for i, r in enumerate(requests)}
    runners: list[ManagedProcess] = []

    def runner(name: str) -> ManagedProcess:
        proc = start_runner(
            tmp_path, name, nats_url=nats_url, run_name=run, tokenizer=qwen3,
            inference_url=url, envs=["reverse_text"], max_concurrency=concurrency,
            extra=("--nats.ack_wait_s", "2"),
        )  # fmt: skip
        runners.append(proc)
        return proc

    async def main() -> tuple[set[str], Completed, Completed, int | None]:
        bus = await Bus.connect(NatsSection(url=nats_url), run, name="test")
        try:
            await bus.ensure_streams()
            first = runner("runner-1")
            await publish_requests(bus, requests)

            async def some_done() -> bool:
                return await num_messages(bus, "ROLLOUTS") >= concurrency

            await wait_for(f"{concurrency} completions from the first runner", some_done,
                           TIMEOUT_S, first)  # fmt: skip
            fake.hold()  # from here the first runner cannot finish what it has in flight

            async def all_slots_in_flight() -> bool:
                return fake.num_active == concurrency

            await wait_for("the first runner's rollouts held in the fake model",
                           all_slots_in_flight, TIMEOUT_S, first)  # fmt: skip
            in_flight = fake.active_tags()
            before = await read_completed(bus)
            assert first.pid is not None
            os.kill(first.pid, signal.SIGKILL)
            assert first.proc is not None
            first.proc.wait(timeout=10)
            fake.release()
            second = runner("runner-2")
            await wait_all_done(bus, requests, "every rollout done after the kill", second)
            return in_flight, before, await read_completed(bus), first.poll()
        finally:
            await bus.close()

    try:
        url = fake.start()
        in_flight, before, completed, first_code = asyncio.run(main())
    finally:
        for proc in runners:
            proc.stop(grace_s=10)
        fake.stop()

    assert first_code == -signal.SIGKILL
    assert len(in_flight) == concurrency, in_flight
    tag_of = {rollout_id: t for t, rollout_id in by_tag.items()}
    assert not in_flight & {tag_of[done.rollout.rollout_id] for _, done in before}
    assert_each_completed_once(completed, requests)
    calls = fake.calls_per_tag()
    assert set(calls) == set(by_tag), f"generate calls per task: {calls}"
    # the rollouts in flight at the kill were redelivered and run again, by the second runner
    assert all(calls[t] >= 2 for t in in_flight), f"in flight {in_flight}, calls {calls}"
    assert fake.num_generate >= n + len(in_flight)
    first_runner = {done.rollout.runner_id for _, done in before}
    assert len(first_runner) == 1
    done_by = {done.rollout.rollout_id: done.rollout.runner_id for _, done in completed}
    assert all(done_by[by_tag[t]] not in first_runner for t in in_flight)


def run_all_queued(
    tmp_path: Path, nats_url: str, qwen3: Path, fake: FakeInference,
    requests: list[rollout_pb2.RolloutRequested], envs: list[str], max_concurrency: int,
) -> Completed:  # fmt: skip
    """Queue every request, then let one runner work through them; its completions."""
    run = run_name("conc")
    proc: ManagedProcess | None = None

    async def main() -> Completed:
        nonlocal proc
        bus = await Bus.connect(NatsSection(url=nats_url), run, name="test")
        try:
            await bus.ensure_streams()
            await publish_requests(bus, requests)  # all queued before the runner pulls
            proc = start_runner(
                tmp_path, "runner", nats_url=nats_url, run_name=run, tokenizer=qwen3,
                inference_url=url, envs=envs, max_concurrency=max_concurrency,
            )  # fmt: skip
            await wait_all_done(bus, requests, "every rollout done", proc)
            return await read_completed(bus)
        finally:
            await bus.close()

    try:
        url = fake.start()
        return asyncio.run(main())
    finally:
        if proc is not None:
            proc.stop(grace_s=10)
        fake.stop()


def test_env_runner_never_exceeds_max_concurrency(
    tmp_path: Path, nats_url: str, qwen3: Path
) -> None:
    fake = FakeInference(qwen3, delay_s=0.4)
    requests = [make_request("reverse_text", i, reverse_task(i)) for i in range(12)]
    completed = run_all_queued(tmp_path, nats_url, qwen3, fake, requests, ["reverse_text"], 3)
    assert_each_completed_once(completed, requests)
    assert fake.num_generate == len(requests)
    # at most the limit, and the limit was reached (12 queued, each call 0.4 s)
    assert fake.max_active == 3, f"{fake.max_active} generate calls were in flight at once"


def test_env_runner_max_concurrency_bounds_all_envs_together(
    tmp_path: Path, nats_url: str, qwen3: Path
) -> None:
    fake = FakeInference(qwen3, delay_s=0.4, tool_calls=1)
    requests = [make_request("reverse_text", i, reverse_task(i)) for i in range(6)]
    requests += [make_request("tool_search", i, SEARCH_TASK) for i in range(6)]
    envs = ["reverse_text", "tool_search"]
    completed = run_all_queued(tmp_path, nats_url, qwen3, fake, requests, envs, 3)
    assert_each_completed_once(completed, requests)
    assert fake.max_active <= 3, f"{fake.max_active} generate calls were in flight at once"


def test_env_runner_heartbeats_keep_a_long_rollout_from_redelivery(
    tmp_path: Path, nats_url: str, qwen3: Path
) -> None:
    ack_wait_s = 1.5
    fake = FakeInference(qwen3, delay_s=3 * ack_wait_s)
    run = run_name("beat")
    requests = [make_request("reverse_text", i, reverse_task(i)) for i in range(2)]
    proc: ManagedProcess | None = None

    async def main() -> tuple[Completed, int]:
        nonlocal proc
        bus = await Bus.connect(NatsSection(url=nats_url), run, name="test")
        try:
            await bus.ensure_streams()
            await publish_requests(bus, requests)
            # free slots: a redelivered request would be pulled at once and call the model again
            proc = start_runner(
                tmp_path, "runner", nats_url=nats_url, run_name=run, tokenizer=qwen3,
                inference_url=url, envs=["reverse_text"], max_concurrency=4,
                extra=("--nats.ack_wait_s", str(ack_wait_s)),
            )  # fmt: skip
            await wait_all_done(bus, requests, "both rollouts done", proc)
            info = await bus.js.consumer_info(
                bus.subjects.stream_name("ROLLOUT_REQUESTS"), "env-runner-reverse_text"
            )
            return await read_completed(bus), int(info.num_redelivered or 0)
        finally:
            await bus.close()

    try:
        url = fake.start()
        completed, num_redelivered = asyncio.run(main())
    finally:
        if proc is not None:
            proc.stop(grace_s=10)
        fake.stop()

    assert_each_completed_once(completed, requests)
    for _, done in completed:
        assert done.rollout.timing.generation_s >= 3 * ack_wait_s * 0.95, done.rollout.timing
    assert fake.calls_per_tag() == Counter({tag(0): 1, tag(1): 1})
    assert num_redelivered == 0


def test_env_runner_traces_a_rollout_with_model_tool_and_reward_spans(
    tmp_path: Path, nats_url: str, qwen3: Path, span_exporter: Any
) -> None:
    # span_exporter: a tracer provider in this process, so the publish carries a traceparent
    fake = FakeInference(qwen3, tool_calls=1)  # a search, then the answer: two model calls
    run = run_name("trace")
    traces = tmp_path / "traces-{service}.jsonl"
    request = make_request("tool_search", 0, SEARCH_TASK)
    proc: ManagedProcess | None = None
    exit_code: int | None = None

    async def main() -> tuple[rollout_pb2.Rollout, str]:
        nonlocal proc, exit_code
        bus = await Bus.connect(NatsSection(url=nats_url), run, name="test")
        try:
            await bus.ensure_streams()
            proc = start_runner(
                tmp_path, "runner", nats_url=nats_url, run_name=run, tokenizer=qwen3,
                inference_url=url, envs=["tool_search"], max_concurrency=2,
                extra=("--telemetry.traces_file", str(traces)),
            )  # fmt: skip
            with trace.get_tracer("test").start_as_current_span("dispatch"):
                origin = current_trace_id()  # the orchestrator's trace, carried in the headers
                await publish_requests(bus, [request])
            await wait_all_done(bus, [request], "the rollout done", proc)
            [(_, done)] = await read_completed(bus)
            exit_code = proc.stop(grace_s=20)  # SIGTERM: the runner flushes its spans
            return done.rollout, origin
        finally:
            await bus.close()

    try:
        url = fake.start()
        rollout, origin = asyncio.run(main())
    finally:
        if proc is not None:
            proc.stop(grace_s=10)
        fake.stop()

    assert exit_code == 0, f"the runner exited with {exit_code}; log: {tmp_path / 'runner.log'}"
    assert rollout.status.kind == OK, rollout.status
    assert rollout.reward == 1.0
    assert rollout.timing.num_model_calls == 2
    path = tmp_path / "traces-env_runner.jsonl"
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    [root] = [s for s in spans if s["name"] == "rollout"
              and s["attributes"].get("treadle.rollout_id") == request.rollout_id]  # fmt: skip
    trace_id = root["context"]["trace_id"]
    assert trace_id == f"0x{rollout.trace_id}", (trace_id, rollout.trace_id)
    assert rollout.trace_id == origin, "the rollout must continue the publisher's trace"
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"] or "", []).append(s)
    below, todo = [], [root["context"]["span_id"]]
    while todo:
        kids = children.get(todo.pop(), [])
        below += kids
        todo += [k["context"]["span_id"] for k in kids]
    names = Counter(s["name"] for s in below)
    wanted = {"model_call": 2, "tool_call": 1, "reward": 1}
    assert {k: names[k] for k in wanted} == wanted, f"spans below the rollout: {names}"
    assert {s["context"]["trace_id"] for s in below} == {trace_id}
    [tool] = [s for s in below if s["name"] == "tool_call"]
    assert tool["attributes"]["treadle.tool"] == "search"
