"""The rollout ledger of a run: what was requested, completed, trained, dropped, lost or
trained twice — read back from the run's durable data, not from any process's memory.

    orchestrator state (object store) ── next_group × group_size ──▶ requested ids
                                     └── groups still in flight ──▶ in flight
                                     └── dropped_stale + dropped_errors ──▶ dropped
    ROLLOUTS stream ── distinct rollout ids ──▶ completed
    batches/step<N> (object store), N ≤ the last PolicyPublished ──▶ trained
                                    N > it (published, not trained yet) ──▶ in flight
    METRICS stream, trainer reports (instance, step) ──▶ the trainer's lineage

Definitions (every count is of distinct rollout ids unless it says otherwise):

- **requested**: ids of every group the orchestrator dispatched (ids are deterministic:
  ``state.group_id_at(n)`` for n < ``next_group``, ``group_size`` rollouts each).
- **completed**: requested ids with a RolloutCompleted on ROLLOUTS.
- **trained**: ids with a sample in the stored Batch of a step the trainer published a
  policy for (steps 1..last PolicyPublished).
- **trained twice**: ids with samples in more than one stored batch, plus samples
  (rollout id, leaf node) that occur more than once in one batch.
- **in flight**: requested ids not trained that the run still holds: their group is in
  the saved orchestrator state, or their batch is published but not trained yet.
- **dropped**: completed rollouts the orchestrator deliberately did not train, by its own
  counters (samples older than ``max_off_policy_steps``, error rollouts).
- **lost**: requested ids that are none of trained, in flight or dropped. A requested
  id the run no longer holds that never completed is lost whatever the counters say;
  completed-but-untrained ids beyond the ``dropped`` counters are lost too.

The lineage check reads the trainer's per-step MetricsReports: each trainer process
(instance) must report contiguous steps, and a restarted one must start at or before the
step after the last one its predecessor reported (it resumed from a checkpoint, redoing
what the killed one had not checkpointed). A gap is a skipped batch; redone steps cost
time only (the killed process's weights died with it).

Not here: running a stack or injecting faults (``tests/testkit/chaos.py``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

from treadle.orchestrator.state import (
    STATE_KEY,
    OrchestratorState,
    group_id_at,
    group_rollout_ids,
)
from treadle.proto.v1 import batch_pb2, metrics_pb2, policy_pb2, rollout_pb2
from treadle.services.bus import Bus
from treadle.services.codecs import decode_message
from treadle.services.errors import ObjectNotFoundError
from treadle.services.objectstore import ObjectStore


@dataclass
class Lineage:
    """The trainer steps behind the final weights, from the trainer's MetricsReports."""

    instances: list[tuple[str, int, int]] = field(default_factory=list)  # (id, first, last)
    skipped: list[int] = field(default_factory=list)  # steps no surviving process trained
    redone: int = 0  # steps trained again after a restart (the killed process's were lost)
    problems: list[str] = field(default_factory=list)  # non-contiguous steps in one process


@dataclass
class Ledger:
    """Counts of one run (see the module docstring for the definitions)."""

    requested: int = 0
    completed: int = 0
    trained: int = 0
    trained_twice: int = 0
    in_flight: int = 0
    dropped: int = 0
    lost: int = 0
    batches: int = 0  # stored batches of trained steps
    trainer_step: int = 0  # last PolicyPublished version
    orchestrator_step: int = 0  # last step whose BatchReady the orchestrator published
    lost_ids: list[str] = field(default_factory=list)  # the first few, for the report
    twice_ids: list[str] = field(default_factory=list)
    unknown_ids: list[str] = field(default_factory=list)  # on ROLLOUTS/in batches, never requested
    lineage: Lineage = field(default_factory=Lineage)

    @property
    def ok(self) -> bool:
        """Nothing lost, nothing trained twice, no stray ids, no skipped trainer step."""
        return not (
            self.lost
            or self.trained_twice
            or self.unknown_ids
            or self.lineage.skipped
            or self.lineage.problems
        )

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{self.lost} lost (e.g. {', '.join(self.lost_ids[:3]) or '?'})")
        if self.trained_twice:
            out.append(f"{self.trained_twice} trained twice (e.g. {', '.join(self.twice_ids[:3])})")
        if self.unknown_ids:
            out.append(f"{len(self.unknown_ids)} ids never requested ({self.unknown_ids[0]})")
        if self.lineage.skipped:
            out.append(f"trainer skipped steps {self.lineage.skipped}")
        out += self.lineage.problems
        return out


def trainer_lineage(reports: list[tuple[str, int]]) -> Lineage:
    """The lineage from (instance_id, step) of the trainer's MetricsReports, in stream order."""
    lineage = Lineage()
    steps: dict[str, list[int]] = {}
    for instance, step in reports:
        steps.setdefault(instance, []).append(step)
    covered = 0  # last step of the lineage so far
    for instance, got in steps.items():  # dicts keep first-appearance order
        first, last = got[0], got[-1]
        if got != list(range(first, last + 1)):
            lineage.problems.append(f"trainer {instance} reported steps {got}: not contiguous")
        if first > covered + 1:
            lineage.skipped += list(range(covered + 1, first))
        lineage.redone += max(0, covered - (first - 1))
        lineage.instances.append((instance, first, last))
        covered = last
    return lineage


async def read_ledger(bus: Bus, store: ObjectStore, group_size: int) -> Ledger:
    """The ledger of the run ``bus`` is bound to, whose data lives in ``store``."""
    led = Ledger()
    try:
        state = OrchestratorState.from_json(await asyncio.to_thread(store.get_bytes, STATE_KEY))
    except ObjectNotFoundError:
        state = OrchestratorState()
    led.orchestrator_step = state.step
    requested = {
        rid
        for n in range(state.next_group)
        for rid in group_rollout_ids(group_id_at(n), group_size)
    }
    for g in state.groups.values():  # a group size changed by a restart: its own ids count
        requested |= set(g.rollout_ids)
    led.requested = len(requested)

    completed: set[str] = set()
    for raw in await bus.stored("ROLLOUTS"):
        done = await bus.decode_stored("ROLLOUTS", raw, rollout_pb2.RolloutCompleted)
        completed.add(done.rollout.rollout_id)
    last = await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
    led.trainer_step = last.policy_version if last is not None else 0

    trained: set[str] = set()
    pending: set[str] = set()  # in batches published but not trained yet
    batches_of: dict[str, int] = Counter()
    samples: Counter[tuple[str, int]] = Counter()
    for step in range(1, state.step + 1):
        try:
            data = await asyncio.to_thread(store.get_bytes, f"batches/step{step:06d}")
        except ObjectNotFoundError:
            continue
        batch = decode_message(batch_pb2.Batch, data, where=f"batches/step{step:06d}")
        ids = {s.rollout_id for s in batch.samples}
        if step > led.trainer_step:
            pending |= ids
            continue
        led.batches += 1
        trained |= ids
        for rid in ids:
            batches_of[rid] += 1
        samples.update((s.rollout_id, s.leaf_node_id) for s in batch.samples)
    twice = {rid for rid, n in batches_of.items() if n > 1}
    twice |= {rid for (rid, _), n in samples.items() if n > 1}
    led.twice_ids = sorted(twice)
    led.trained_twice = len(twice)
    led.completed = len(completed & requested)
    led.trained = len(trained & requested)
    led.unknown_ids = sorted((completed | trained | pending) - requested)

    holding = {rid for g in state.groups.values() for rid in g.rollout_ids} | pending
    gone = requested - trained - holding  # ids the run no longer holds and did not train
    led.in_flight = len(holding - trained)
    led.dropped = state.dropped_stale + state.dropped_errors
    never_completed = gone - completed
    led.lost = len(never_completed) + max(0, len(gone & completed) - led.dropped)
    led.lost_ids = sorted(never_completed)[:10] if never_completed else []
    if not led.lost_ids and led.lost:
        led.lost_ids = sorted(gone & completed)[:10]

    reports = []
    for raw in await bus.stored("METRICS", bus.subjects.metrics("trainer")):
        report = await bus.decode_stored("METRICS", raw, metrics_pb2.MetricsReport)
        if report.step > 0:
            reports.append((report.instance_id, int(report.step)))
    led.lineage = trainer_lineage(reports)
    covered = led.lineage.instances[-1][2] if led.lineage.instances else 0
    if covered < led.trainer_step:
        led.lineage.skipped += list(range(covered + 1, led.trainer_step + 1))
    return led
