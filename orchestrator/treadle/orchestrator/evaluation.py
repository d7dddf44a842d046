"""Evaluation during training: when a round is due, and what a finished round reports.

    [orchestrator.eval] ──▶ schedule: steps 0 (at_start), every_steps, 2·every_steps, ...,
                            and max_steps (the final policy)
    round due at step N ──▶ the loop (loop.py) dispatches each held-out task ×
       (state.EvalRound)    rollouts_per_task as RolloutRequested{labels: split=eval}, once
                            the orchestrator has published step N and inference serves a
                            policy >= N; training dispatch goes on beside it
    round complete      ──▶ round_metrics: one metrics row of eval/ keys at step N
                        └─▶ result_rows: outputs/<run>/store/eval/step-<N>.jsonl

The loop owns dispatch, collection and durability (an eval round lives in the saved
state like a training group); this module only plans rounds and turns a finished one
into numbers and rows. Eval rollouts are never trained, never batched, and count in
neither the policy gate nor ``max_groups_in_flight``. The numbers match ``treadle eval``
on the same tasks: means over every rollout (an error rollout counts with the reward it
carries), pass@k with a rollout passing at reward >= ``pass_reward``. With
``rollouts_per_task`` > 1 the k rollouts of each task are a group: its group rewards
(``Rubric(group_rewards=...)``, computed by an env runner serving the environment, as
for training groups) are added to their rewards before the round is scored, as
``treadle eval`` does; a group whose group reward fails makes its rollouts errors
(``eval/num_group_reward_errors``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.orchestrator.samples import Sample
from treadle.proto.v1 import rollout_pb2
from treadle.services.passk import ks_for, pass_at_k

Kind = rollout_pb2.RolloutStatus.Kind


def results_key(step: int) -> str:
    """Object-store key of the rollouts of the eval round of ``step``."""
    return f"eval/step-{step:06d}.jsonl"


def schedule(every_steps: int, max_steps: int, at_start: bool) -> list[int]:
    """Steps whose policy is evaluated, ascending (empty when evaluation is off)."""
    if every_steps <= 0:
        return []
    steps = list(range(every_steps, max_steps + 1, every_steps))
    if not steps or steps[-1] != max_steps:
        steps.append(max_steps)
    return ([0] if at_start else []) + steps


def first_due(plan: list[int], step: int) -> int:
    """The first planned step at or after ``step`` (-1 when none is left): where a run
    that begins, or turns evaluation on, at ``step`` starts."""
    return next((s for s in plan if s >= step), -1)


def due_now(plan: list[int], next_due: int, reached: int) -> tuple[int, int] | None:
    """(step to evaluate now, planned rounds skipped) once ``reached`` (the newest step
    both published and served) is at or past ``next_due``; the newest planned step within
    reach is evaluated, older ones are skipped. None when nothing is due."""
    if next_due < 0 or reached < next_due:
        return None
    within = [s for s in plan if next_due <= s <= reached]
    if not within:  # next_due is off the plan (the config changed): evaluate it anyway
        return next_due, 0
    return within[-1], len(within) - 1


def next_after(plan: list[int], step: int) -> int:
    """The planned step after ``step``; -1 when none is left."""
    return next((s for s in plan if s > step), -1)


@dataclass
class EvalRollout:
    """One finished eval rollout with what the round knows about it."""

    task_id: str
    index: int  # 0 .. rollouts_per_task - 1
    rollout: rollout_pb2.Rollout
    samples: Sequence[Sample]  # its branches ([] when it was refused or did not decode)

    @property
    def reward(self) -> float:
        """The rollout's reward; 0 when it is not finite (such a rollout was refused)."""
        return self.rollout.reward if math.isfinite(self.rollout.reward) else 0.0

    @property
    def policy_versions(self) -> tuple[int, int]:
        """(min, max) policy version over its sampled tokens; (-1, -1) when none."""
        sampled = [s.policy_versions[s.loss_mask == 1] for s in self.samples]
        v = np.concatenate(sampled) if sampled else np.zeros(0, np.int32)
        return (int(v.min()), int(v.max())) if v.size else (-1, -1)


def round_metrics(done: Sequence[EvalRollout], *, k: int, pass_reward: float) -> dict[str, float]:
    """The eval row's values (``eval/`` keys): reward mean/std, the mean of each reward
    component and environment metric, pass@1..k over tasks with k rollouts, counts, and
    the policy versions the rollouts sampled from."""
    out: dict[str, float] = {"eval/num_rollouts": float(len(done))}
    out["eval/num_tasks"] = float(len({d.task_id for d in done}))
    kinds = [d.rollout.status.kind for d in done]
    out["eval/num_rollouts_error"] = float(sum(k_ not in (Kind.KIND_OK, Kind.KIND_TRUNCATED)
                                               for k_ in kinds))  # fmt: skip
    out["eval/num_rollouts_truncated"] = float(sum(k_ == Kind.KIND_TRUNCATED for k_ in kinds))
    if not done:
        return out
    rewards = np.array([d.reward for d in done], dtype=np.float64)
    out["eval/reward_mean"] = float(rewards.mean())
    out["eval/reward_std"] = float(rewards.std())
    components: dict[str, list[float]] = {}
    metrics: dict[str, list[float]] = {}
    for d in done:
        for r in d.rollout.rewards:
            components.setdefault(r.name, []).append(r.value)
        for name, value in d.rollout.metrics.items():
            metrics.setdefault(name, []).append(value)
    out |= {f"eval/reward/{n}": float(np.mean(v)) for n, v in sorted(components.items())}
    out |= {f"eval/metric/{n}": float(np.mean(v)) for n, v in sorted(metrics.items())}
    by_task: dict[str, list[bool]] = {}
    for d in done:
        by_task.setdefault(d.task_id, []).append(d.reward >= pass_reward)
    complete = [passed for passed in by_task.values() if len(passed) >= k]
    if complete:
        for kk in ks_for(k):
            out[f"eval/pass@{kk}"] = float(
                np.mean([pass_at_k(len(p), sum(p), kk) for p in complete])
            )
    versions = [d.policy_versions for d in done if d.policy_versions[0] >= 0]
    out["eval/policy_version"] = float(min(v[0] for v in versions)) if versions else -1.0
    out["eval/policy_version_max"] = float(max(v[1] for v in versions)) if versions else -1.0
    return out


def result_rows(step: int, done: Sequence[EvalRollout], pass_reward: float) -> bytes:
    """The round's rollouts as JSONL: task, reward and its parts, status, the policy
    versions sampled from, and the conversation as text."""
    lines = []
    for d in done:
        r = d.rollout
        low, high = d.policy_versions
        row = {
            "step": step,
            "task_id": d.task_id,
            "index": d.index,
            "rollout_id": r.rollout_id,
            "reward": d.reward,
            "passed": d.reward >= pass_reward,
            "rewards": {x.name: _finite(x.value) for x in r.rewards},
            "metrics": {name: _finite(v) for name, v in r.metrics.items()},
            "status": Kind.Name(r.status.kind).removeprefix("KIND_").lower(),
            "message": r.status.message,
            "policy_version_min": low,
            "policy_version_max": high,
            "messages": [_message(n) for n in r.nodes],
            "trace_id": r.trace_id,
        }
        lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False))
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _message(n: rollout_pb2.MessageNode) -> dict[str, Any]:
    m: dict[str, Any] = {
        "role": rollout_pb2.Role.Name(n.role).removeprefix("ROLE_").lower(),
        "content": n.content,
    }
    if n.reasoning_content:
        m["reasoning"] = n.reasoning_content
    if n.tool_calls:
        m["tool_calls"] = [{"name": c.name, "arguments": c.arguments_json} for c in n.tool_calls]
    if n.parent_id != n.node_id - 1:  # a branch: say where it hangs
        m["parent"] = n.parent_id
    return m


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None
