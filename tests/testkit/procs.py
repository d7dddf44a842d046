"""Process helpers for tests."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie stays when pid 1 does not reap)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def processes_under(path: Path) -> list[int]:
    """Running processes (not zombies, not this one) whose command line names something
    under ``path``: what a test's launch left behind."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if str(path) in cmdline.replace("\0", " ") and running(int(pid)):
            found.append(int(pid))
    return found


async def wait_healthy(proc: Any, target: str, service: str = "", timeout_s: float = 600) -> None:
    """Wait until the gRPC health of ``target`` (``service``, or the server's) says SERVING;
    ChildFailedError when ``proc`` (a ManagedProcess) dies first or is not healthy in time."""
    from treadle.services.rpc import check_health

    deadline = time.monotonic() + timeout_s
    while not await check_health(target, service):
        if proc.poll() is not None:
            raise proc.failure("died during startup")
        if time.monotonic() > deadline:
            raise proc.failure(f"not healthy after {timeout_s:.0f}s")
        await asyncio.sleep(0.5)
