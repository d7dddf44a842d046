"""One single-turn rollout: render the prompt, generate token ids, score, build the Rollout.

    RolloutRequested ─▶ environment.prompt(task) ─▶ treadle_native render (ids + attribution)
        ─▶ inference generate (token ids in, token ids + logprobs + policy versions out)
        ─▶ treadle_native parse (content) ─▶ environment.reward ─▶ Rollout (message-node graph)

Token-exact: the prompt ids are the renderer's, the completion ids are inference's;
nothing is decoded and re-encoded. Every failure becomes a rollout status (never an
exception out of here), so the orchestrator always gets a completion for its group.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
from google.protobuf.timestamp_pb2 import Timestamp

import treadle_native
from treadle.env_runner.environments import Environment
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.errors import TreadleError
from treadle.services.telemetry import current_trace_id, tracer

log = logging.getLogger(__name__)
T = TypeVar("T")

Status = rollout_pb2.RolloutStatus
Role = rollout_pb2.Role
ROLES = {
    "system": Role.ROLE_SYSTEM,
    "user": Role.ROLE_USER,
    "assistant": Role.ROLE_ASSISTANT,
    "tool": Role.ROLE_TOOL,
}


class Generation(Protocol):
    """What a generate call returns (the inference client's GenerateResult)."""

    @property
    def token_ids(self) -> np.ndarray: ...  # [n] int32

    @property
    def logprobs(self) -> np.ndarray: ...  # [n] float32

    @property
    def policy_versions(self) -> np.ndarray: ...  # [n] int32

    @property
    def finish_reason(self) -> str: ...


class Generator(Protocol):
    async def generate(
        self,
        prompt_ids: Any,
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
    ) -> Generation: ...


@dataclass
class RolloutContext:
    renderer: treadle_native.Renderer
    generator: Generator
    runner_id: str
    attempts: int = 3
    enable_thinking: bool | None = None
    executor: Executor | None = None
    """Threads that run environment code (prompt, reward): size it to the runner's
    concurrency, or rollouts whose reward blocks (a judge, a test run) queue behind the
    default pool's few threads. None: asyncio's default pool."""


async def call_env(rc: RolloutContext, fn: Callable[..., T], *args: Any) -> T:
    """Run user environment code in ``rc.executor`` (it may block), keeping the trace
    context of the calling task."""
    loop = asyncio.get_running_loop()
    ctx = contextvars.copy_context()
    return await loop.run_in_executor(rc.executor, functools.partial(ctx.run, fn, *args))


def _now() -> Timestamp:
    t = Timestamp()
    t.GetCurrentTime()
    return t


def _fail(
    rollout: rollout_pb2.Rollout, kind: rollout_pb2.RolloutStatus.ErrorKind, message: str
) -> rollout_pb2.Rollout:
    rollout.status.CopyFrom(
        Status(kind=Status.Kind.KIND_ERROR, error_kind=kind, message=message[:2000])
    )
    return rollout


def prompt_nodes(
    rollout: rollout_pb2.Rollout, messages: list[dict[str, Any]], rendered: Any
) -> np.ndarray:
    """One node per prompt message, chained; returns the generation-prompt ids that follow
    the last message (template scaffold outside any message before it goes to the first node)."""
    ids = rendered.token_ids
    index = rendered.message_index
    last_owned = max((i for i in range(len(ids)) if index[i] >= 0), default=-1)
    bounds: list[
        list[int]
    ] = []  # [message, start, end); unowned tokens join the segment before them
    for i in range(last_owned + 1):
        m = int(index[i])
        if m >= 0 and (not bounds or bounds[-1][0] != m):
            bounds.append([m, i, i + 1])
        elif bounds:
            bounds[-1][2] = i + 1
    if bounds:
        bounds[0][1] = 0  # scaffold before the first message (e.g. BOS)
    for k, (m, s, e) in enumerate(bounds):
        node = rollout.nodes.add(
            node_id=k,
            parent_id=k - 1,
            role=ROLES[messages[m]["role"]],
            content=str(messages[m].get("content") or ""),
        )
        k_ids = ids[s:e]
        node.token_ids.CopyFrom(to_token_array(np.ascontiguousarray(k_ids, dtype=np.int32)))
        node.sampled_mask.CopyFrom(to_token_array(np.zeros(len(k_ids), np.uint8)))
        node.logprobs.CopyFrom(to_token_array(np.zeros(len(k_ids), np.float32)))
        node.policy_versions.CopyFrom(to_token_array(np.full(len(k_ids), -1, np.int32)))
    return np.ascontiguousarray(ids[last_owned + 1 :], dtype=np.int32)


async def run_rollout(
    req: rollout_pb2.RolloutRequested, env: Environment | None, rc: RolloutContext
) -> rollout_pb2.Rollout:
    """Run ``req``; the result always has a status (errors included)."""
    rollout = rollout_pb2.Rollout(
        rollout_id=req.rollout_id,
        group_id=req.group_id,
        group_index=req.group_index,
        env=req.env,
        task_id=req.task_id,
        runner_id=rc.runner_id,
        request_policy_version=req.policy_version,
        min_policy_version=-1,
        max_policy_version=-1,
    )
    rollout.timing.requested_at.CopyFrom(req.requested_at)
    rollout.timing.started_at.CopyFrom(_now())
    with tracer(__name__).start_as_current_span(
        "rollout", attributes={"treadle.rollout_id": req.rollout_id, "treadle.env": req.env}
    ):
        rollout.trace_id = current_trace_id()
        try:
            await _run(req, env, rc, rollout)
        finally:
            rollout.timing.finished_at.CopyFrom(_now())
    return rollout


async def _run(
    req: rollout_pb2.RolloutRequested,
    env: Environment | None,
    rc: RolloutContext,
    rollout: rollout_pb2.Rollout,
) -> None:
    if env is None:
        _fail(
            rollout,
            Status.ErrorKind.ERROR_KIND_INVALID_REQUEST,
            f"this runner does not serve environment {req.env!r}",
        )
        return
    try:
        task = json.loads(req.task_json)
        if not isinstance(task, dict):
            raise ValueError("task_json is not a JSON object")
    except ValueError as e:
        _fail(rollout, Status.ErrorKind.ERROR_KIND_INVALID_REQUEST, f"bad task_json: {e}")
        return
    t0 = time.monotonic()
    try:
        messages = await call_env(rc, env.prompt, task)  # user code may block
        rendered = rc.renderer.render(
            messages, add_generation_prompt=True, enable_thinking=rc.enable_thinking
        )
    except treadle_native.TreadleNativeError as e:
        _fail(rollout, Status.ErrorKind.ERROR_KIND_TEMPLATE, f"cannot render the prompt: {e}")
        return
    except Exception as e:  # environment code is user code: its failure is data
        _fail(rollout, Status.ErrorKind.ERROR_KIND_ENV, f"prompt() raised {type(e).__name__}: {e}")
        return
    rollout.timing.env_s += time.monotonic() - t0
    generation_prompt = prompt_nodes(rollout, messages, rendered)
    s = req.sampling
    gen: Generation | None = None
    t0 = time.monotonic()
    last_error = ""
    for attempt in range(rc.attempts):
        try:
            with tracer(__name__).start_as_current_span("generate"):
                gen = await rc.generator.generate(
                    rendered.token_ids,
                    max_tokens=s.max_tokens or 256,
                    temperature=s.temperature,
                    top_p=s.top_p or 1.0,
                    top_k=s.top_k,
                    seed=s.seed if s.HasField("seed") else None,
                )
            break
        except TreadleError as e:
            last_error = str(e)
            log.warning(
                "generate for %s failed (attempt %d/%d): %s",
                req.rollout_id,
                attempt + 1,
                rc.attempts,
                e,
            )
            await asyncio.sleep(min(2.0**attempt, 10.0))
    rollout.timing.generation_s += time.monotonic() - t0
    rollout.timing.num_model_calls += 1
    if gen is None:
        _fail(
            rollout,
            Status.ErrorKind.ERROR_KIND_INFERENCE,
            f"inference failed {rc.attempts} times: {last_error}",
        )
        return
    sampled = np.ascontiguousarray(gen.token_ids, dtype=np.int32)
    k = len(generation_prompt)
    node = rollout.nodes.add(
        node_id=len(rollout.nodes), parent_id=len(rollout.nodes) - 1, role=Role.ROLE_ASSISTANT
    )
    node.token_ids.CopyFrom(to_token_array(np.concatenate([generation_prompt, sampled])))
    node.sampled_mask.CopyFrom(
        to_token_array(np.concatenate([np.zeros(k, np.uint8), np.ones(len(sampled), np.uint8)]))
    )
    node.logprobs.CopyFrom(
        to_token_array(
            np.concatenate([np.zeros(k, np.float32), np.asarray(gen.logprobs, np.float32)])
        )
    )
    versions = np.asarray(gen.policy_versions, np.int32)
    node.policy_versions.CopyFrom(
        to_token_array(np.concatenate([np.full(k, -1, np.int32), versions]))
    )
    if versions.size:
        rollout.min_policy_version = int(versions.min())
        rollout.max_policy_version = int(versions.max())
    try:
        parsed = rc.renderer.parse(sampled)
    except treadle_native.TreadleNativeError as e:
        _fail(
            rollout, Status.ErrorKind.ERROR_KIND_MODEL_OUTPUT, f"cannot parse the completion: {e}"
        )
        return
    node.content = parsed.content
    node.reasoning_content = parsed.reasoning or ""
    node.finish_reason = (
        rollout_pb2.FinishReason.FINISH_REASON_STOP
        if parsed.stopped
        else rollout_pb2.FinishReason.FINISH_REASON_LENGTH
    )
    t0 = time.monotonic()
    try:
        with tracer(__name__).start_as_current_span("reward"):
            result = await call_env(rc, env.reward, task, parsed.content)
        rewards = result if isinstance(result, dict) else {"reward": result}
        for name, value in rewards.items():
            rollout.rewards.add(name=name, value=float(value), weight=1.0)
        rollout.reward = float(sum(float(v) for v in rewards.values()))
    except Exception as e:  # reward code is user code: its failure is data
        _fail(
            rollout, Status.ErrorKind.ERROR_KIND_REWARD, f"reward() raised {type(e).__name__}: {e}"
        )
        return
    finally:
        rollout.timing.reward_s += time.monotonic() - t0
    rollout.metrics["completion_tokens"] = float(len(sampled))
    if parsed.stopped:
        rollout.status.kind = Status.Kind.KIND_OK
    else:
        rollout.status.CopyFrom(
            Status(
                kind=Status.Kind.KIND_TRUNCATED, truncation=Status.Truncation.TRUNCATION_MAX_TOKENS
            )
        )
