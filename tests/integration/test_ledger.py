"""The rollout ledger read back from a run's data (a real nats-server and a local object
store, filled with what the services would have written)."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest

from treadle.orchestrator.ledger import Ledger, read_ledger, trainer_lineage
from treadle.orchestrator.state import (
    GroupState,
    OrchestratorState,
    group_id_at,
    group_rollout_ids,
    save_state,
)
from treadle.proto.v1 import batch_pb2, metrics_pb2, policy_pb2, rollout_pb2
from treadle.services.bus import Bus
from treadle.services.objectstore import LocalObjectStore
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration

_runs = itertools.count()
GROUP_SIZE = 2


async def fill(bus: Bus, store: LocalObjectStore, *, completed: list[str],
               batches: list[list[str]], trainer_steps: list[tuple[str, int]],
               state: OrchestratorState) -> None:  # fmt: skip
    for rid in completed:
        rollout = rollout_pb2.Rollout(rollout_id=rid, group_id=rid.rsplit("-", 1)[0])
        await bus.publish(bus.subjects.rollouts_completed,
                          rollout_pb2.RolloutCompleted(rollout=rollout), msg_id=rid)  # fmt: skip
    for step, ids in enumerate(batches, start=1):
        batch = batch_pb2.Batch(step=step)
        for rid in ids:
            batch.samples.add(rollout_id=rid, leaf_node_id=1)
        store.put_bytes(f"batches/step{step:06d}", batch.SerializeToString())
    for instance, step in trainer_steps:
        await bus.publish(bus.subjects.metrics("trainer"),
                          metrics_pb2.MetricsReport(service="trainer", instance_id=instance,
                                                    step=step), msg_id=None)  # fmt: skip
    last = max((s for _, s in trainer_steps), default=0)
    if last:
        await bus.publish(bus.subjects.policy_published,
                          policy_pb2.PolicyPublished(policy_version=last), msg_id=None)  # fmt: skip
    save_state(store, state)


def ids(n: int) -> list[str]:
    return group_rollout_ids(group_id_at(n), GROUP_SIZE)


def ledger_of(nats_url: str, tmp_path: Path, **data: object) -> Ledger:
    async def main() -> Ledger:
        store = LocalObjectStore(tmp_path / "store")
        bus = await Bus.connect(NatsSection(url=nats_url), f"ledger{next(_runs)}", store=store)
        try:
            await bus.ensure_streams()
            await fill(bus, store, **data)  # type: ignore[arg-type]
            return await read_ledger(bus, store, GROUP_SIZE)
        finally:
            await bus.close()

    return asyncio.run(main())


def test_ledger_of_a_clean_run_balances(nats_url: str, tmp_path: Path) -> None:
    # groups 0..2 trained in steps 1..2 (group 1's second rollout dropped as stale),
    # group 3 still in flight with one completion
    g3 = GroupState(group_id_at(3), "t", "{}", ids(3), 0, completed={ids(3)[0]: 9})
    state = OrchestratorState(step=2, next_group=4, groups={g3.group_id: g3}, dropped_stale=1)
    led = ledger_of(
        nats_url, tmp_path,
        completed=ids(0) + ids(1) + ids(2) + ids(3)[:1],
        batches=[ids(0) + ids(1)[:1], ids(2)],
        trainer_steps=[("a", 1), ("a", 2)],
        state=state,
    )  # fmt: skip
    assert (led.requested, led.completed, led.trained, led.in_flight, led.dropped) == (
        8,
        7,
        5,
        2,
        1,
    )
    assert (led.lost, led.trained_twice) == (0, 0)
    assert led.ok, led.problems()


def test_ledger_counts_lost_and_twice_trained_rollouts(nats_url: str, tmp_path: Path) -> None:
    # group 1 left the state without completing (lost 2); group 0 in two batches;
    # group 2 completed, never batched, nothing counts it as dropped (lost 2)
    state = OrchestratorState(step=2, next_group=3)
    led = ledger_of(
        nats_url, tmp_path,
        completed=ids(0) + ids(2),
        batches=[ids(0), ids(0)[:1]],
        trainer_steps=[("a", 1), ("a", 2)],
        state=state,
    )  # fmt: skip
    assert led.lost == 4
    assert led.lost_ids[:2] == ids(1)  # the never completed ones first
    assert led.trained_twice == 1
    assert led.twice_ids == ids(0)[:1]
    assert not led.ok


def test_ledger_batch_not_trained_yet_is_in_flight(nats_url: str, tmp_path: Path) -> None:
    state = OrchestratorState(step=2, next_group=2)
    led = ledger_of(
        nats_url, tmp_path,
        completed=ids(0) + ids(1),
        batches=[ids(0), ids(1)],
        trainer_steps=[("a", 1)],
        state=state,
    )  # fmt: skip
    assert (led.trained, led.in_flight, led.lost, led.batches) == (2, 2, 0, 1)


def test_trainer_lineage_resumed_from_a_checkpoint_redoes_and_skips_nothing() -> None:
    lineage = trainer_lineage([("a", 1), ("a", 2), ("a", 3), ("b", 3), ("b", 4)])
    assert (lineage.skipped, lineage.redone, lineage.problems) == ([], 1, [])
    assert lineage.instances == [("a", 1, 3), ("b", 3, 4)]


def test_trainer_lineage_finds_a_skipped_step() -> None:
    assert trainer_lineage([("a", 1), ("a", 2), ("b", 4)]).skipped == [3]
    assert trainer_lineage([("a", 1), ("a", 3)]).problems
