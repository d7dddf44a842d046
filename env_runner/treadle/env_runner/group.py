"""Group rewards in RL: the orchestrator asks, an env runner scores.

A group reward sees every rollout of a task, so no single rollout's runner can compute
it. When a group is complete, the orchestrator sends a ``GroupScoreRequest`` (NATS
request/reply on ``treadle.<run>.groups.score.<env>``); any runner serving the
environment answers with each rollout's group rewards. Runners subscribe only for
environments that declare group rewards, so "no responders" tells the orchestrator
there are none. The rollouts' states are rebuilt from their message graphs (the last
branch's messages, the task, the metrics, the rollout's own rewards); what a harness
kept in ``state.info`` does not travel. ``treadle eval`` builds its states the same way
(``group_state``), so a group reward sees the same inputs in eval and RL.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from treadle.env_runner.environments import Environment
from treadle.env_runner.rubric import RewardError, RolloutState
from treadle.proto.v1 import rollout_pb2

ROLE_NAMES = {
    rollout_pb2.Role.ROLE_SYSTEM: "system",
    rollout_pb2.Role.ROLE_USER: "user",
    rollout_pb2.Role.ROLE_ASSISTANT: "assistant",
    rollout_pb2.Role.ROLE_TOOL: "tool",
}


def messages_of(rollout: rollout_pb2.Rollout) -> list[dict[str, Any]]:
    """The conversation of the rollout's last branch (root -> last node)."""
    if not rollout.nodes:
        return []
    path = []
    i = len(rollout.nodes) - 1
    while i >= 0:
        path.append(rollout.nodes[i])
        i = rollout.nodes[i].parent_id
    out = []
    for n in reversed(path):
        m: dict[str, Any] = {"role": ROLE_NAMES.get(n.role, "user"), "content": n.content}
        if n.tool_calls:
            m["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments_json}}
                               for c in n.tool_calls]  # fmt: skip
        if n.tool_call_id:
            m["tool_call_id"] = n.tool_call_id
        if n.name:
            m["name"] = n.name
        out.append(m)
    return out


def state_of(task: dict[str, Any], rollout: rollout_pb2.Rollout) -> RolloutState:
    return group_state(RolloutState(task=task, messages=messages_of(rollout)), rollout)


def group_state(state: RolloutState, rollout: rollout_pb2.Rollout) -> RolloutState:
    """``state`` with what group rewards read from its scored rollout: every rollout
    metric (``completion_tokens``, ...) and the rollout's own rewards."""
    state.metrics = {**state.metrics, **dict(rollout.metrics)}
    state.rewards = {r.name: r.value for r in rollout.rewards if not r.from_group}
    state.reward = sum(r.value * r.weight for r in rollout.rewards if not r.from_group)
    return state


async def score_group(
    env: Environment,
    req: rollout_pb2.GroupScoreRequest,
    run_sync: Callable[[Callable[[], Any]], Awaitable[Any]],
) -> rollout_pb2.GroupScoreReply:
    """Each rollout's group rewards; a raising group reward is the reply's error."""
    reply = rollout_pb2.GroupScoreReply()
    try:
        task = json.loads(req.task_json)
    except ValueError as e:
        reply.error = f"bad task_json: {e}"
        return reply
    states = [state_of(task, r) for r in req.rollouts]
    try:
        scored = await env.rubric.score_group(states, run_sync)
    except RewardError as e:
        reply.error = str(e)
        return reply
    for r, score in zip(req.rollouts, scored, strict=True):
        g = reply.rollouts.add(rollout_id=r.rollout_id)
        for name, value, weight in score.rewards:
            g.rewards.add(name=name, value=value, weight=weight, from_group=True)
        g.metrics.update(score.metrics)
    return reply
