"""The orchestrator's RL loop against a real nats-server, with a fake env runner and a
fake trainer on the bus: batches in order, every rollout trained at most once,
staleness bounded, and a restart mid-run loses and repeats nothing."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.aio.msg
import numpy as np
import pytest
from opentelemetry import trace

from testkit.teacher import FakeTeacherServer
from treadle.orchestrator.loop import RLLoop
from treadle.orchestrator.spec import SPEC, OrchestratorConfig
from treadle.orchestrator.state import STATE_KEY, OrchestratorState, eval_group_id
from treadle.orchestrator.teacher import NoPrivilegedContext
from treadle.proto.v1 import batch_pb2, policy_pb2, rollout_pb2
from treadle.services import telemetry
from treadle.services.bus import Bus, Delivery
from treadle.services.codecs import to_array, to_token_array
from treadle.services.errors import ConfigError, TreadleError
from treadle.services.host import ServiceContext
from treadle.services.objectstore import LocalObjectStore

pytestmark = pytest.mark.integration


class World:
    """Fake env runner + fake trainer/inference sharing one policy version."""

    def __init__(self, bus: Bus, seed: int = 0, frozen: bool = False):
        self.bus = bus
        self.version = 0
        self.frozen = frozen  # inference never loads new weights (a broken deployment)
        self.rng = random.Random(seed)
        self.batches: list[batch_pb2.BatchReady] = []
        self.requests: list[rollout_pb2.RolloutRequested] = []
        # the trace each request / BatchReady was handled in (its headers carry it)
        self.runner_traces: dict[str, int] = {}
        self.trainer_traces: dict[int, int] = {}
        # the reward of a request (default: uniform in [0, 1), so groups always vary)
        self.reward_of: Callable[[rollout_pb2.RolloutRequested], float] | None = None
        # requests this runner takes but never finishes (its consumer naks them at the end)
        self.hold: Callable[[rollout_pb2.RolloutRequested], bool] = lambda req: False
        # requests this runner takes and drops (acked, never completed: nobody serves them)
        self.drop: Callable[[rollout_pb2.RolloutRequested], bool] = lambda req: False
        # the environment gives privileged context (self-distillation) when asked
        self.privileged = True
        self.train_s = 0.05  # a step's training: the new policy is published after it

    async def runner(self, req: rollout_pb2.RolloutRequested, d: Delivery) -> None:
        self.requests.append(req)
        self.runner_traces[req.rollout_id] = trace.get_current_span().get_span_context().trace_id
        if self.hold(req):
            await asyncio.Event().wait()
        if self.drop(req):
            return
        await asyncio.sleep(self.rng.uniform(0, 0.05))
        r = rollout_pb2.Rollout(
            rollout_id=req.rollout_id,
            group_id=req.group_id,
            group_index=req.group_index,
            env=req.env,
        )
        for parent, ids, sampled in ((-1, [5, 6, 7], False), (0, [8, 9, 10, 11], True)):
            n = r.nodes.add(node_id=len(r.nodes), parent_id=parent)
            k = len(ids)
            n.token_ids.CopyFrom(to_token_array(np.array(ids, np.int32)))
            n.sampled_mask.CopyFrom(to_token_array(np.full(k, int(sampled), np.uint8)))
            n.logprobs.CopyFrom(to_token_array(np.full(k, -1.0 if sampled else 0.0, np.float32)))
            n.policy_versions.CopyFrom(
                to_token_array(np.full(k, self.version if sampled else -1, np.int32))
            )
        if req.want_privileged_prompts and self.privileged:  # self-distillation: a hint
            r.privileged_prompts.add(
                root_node_id=0, num_replaced=3,
                token_ids=to_token_array(np.array([5, 6, 40, 41, 7], np.int32)),
            )  # fmt: skip
        r.reward = self.reward_of(req) if self.reward_of else self.rng.random()
        r.status.kind = rollout_pb2.RolloutStatus.Kind.KIND_OK
        await self.bus.publish(
            self.bus.subjects.rollouts_completed,
            rollout_pb2.RolloutCompleted(rollout=r),
            msg_id=r.rollout_id,
        )

    async def trainer(self, ready: batch_pb2.BatchReady, d: Delivery) -> None:
        self.batches.append(ready)
        self.trainer_traces[ready.step] = trace.get_current_span().get_span_context().trace_id
        await asyncio.sleep(self.train_s)
        msg = policy_pb2.PolicyPublished(policy_version=ready.step)
        await self.bus.publish(
            self.bus.subjects.policy_published, msg, msg_id=f"policy-{ready.step}"
        )
        if not self.frozen:
            self.version = ready.step  # inference loads it at once


def config(tmp_path: Path, url: str, run: str, **orch: Any) -> OrchestratorConfig:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}", "text": "abc"}) for i in range(20)))
    section = {"tasks": str(tasks), "max_steps": 6, "group_size": 3, "groups_per_step": 2, "max_groups_in_flight": 4,
               "max_async_level": 1, "max_off_policy_steps": 1, "seq_len": 32, "status_poll_s": 0.05, **orch}  # fmt: skip
    return OrchestratorConfig.model_validate(
        {"run": {"name": run}, "nats": {"url": url}, "orchestrator": section}
    )


async def run_world(
    tmp_path: Path,
    url: str,
    run: str,
    *,
    stop_after_steps: int | None = None,
    linger_s: float = 0.0,
    train_s: float = 0.05,
    frozen: bool = False,
    group_scorer: Any = None,
    reward_of: Callable[[rollout_pb2.RolloutRequested], float] | None = None,
    hold: Callable[[rollout_pb2.RolloutRequested], bool] | None = None,
    drop: Callable[[rollout_pb2.RolloutRequested], bool] | None = None,
    metrics: list[tuple[int, dict[str, float]]] | None = None,
    privileged: bool = True,
    **orch: Any,
) -> tuple[World, RLLoop]:
    cfg = config(tmp_path, url, run, **orch)
    store = LocalObjectStore(tmp_path / "store")
    bus = await Bus.connect(cfg.nats, run, store=store)
    await bus.ensure_streams()
    world = World(await Bus.connect(cfg.nats, run, store=store), frozen=frozen)
    world.reward_of = reward_of
    world.privileged = privileged
    world.train_s = train_s
    if hold is not None:
        world.hold = hold
    if drop is not None:
        world.drop = drop
    last = await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
    world.version = (
        last.policy_version if last is not None else 0
    )  # inference serves the newest policy
    ctx = ServiceContext(SPEC, cfg, "orchestrator-test", bus, store)
    if metrics is not None:  # what the loop reports, recorded on its way to METRICS
        report = ctx.report_metrics

        async def recorded(step: int, values: dict[str, float]) -> None:
            metrics.append((step, dict(values)))
            await report(step, values)

        ctx.report_metrics = recorded  # type: ignore[method-assign]
    loop = RLLoop(ctx, cfg.orchestrator)
    stop = asyncio.Event()
    side_stop = asyncio.Event()
    runner = await world.bus.consumer(
        "ROLLOUT_REQUESTS",
        "fake-runner",
        bus.subjects.rollouts_requested_any,
        rollout_pb2.RolloutRequested,
    )
    trainer = await world.bus.consumer(
        "BATCHES", "fake-trainer", bus.subjects.batches_any, batch_pb2.BatchReady
    )
    side = [
        asyncio.create_task(
            runner.run(
                world.runner,
                side_stop,
                concurrency=16 if hold else 4,
                fetch_timeout_s=0.1,
                drain_timeout_s=0.5,
            )
        ),
        asyncio.create_task(trainer.run(world.trainer, side_stop, fetch_timeout_s=0.1)),
    ]
    if group_scorer is not None:  # an env runner answering group-reward requests
        await world.bus.serve(bus.subjects.groups_score("reverse_text"), "runners",
                              rollout_pb2.GroupScoreRequest, group_scorer)  # fmt: skip
    main = asyncio.create_task(loop.run(stop))
    try:
        async with asyncio.timeout(120):
            if stop_after_steps is None:
                await main
            else:
                while loop.state.step < stop_after_steps:  # noqa: ASYNC110 - polling the loop's state
                    await asyncio.sleep(0.02)
                await asyncio.sleep(linger_s)
                main.cancel()  # the orchestrator goes away mid-run
                await asyncio.gather(main, return_exceptions=True)
    finally:
        await asyncio.sleep(0.3)  # let the fake trainer take the last batch
        side_stop.set()
        await asyncio.gather(*side)
        await world.bus.close()
        await bus.close()
    return world, loop


def test_rl_loop_trains_every_rollout_at_most_once_with_bounded_staleness(
    tmp_path: Path, nats_url: str
) -> None:
    world, loop = asyncio.run(run_world(tmp_path, nats_url, "loop1"))
    steps = [b.step for b in world.batches]
    assert steps == [1, 2, 3, 4, 5, 6]
    ids = [rid for b in world.batches for rid in b.rollout_ids]
    assert len(ids) == len(set(ids))  # nothing trained twice
    requested = {r.rollout_id for r in world.requests}
    assert set(ids) <= requested
    for b in world.batches:
        assert b.min_policy_version >= (b.step - 1) - 1  # max_off_policy_steps = 1
        assert b.num_samples >= 1
        assert b.data.sha256
    assert loop.state.step == 6


def test_rl_loop_completions_share_state_writes_and_each_is_durable_before_its_ack(
    tmp_path: Path, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group commit: completions arriving together share one state write (fewer writes
    than completions), and none is acked before a written state holds it (recorded as
    completed, or trained)."""
    written: list[OrchestratorState] = []
    put = LocalObjectStore.put_bytes

    def recording_put(self: LocalObjectStore, key: str, data: bytes, media_type: str = "") -> Any:
        ref = put(self, key, data, media_type)
        if key == STATE_KEY:
            written.append(OrchestratorState.from_json(data))
        return ref

    acked: list[str] = []
    unsaved: list[str] = []
    ack_sync = nats.aio.msg.Msg.ack_sync

    async def checked_ack(self: nats.aio.msg.Msg, *args: Any) -> Any:
        if ".rollouts.completed" in self.subject:
            r = rollout_pb2.RolloutCompleted.FromString(self.data).rollout
            seq = self.metadata.sequence.stream
            if not any(
                r.rollout_id in st.trained
                or (
                    (g := st.groups.get(r.group_id)) is not None
                    and g.completed.get(r.rollout_id) == seq
                )
                for st in written
            ):
                unsaved.append(r.rollout_id)
            acked.append(r.rollout_id)
        return await ack_sync(self, *args)

    monkeypatch.setattr(LocalObjectStore, "put_bytes", recording_put)
    monkeypatch.setattr(nats.aio.msg.Msg, "ack_sync", checked_ack)
    world, _ = asyncio.run(run_world(tmp_path, nats_url, "commit"))
    assert [b.step for b in world.batches] == [1, 2, 3, 4, 5, 6]
    trained = {rid for b in world.batches for rid in b.rollout_ids}
    assert trained <= set(acked)
    assert not unsaved
    assert len(written) < len(acked)


def test_rl_loop_level_zero_is_on_policy(tmp_path: Path, nats_url: str) -> None:
    world, _ = asyncio.run(
        run_world(
            tmp_path, nats_url, "loop0", max_async_level=0, max_off_policy_steps=0, max_steps=4
        )
    )
    for b in world.batches:
        assert (
            b.min_policy_version == b.max_policy_version == b.step - 1
        )  # generated by exactly policy s - 1


def test_rl_loop_restart_loses_and_repeats_nothing(tmp_path: Path, nats_url: str) -> None:
    first, loop_a = asyncio.run(run_world(tmp_path, nats_url, "restart", stop_after_steps=3))
    assert loop_a.state.step >= 3
    second, loop_b = asyncio.run(run_world(tmp_path, nats_url, "restart"))
    assert loop_b.state.step == 6
    batches = {b.step: b for b in [*first.batches, *second.batches]}
    assert sorted(batches) == [1, 2, 3, 4, 5, 6]
    ids = [rid for b in batches.values() for rid in b.rollout_ids]
    assert len(ids) == len(set(ids))
    # every request published before the restart completed into a batch, is still owned by
    # a group, or was dropped and counted: as too old for the policy (a slow machine makes
    # a restart's in-flight rollouts stale), as an error, or with its group (filtered or
    # refused); the counters live in the saved state, so both runs' drops are in them
    done = set(ids) | {rid for g in loop_b.state.groups.values() for rid in g.rollout_ids}
    missing = [req.rollout_id for req in first.requests if req.rollout_id not in done]
    st = loop_b.state
    counted = st.dropped_stale + st.dropped_errors + 3 * (st.groups_filtered + st.groups_refused)
    assert len(missing) <= counted, (missing, st.dropped_stale, st.dropped_errors,
                                     st.groups_filtered, st.groups_refused)  # fmt: skip


def test_rl_loop_gives_up_clearly_when_every_sample_is_stale(tmp_path: Path, nats_url: str) -> None:
    # the gate believes the trainer's version, but rollouts keep coming from version 0
    with pytest.raises(TreadleError, match="every sample of the last 20 batches was dropped"):
        asyncio.run(
            run_world(
                tmp_path, nats_url, "stale", frozen=True, max_off_policy_steps=0, max_steps=30
            )
        )


def first_bonus_scorer(
    failing_group: str, seen: list[str]
) -> Callable[[rollout_pb2.GroupScoreRequest], Awaitable[rollout_pb2.GroupScoreReply]]:
    """An env runner answering group-reward requests: +10 for the group's first rollout;
    the group ``failing_group``'s group reward raises. Each request's group id goes to
    ``seen``; requests carry text only."""
    from treadle.env_runner import Environment, Rubric
    from treadle.env_runner.group import score_group

    def first_bonus(completions: list[str]) -> list[float]:
        return [1.0] + [0.0] * (len(completions) - 1)

    env = Environment(
        "reverse_text", prompt=lambda t: "x", rubric=Rubric(group_rewards=[(first_bonus, 10.0)])
    )
    broken = Environment(
        "reverse_text", prompt=lambda t: "x", rubric=Rubric(group_rewards=[lambda: 1 / 0])
    )

    async def scorer(req: rollout_pb2.GroupScoreRequest) -> rollout_pb2.GroupScoreReply:
        seen.append(req.group_id)
        assert all(not n.token_ids.data for r in req.rollouts for n in r.nodes)  # text only

        async def run_sync(fn: Any) -> Any:
            return fn()

        return await score_group(broken if req.group_id == failing_group else env, req, run_sync)

    return scorer


def test_rl_loop_applies_group_rewards_from_an_env_runner(tmp_path: Path, nats_url: str) -> None:
    """Complete groups go to an env runner for their group rewards (here +10 for the
    group's first rollout); a group whose group reward fails is not trained."""
    seen: list[str] = []
    scorer = first_bonus_scorer("g0000001", seen)
    world, _loop = asyncio.run(
        run_world(tmp_path, nats_url, "groups", group_scorer=scorer, max_steps=3)
    )
    trained = [rid for b in world.batches for rid in b.rollout_ids]
    assert not [rid for rid in trained if rid.startswith("g0000001-")]  # its group reward failed
    assert sum(b.metrics["num_group_reward_errors"] for b in world.batches) == 1
    for b in world.batches:  # each trained group has one +10 rollout among group_size 3
        n_groups = b.metrics["num_groups"] - b.metrics["num_group_reward_errors"]
        assert b.metrics["reward_max"] >= 10
        assert b.metrics["reward_mean"] * b.metrics["num_samples"] >= 10 * n_groups - 1e-9
    assert set(seen) >= {rid.rsplit("-", 1)[0] for rid in trained}


def test_rl_loop_without_group_rewards_asks_nobody(tmp_path: Path, nats_url: str) -> None:
    world, _loop = asyncio.run(run_world(tmp_path, nats_url, "nogroups", max_steps=2))
    assert [b.step for b in world.batches] == [1, 2]
    assert all(b.metrics["num_group_reward_errors"] == 0 for b in world.batches)


@pytest.mark.parametrize("messaging", [True, False], ids=["messaging-spans", "no-messaging-spans"])
def test_rl_loop_traces_each_rollout_and_links_each_batch_to_them(
    tmp_path: Path, nats_url: str, span_exporter: Any, messaging: bool
) -> None:
    run = "traced" if messaging else "tracedoff"
    telemetry.set_messaging_spans(messaging)
    try:
        world, _ = asyncio.run(run_world(tmp_path, nats_url, run, max_steps=2))
    finally:
        telemetry.set_messaging_spans(False)
    spans = span_exporter.get_finished_spans()
    dispatch = {s.attributes["treadle.rollout_id"]: s for s in spans if s.name == "dispatch"}
    assert set(dispatch) == {r.rollout_id for r in world.requests}
    assert all(s.parent is None for s in dispatch.values())  # each rollout begins a trace
    traces = {rid: s.context.trace_id for rid, s in dispatch.items()}
    assert len(set(traces.values())) == len(traces)  # one trace per rollout
    # the env runner's work, and the bus's hops when they have spans, stay in the rollout's
    # trace; the orchestrator records no span per completion (its batch links the trace)
    assert set(world.runner_traces.values()) == set(traces.values())
    assert not [s for s in spans if s.name == "collect"]
    hops = (
        f"process treadle.{run}.rollouts.requested",
        f"process treadle.{run}.rollouts.completed",
    )
    for hop in hops:
        seen = {s.context.trace_id for s in spans if s.name.startswith(hop)}
        assert seen == (set(traces.values()) if messaging else set())
    batches = sorted(
        (s for s in spans if s.name == "batch"), key=lambda s: s.attributes["treadle.step"]
    )
    assert [b.attributes["treadle.step"] for b in batches] == [1, 2]
    for batch, ready in zip(batches, world.batches, strict=True):
        assert batch.parent is None
        assert batch.context.trace_id not in traces.values()  # a trace of its own ...
        # ... linked to the trace of every rollout it holds
        assert sorted(link.context.trace_id for link in batch.links) == sorted(
            traces[rid] for rid in ready.rollout_ids
        )
        in_batch = {s.name for s in spans if s.context.trace_id == batch.context.trace_id}
        assert {"score_group", "pack", "store_batch"} <= in_batch
        # the trainer consumes the BatchReady inside the batch's trace
        assert world.trainer_traces[ready.step] == batch.context.trace_id
        if messaging:
            assert f"process treadle.{run}.batches.{ready.step}" in in_batch
        else:
            assert not any(n.startswith(("publish ", "process ")) for n in in_batch)


def easy_tasks_all_pass(req: rollout_pb2.RolloutRequested) -> float:
    """Even tasks: every rollout gets 1 (a zero-variance group); odd tasks vary."""
    k = int(req.task_id[1:])
    return 1.0 if k % 2 == 0 else (req.group_index + 1) / 4


@pytest.mark.parametrize("action", ["drop", "resample"])
def test_rl_loop_filter_keeps_zero_variance_groups_out_of_batches(
    tmp_path: Path, nats_url: str, action: str
) -> None:
    world, loop = asyncio.run(
        run_world(tmp_path, nats_url, f"filter-{action}", reward_of=easy_tasks_all_pass,
                  filter={"action": action}, max_steps=4)
    )  # fmt: skip
    task_of = {r.rollout_id: r.task_id for r in world.requests}
    assert [b.step for b in world.batches] == [1, 2, 3, 4]
    trained = [rid for b in world.batches for rid in b.rollout_ids]
    assert trained
    assert all(int(task_of[rid][1:]) % 2 == 1 for rid in trained)  # no easy task trained
    refused = sum(b.metrics["num_groups_zero_variance"] for b in world.batches)
    easy = {task_of[rid] for rid in task_of if int(task_of[rid][1:]) % 2 == 0}
    assert easy  # the sampler handed out easy tasks, and each was refused and counted
    assert loop.state.groups_filtered == refused >= 1
    assert loop.gauges()["groups_filtered_total"] == refused
    groups = [len(b.rollout_ids) // 3 for b in world.batches]  # group_size 3
    if action == "resample":  # refused groups were replaced: every batch is full
        assert groups == [2, 2, 2, 2]
    else:  # dropped: some batch trained fewer groups than groups_per_step
        assert min(groups) < 2


def test_rl_loop_filter_resample_gives_up_clearly_when_every_group_is_refused(
    tmp_path: Path, nats_url: str
) -> None:
    with pytest.raises(TreadleError, match="the last 6 completed groups were all refused"):
        asyncio.run(
            run_world(tmp_path, nats_url, "filter-all", reward_of=lambda req: 0.0,
                      filter={"action": "resample", "max_refused_in_a_row": 6})
        )  # fmt: skip


def test_rl_loop_filter_keep_counts_zero_variance_groups_and_trains_them(
    tmp_path: Path, nats_url: str
) -> None:
    world, loop = asyncio.run(
        run_world(tmp_path, nats_url, "filter-keep", reward_of=easy_tasks_all_pass, max_steps=3)
    )
    task_of = {r.rollout_id: r.task_id for r in world.requests}
    trained = [rid for b in world.batches for rid in b.rollout_ids]
    counted = sum(b.metrics["num_groups_zero_variance"] for b in world.batches)
    easy_groups = {rid[:8] for rid in trained if int(task_of[rid][1:]) % 2 == 0}
    assert counted == len(easy_groups) >= 1
    assert loop.state.groups_filtered == 0


# --- evaluation during training ----------------------------------------------------------------
def eval_tasks(tmp_path: Path, n: int = 5) -> Path:
    path = tmp_path / "heldout.jsonl"
    path.write_text("\n".join(json.dumps({"id": f"h{i}", "text": "xyz"}) for i in range(n)))
    return path


def heldout_even_pass(req: rollout_pb2.RolloutRequested) -> float:
    """Held-out tasks h0, h2, h4 pass (reward 1), h1, h3 fail (0); training rewards vary."""
    if req.labels.get("split") == "eval":
        return 1.0 if int(req.task_id[1:]) % 2 == 0 else 0.0
    return random.random()


def eval_rows(metrics: list[tuple[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    rows: dict[int, dict[str, float]] = {}
    for step, values in metrics:
        if any(k.startswith("eval/") for k in values):
            assert not any(not k.startswith("eval/") for k in values)  # a row of its own
            assert step not in rows  # one row per round
            rows[step] = values
    return rows


def test_rl_loop_evaluates_heldout_tasks_every_n_steps_without_training_them(
    tmp_path: Path, nats_url: str, span_exporter: Any
) -> None:
    metrics: list[tuple[int, dict[str, float]]] = []
    world, loop = asyncio.run(
        run_world(tmp_path, nats_url, "eval", reward_of=heldout_even_pass, metrics=metrics,
                  eval={"every_steps": 2, "tasks": str(eval_tasks(tmp_path)),
                        "rollouts_per_task": 2, "sampling": {"temperature": 0.7}})
    )  # fmt: skip
    rows = eval_rows(metrics)
    assert sorted(rows) == [0, 2, 4, 6]  # at start, every 2 steps, the final policy
    for step, row in rows.items():
        assert row["eval/num_tasks"] == 5
        assert row["eval/num_rollouts"] == 10
        assert row["eval/num_rollouts_error"] == 0
        assert row["eval/reward_mean"] == pytest.approx(0.6)
        assert row["eval/pass@1"] == pytest.approx(0.6)
        assert row["eval/pass@2"] == pytest.approx(0.6)
        # the policy evaluated is the one trained for `step` steps (or newer), never older
        assert step <= row["eval/policy_version"] <= row["eval/policy_version_max"]
        assert row["eval/dispatch_step"] >= step
    evals = [r for r in world.requests if r.labels.get("split") == "eval"]
    train = [r for r in world.requests if r.labels.get("split") == "train"]
    assert len(evals) == 4 * 10
    assert len(train) + len(evals) == len(world.requests)
    assert all(r.sampling.temperature == pytest.approx(0.7) for r in evals)
    assert all(r.sampling.temperature == 1.0 for r in train)
    eval_ids = {r.rollout_id for r in evals}
    assert len(eval_ids) == 40
    assert not eval_ids & {r.rollout_id for r in train}
    # training is unaffected: every step trains groups_per_step training groups, none eval
    assert [b.step for b in world.batches] == [1, 2, 3, 4, 5, 6]
    trained = [rid for b in world.batches for rid in b.rollout_ids]
    assert len(trained) == len(set(trained)) == 6 * 2 * 3
    assert not eval_ids & set(trained)
    # each eval rollout is traced like a training one, its dispatch span saying split = eval
    dispatch = [s for s in span_exporter.get_finished_spans() if s.name == "dispatch"]
    split = {s.attributes["treadle.rollout_id"]: s.attributes["treadle.split"] for s in dispatch}
    assert {rid for rid, sp in split.items() if sp == "eval"} == eval_ids
    assert {rid for rid, sp in split.items() if sp == "train"} == {r.rollout_id for r in train}
    assert all(b.metrics["reward_max"] < 1.0 for b in world.batches)  # no eval reward in them
    assert loop.state.eval_round is None
    assert loop.state.eval_next == -1
    assert not loop.eval_buffer
    assert loop.state.duplicates_ignored == 0
    store = LocalObjectStore(tmp_path / "store")
    for step in rows:
        lines = store.get_bytes(f"eval/step-{step:06d}.jsonl").decode().splitlines()
        got = [json.loads(line) for line in lines]
        assert sorted((g["task_id"], g["index"]) for g in got) == [
            (f"h{i}", k) for i in range(5) for k in range(2)
        ]
        assert all(g["passed"] == (int(g["task_id"][1:]) % 2 == 0) for g in got)
        assert all(g["policy_version_min"] >= step and g["messages"] for g in got)


def test_rl_loop_eval_rounds_get_group_rewards_as_treadle_eval_does(
    tmp_path: Path, nats_url: str
) -> None:
    """With rollouts_per_task > 1 each held-out task's rollouts are a group: its group
    rewards (+10 for the group's first rollout) count in the round's numbers; a group whose
    group reward fails makes its rollouts errors, counted."""
    seen: list[str] = []
    # the last held-out task's group reward fails in the round of step 2
    scorer = first_bonus_scorer(eval_group_id(2, 4), seen)
    metrics: list[tuple[int, dict[str, float]]] = []
    asyncio.run(run_world(
        tmp_path, nats_url, "evalgroups", reward_of=heldout_even_pass, metrics=metrics,
        group_scorer=scorer, max_steps=2,
        eval={"every_steps": 2, "tasks": str(eval_tasks(tmp_path)), "rollouts_per_task": 2},
    ))  # fmt: skip
    rows = eval_rows(metrics)
    assert sorted(rows) == [0, 2]
    # h0 h2 h4 pass (1), h1 h3 fail (0); each task's first rollout gets +10
    assert rows[0]["eval/reward_mean"] == pytest.approx((3 * 2 * 1.0 + 5 * 10) / 10)
    assert rows[0]["eval/pass@1"] == pytest.approx((3 * 1.0 + 2 * 0.5) / 5)
    assert rows[0]["eval/num_group_reward_errors"] == 0
    assert rows[2]["eval/num_group_reward_errors"] == 1
    assert rows[2]["eval/num_rollouts_error"] == 2
    assert {eval_group_id(s, i) for s in (0, 2) for i in range(5)} <= set(seen)


def test_rl_loop_eval_round_in_flight_survives_a_restart(tmp_path: Path, nats_url: str) -> None:
    """The first orchestrator goes away while the eval round of step 0 is in flight (half of
    its rollouts done, the rest held by the runner); the second finishes that round from the
    saved state, and the run's training is neither stalled nor changed by it."""
    metrics: list[tuple[int, dict[str, float]]] = []
    kw: dict[str, Any] = {"reward_of": heldout_even_pass, "metrics": metrics,
                          "eval": {"every_steps": 3, "tasks": str(eval_tasks(tmp_path)),
                                   "rollouts_per_task": 2}}  # fmt: skip
    first, loop_a = asyncio.run(
        run_world(tmp_path, nats_url, "eval-restart", stop_after_steps=4,
                  hold=lambda req: req.labels.get("split") == "eval" and req.group_index == 1, **kw)
    )  # fmt: skip
    assert loop_a.state.step >= 4  # training went on while the eval round waited
    assert loop_a.state.eval_round is not None
    assert loop_a.state.eval_round.step == 0
    assert not eval_rows(metrics)
    second, loop_b = asyncio.run(run_world(tmp_path, nats_url, "eval-restart", **kw))
    rows = eval_rows(metrics)
    assert 0 in rows
    assert 6 in rows
    # the planned rounds (0, 3, 6): each evaluated once, or skipped (counted) while round 0 waited
    assert len(rows) + sum(r["eval/num_rounds_skipped"] for r in rows.values()) == 3
    for step, row in rows.items():
        assert row["eval/num_rollouts"] == 10
        assert row["eval/num_rollouts_error"] == 0
        assert row["eval/pass@1"] == pytest.approx(0.6)
        assert row["eval/policy_version"] >= step
    batches = {b.step: b for b in [*first.batches, *second.batches]}
    assert sorted(batches) == [1, 2, 3, 4, 5, 6]
    trained = [rid for b in batches.values() for rid in b.rollout_ids]
    assert len(trained) == len(set(trained))
    assert not [rid for rid in trained if rid.startswith("e")]
    assert loop_b.state.eval_round is None
    assert loop_b.state.eval_next == -1


def batch_of(tmp_path: Path, ready: batch_pb2.BatchReady) -> batch_pb2.Batch:
    return batch_pb2.Batch.FromString(LocalObjectStore(tmp_path / "store").get_bytes(ready.data))


def test_rl_loop_distills_from_a_fake_teacher_within_each_batch_trace(
    tmp_path: Path, nats_url: str, span_exporter: Any
) -> None:
    """algorithm = 'distill' against a fake teacher (every token -1.5; the fake runner's
    sampled tokens carry -1.0): each sampled token's advantage is -1.5 - (-1.0)."""
    fake = FakeTeacherServer(logprob=-1.5, vocab=64)
    student = FakeTeacherServer(vocab=64)  # the tokenizer check's other side
    metrics: list[tuple[int, dict[str, float]]] = []
    try:
        world, _ = asyncio.run(run_world(
            tmp_path, nats_url, "distill", max_steps=2, metrics=metrics, vocab_size=64,
            algorithm="distill", teacher={"urls": [fake.url], "student_url": student.url},
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    assert [b.step for b in world.batches] == [1, 2]
    for ready in world.batches:
        assert ready.num_samples == 6  # 2 groups x 3 rollouts, none refused
        for mb in batch_of(tmp_path, ready).micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            adv = to_array(mb.advantages)
            np.testing.assert_allclose(adv[mask], -0.5)
            assert (adv[~mask] == 0).all()
    # the teacher saw each rollout's whole sequence: prompt and completion, as sampled, a
    # group's in one completions request
    assert fake.scored == [[5, 6, 7, 8, 9, 10, 11]] * 12
    assert [path for path, _ in fake.requests] == ["/v1/completions"] * 4
    steps = dict(metrics)
    assert steps[1]["teacher_kl_mean"] == pytest.approx(0.5)  # student - teacher
    assert steps[1]["teacher_num_tokens"] == 6 * 4
    assert steps[1]["num_teacher_errors"] == 0
    # each group is scored ahead of its batch, in a trace of its own (span prepare_group,
    # the teacher calls its children) that its batch's span links; vLLM gets that trace
    spans = span_exporter.get_finished_spans()
    prepared = {s.context.span_id: s for s in spans if s.name == "prepare_group"}
    assert len(prepared) == 4  # 2 steps x 2 groups
    calls = [s for s in spans if s.name == "teacher_call"]
    assert len(calls) == 4
    assert sorted(c.parent.span_id for c in calls) == sorted(prepared)
    assert all(c.context.trace_id == prepared[c.parent.span_id].context.trace_id for c in calls)
    linked = [  # each batch links the preparations of its own two groups
        sorted(x.context.span_id for x in b.links if x.context.span_id in prepared)
        for b in spans
        if b.name == "batch"
    ]
    assert [len(x) for x in linked] == [2, 2]
    assert sorted(x for pair in linked for x in pair) == sorted(prepared)
    sent = {int(h["traceparent"].split("-")[1], 16) for h in fake.headers}
    assert sent == {p.context.trace_id for p in prepared.values()}


def test_rl_loop_distills_the_teachers_top_k_into_the_batch(tmp_path: Path, nats_url: str) -> None:
    """algorithm = 'distill-topk' against a fake teacher whose top 3 at every position are
    ids 0, 1, 2 at -1, -2, -3: each batch carries them on exactly the sampled tokens, with
    the weight distill_weight, and no advantage; the startup check asked for the top 3."""
    fake = FakeTeacherServer(logprob=-1.5, vocab=64)
    student = FakeTeacherServer(vocab=64)
    metrics: list[tuple[int, dict[str, float]]] = []
    try:
        world, _ = asyncio.run(run_world(
            tmp_path, nats_url, "distill-topk", max_steps=2, metrics=metrics, vocab_size=64,
            algorithm="distill-topk", algorithm_args={"distill_weight": 0.5},
            teacher={"urls": [fake.url], "student_url": student.url, "top_k": 3},
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    assert [b.step for b in world.batches] == [1, 2]
    for ready in world.batches:
        assert ready.num_samples == 6
        for mb in batch_of(tmp_path, ready).micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            assert mb.teacher_top_k == 3
            ids, lps = to_array(mb.teacher_topk_ids), to_array(mb.teacher_topk_logprobs)
            weight = to_array(mb.teacher_weight)
            assert ids.shape == lps.shape == (mb.num_tokens, 3)
            assert (ids[mask] == [0, 1, 2]).all()
            assert (lps[mask] == [-1.0, -2.0, -3.0]).all()
            assert (ids[~mask] == 0).all()
            np.testing.assert_array_equal(weight, np.where(mask, 0.5, 0.0))
            assert (to_array(mb.advantages) == 0).all()
    asked = [body.get("prompt_logprobs") for _, body in fake.requests]
    assert asked == [3] * len(asked)
    assert fake.scored[0] == [0, 1, 2]  # the startup check's probe
    assert dict(metrics)[1]["teacher_kl_mean"] == pytest.approx(0.5)  # the sampled tokens'


def test_rl_loop_adds_demonstrations_to_every_batch_beside_the_sampled_tokens(
    tmp_path: Path, nats_url: str
) -> None:
    """[orchestrator.demos] with top-k distillation: each batch carries the 6 rollouts'
    samples (the teacher's top 3 on their sampled tokens) and 2 conversations of the
    dataset, whose assistant tokens carry policy version -1, no advantage and one-hot rows
    of the same width 3 at the demos' weight; the batch's policy versions are the sampled
    tokens'; the cursor is saved."""
    from testkit.paths import shared_tokenizer
    from tests.unit.test_demos import conversations

    vocab = 151_936  # the demonstrations' tokenizer's model's: their ids are checked
    fake = FakeTeacherServer(logprob=-1.5, vocab=vocab)
    student = FakeTeacherServer(vocab=vocab)
    metrics: list[tuple[int, dict[str, float]]] = []
    data = conversations(tmp_path / "demos.jsonl", 5)
    try:
        world, loop = asyncio.run(run_world(
            tmp_path, nats_url, "demos", max_steps=2, metrics=metrics,
            vocab_size=vocab,
            algorithm="distill-topk", seq_len=64,
            teacher={"urls": [fake.url], "student_url": student.url, "top_k": 3},
            tokenizer=str(shared_tokenizer("qwen3")),
            demos={"data": str(data), "samples_per_step": 2, "weight": 0.5},
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    assert [b.step for b in world.batches] == [1, 2]
    demo_ids = []
    for ready in world.batches:
        assert ready.num_samples == 6 + 2
        assert ready.min_policy_version >= 0
        batch = batch_of(tmp_path, ready)
        demo_ids += [s.rollout_id for s in batch.samples if s.rollout_id.startswith("demo-")]
        demo_tokens = 0
        for mb in batch.micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            ver = to_array(mb.policy_versions)
            ids, lps = to_array(mb.teacher_topk_ids), to_array(mb.teacher_topk_logprobs)
            weight = to_array(mb.teacher_weight)
            assert mb.teacher_top_k == 3
            sampled, demo = mask & (ver >= 0), mask & (ver == -1)
            assert (ids[sampled] == [0, 1, 2]).all()
            np.testing.assert_array_equal(weight[sampled], 1.0)
            inputs = to_array(mb.input_ids)
            assert (ids[demo] == inputs[demo, None]).all()
            assert (lps[demo, 0] == 0).all()
            assert (lps[demo, 1:] == -1e4).all()
            np.testing.assert_array_equal(weight[demo], 0.5)
            assert (to_array(mb.advantages)[demo] == 0).all()
            demo_tokens += int(demo.sum())
        assert demo_tokens > 0
    assert len(set(demo_ids)) == 4  # 4 of the 5 conversations, each once, epoch 0
    assert all(rid.endswith("-e0") for rid in demo_ids)
    assert [dict(metrics)[s]["num_demos"] for s in (1, 2)] == [2.0, 2.0]
    assert loop.state.demo_cursor == [0, 4]


def test_rl_loop_demonstrations_continue_after_a_restart(tmp_path: Path, nats_url: str) -> None:
    """The demonstrations' cursor is saved with the state: a restarted orchestrator takes the
    next conversations, never the ones already trained (ids carry the epoch)."""
    from testkit.paths import shared_tokenizer
    from tests.unit.test_demos import conversations

    data = conversations(tmp_path / "demos.jsonl", 7)
    settings: dict[str, Any] = {
        "vocab_size": 151_936, "seq_len": 64, "max_steps": 4,
        "tokenizer": str(shared_tokenizer("qwen3")),
        "demos": {"data": str(data), "samples_per_step": 2},
    }  # fmt: skip
    first, loop_a = asyncio.run(
        run_world(tmp_path, nats_url, "demosrestart", stop_after_steps=1, **settings)
    )
    assert loop_a.state.step >= 1
    second, loop_b = asyncio.run(run_world(tmp_path, nats_url, "demosrestart", **settings))
    assert loop_b.state.step == 4
    batches = {b.step: b for b in [*first.batches, *second.batches]}
    assert sorted(batches) == [1, 2, 3, 4]
    ids = [rid for b in batches.values() for rid in b.rollout_ids if rid.startswith("demo-")]
    assert len(ids) == 8
    assert len(set(ids)) == 8, ids  # 7 of epoch 0, then the first of epoch 1
    assert sum(rid.endswith("-e1") for rid in ids) == 1
    assert loop_b.state.demo_cursor == [1, 1]


def test_rl_loop_scores_in_the_batch_trace_with_score_ahead_off(
    tmp_path: Path, nats_url: str, span_exporter: Any
) -> None:
    """teacher.score_ahead = false: the teacher scores a step's groups when its batch is
    cut, each call a span of the batch's trace; the advantages are the same."""
    fake = FakeTeacherServer(logprob=-1.5, vocab=64)
    student = FakeTeacherServer(vocab=64)
    metrics: list[tuple[int, dict[str, float]]] = []
    try:
        world, _ = asyncio.run(run_world(
            tmp_path, nats_url, "distill-late", max_steps=2, metrics=metrics, vocab_size=64,
            algorithm="distill",
            teacher={"urls": [fake.url], "student_url": student.url, "score_ahead": False},
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    for ready in world.batches:
        for mb in batch_of(tmp_path, ready).micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            np.testing.assert_allclose(to_array(mb.advantages)[mask], -0.5)
    assert dict(metrics)[2]["teacher_kl_mean"] == pytest.approx(0.5)
    spans = span_exporter.get_finished_spans()
    assert not [s for s in spans if s.name == "prepare_group"]
    batch_traces = {s.context.trace_id for s in spans if s.name == "batch"}
    calls = [s for s in spans if s.name == "teacher_call"]
    assert len(calls) == 4
    assert {s.context.trace_id for s in calls} == batch_traces
    sent = {int(h["traceparent"].split("-")[1], 16) for h in fake.headers}
    assert sent == batch_traces


def test_rl_loop_self_distills_with_the_privileged_prompt_on_the_students_server(
    tmp_path: Path, nats_url: str
) -> None:
    """teacher.self_distill: training requests ask for privileged prompts, the teacher (the
    student's own server: student_url, no urls) scores the privileged prompt followed by
    the sampled tokens, and each sampled token's advantage comes from that score."""
    # a server with the token route only (no /v1/completions): one request per sequence
    fake = FakeTeacherServer(logprob=-1.25, vocab=64, completions=False)
    metrics: list[tuple[int, dict[str, float]]] = []
    try:
        world, _ = asyncio.run(run_world(
            tmp_path, nats_url, "selfdistill", max_steps=2, metrics=metrics, vocab_size=64,
            algorithm="distill", teacher={"self_distill": True, "student_url": fake.url},
        ))  # fmt: skip
    finally:
        fake.close()
    assert [b.step for b in world.batches] == [1, 2]
    assert world.requests
    assert all(r.want_privileged_prompts for r in world.requests)
    # the prompt [5, 6, 7] replaced by [5, 6, 40, 41, 7], then the sampled [8, 9, 10, 11]
    assert fake.scored == [[5, 6, 40, 41, 7, 8, 9, 10, 11]] * 12
    assert [path for path, _ in fake.requests] == ["/inference/v1/generate"] * 12
    for ready in world.batches:
        assert ready.num_samples == 6
        for mb in batch_of(tmp_path, ready).micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            adv = to_array(mb.advantages)
            np.testing.assert_allclose(adv[mask], -0.25)  # -1.25 - (-1.0)
            assert (adv[~mask] == 0).all()
    assert dict(metrics)[1]["num_teacher_errors"] == 0


def test_rl_loop_self_distill_on_an_environment_without_privileged_context_stops_at_once(
    tmp_path: Path, nats_url: str
) -> None:
    """No rollout carries a privileged prompt: the run stops at the first group, naming
    the environment and the setting (it used to refuse group after group until 20 empty
    batches ended it with a message about stale samples)."""
    fake = FakeTeacherServer(logprob=-1.25, vocab=64)
    try:
        with pytest.raises(NoPrivilegedContext, match=r"'reverse_text'.*self_distill"):
            asyncio.run(run_world(
                tmp_path, nats_url, "selfdistillnone", max_steps=2, vocab_size=64,
                privileged=False, algorithm="distill",
                teacher={"self_distill": True, "student_url": fake.url},
            ))  # fmt: skip
    finally:
        fake.close()
    assert fake.scored == []


def test_rl_loop_self_distill_without_privileged_context_stops_before_its_batch_is_cut(
    tmp_path: Path, nats_url: str
) -> None:
    """Groups are scored ahead of their batch: the first complete group without a
    privileged prompt stops the run even though no batch can be cut yet (every other
    group's rollouts are held, so step 1 never fills; the run used to wait for the cut)."""
    fake = FakeTeacherServer(logprob=-1.25, vocab=64)

    async def run() -> None:
        await asyncio.wait_for(run_world(
            tmp_path, nats_url, "selfdistillahead", max_steps=2, vocab_size=64,
            privileged=False, algorithm="distill",
            teacher={"self_distill": True, "student_url": fake.url},
            hold=lambda req: req.group_id != "g0000000",
        ), timeout=60)  # fmt: skip

    try:
        with pytest.raises(NoPrivilegedContext, match=r"group g0000000 .*'reverse_text'"):
            asyncio.run(run())
    finally:
        fake.close()
    assert fake.scored == []


def test_rl_loop_refuses_and_counts_a_group_whose_teacher_call_fails(
    tmp_path: Path, nats_url: str
) -> None:
    """The first group's teacher request is refused (HTTP 400): that group is not trained
    (never trained without the signal), the failure is counted, the run goes on."""
    fake, student = FakeTeacherServer(num_failures=1), FakeTeacherServer()
    metrics: list[tuple[int, dict[str, float]]] = []
    try:
        world, loop = asyncio.run(run_world(
            tmp_path, nats_url, "distillfail", max_steps=3, metrics=metrics,
            algorithm="grpo+distill", teacher={"urls": fake.url, "student_url": student.url},
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    assert [b.step for b in world.batches] == [1, 2, 3]
    assert sum(b.num_samples for b in world.batches) == 3 * 6 - 3
    assert sum(v["num_groups_refused_by_algorithm"] for _, v in metrics) == 1
    assert sum(v.get("num_teacher_errors", 0) for _, v in metrics) == 1
    assert loop.teacher is not None
    assert loop.teacher.errors_total == 1


def test_rl_loop_teacher_with_another_tokenizer_stops_before_any_rollout(
    tmp_path: Path, nats_url: str
) -> None:
    teacher, student = FakeTeacherServer(offset=1), FakeTeacherServer()
    try:
        with pytest.raises(ConfigError, match="do not share a tokenizer") as e:
            asyncio.run(run_world(
                tmp_path, nats_url, "distillbad", algorithm="distill",
                teacher={"urls": teacher.url, "student_url": student.url},
            ))  # fmt: skip
    finally:
        teacher.close()
        student.close()
    assert f"teacher {teacher.url}" in str(e.value)
    assert student.url in str(e.value)
    assert teacher.scored == []  # nothing was scored, nothing dispatched


# --- several environments -----------------------------------------------------------------
def two_env_tasks(tmp_path: Path) -> dict[str, Any]:
    """countdown (weight 3, algorithm sft) and reverse_text (weight 1, the run's grpo),
    each with its own task file (task ids c<i> / r<i>)."""
    out: dict[str, Any] = {}
    for env, prefix, extra in [("countdown", "c", {"weight": 3, "algorithm": "sft"}),
                               ("reverse_text", "r", {})]:  # fmt: skip
        path = tmp_path / f"{env}.jsonl"
        path.write_text("\n".join(json.dumps({"id": f"{prefix}{i}"}) for i in range(7)))
        out[env] = {"tasks": str(path), **extra}
    return out


def test_rl_loop_names_an_environment_no_runner_serves(tmp_path: Path, nats_url: str) -> None:
    """reverse_text's requests are never completed (no runner serves it) while countdown
    trains: the loop's watch holds reverse_text, and only it, as unserved."""
    world, loop = asyncio.run(run_world(
        tmp_path, nats_url, "unserved", tasks=None, envs=two_env_tasks(tmp_path),
        max_steps=20, stop_after_steps=2, max_groups_in_flight=12,
        drop=lambda req: req.env == "reverse_text", reward_of=low_countdown_high_reverse,
    ))  # fmt: skip
    assert [b.step for b in world.batches][:2] == [1, 2]
    assert any(r.env == "reverse_text" for r in world.requests)
    (warning,) = loop.served.due(time.monotonic() + 1e6)
    assert "'reverse_text'" in warning


def low_countdown_high_reverse(req: rollout_pb2.RolloutRequested) -> float:
    """countdown rewards in [0, 0.5), reverse_text in [0.5, 1): per-env means tell them apart."""
    k = (int(req.group_id[1:]) * 7 + req.group_index) % 10 / 20
    return k if req.env == "countdown" else 0.5 + k


def group_envs(world: World) -> dict[str, tuple[str, str]]:
    """group id -> (env, task id) of every group the fake runner saw requests of."""
    out: dict[str, tuple[str, str]] = {}
    for req in world.requests:
        assert out.setdefault(req.group_id, (req.env, req.task_id)) == (req.env, req.task_id)
    return out


def test_rl_loop_two_environments_share_batches_at_their_weights_each_with_its_algorithm(
    tmp_path: Path, nats_url: str
) -> None:
    metrics: list[tuple[int, dict[str, float]]] = []
    world, _ = asyncio.run(run_world(
        tmp_path, nats_url, "twoenvs", metrics=metrics, reward_of=low_countdown_high_reverse,
        tasks=None, envs=two_env_tasks(tmp_path), max_steps=8, groups_per_step=4,
        max_groups_in_flight=8,
    ))  # fmt: skip
    assert [b.step for b in world.batches] == list(range(1, 9))
    groups = group_envs(world)
    assert len(groups) == 32
    # each group ran in its environment, on a task of that environment's file
    assert all(task[0] == env[0] for env, task in groups.values())
    num_countdown = sum(env == "countdown" for env, _ in groups.values())
    assert 18 <= num_countdown <= 30  # weight 3 : 1 of 32 groups (24 expected)
    env_of_rollout = {r.rollout_id: r.env for r in world.requests}
    mixed = 0
    for ready in world.batches:
        in_batch = {env_of_rollout[rid] for rid in ready.rollout_ids}
        mixed += in_batch == {"countdown", "reverse_text"}
        batch = batch_of(tmp_path, ready)
        for mb in batch.micro_batches:
            mask, adv = to_array(mb.loss_mask).astype(bool), to_array(mb.advantages)
            bounds, index = to_array(mb.cu_seqlens), to_array(mb.sample_index)
            for doc, (lo, hi) in enumerate(itertools.pairwise(bounds)):
                env = env_of_rollout[batch.samples[index[doc]].rollout_id]
                doc_adv = adv[lo:hi][mask[lo:hi]]
                assert doc_adv.size
                if env == "countdown":  # sft: 1 on every sampled token
                    np.testing.assert_array_equal(doc_adv, 1.0)
                else:  # grpo: reward minus its group's mean, rewards within [0.5, 1)
                    assert (np.abs(doc_adv) < 0.5).all()
    assert mixed >= 1  # groups of both environments in one batch
    rows = {step: row for step, row in metrics if "num_groups" in row}
    assert sorted(rows) == list(range(1, 9))
    for row in rows.values():
        assert row["env/countdown/num_groups"] + row["env/reverse_text/num_groups"] == 4
        assert (
            row["env/countdown/num_samples"] + row["env/reverse_text/num_samples"]
            == row["num_samples"]
        )
        if row["env/countdown/num_groups"]:
            assert row["env/countdown/reward_mean"] < 0.5
        else:
            assert "env/countdown/reward_mean" not in row
        if row["env/reverse_text/num_groups"]:
            assert row["env/reverse_text/reward_mean"] >= 0.5
    assert sum(r["env/countdown/num_groups"] for r in rows.values()) == num_countdown


def test_rl_loop_two_environments_resume_the_same_environment_and_task_sequence(
    tmp_path: Path, nats_url: str
) -> None:
    """A restart mid-run dispatches the very (environment, task) of each group that an
    uninterrupted run does: the draw and each environment's task cursor are saved."""
    whole_dir, halves_dir = tmp_path / "whole", tmp_path / "halves"
    whole_dir.mkdir()
    halves_dir.mkdir()
    envs = two_env_tasks(tmp_path)
    whole, _ = asyncio.run(run_world(whole_dir, nats_url, "mixwhole", tasks=None, envs=envs))
    first, _ = asyncio.run(run_world(halves_dir, nats_url, "mixhalves", tasks=None, envs=envs,
                                     stop_after_steps=3))  # fmt: skip
    second, loop = asyncio.run(run_world(halves_dir, nats_url, "mixhalves", tasks=None, envs=envs))
    assert loop.state.step == 6
    expected = group_envs(whole)
    assert len(expected) == 12
    assert {e for e, _ in expected.values()} == {"countdown", "reverse_text"}
    resumed = group_envs(first)
    for gid, got in group_envs(second).items():
        assert resumed.setdefault(gid, got) == got  # a request published again: the same
    assert resumed == expected
    ids = [rid for b in [*first.batches, *second.batches] for rid in b.rollout_ids]
    assert len(ids) == len(set(ids))


def test_rl_loop_restarted_scores_the_groups_complete_before_the_restart_ahead(
    tmp_path: Path, nats_url: str, span_exporter: Any
) -> None:
    """An orchestrator restarted with complete groups in its saved state scores them ahead
    like the groups that complete later: every batch after the restart links the
    preparation of each of its groups, and the advantages are the teacher's."""
    fake, student = FakeTeacherServer(logprob=-1.5, vocab=64), FakeTeacherServer(vocab=64)
    teacher = {"urls": [fake.url], "student_url": student.url}
    try:
        _, loop_a = asyncio.run(run_world(
            tmp_path, nats_url, "distillrestart", max_steps=4, vocab_size=64,
            algorithm="distill", teacher=teacher, stop_after_steps=1, linger_s=0.6,
            hold=lambda req: req.group_id == "g0000003",  # step 2's other group: not done
        ))  # fmt: skip
        complete = [g.group_id for g in loop_a.state.groups.values() if g.done]
        span_exporter.clear()
        second, _ = asyncio.run(run_world(
            tmp_path, nats_url, "distillrestart", max_steps=4, vocab_size=64,
            algorithm="distill", teacher=teacher,
        ))  # fmt: skip
    finally:
        fake.close()
        student.close()
    assert complete  # the test is about them
    spans = span_exporter.get_finished_spans()
    prepared = {s.context.span_id: s for s in spans if s.name == "prepare_group"}
    prepared_groups = {s.attributes["treadle.group_id"] for s in prepared.values()}
    assert set(complete) <= prepared_groups
    batches = [b for b in spans if b.name == "batch"]
    assert len(batches) == len(second.batches) >= 1
    for b in batches:
        assert len([x for x in b.links if x.context.span_id in prepared]) == 2
    for ready in second.batches:
        for mb in batch_of(tmp_path, ready).micro_batches:
            mask = to_array(mb.loss_mask).astype(bool)
            np.testing.assert_allclose(to_array(mb.advantages)[mask], -0.5)
