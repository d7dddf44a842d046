"""The local launcher: one command starts the whole stack on one machine.

    embedded nats-server (unless nats.url is set)
      └─▶ inference ─▶ trainer ─▶ orchestrator ─▶ env_runner   (installed ones, in order)
          each: `python -m <service> @ <run files> --nats.url .. --<svc>.grpc.port ..`,
          healthy (gRPC health SERVING) before the next starts

Children log to ``outputs/<run>/logs/<name>.log``; the resolved config (secrets masked)
goes to ``outputs/<run>/config.toml`` and the stack's pids/ports to ``stack.json``.
When a child dies the launcher stops the others and exits non-zero with that child's
last log lines; Ctrl-C stops everything in reverse order.

Not here: what the services do once up (the RL loop lives in the orchestrator).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from treadle.proto.v1 import common_pb2
from treadle.services.config import ConfigSources, gather, to_toml, validate
from treadle.services.errors import ChildFailedError, ConfigError
from treadle.services.nats_server import EmbeddedNats
from treadle.services.ports import free_port
from treadle.services.registry import (
    KNOWN_SERVICES,
    LAUNCHER_SECTION,
    ServiceSpec,
    installed_services,
    known_sections,
)
from treadle.services.rpc import check_health, open_channel
from treadle.services.sections import ServiceConfig, StrictModel
from treadle.services.supervisor import Supervisor

log = logging.getLogger(__name__)


class LauncherSection(StrictModel):
    """[launcher]: how the local launcher runs the stack."""

    services: list[str] | None = None
    """Services to start, e.g. ["env_runner"]; default: every installed service."""
    health_timeout_s: float = Field(120.0, gt=0)
    """Seconds a child may take to report SERVING before the launch fails."""
    stop_grace_s: float = Field(15.0, ge=0)
    """Seconds a child gets after SIGTERM before SIGKILL."""


class LauncherConfig(ServiceConfig):
    """Config of the local launcher (`treadle rl`, `treadle sft`, `treadle stack`)."""

    launcher: LauncherSection = Field(default_factory=LauncherSection)


@dataclass
class Launched:
    spec: ServiceSpec
    pid: int
    target: str


def resolve(
    sources: ConfigSources,
) -> tuple[LauncherConfig, list[tuple[ServiceSpec, ServiceConfig]]]:
    """Validate the launcher's config and every selected service's config up front."""
    raw = gather(sources)
    cfg = validate(LauncherConfig, raw, known_sections())
    installed = installed_services()
    names = cfg.launcher.services if cfg.launcher.services is not None else list(installed)
    specs = []
    for name in names:
        if name not in installed:
            if name in KNOWN_SERVICES:
                raise ConfigError(
                    f"launcher.services: {name!r} is not installed (`pip install {KNOWN_SERVICES[name]}`)"
                )
            raise ConfigError(
                f"launcher.services: unknown service {name!r}; services are {', '.join(KNOWN_SERVICES)}"
            )
        specs.append(installed[name])
    # every service's config is validated before anything starts
    return cfg, [(spec, validate(spec.config_cls, raw, known_sections())) for spec in specs]


async def _status_line(launched: Launched) -> str:
    """State and message reported by the service's GetStatus."""
    async with open_channel(
        launched.target, [launched.spec.control], default_timeout_s=3.0
    ) as channel:
        stub = launched.spec.stub(channel)
        status = await stub.GetStatus(common_pb2.GetStatusRequest())
    state = common_pb2.ServiceState.Name(status.info.state).removeprefix("SERVICE_STATE_")
    return f"{state}{': ' + status.info.message if status.info.message else ''}"


async def run_stack(sources: ConfigSources, *, check_only: bool) -> int:
    """Start the local stack; with ``check_only`` stop it again once every part is healthy."""
    cfg, specs = resolve(sources)
    run_dir = cfg.run.run_dir
    logs_dir = run_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    supervisor = Supervisor(logs_dir)
    nats: EmbeddedNats | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    launched: list[Launched] = []
    t0 = time.monotonic()
    try:
        nats_url = cfg.nats.url
        if nats_url is None:
            store_dir = cfg.nats.embedded_store_dir or run_dir / "nats"
            nats = EmbeddedNats(store_dir, logs_dir / "nats-server.log")
            nats_url = await asyncio.to_thread(nats.start)
            log.info(
                "[startup] embedded nats-server at %s (pid %s)",
                nats_url,
                nats.process and nats.process.pid,
            )
        child_argv = [a for a in sources.to_argv() if a != "--dry-run"]
        for spec, spec_cfg in specs:
            host = spec.grpc_section(spec_cfg).host
            try:
                port = free_port(host)
            except OSError as e:
                raise ConfigError(
                    f"{spec.name}.grpc.host = {host!r} cannot be bound on this machine ({e.strerror}); "
                    "use 127.0.0.1 or an address of one of its interfaces"
                ) from None
            target = f"{host}:{port}"
            argv = [sys.executable, "-m", spec.module, *child_argv,
                    "--nats.url", nats_url, f"--{spec.name}.grpc.port", str(port)]  # fmt: skip

            async def healthy(target: str = target, name: str = spec.control.full_name) -> bool:
                return await check_health(target, name)

            proc = await supervisor.start(
                spec.name,
                argv,
                health=healthy,
                health_timeout_s=cfg.launcher.health_timeout_s,
                stop_grace_s=cfg.launcher.stop_grace_s,
            )
            assert proc.pid is not None
            launched.append(Launched(spec, proc.pid, target))
        _write_stack(run_dir / "stack.json", nats_url, nats, launched)
        print(
            f"treadle: stack of run {cfg.run.name!r} is up in {time.monotonic() - t0:.1f}s (logs: {logs_dir})"
        )
        print(
            f"  {'nats':<13} {nats_url}  {'embedded, pid ' + str(nats.process.pid) if nats and nats.process else 'external'}"
        )
        for item in launched:
            print(
                f"  {item.spec.name:<13} grpc {item.target}  pid {item.pid}  {await _status_line(item)}"
            )
        if check_only:
            return 0
        print("press Ctrl-C to stop")
        watcher = asyncio.create_task(supervisor.watch())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
        watcher.cancel()
        stopper.cancel()
        if watcher in done and not watcher.cancelled():
            raise watcher.result()
        return 0
    finally:
        codes = supervisor.stop_all()
        if nats is not None:
            nats.stop(cfg.launcher.stop_grace_s)
        if codes:
            print(
                "treadle: stack stopped ("
                + ", ".join(f"{n}: exit {c}" for n, c in codes.items())
                + ")"
            )


def _write_stack(
    path: Any, nats_url: str, nats: EmbeddedNats | None, launched: list[Launched]
) -> None:
    doc = {
        "started_at": time.time(),
        "nats": {"url": nats_url, "pid": nats.process.pid if nats and nats.process else None},
        "services": {i.spec.name: {"pid": i.pid, "grpc": i.target} for i in launched},
    }
    path.write_text(json.dumps(doc, indent=2))


__all__ = [
    "LAUNCHER_SECTION",
    "ChildFailedError",
    "LauncherConfig",
    "LauncherSection",
    "resolve",
    "run_stack",
]
