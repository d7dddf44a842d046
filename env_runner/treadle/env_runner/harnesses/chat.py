"""Chat harnesses: the model talks in the runner's own loop (no separate program).

    SingleTurn()            one model call on the task's prompt
    ToolUse(max_turns=8)    OpenAI-style function calling until the model answers
                            without a tool call (tools from Python functions or MCP)
    UserSimulator(user)     another model or a scripted policy plays the user until it
                            says the done marker

Bad model output is data, not a crash: a malformed tool call or an unknown tool is
answered with an error the model can read and counted in the rollout's metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from treadle.env_runner.harnesses.base import EnvView, RunSync
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.session import ModelSession, Truncated, Turn
from treadle.env_runner.tools import ToolSet
from treadle.proto.v1 import rollout_pb2
from treadle.services.telemetry import tracer

Status = rollout_pb2.RolloutStatus


def _bump(state: RolloutState, key: str, by: float = 1.0) -> None:
    state.metrics[key] = state.metrics.get(key, 0.0) + by


async def run_tool_calls(
    turn: Turn, tools: ToolSet, state: RolloutState, run_sync: RunSync
) -> list[dict[str, Any]]:
    """Run the turn's tool calls; one tool message per call (errors the model can read),
    counted in the state's metrics: tool_calls, malformed_tool_calls, tool_<status>."""
    results: list[dict[str, Any]] = []
    for call in turn.tool_calls:
        _bump(state, "tool_calls")
        with tracer(__name__).start_as_current_span(
            "tool_call", attributes={"treadle.tool": call.name, "treadle.tool_status": call.status}
        ):
            if call.status == "malformed":
                _bump(state, "malformed_tool_calls")
                content = f"error: the tool call could not be parsed: {call.raw_text[:200]!r}"
            else:
                result = await tools.call(call.name, call.arguments, state, run_sync)
                if result.status != "ok":
                    _bump(state, f"tool_{result.status}")
                content = result.content
        results.append(
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
        )
    return results


class SingleTurn:
    """One model call on ``env.prompt(task)``."""

    async def run(self, env: EnvView, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None:  # fmt: skip
        messages = await env.messages(task, run_sync)
        turn = await session.chat(messages)
        if turn.finish_reason == "length":
            state.truncated = "max_tokens"


@dataclass
class ToolUse:
    """Function calling until the model answers without a tool call."""

    max_turns: int = 8
    """Model calls per rollout; the rollout is truncated (MAX_TURNS) beyond."""

    async def run(self, env: EnvView, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None:  # fmt: skip
        tools = env.toolset(task)
        schemas = tools.schemas()
        messages = await env.messages(task, run_sync)
        results: list[dict[str, Any]] = []
        for _ in range(self.max_turns):
            turn = await session.chat(messages, schemas)
            messages.append(turn.message)
            if not turn.tool_calls:
                if turn.finish_reason == "length":
                    state.truncated = "max_tokens"
                state.messages = list(messages)
                return
            results = await run_tool_calls(turn, tools, state, run_sync)
            messages.extend(results)
            state.messages = list(messages)
        session.record_messages(results)  # the last tool results, never shown to the model
        raise Truncated(
            Status.Truncation.TRUNCATION_MAX_TURNS, f"no final answer within {self.max_turns} turns"
        )


UserFn = Callable[..., Any]


@dataclass
class UserSimulator:
    """A simulated user talks with the model until it says ``done_marker``.

    ``user`` is a scripted policy — ``user(task, messages) -> str`` (sync or async) — or
    an ``OpenAIChat`` playing the user from ``task["persona"]``/``task["scenario"]``.
    The agent's own tools (``env.tools``) are available between user turns.
    """

    user: Any
    done_marker: str = "[DONE]"
    max_turns: int = 6
    """Agent turns per conversation; the rollout is truncated (MAX_TURNS) beyond."""
    user_max_tokens: int = 128
    user_temperature: float = 0.7
    """Sampling temperature of a model playing the user (0: greedy, reproducible)."""

    async def _user_says(
        self, task: dict[str, Any], messages: list[dict[str, Any]], run_sync: RunSync
    ) -> str:
        with tracer(__name__).start_as_current_span("user_turn"):
            if hasattr(self.user, "chat") and not callable(self.user):
                persona = task.get("persona") or "a user of this assistant"
                scenario = task.get("scenario") or ""
                system = (
                    f"You play {persona}. {scenario} Reply as the user, briefly. When your "
                    f"goal is reached or the conversation should end, reply with {self.done_marker}."
                )
                # roles flip: the simulator sees the agent as its "user"
                flipped = [{"role": "system", "content": system}] + [
                    {"role": "user" if m["role"] == "assistant" else "assistant", "content": str(m.get("content") or "")}
                    for m in messages if m["role"] in ("user", "assistant")
                ]  # fmt: skip
                reply = await self.user.chat(flipped, tools=None, max_tokens=self.user_max_tokens,
                                             temperature=self.user_temperature, top_p=1.0,
                                             seed=None)  # fmt: skip
                return str(reply.get("content") or "")
            out = self.user(task, list(messages))
            if inspect.isawaitable(out):
                out = await out
            return str(out)

    async def run(self, env: EnvView, task: dict[str, Any], session: ModelSession,
                  state: RolloutState, run_sync: RunSync) -> None:  # fmt: skip
        messages = await env.messages(task, run_sync)
        tools = env.toolset(task)
        schemas = tools.schemas() or None
        if not messages or messages[-1]["role"] != "user":
            messages.append(
                {"role": "user", "content": await self._user_says(task, messages, run_sync)}
            )
        agent_turns = 0
        while True:
            if agent_turns >= self.max_turns:
                state.messages = list(messages)
                raise Truncated(
                    Status.Truncation.TRUNCATION_MAX_TURNS,
                    f"conversation not done within {self.max_turns} turns",
                )
            turn = await session.chat(messages, schemas)
            agent_turns += 1
            messages.append(turn.message)
            if turn.tool_calls:
                messages.extend(await run_tool_calls(turn, tools, state, run_sync))
                continue
            said = await self._user_says(task, messages, run_sync)
            _bump(state, "user_turns")
            if self.done_marker in said:
                state.info["user_done"] = True
                said = said.replace(self.done_marker, "").strip()
                if said:
                    messages.append({"role": "user", "content": said})
                state.messages = list(messages)
                return
            messages.append({"role": "user", "content": said})
