"""The env runner service: pulls RolloutRequested, runs rollouts, publishes RolloutCompleted.

A request is acked only after its RolloutCompleted is published (Nats-Msg-Id = rollout_id),
so a runner killed mid-rollout causes a redelivery, and a repeated publish is dropped
by JetStream: nothing lost, nothing counted twice.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.env_runner import group
from treadle.env_runner.environments import Environment, load_environments
from treadle.env_runner.rollout import RolloutContext, call_env, new_rollout, run_rollout
from treadle.env_runner.siblings import SiblingCalls
from treadle.env_runner.spec import SPEC, EnvRunnerSection
from treadle.proto.v1 import (
    common_pb2,
    env_runner_service_pb2,
    env_runner_service_pb2_grpc,
    rollout_pb2,
)
from treadle.services.bus import Delivery, Slots
from treadle.services.errors import ConfigError
from treadle.services.host import IdleApp, ServiceContext

log = logging.getLogger(__name__)


class EnvRunnerApp:
    def __init__(
        self,
        ctx: ServiceContext,
        cfg: EnvRunnerSection,
        envs: dict[str, Environment],
        rc: RolloutContext,
    ):
        self.ctx = ctx
        self.cfg = cfg
        self.envs = envs
        self.rc = rc
        self.active = 0
        self.completed = 0
        self.failed = 0
        self.control = EnvRunnerControl(self)

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return [
            (
                env_runner_service_pb2_grpc.add_EnvRunnerControlServicer_to_server,
                self.control,
                SPEC.control,
            )
        ]

    async def handle(self, req: rollout_pb2.RolloutRequested, delivery: Delivery) -> None:
        problem = request_problem(req)
        if problem:  # answered as an error rollout, so that its group still completes
            rollout = new_rollout(req, self.rc.runner_id)
            rollout.status.CopyFrom(rollout_pb2.RolloutStatus(
                kind=rollout_pb2.RolloutStatus.Kind.KIND_ERROR,
                error_kind=rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_INVALID_REQUEST,
                message=problem,
            ))  # fmt: skip
        else:
            self.active += 1
            try:
                rollout = await run_rollout(req, self.envs.get(req.env), self.rc)
            finally:
                self.active -= 1
        done = rollout_pb2.RolloutCompleted(rollout=rollout)
        stamp = Timestamp()
        stamp.GetCurrentTime()
        done.completed_at.CopyFrom(stamp)
        await self.ctx.bus.publish(
            self.ctx.bus.subjects.rollouts_completed, done, msg_id=rollout.rollout_id
        )
        self.completed += 1
        if rollout.status.kind == rollout_pb2.RolloutStatus.Kind.KIND_ERROR:
            self.failed += 1
            log.warning("rollout %s failed: %s", rollout.rollout_id, rollout.status.message)

    async def run(self, stop: asyncio.Event) -> None:
        bus = self.ctx.bus
        consumers = []
        for env in self.cfg.envs:
            consumers.append(
                await bus.consumer(
                    "ROLLOUT_REQUESTS",
                    f"env-runner-{env}",
                    bus.subjects.rollouts_requested(env),
                    rollout_pb2.RolloutRequested,
                )
            )
        subs = []
        for name, environment in self.envs.items():
            if environment.rubric.group_rewards:
                subs.append(await bus.serve(
                    bus.subjects.groups_score(name), f"env-runner-{name}",
                    rollout_pb2.GroupScoreRequest, functools.partial(self.score_group, environment),
                ))  # fmt: skip
        self.ctx.message = f"serving {', '.join(self.cfg.envs)} with up to {self.cfg.max_concurrency} rollouts at once"
        try:
            slots = Slots(self.cfg.max_concurrency)  # one budget for every environment served
            await asyncio.gather(
                *(
                    c.run(self.handle, stop, concurrency=self.cfg.max_concurrency, slots=slots)
                    for c in consumers
                )
            )
        finally:
            for sub in subs:
                await sub.unsubscribe()
            await stop_services(self.rc)
            if (aclose := getattr(self.rc.generator, "aclose", None)) is not None:
                await aclose()
            if self.rc.executor is not None:
                self.rc.executor.shutdown(wait=False, cancel_futures=True)

    async def score_group(
        self, env: Environment, req: rollout_pb2.GroupScoreRequest
    ) -> rollout_pb2.GroupScoreReply:
        """Group rewards of a complete group, for the orchestrator (see group.py)."""
        return await group.score_group(env, req, lambda fn: call_env(self.rc, fn))


MAX_TOKENS_PER_CALL = 1 << 20  # sampled tokens one model call may ask for


def request_problem(req: rollout_pb2.RolloutRequested) -> str:
    """Why ``req`` cannot be run as sent ("" when it can): sampling settings a generator
    would choke on or spend unbounded time with, or no rollout id."""
    s = req.sampling
    if not req.rollout_id:
        return "the request has no rollout_id"
    if not math.isfinite(s.temperature) or s.temperature < 0:
        return f"sampling.temperature {s.temperature} is not a finite number >= 0"
    if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
        return f"sampling.top_p {s.top_p} is not in [0, 1]"
    if s.top_k < 0:
        return f"sampling.top_k {s.top_k} is negative"
    if not 0 <= s.max_tokens <= MAX_TOKENS_PER_CALL:
        return f"sampling.max_tokens {s.max_tokens} is not in [0, {MAX_TOKENS_PER_CALL}]"
    if not math.isfinite(req.timeout_s) or req.timeout_s < 0:
        return f"timeout_s {req.timeout_s} is not a finite number >= 0"
    return ""


class EnvRunnerControl(env_runner_service_pb2_grpc.EnvRunnerControlServicer):
    def __init__(self, app: EnvRunnerApp):
        self.app = app

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> env_runner_service_pb2.EnvRunnerStatus:
        a = self.app
        return env_runner_service_pb2.EnvRunnerStatus(
            info=a.ctx.info(),
            envs=a.cfg.envs,
            max_concurrency=a.cfg.max_concurrency,
            num_active_rollouts=a.active,
            num_completed=a.completed,
            num_failed=a.failed,
        )


class IdleControl(env_runner_service_pb2_grpc.EnvRunnerControlServicer):
    """Control plane of a runner that has no tokenizer yet (nothing to render with)."""

    def __init__(self, ctx: ServiceContext, cfg: EnvRunnerSection):
        self.ctx = ctx
        self.cfg = cfg

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> env_runner_service_pb2.EnvRunnerStatus:
        return env_runner_service_pb2.EnvRunnerStatus(
            info=self.ctx.info(), envs=self.cfg.envs, max_concurrency=self.cfg.max_concurrency
        )


def context_bound(cfg: EnvRunnerSection) -> tuple[int, str]:
    """The context a model call must fit in, and where it comes from: the smaller of the
    model's own (config.json) and the one inference serves (``max_model_len``); 0 when
    neither is known."""
    from treadle.services.model_folder import context_length

    own = context_length(cfg.tokenizer) if cfg.tokenizer is not None else None
    bounds = [(n, src) for n, src in ((own, "config.json"),
              (cfg.max_model_len, "env_runner.max_model_len")) if n]  # fmt: skip
    return min(bounds) if bounds else (0, "")


async def build(ctx: ServiceContext) -> EnvRunnerApp | IdleApp:
    from treadle.services.rendering import open_renderer

    cfg: EnvRunnerSection = ctx.config.env_runner
    if cfg.tokenizer is None:  # e.g. `treadle stack` on embedded defaults
        servicer = (
            env_runner_service_pb2_grpc.add_EnvRunnerControlServicer_to_server,
            IdleControl(ctx, cfg),
            SPEC.control,
        )
        return IdleApp(
            ctx,
            [servicer],
            "env_runner.tokenizer is not set: serving the control plane only "
            "(point it at the served model's folder or tokenizer.json to run rollouts)",
        )
    extra, names = dict(cfg.environments), list(cfg.envs)
    if cfg.pushed_envs:  # installed once per pin, then loaded like any other
        from treadle.env_runner.pushed import install_all

        cache = cfg.pushed_envs_dir or ctx.config.run.run_dir / "env_runner" / "envs"
        pushed = await asyncio.to_thread(install_all, ctx.store, cfg.pushed_envs, cache)
        extra |= pushed
        names += [n for n in pushed if n not in names]
        cfg = cfg.model_copy(update={"envs": names})  # served like the listed ones
    envs = load_environments(names, extra, cfg.group_rewards, cfg.runtimes)
    for table in ("group_rewards", "runtimes"):
        for name in sorted(set(getattr(cfg, table)) - set(names)):
            log.warning(
                "env_runner.%s.%s is ignored: this runner does not serve %s", table, name, name
            )
    for name, env in envs.items():
        log.info("[startup] environment %s: harness %s, runtime %s", name,
                 type(env.harness).__name__, env.runtime.describe())  # fmt: skip
    assert cfg.tokenizer is not None  # checked above (the copy keeps it)
    renderer = open_renderer(
        cfg.renderer, cfg.tokenizer, force=cfg.renderer_force, what="env_runner.renderer"
    )
    client = inference_generator(cfg, ctx)
    max_model_len, source = context_bound(cfg)
    if max_model_len:
        log.info("[startup] model calls fit in the context length %d (%s)", max_model_len, source)
    rc = RolloutContext(
        renderer,
        client,
        ctx.instance_id,
        attempts=cfg.inference_attempts,
        enable_thinking=cfg.enable_thinking,
        executor=ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="env"),
        max_model_len=max_model_len,
        siblings=SiblingCalls(cfg.group_call_window_s),
    )
    await start_services(rc, envs.values(), cfg.interception_host, cfg.interception_port)
    return EnvRunnerApp(ctx, cfg, envs, rc)


def inference_generator(cfg: EnvRunnerSection, ctx: ServiceContext | None = None) -> Any:
    """The client of inference: one server's, or a pool over ``cfg.replica_urls`` (probed
    against the policies published in ``ctx``'s object store, reported as metrics)."""
    from treadle.services.inference_client import InferenceClient
    from treadle.services.inference_pool import InferencePool, published_probes

    urls = cfg.replica_urls
    key = read_key(cfg.inference_key_file) if cfg.inference_key_file is not None else None
    if len(urls) == 1 and not cfg.inference_discovery:
        return InferenceClient(urls[0], timeout_s=cfg.inference_timeout_s,
                               model=cfg.inference_model, api_key=key)  # fmt: skip
    discover: Callable[[], Awaitable[list[str]]] | None = None
    if cfg.inference_discovery:
        if ctx is None:
            raise ValueError("env_runner.inference_discovery needs the service's NATS connection")
        from treadle.services.discovery import announced

        bus = ctx.bus

        async def announced_urls() -> list[str]:
            return [a.url for a in await announced(bus)]

        discover = announced_urls

    reports: set[asyncio.Task[None]] = set()

    def changed(pool: InferencePool) -> None:
        if ctx is None:
            return
        ctx.message = f"{ctx.message.split(' | ')[0]} | {pool.describe()}"
        task = asyncio.get_running_loop().create_task(ctx.report_metrics(0, pool.stats()))
        reports.add(task)
        task.add_done_callback(reports.discard)

    pool = InferencePool(
        urls, cfg.inference_timeout_s,
        lookup=published_probes(ctx.store) if ctx is not None else None,
        probe_interval_s=cfg.inference_probe_interval_s,
        tolerance=cfg.inference_probe_tolerance, on_change=changed, discover=discover,
        model=cfg.inference_model, api_key=key,
    )  # fmt: skip
    log.info("[startup] %d inference replicas listed%s: %s", len(urls),
             ", more discovered through NATS" if cfg.inference_discovery else "", ", ".join(urls) or "-")  # fmt: skip
    return pool


def read_key(path: Path) -> str:
    """A run's key on a hosted inference deployment (ConfigError naming the file)."""
    try:
        key = path.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise ConfigError(f"env_runner.inference_key_file {path}: {e.strerror or e}") from None
    if not key:
        raise ConfigError(f"env_runner.inference_key_file {path} is empty")
    return key


def needs_interception(envs: Iterable[Environment]) -> bool:
    """Whether a harness is a separate program that talks to the model over HTTP."""
    return any(getattr(type(e.harness), "uses_interception", False) for e in envs)


async def start_services(rc: RolloutContext, envs: Iterable[Environment], host: str = "127.0.0.1",
                         port: int = 0) -> None:  # fmt: skip
    """Start what the environments' harnesses need (the interception server)."""
    if needs_interception(envs):
        from treadle.env_runner.interception import InterceptionServer

        server = InterceptionServer(host=host, port=port)
        await server.start()
        rc.services = {**(rc.services or {}), "interception": server}
        log.info("[startup] interception server on %s", server.url)


async def stop_services(rc: RolloutContext) -> None:
    server = (rc.services or {}).pop("interception", None)
    if server is not None:
        await server.stop()
