"""The local runtime: programs run as plain child processes of the runner, in the work dir.

For development and trusted programs only: nothing is isolated. A program runs as the
runner's user, sees the runner's files and network, and can read what the runner can;
an environment whose programs are untrusted (model-written code, an agent with a shell)
belongs in the sandbox or a container. What it does keep:

    environment   only the basics of :data:`PASSED_ENV` from the runner's (PATH, HOME,
                  LANG, ...), plus the runtime's and the exec's ``env`` -- never the
                  runner's credentials or TREADLE_* settings
    wall_s        the program's whole process group is killed (it is a session leader)
    output_bytes  each stream capped; the group is killed beyond (OUTPUT_LIMIT)
    cpu_s, file_bytes
                  RLIMIT_CPU / RLIMIT_FSIZE of the program, set with ``prlimit`` right
                  after it starts (each process's own; its children inherit them): a
                  guard against accidents, not containment
    memory_bytes, processes, open_files, tmp_bytes, shm_bytes, work_bytes
                  not enforced (an address-space limit breaks runtimes that reserve
                  more than they use, Node's among them)

A process that leaves the program's session (a daemon) is not killed, and is not waited
for: the output read up to the program's exit is kept.

Not here: the sandbox (sandbox.py) and containers (container.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from treadle.env_runner.runtimes.base import (
    STOPPED_EARLY,
    Runtime,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    supervise,
    traced_run,
)

# what a local program inherits from the runner's environment (and nothing else)
PASSED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL",
              "LC_CTYPE", "TERM", "TZ", "TMPDIR")  # fmt: skip
DRAIN_GRACE_S = 1.0  # after the program's exit, how long an escaped daemon may hold its pipes
# trusted programs: by default only the harness's own time limits apply
LOCAL_LIMITS = SandboxLimits(wall_s=24 * 3600.0, cpu_s=24 * 3600)
ENFORCEMENT = {"user": "runner", "memory": "none", "processes": "none", "cpu": "rlimit",
               "tmp": "none", "work": "none", "network": "host"}  # fmt: skip


@dataclass
class LocalRuntime(Runtime):
    """Programs as child processes of the runner (module doc)."""

    kind: ClassVar[str] = "local"
    shares_host_loopback: ClassVar[bool] = True
    limits: SandboxLimits = LOCAL_LIMITS
    """Default: a day of wall and CPU time (the harness's timeout is what ends a program)."""
    network: bool = True
    """Always true: nothing is cut off locally (kept for the common surface)."""
    env: dict[str, str] = field(default_factory=dict)
    ro_paths: Sequence[str] = ()
    """Ignored: every path the runner reads is visible."""

    def __post_init__(self) -> None:
        if not self.network:
            raise ValueError(
                "the local runtime cannot cut programs off the network: use the sandbox "
                "or a container runtime"
            )

    async def exec(
        self,
        workdir: Path,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
        pass_fds: Sequence[int] = (),
        stop_when: asyncio.Event | None = None,
    ) -> SandboxResult:
        if not argv:
            raise ValueError("argv is empty: nothing to run")
        with traced_run("local", argv) as record:
            return record(await self._exec(workdir, argv, stdin, env, limits or self.limits,
                                           pass_fds, stop_when))  # fmt: skip

    async def _exec(
        self,
        workdir: Path,
        argv: Sequence[str],
        stdin: bytes | None,
        env: Mapping[str, str] | None,
        lim: SandboxLimits,
        pass_fds: Sequence[int],
        stop_when: asyncio.Event | None,
    ) -> SandboxResult:
        basics = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        full_env = {**basics, **self.env, **(env or {})}
        t0 = time.monotonic()
        # our own pipes for its output, not asyncio's: a daemon that leaves the program's
        # session may hold them open, and asyncio would not report the program's exit
        # before they close
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, cwd=workdir, env=full_env,
                    stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                    stdout=out_w, stderr=err_w, start_new_session=True, pass_fds=tuple(pass_fds),
                )  # fmt: skip
            except OSError as e:  # no such program, not executable: the program's outcome
                for fd in (out_r, err_r):
                    os.close(fd)
                message = f"cannot start {argv[0]}: {e.strerror or e}"
                return SandboxResult(SandboxStatus.EXIT_NONZERO, 127, b"", message.encode(),
                                     time.monotonic() - t0, message, dict(ENFORCEMENT))  # fmt: skip
        finally:
            for fd in (out_w, err_w, *pass_fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
        _set_rlimits(proc.pid, lim)

        async def stop() -> None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        loop = asyncio.get_running_loop()
        readers, transports = [], []
        for fd in (out_r, err_r):
            reader = asyncio.StreamReader(limit=1 << 20)
            transport, _ = await loop.connect_read_pipe(
                functools.partial(asyncio.StreamReaderProtocol, reader), os.fdopen(fd, "rb", 0)
            )
            readers.append(reader)
            transports.append(transport)
        try:
            out = await supervise(proc, lim, stdin, stop, streams=(readers[0], readers[1]),
                                  drain_grace_s=DRAIN_GRACE_S, stop_when=stop_when)  # fmt: skip
        finally:  # no process of the program's group outlives the call
            await stop()
            for transport in transports:
                transport.close()
        status, message = _classify(proc.returncode, out.timed_out, out.over_limit, lim)
        if out.stopped_early:
            status, message = SandboxStatus.SIGNALED, STOPPED_EARLY
        return SandboxResult(status, proc.returncode, out.stdout, out.stderr,
                             time.monotonic() - t0, message, dict(ENFORCEMENT))  # fmt: skip

    def python(self) -> str:
        return sys.executable

    def path(self, workdir: Path) -> str:
        return str(workdir)

    def describe(self) -> str:
        return "local (not isolated)"


def _set_rlimits(pid: int, lim: SandboxLimits) -> None:
    """The CPU-time and file-size limits of ``lim`` on the started program (it may have
    forked already: a guard, not containment)."""
    # CPU: SIGXCPU at the soft limit (CPU_LIMIT), SIGKILL a second later if ignored
    wanted = ((resource.RLIMIT_CPU, lim.cpu_s, lim.cpu_s + 1),
              (resource.RLIMIT_FSIZE, lim.file_bytes, lim.file_bytes))  # fmt: skip
    for which, soft, hard in wanted:
        with contextlib.suppress(OSError, ValueError):  # gone already, or above the hard limit
            resource.prlimit(pid, which, (soft, hard))


def _classify(
    rc: int | None, timed_out: bool, over_limit: str | None, lim: SandboxLimits
) -> tuple[SandboxStatus, str]:
    S = SandboxStatus
    if over_limit:
        return S.OUTPUT_LIMIT, f"{over_limit} exceeded {lim.output_bytes} bytes; killed"
    if timed_out:
        return S.TIMEOUT, f"still running after {lim.wall_s:g}s of wall time; killed"
    if rc == 0:
        return S.OK, ""
    if rc is not None and rc < 0:
        if -rc == signal.SIGXCPU:
            return S.CPU_LIMIT, f"used its {lim.cpu_s}s of CPU time; killed"
        with contextlib.suppress(ValueError):
            return S.SIGNALED, f"was killed by {signal.Signals(-rc).name}"
    return S.EXIT_NONZERO, f"exited with code {rc}"
