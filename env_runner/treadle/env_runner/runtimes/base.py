"""What every runtime shares: its limits, the result of a run, a workspace, supervision.

A *runtime* is where an environment's programs run -- a CLI agent, a solution's tests,
any program a harness, tool or reward starts. It is the third axis of an environment
(task set x harness x runtime): ``Environment(..., runtime="sandbox")``, overridable per
environment from the run's config (``[env_runner.runtimes.<env>]``, see ``runtimes/``).

    runtime = SandboxRuntime(SandboxLimits(wall_s=10))      # or LocalRuntime(), ContainerRuntime(image=...)
    async with await runtime.start() as ws:                 # a fresh work dir (start)
        ws.put("solution.py", code)                         # files in
        result = await ws.exec([runtime.python(), "solution.py"], stdin=b"...")   # exec, under the limits
        report = ws.get("report.json")                      # files out
    # the work dir is gone (teardown), unless start(keep=True)

Every runtime has the same surface:

    start(workdir=None, keep=False)   a Workspace over a fresh (or the given) host directory
    Workspace.exec(argv, stdin, env, limits, pass_fds)
                                      runs argv to its end in the work dir; every outcome
                                      of the program is a SandboxResult with a status
    Workspace.put / get               files in and out (relative paths; never through a
                                      symlink the program planted, never out of the dir)
    Workspace.close()                 teardown (also ``async with``)
    limits (SandboxLimits)            the default limits of each exec; exec may pass others
    network (bool)                    whether programs reach any network (default: none)
    python()                          the interpreter a program names to run Python there
    path(workdir)                     the work dir as the program sees it (/work, or the
                                      host path for the local runtime)

What enforces each limit differs by runtime (``SandboxResult.enforcement`` says, per
run): the bubblewrap sandbox and containers enforce all of them; the local runtime only
the wall time and the output caps (it isolates nothing: trusted programs only).

Not here: the runtimes themselves (local.py, sandbox.py, container.py), and what runs
in them (harnesses, rewards).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import enum
import os
import shutil
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import ClassVar, NamedTuple

STOP_GRACE_S = 5.0  # after stop_when is set, how long a program may take to end by itself
STOPPED_EARLY = f"stopped {STOP_GRACE_S:g}s after what it worked for had ended"


class SandboxStatus(enum.StrEnum):
    """How a program run in a runtime ended (metrics name it ``sandbox_<status>``)."""

    OK = "ok"
    EXIT_NONZERO = "exit_nonzero"
    TIMEOUT = "timeout"  # wall time
    CPU_LIMIT = "cpu_limit"
    MEMORY_LIMIT = "memory_limit"
    PROCESS_LIMIT = "process_limit"
    OUTPUT_LIMIT = "output_limit"
    SIGNALED = "signaled"
    DISK_LIMIT = "disk_limit"  # /work grew past work_bytes


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program run, in any runtime (each runtime's module says what
    enforces them there)."""

    wall_s: float = 60.0
    cpu_s: int = 60  # CPU time of the whole sandbox (and of each process)
    memory_bytes: int = 2 << 30  # the whole sandbox's memory, /tmp included (and each
    # process's address space); see the module doc for what enforces it
    processes: int = 128
    open_files: int = 256
    file_bytes: int = 256 << 20  # largest file a process may write
    output_bytes: int = 1 << 20  # stdout and stderr each; the program is killed beyond
    tmp_bytes: int = 256 << 20  # size of the private /tmp (a tmpfs)
    shm_bytes: int = 64 << 20  # size of the private /dev/shm (a tmpfs)
    work_bytes: int = 1 << 30  # total size of /work (checked, see the module doc)
    address_space_bytes: int | None = None  # each process's address space (RLIMIT_AS)
    # where the runtime sets one (the sandbox); None: memory_bytes. Programs that reserve
    # far more than they use (Bun, hence opencode; JVMs) need more; memory stays capped

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "address_space_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"limit {f.name} must be a positive number, not {value!r}")


@dataclass
class SandboxResult:
    """The outcome of one program run, in any runtime."""

    status: SandboxStatus
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    message: str = ""
    enforcement: dict[str, str] = field(default_factory=dict)
    """What enforced each limit on this run: ``user`` (``userns-uid:<uid>``), ``memory``,
    ``processes``, ``cpu`` (``cgroup-v1`` / ``cgroup-v2`` / ``scan`` / ``rlimit``),
    ``tmp`` (``tmpfs``), ``work`` (``scan``), ``userns`` (``seccomp`` / ``disabled``)."""
    removed: list[str] = field(default_factory=list)
    """Work-dir entries removed after the run (symlinks, FIFOs, devices), relative paths."""

    @property
    def ok(self) -> bool:
        return self.status == SandboxStatus.OK


@contextlib.contextmanager
def traced_run(
    runtime: str, argv: Sequence[str]
) -> Iterator[Callable[[SandboxResult], SandboxResult]]:
    """A ``sandbox.run`` span around one program run; call what it yields with the result
    (status, exit code and wall time become attributes)."""
    try:
        from treadle.services.telemetry import tracer
    except ImportError:  # a runner whose interpreter has only this module and the chassis's
        # errors (e.g. a sandbox driven by an unprivileged user's Python): no span
        yield lambda result: result
        return
    program = os.path.basename(str(argv[0])) if argv else ""
    with tracer(__name__).start_as_current_span(
        "sandbox.run", attributes={"treadle.runtime": runtime, "treadle.program": program}
    ) as span:

        def record(result: SandboxResult) -> SandboxResult:
            span.set_attribute("treadle.sandbox_status", str(result.status))
            span.set_attribute("treadle.wall_s", result.wall_s)
            if result.returncode is not None:
                span.set_attribute("process.exit.code", result.returncode)
            return result

        yield record


class Supervised(NamedTuple):
    """What :func:`supervise` saw of a program that has exited."""

    stdout: bytes  # at most output_bytes
    stderr: bytes  # at most output_bytes
    timed_out: bool  # still running after wall_s: stopped
    over_limit: str | None  # "stdout" or "stderr" when that stream passed output_bytes: stopped
    stopped_early: bool = False  # stopped after ``stop_when`` was set (and its grace)


async def supervise(
    proc: asyncio.subprocess.Process,
    limits: SandboxLimits,
    stdin: bytes | None,
    stop: Callable[[], Awaitable[None]],
    *,
    streams: tuple[asyncio.StreamReader, asyncio.StreamReader] | None = None,
    drain_grace_s: float = 5.0,
    stop_when: asyncio.Event | None = None,
) -> Supervised:
    """Run a started program to its end under ``limits``: write ``stdin`` (then close it),
    drain stdout and stderr (each cut at ``output_bytes``), and wait at most ``wall_s``.

    ``stop`` is how the runtime kills the program (:class:`Sandbox`: its process tree;
    ``ContainerRuntime``: ``<engine> kill``). It is called once when a stream passes its
    cap or the wall time runs out, and again whenever this coroutine ends early
    (cancelled, or failed) with the program still running: the program never outlives
    the call. Cancellation propagates after that stop. A process that escaped the stop
    and still holds a pipe open is waited for ``drain_grace_s`` after the program ended;
    the output read by then is kept. ``streams`` are the program's stdout and stderr when
    they are not asyncio's pipes of ``proc`` (the caller closes them). Once ``stop_when``
    is set (e.g. the rollout the program works for has ended), the program has
    :data:`STOP_GRACE_S` to end by itself, then it is stopped (``stopped_early``).
    """
    over: list[str] = []
    stopping: list[asyncio.Task[None]] = []

    def stop_once() -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(stop()))

    bufs = {"stdout": bytearray(), "stderr": bytearray()}

    async def drain(stream: asyncio.StreamReader | None, name: str) -> bytes:
        buf = bufs[name]
        while stream is not None and (chunk := await stream.read(65536)):
            room = limits.output_bytes - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room and not over:
                over.append(name)
                stop_once()
        return bytes(buf)

    out, err = streams or (proc.stdout, proc.stderr)
    readers = asyncio.gather(drain(out, "stdout"), drain(err, "stderr"))
    timed_out = False
    early: list[bool] = []

    async def stop_early(event: asyncio.Event) -> None:
        await event.wait()
        await asyncio.sleep(STOP_GRACE_S)
        if proc.returncode is None:
            early.append(True)
            stop_once()

    watcher = asyncio.ensure_future(stop_early(stop_when)) if stop_when is not None else None
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
            stdout, stderr = await asyncio.wait_for(readers, timeout=drain_grace_s)
        except TimeoutError:  # a grandchild that escaped the stop holds a pipe open
            readers.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await readers
            transport = getattr(proc, "_transport", None)  # close our ends of the pipes now
            if transport is not None:
                transport.close()
            stdout, stderr = bytes(bufs["stdout"]), bytes(bufs["stderr"])  # what came
    except BaseException:  # cancelled (or failed): nobody wants the output
        readers.cancel()
        if proc.returncode is None:
            await stop()
        with contextlib.suppress(asyncio.CancelledError):
            await readers  # retrieved, so asyncio does not log it as never retrieved
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    return Supervised(stdout, stderr, timed_out, over[0] if over else None, bool(early))


class Runtime(abc.ABC):
    """Where an environment's programs run (module doc). Subclasses are dataclasses with
    the fields ``limits``, ``network``, ``env`` and ``ro_paths``."""

    kind: ClassVar[str]
    """Its name in configs: "local", "sandbox", "container"."""
    passes_fds: ClassVar[bool] = True
    """Whether ``exec`` can hand the program open file descriptors (``pass_fds``)."""
    shares_host_loopback: ClassVar[bool] = False
    """Whether programs reach the runner's 127.0.0.1 (only the local runtime's do)."""
    limits: SandboxLimits
    network: bool
    env: dict[str, str]
    """Environment variables of every program, on top of the runtime's basics."""
    ro_paths: Sequence[str]
    """Host paths programs may read (read-only), beyond what the runtime shows anyway."""

    @abc.abstractmethod
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
        """Run ``argv`` in ``workdir`` to its end under ``limits`` (default: the
        runtime's). ``pass_fds`` are handed to the program and closed here once it has
        started (a runtime that cannot pass them raises ValueError). Once ``stop_when`` is
        set, the program has STOP_GRACE_S to end, then it is stopped (status SIGNALED,
        message saying so)."""

    @abc.abstractmethod
    def python(self) -> str:
        """The Python interpreter a program names to run Python in this runtime."""

    @abc.abstractmethod
    def path(self, workdir: Path) -> str:
        """``workdir`` as the programs see it."""

    def check(self) -> None:  # noqa: B027 (a runtime that needs nothing keeps it)
        """Raise (a ConfigError) when this machine cannot run it (no bubblewrap, no
        container engine); nothing when it can."""

    def with_ro_paths(self, paths: Sequence[str]) -> Runtime:
        """A copy that also lets programs read ``paths``."""
        if not paths:
            return self
        return dataclasses.replace(self, ro_paths=[*self.ro_paths, *paths])  # type: ignore[type-var]

    def with_limits(self, limits: SandboxLimits) -> Runtime:
        """A copy whose execs default to ``limits``."""
        return dataclasses.replace(self, limits=limits)  # type: ignore[type-var]

    async def start(self, workdir: Path | None = None, *, keep: bool = False) -> Workspace:
        """A workspace over ``workdir`` (created if missing), or over a fresh private
        directory; ``keep`` leaves it on disk at teardown."""
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"treadle-{self.kind}-"))
        else:
            workdir.mkdir(parents=True, exist_ok=True)
        return Workspace(self, workdir, keep=keep)

    def describe(self) -> str:
        """One line for logs: the kind and what is not the default."""
        return self.kind + (" (network on)" if self.network else "")


class Workspace:
    """A runtime's work dir and the programs run in it (module doc)."""

    def __init__(self, runtime: Runtime, workdir: Path, *, keep: bool = False):
        self.runtime = runtime
        self.workdir = workdir
        """The directory on the runner's side."""
        self.keep = keep
        self.closed = False

    @property
    def path(self) -> str:
        """The work dir as its programs see it."""
        return self.runtime.path(self.workdir)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
        limits: SandboxLimits | None = None,
        pass_fds: Sequence[int] = (),
        stop_when: asyncio.Event | None = None,
    ) -> SandboxResult:
        if self.closed:
            raise RuntimeError(f"workspace {self.workdir} is closed")
        return await self.runtime.exec(self.workdir, argv, stdin=stdin, env=env, limits=limits,
                                       pass_fds=pass_fds, stop_when=stop_when)  # fmt: skip

    def _parts(self, rel: str) -> tuple[str, ...]:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts or "." in parts:
            raise ValueError(f"{rel!r} is not a relative path inside the work dir")
        return parts

    def _open_parent(self, rel: str, *, make: bool) -> tuple[int, str]:
        """A directory fd of ``rel``'s parent and its last name, reached one component at
        a time from the work dir with O_NOFOLLOW: a link a program planted anywhere on the
        way (even one swapped in while this walks) is refused, never followed."""
        parts = self._parts(rel)
        fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i, part in enumerate(parts[:-1]):
                if make:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                try:
                    nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except (NotADirectoryError, OSError) as e:
                    if isinstance(e, FileNotFoundError):
                        raise
                    where = "/".join(parts[: i + 1])
                    raise ValueError(f"{rel!r}: {where} is a link or not a directory") from None
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return fd, parts[-1]

    def put(self, rel: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file into the work dir (parents made as needed)."""
        raw = data.encode() if isinstance(data, str) else data
        parent, name = self._open_parent(rel, make=True)
        try:
            # not truncated before it is known to be a regular file; O_NONBLOCK: a FIFO
            # planted there must not block the runner
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
            try:
                fd = os.open(name, flags, mode, dir_fd=parent)
            except OSError as e:  # ELOOP: the name is a link; ENXIO: a FIFO
                raise ValueError(f"{rel!r} cannot be written: {e.strerror}") from None
        finally:
            os.close(parent)
        with os.fdopen(fd, "wb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{rel!r} is not a regular file")
            os.set_blocking(f.fileno(), True)
            os.ftruncate(f.fileno(), 0)
            f.write(raw)

    def get(self, rel: str, max_bytes: int = 64 << 20) -> bytes:
        """A regular file of the work dir (FileNotFoundError when absent; ValueError when it
        is a link, not a regular file, or over ``max_bytes``)."""
        parent, name = self._open_parent(rel, make=False)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
            except FileNotFoundError:
                raise
            except OSError as e:  # ELOOP: the name is a link
                raise ValueError(f"{rel!r} cannot be read: {e.strerror}") from None
        finally:
            os.close(parent)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{rel!r} is not a regular file")
            if info.st_size > max_bytes:
                raise ValueError(f"{rel!r} holds {info.st_size} bytes, over {max_bytes}")
            return f.read(max_bytes + 1)[:max_bytes]

    async def close(self) -> None:
        """Teardown: the work dir goes, unless ``keep``."""
        if self.closed:
            return
        self.closed = True
        if not self.keep:
            await asyncio.to_thread(shutil.rmtree, self.workdir, True)

    async def __aenter__(self) -> Workspace:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
