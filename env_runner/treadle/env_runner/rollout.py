"""One rollout: task -> harness (model calls recorded by a ModelSession) -> rubric.

    RolloutRequested ─▶ check the task ─▶ harness.run (each model call: treadle_native
        render/bridge ─▶ inference token route ─▶ parse) ─▶ rubric.score ─▶ Rollout

Token-exact: prompt ids are the renderer's, completion ids are inference's; nothing is
decoded and re-encoded. Every failure becomes a rollout status (never an exception out
of here), so the orchestrator always gets a completion for its group.
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
from typing import Any, TypeVar, cast

from google.protobuf.timestamp_pb2 import Timestamp
from opentelemetry import trace

import treadle_native
from treadle.env_runner.environments import Environment, as_environment
from treadle.env_runner.harnesses.base import HarnessError
from treadle.env_runner.rubric import RewardError, RolloutState
from treadle.env_runner.session import Generator, Limits, ModelSession, Truncated, TurnError
from treadle.env_runner.siblings import SiblingCalls
from treadle.env_runner.tasksets import TaskError
from treadle.proto.v1 import rollout_pb2
from treadle.services.telemetry import current_trace_id, tracer

log = logging.getLogger(__name__)
T = TypeVar("T")

Status = rollout_pb2.RolloutStatus


@dataclass
class RolloutContext:
    renderer: treadle_native.Renderer | None
    generator: Generator | None
    runner_id: str
    attempts: int = 3
    enable_thinking: bool | None = None
    executor: Executor | None = None
    """Threads that run environment code (prompt, tools, rewards): size it to the runner's
    concurrency, or rollouts whose reward blocks (a judge, a test run) queue behind the
    default pool's few threads. None: asyncio's default pool."""
    openai: Any = None
    """An OpenAIChat: call an OpenAI-compatible endpoint instead of the token route
    (evaluation of external models; nodes then carry no token ids)."""
    services: dict[str, Any] | None = None
    """Shared helpers harnesses may need (e.g. the interception server), by name."""
    max_model_len: int = 0
    """The served model's context length in tokens (0 = unknown): no model call asks for
    more than the room it leaves after the prompt."""
    siblings: SiblingCalls | None = None
    """Sends a group's identical first calls as one request (siblings.py; with window 0
    or None, each call alone)."""


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


def _fail(rollout: rollout_pb2.Rollout, kind: int, message: str) -> rollout_pb2.Rollout:
    error_kind = cast("rollout_pb2.RolloutStatus.ErrorKind", kind)
    rollout.status.CopyFrom(
        Status(kind=Status.Kind.KIND_ERROR, error_kind=error_kind, message=message[:2000])
    )
    return rollout


async def run_rollout(
    req: rollout_pb2.RolloutRequested,
    env: Environment | Any | None,
    rc: RolloutContext,
    state_out: list[RolloutState] | None = None,
) -> rollout_pb2.Rollout:
    """Run ``req``; the result always has a status (errors included). ``state_out``, when
    given, receives the rollout's RolloutState (for group rewards)."""
    rollout = new_rollout(req, rc.runner_id)
    rollout.timing.started_at.CopyFrom(_now())
    with tracer(__name__).start_as_current_span(
        "rollout", attributes={"treadle.rollout_id": req.rollout_id, "treadle.env": req.env}
    ):
        rollout.trace_id = current_trace_id()
        try:
            await _run(req, env, rc, rollout, state_out)
        except Exception as e:  # a bug of ours: still a status, never a lost rollout
            log.exception("rollout %s failed inside Treadle", req.rollout_id)
            _fail(rollout, Status.ErrorKind.ERROR_KIND_INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            rollout.timing.finished_at.CopyFrom(_now())
    return rollout


def new_rollout(req: rollout_pb2.RolloutRequested, runner_id: str) -> rollout_pb2.Rollout:
    rollout = rollout_pb2.Rollout(
        rollout_id=req.rollout_id, group_id=req.group_id, group_index=req.group_index,
        env=req.env, task_id=req.task_id, runner_id=runner_id,
        request_policy_version=req.policy_version, min_policy_version=-1, max_policy_version=-1,
    )  # fmt: skip
    rollout.timing.requested_at.CopyFrom(req.requested_at)
    return rollout


def _set_truncated(rollout: rollout_pb2.Rollout, truncation: int, message: str) -> None:
    value = cast("rollout_pb2.RolloutStatus.Truncation", truncation)
    rollout.status.CopyFrom(
        Status(kind=Status.Kind.KIND_TRUNCATED, truncation=value, message=message)
    )


async def _run(
    req: rollout_pb2.RolloutRequested,
    env: Any,
    rc: RolloutContext,
    rollout: rollout_pb2.Rollout,
    state_out: list[RolloutState] | None = None,
) -> None:
    if env is None:
        _fail(rollout, Status.ErrorKind.ERROR_KIND_INVALID_REQUEST,
              f"this runner does not serve environment {req.env!r}")  # fmt: skip
        return
    env = as_environment(env)
    try:
        task = json.loads(req.task_json)
        env.check(task, f"task {req.task_id!r}")
    except (ValueError, TaskError) as e:
        rollout.metrics["invalid_task"] = 1.0
        _fail(rollout, Status.ErrorKind.ERROR_KIND_INVALID_REQUEST, f"bad task: {e}")
        return
    state = RolloutState(task=task, runtime=env.runtime)
    if state_out is not None:
        state_out.append(state)
    s = req.sampling
    timeout = req.timeout_s or env.timeout_s
    limits = Limits(
        max_total_tokens=s.max_total_tokens or env.max_total_tokens,
        deadline=time.monotonic() + timeout if timeout else 0.0,
        max_model_len=rc.max_model_len,
    )
    privileged: str | None = None
    if req.want_privileged_prompts and env.privileged is not None:
        try:
            privileged = str(await call_env(rc, env.privileged, task))
        except Exception as e:  # environment code is user code: its failure is data
            _fail(rollout, Status.ErrorKind.ERROR_KIND_ENV,
                  f"privileged context: {type(e).__name__}: {e}")  # fmt: skip
            return
    generator = rc.generator
    if (bind := getattr(generator, "for_rollout", None)) is not None:
        generator = bind(req.rollout_id)  # several replicas: the rollout's turns stay on one
    if rc.siblings is not None and generator is not None:
        generator = rc.siblings.bind(req, generator)
    session = ModelSession(
        rollout, s, limits, state, renderer=rc.renderer, generator=generator,
        openai=rc.openai, attempts=rc.attempts, enable_thinking=rc.enable_thinking,
        privileged=privileged,
    )  # fmt: skip
    state.info["session"] = session

    async def run_sync(fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return await call_env(rc, fn)
        finally:
            rollout.timing.env_s += time.monotonic() - t0

    truncation: tuple[int, str] | None = None
    # the harness's turns are the rollout span's children (no span of its own: the rollout
    # is the harness's run plus the reward's span)
    trace.get_current_span().set_attribute("treadle.harness", type(env.harness).__name__)
    try:
        coro = env.harness.run(env, task, session, state, run_sync)
        if timeout:
            await asyncio.wait_for(coro, timeout)
        else:
            await coro
    except Truncated as e:
        truncation = (e.truncation, str(e))
    except TimeoutError:
        truncation = (
            Status.Truncation.TRUNCATION_TIMEOUT,
            f"the rollout ran past its {timeout:g} s budget",
        )
    except TurnError as e:
        _fail(rollout, e.error_kind, str(e))
        return
    except HarnessError as e:
        _fail(rollout, e.error_kind, str(e))
        return
    except Exception as e:  # environment code is user code: its failure is data
        log.debug("environment %s raised", req.env, exc_info=True)
        _fail(rollout, Status.ErrorKind.ERROR_KIND_ENV, f"{type(e).__name__}: {e}")
        return
    finally:
        state.info.pop("session", None)
        if rc.siblings is not None:
            rc.siblings.release(generator)
        for k, v in state.metrics.items():
            rollout.metrics[k] = float(v)
        rollout.metrics["num_turns"] = float(session.num_turns)
    t0 = time.monotonic()
    try:
        with tracer(__name__).start_as_current_span("reward"):
            score = await env.rubric.score(state, run_sync)
    except RewardError as e:
        rollout.metrics["reward_error"] = 1.0
        _fail(rollout, Status.ErrorKind.ERROR_KIND_REWARD, str(e))
        return
    finally:
        rollout.timing.reward_s += time.monotonic() - t0
    for name, value, weight in score.rewards:
        rollout.rewards.add(name=name, value=value, weight=weight)
    rollout.reward = score.total
    for k, v in score.metrics.items():
        rollout.metrics[k] = v
    if truncation is not None:
        _set_truncated(rollout, *truncation)
    elif state.truncated == "max_tokens":
        _set_truncated(
            rollout, Status.Truncation.TRUNCATION_MAX_TOKENS, "the last model call hit max_tokens"
        )
    else:
        rollout.status.kind = Status.Kind.KIND_OK
