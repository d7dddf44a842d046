"""The orchestrator's durable state, so that a restart loses and repeats nothing.

Saved (atomically, as JSON in the object store) after every change that another
service could observe: before rollout requests are published, after a completed
rollout is recorded (before its ack), and after a batch is published. It holds

- the task cursor (with several environments: one per environment, and the number of
  environment draws, ``mixture.py``) and the counter that makes group and rollout ids
  deterministic,
- every group in flight: its task, its rollout ids, and which have completed (with the
  ROLLOUTS stream sequence each completion can be re-read from),
- the evaluation round in flight (``EvalRound``: its groups, like training groups) and
  the next step due for evaluation, so a restart re-requests what an eval round lacks,
- the last published step, and the ids of the most recently trained rollouts (a bounded
  tail, ``TRAINED_TAIL``). A redelivered completion of a trained rollout is a no-op
  because its group left ``groups`` when it was batched and group ids never repeat; the
  tail is a second check for the recent ones. It is bounded because the state is saved
  on every completion: an unbounded ledger made each save O(run length) — 240 steps of
  reverse-text slowed from 3.4 to 5 s per step.

Completed rollouts themselves are not copied here: after a restart they are re-read
from the ROLLOUTS stream (limits retention) by sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from treadle.services.errors import IntegrityError, ObjectNotFoundError
from treadle.services.objectstore import ObjectStore

STATE_KEY = "state/orchestrator.json"
STATE_FORMAT = "treadle-orchestrator-state/1"
TRAINED_TAIL = 4096  # trained rollout ids kept in the saved state


def group_id_at(index: int) -> str:
    """Id of the ``index``-th group dispatched in a run (0-based): ids never repeat."""
    return f"g{index:07d}"


def group_rollout_ids(gid: str, group_size: int) -> list[str]:
    """Ids of the rollouts of group ``gid``, in group order."""
    return [f"{gid}-{k:03d}" for k in range(group_size)]


def eval_group_id(step: int, index: int) -> str:
    """Id of the group of the ``index``-th task of the eval round of ``step``: never a
    training group's id (those begin with 'g'), unique per round."""
    return f"e{step:07d}-t{index:05d}"


@dataclass
class GroupState:
    group_id: str
    task_id: str
    task_json: str
    rollout_ids: list[str]
    dispatched_version: int  # inference policy version when dispatched
    completed: dict[str, int] = field(default_factory=dict)  # rollout_id -> ROLLOUTS stream seq
    rejected: list[str] = field(default_factory=list)  # completed, failed the sanity checks
    env: str = ""  # environment its rollouts run in ("": the run's one environment, old states)

    @property
    def done(self) -> bool:
        return len(self.completed) == len(self.rollout_ids)


@dataclass
class EvalRound:
    """An evaluation round in flight (``evaluation.py``); its rollouts are never trained."""

    step: int  # the trainer step whose policy it evaluates (inference served >= it at dispatch)
    dispatch_step: int  # the last published step when it was dispatched
    dispatched_version: int  # inference policy version when dispatched
    env: str
    dispatched_at: float  # wall-clock time of the dispatch, s since the epoch
    groups: dict[str, GroupState] = field(default_factory=dict)  # one per task, in task order
    rounds_skipped: int = 0  # scheduled rounds passed over before this one (eval too slow)

    @property
    def done(self) -> bool:
        return all(g.done for g in self.groups.values())

    def to_doc(self) -> dict[str, Any]:
        return {**vars(self), "groups": {gid: vars(g) for gid, g in self.groups.items()}}

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> EvalRound:
        groups = {gid: GroupState(**g) for gid, g in doc.pop("groups").items()}
        return cls(groups=groups, **doc)


@dataclass
class OrchestratorState:
    step: int = 0  # last step whose BatchReady was published
    epoch: int = 0  # task cursor of a run with one environment
    position: int = 0
    env_cursors: dict[str, list[int]] = field(
        default_factory=dict
    )  # several: env -> [epoch, position]
    env_draws: int = 0  # environments drawn for new groups so far (mixture.py)
    next_group: int = 0  # groups dispatched so far (ids are derived from it)
    groups: dict[str, GroupState] = field(default_factory=dict)  # in dispatch order
    trained: list[str] = field(default_factory=list)  # rollout ids in published batches (recent)
    demo_cursor: list[int] = field(default_factory=lambda: [0, 0])  # [epoch, position]
    dropped_stale: int = 0
    dropped_errors: int = 0
    duplicates_ignored: int = 0
    rejected: int = 0  # completions refused by the sanity checks (never trained)
    lost: int = 0  # completions that could not be re-read after a restart (requested again)
    groups_filtered: int = 0  # completed groups not trained: refused by orchestrator.filter
    groups_refused: int = 0  # completed groups not trained: the algorithm's output was unusable
    rollouts_stream: str = ""  # creation time of the ROLLOUTS stream the seqs above refer to
    eval_next: int | None = None  # next step due for evaluation; None: not planned, -1: none left
    eval_round: EvalRound | None = None  # the evaluation round in flight

    def to_json(self) -> bytes:
        # field by field: dataclasses.asdict deep-copies every list, groups' too
        doc: dict[str, Any] = {"format": STATE_FORMAT}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "groups":
                value = {gid: vars(g) for gid, g in value.items()}
            elif f.name == "eval_round" and value is not None:
                value = value.to_doc()
            doc[f.name] = value
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> OrchestratorState:
        try:
            doc = json.loads(data)
            if doc.pop("format", None) != STATE_FORMAT:
                raise ValueError(f"not {STATE_FORMAT}")
            groups = {gid: GroupState(**g) for gid, g in doc.pop("groups").items()}
            round_doc = doc.pop("eval_round", None)
            eval_round = EvalRound.from_doc(round_doc) if round_doc is not None else None
            return cls(groups=groups, eval_round=eval_round, **doc)
        except (ValueError, TypeError, KeyError) as e:
            raise IntegrityError(f"orchestrator state {STATE_KEY} is unreadable: {e}") from None


def load_state(store: ObjectStore) -> OrchestratorState | None:
    """The saved state, or None on a fresh run."""
    try:
        return OrchestratorState.from_json(store.get_bytes(STATE_KEY))
    except ObjectNotFoundError:
        return None


def state_bytes(state: OrchestratorState, keep_trained: int = TRAINED_TAIL) -> bytes:
    """The state as saved, its trained tail cut to ``keep_trained`` ids first."""
    if len(state.trained) > keep_trained:
        del state.trained[: len(state.trained) - keep_trained]
    return state.to_json()


def write_state(store: ObjectStore, data: bytes) -> None:
    """Store ``state_bytes``' output atomically (the store's put is atomic per object)."""
    store.put_bytes(STATE_KEY, data, "application/json")


def save_state(
    store: ObjectStore, state: OrchestratorState, keep_trained: int = TRAINED_TAIL
) -> None:
    """Write the state atomically."""
    write_state(store, state_bytes(state, keep_trained))
