"""Helpers of the hosted-run tests: one nats-server with every run's users, run files."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from treadle.services.credentials import RunCredentials, create_streams, generate_shared
from treadle.services.nats_server import EmbeddedNats
from treadle.services.sections import NatsSection


def start_shared_nats(
    root: Path, runs: Sequence[str], envs: dict[str, list[str]] | None = None
) -> tuple[EmbeddedNats, dict[str, RunCredentials]]:
    """One TLS nats-server holding every run's users (``generate_shared``), streams made
    (and the env runners' consumers of ``envs[run]``)."""
    creds = generate_shared(root / "credentials", runs)
    conf = creds[runs[0]].nats_conf  # one server config holds every run's users
    server = EmbeddedNats(root / "store", root / "nats-server.log", config_file=conf)
    server.start()
    assert server.url
    for run in runs:
        asyncio.run(create_streams(creds[run], server.url, (envs or {}).get(run, [])))
    return server, creds


def nats_cfg(server: EmbeddedNats, creds: RunCredentials, role: str) -> NatsSection:
    """The [nats] section of the run's ``role`` user."""
    assert server.url
    return NatsSection(
        url=server.url,
        credentials=creds.seed(role),
        tls_ca=creds.ca,
        manage_streams=False,
        connect_timeout_s=2.0,
    )


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value if not isinstance(value, Path) else str(value))


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """A TOML config file of ``sections`` (dotted names for subsections)."""
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def run_nats_section(server: EmbeddedNats, creds: RunCredentials, role: str) -> dict[str, Any]:
    """A run file's [nats] as the run's ``role`` user."""
    return {
        "url": server.url,
        "credentials": creds.seed(role),
        "tls_ca": creds.ca,
        "manage_streams": False,
    }


def host_argv(
    service: str, root: Path, server: EmbeddedNats, creds: RunCredentials, run_files: list[Path]
) -> list[str]:
    """The command line of a ``service`` process hosting ``run_files`` as the deployment's
    own run "platform" (``creds``: its users), before the service's own flags."""
    assert server.url
    return [
        sys.executable, "-m", f"treadle.{service}", "--run.name", "platform",
        "--run.output_dir", str(root / "out"), "--object_store.root", str(root / "store-platform"),
        "--nats.url", server.url, "--nats.credentials", str(creds.seed(service)),
        "--nats.tls_ca", str(creds.ca), "--nats.manage_streams", "false",
        f"--{service}.hosted.runs", json.dumps([str(p) for p in run_files]),
    ]  # fmt: skip


async def last_policy(server: EmbeddedNats, creds: RunCredentials) -> Any:
    """The run's newest PolicyPublished (None: none), read as its orchestrator user."""
    from treadle.proto.v1 import policy_pb2
    from treadle.services.bus import Bus

    cfg = nats_cfg(server, creds, "orchestrator")
    bus = await Bus.connect(cfg, creds.run, name=f"orch-{creds.run}", role="orchestrator")
    try:
        return await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
    finally:
        await bus.close()
