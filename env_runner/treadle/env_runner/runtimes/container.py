"""A container runtime for untrusted rollout code: each run is a fresh Docker/Podman container.

The compose deployment's counterpart of :class:`~treadle.env_runner.runtimes.sandbox.Sandbox`, with
the same calling shape (``workdir``, :class:`SandboxLimits`, ``network``, ``env``,
``ro_paths``; ``await run(argv, stdin=...)`` -> :class:`SandboxResult`), so a harness can
take either. Each run is one ``<engine> run --rm`` of ``image``:

    isolation   --network none (unless ``network``), --read-only root, --tmpfs /tmp,
                --cap-drop ALL, --security-opt no-new-privileges, a non-root --user,
                the work dir bind-mounted at /work (writable, like /tmp and the engine's
                /dev/shm; nothing else is),
                ``ro_paths`` bind-mounted read-only at their own paths
    limits      wall_s     the runner kills the container (``<engine> kill <name>``); it
                           counts from the ``run`` call, so container start (and a pull)
                           is included
                memory     --memory = --memory-swap (the container's whole RAM, no swap)
                processes  --pids-limit
                cpu_s, open_files, file_bytes
                           --ulimit cpu / nofile / fsize (and core=0)
                output     each stream capped at ``output_bytes``; the container is killed
                ``cpus``   --cpus (a field here: SandboxLimits has no CPU share)
    env         only HOME=/work, TMPDIR=/tmp, LANG=C.UTF-8 and ``env``, each as
                ``--env K=V`` (the image's own ENV, e.g. its PATH, stays; the runner's
                environment never enters)

    container = Container(workdir, SandboxLimits(wall_s=10), image="python:3.11-slim")
    result = await container.run(["python", "solution_test.py"])  # argv as the image sees it
    result.status, result.stdout

The engine is ``engine`` (a name or path), else ``TREADLE_CONTAINER_ENGINE``, else
``docker`` or ``podman`` on PATH; none is :class:`ContainerUnavailableError` (a
``ConfigError`` and a ``SandboxUnavailableError``). An engine that cannot run the
container at all (daemon down, image missing: ``docker run`` exits 125 with its own error)
is :class:`ContainerEngineError` — an infrastructure failure, never scored as the
program's; so is exit 126 with the OCI runtime's own error (the container could not be
created: podman with runc says "runc create failed", e.g. for an rlimit the host
refuses). Every outcome of the program itself is a :class:`SandboxResult` with a status.

Exit 137 (SIGKILL) that the runner did not cause is asked of ``<engine> inspect``
(``.State.OOMKilled``). With ``--rm`` Docker has usually removed the container by the time
``docker run`` returns, so the answer is mostly unavailable; the status is then
MEMORY_LIMIT, the likely cause, and its message says it was inferred.

Deployment notes. The work dir is passed to the engine as a path; with a sibling engine
(the host's Docker socket mounted into the runner's container) the engine resolves it on
the *host*, so work dirs must live on a host directory mounted at the same path (see
compose/README.md). Rootless Podman maps uids: pass ``extra_args=["--userns=keep-id"]``.

What this module does not do: build or pull-manage images (``--pull`` policy only), nor
provide the isolation, which is Docker's (or Podman's). The unit tests drive a fake
engine that records the argv and emulates ``run``/``kill``/``inspect``, and check that the
real Docker CLI accepts that argv. Where Debian's ``podman`` and ``runc`` are installed,
``tests/integration/test_container_engine.py`` runs this runtime against real rootful
Podman 4.3 (an exploded root filesystem, the host's /usr read-only) and checks the
containment: uid 65534, no network, a read-only root, memory and wall-time limits, and a
CLI agent reaching its model through the relay. Podman there needs ``--runtime runc``
(crun refuses hybrid cgroups) and an explicit ``--ulimit nproc`` within the host's limit
(its default is above it): pass both in ``extra_args``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import time
import uuid
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
from treadle.env_runner.runtimes.sandbox import SandboxUnavailableError
from treadle.services.errors import ConfigError, TreadleError

ENGINE_ENV = "TREADLE_CONTAINER_ENGINE"
ENGINES = ("docker", "podman")
DEFAULT_IMAGE = "python:3.11-slim"
CONTAINER_WORKDIR = "/work"
NOBODY = "65534:65534"
LABEL = "treadle.runtime=container"
PULL_POLICIES = ("always", "missing", "never")
KILL_GRACE_S = 5.0  # after `<engine> kill`, how long `<engine> run` may take to return
ENGINE_CALL_TIMEOUT_S = 30.0  # one kill / inspect / rm call
ENGINE_FAILED = 125  # `docker run` / `podman run`: the engine itself failed
CANNOT_INVOKE = 126  # the engine could not start the container's process (also its OCI
# runtime failing to create the container: podman's "runc create failed")
OCI_FAILURE_MARKERS = (b"OCI runtime", b"OCI permission denied", b"runc create failed",
                       b"crun: ", b"error during container init")  # fmt: skip
# what the engines print when `run` itself failed (as opposed to the program exiting 125)
ENGINE_ERROR_MARKERS = (
    b"Error response from daemon",
    b"Cannot connect to the Docker daemon",
    b"Unable to find image",
    b"docker: ",
    b"Error: ",  # podman
)
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ContainerUnavailableError(SandboxUnavailableError, ConfigError):
    """No container engine binary: install Docker or Podman, or set TREADLE_CONTAINER_ENGINE."""


class ContainerEngineError(TreadleError):
    """The engine could not run the container (daemon unreachable, image missing, ...)."""


def engine_path(engine: str | None = None) -> str:
    """The engine binary: ``engine``, ``TREADLE_CONTAINER_ENGINE``, or docker/podman on PATH."""
    wanted = engine or os.environ.get(ENGINE_ENV)
    if wanted:
        if found := shutil.which(wanted):
            return found
        source = "engine" if engine else ENGINE_ENV
        raise ContainerUnavailableError(
            f"container engine {wanted!r} ({source}) is not an executable on PATH: "
            "install Docker or Podman, or point TREADLE_CONTAINER_ENGINE at one"
        )
    for name in ENGINES:
        if found := shutil.which(name):
            return found
    raise ContainerUnavailableError(
        "no container engine: neither `docker` nor `podman` is on PATH; install one, "
        "or set TREADLE_CONTAINER_ENGINE to its path"
    )


@dataclass
class Container:
    """Runs programs in fresh containers over one work dir (module doc)."""

    workdir: Path
    """Host directory mounted read-write at /work (created if missing)."""
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: bool = False
    """Give the container the engine's default network; otherwise --network none."""
    env: dict[str, str] = field(default_factory=dict)
    """The program's environment, on top of HOME=/work, TMPDIR=/tmp, LANG=C.UTF-8."""
    ro_paths: Sequence[str] = ()
    """Host paths bind-mounted read-only at the same path inside."""
    image: str = DEFAULT_IMAGE
    """Image to run; argv is resolved inside it (``python``, not the runner's interpreter)."""
    engine: str | None = None
    """Engine binary name or path; None: TREADLE_CONTAINER_ENGINE, else docker, else podman."""
    user: str | None = None
    """uid:gid inside; None: the runner's own, or 65534:65534 (nobody) when the runner is
    root. Root is refused. As root, the runner hands the work dir to this uid:gid."""
    cpus: float = 1.0
    """CPU share (--cpus), in cores."""
    tmp_bytes: int = 64 << 20
    """Size of the private /tmp (tmpfs; it counts against the memory limit)."""
    pull: str = "missing"
    """--pull policy: always, missing or never. Pulling counts against wall_s."""
    extra_args: Sequence[str] = ()
    """More engine flags, placed before the image (e.g. --userns=keep-id for rootless Podman)."""

    def __post_init__(self) -> None:
        if self.pull not in PULL_POLICIES:
            raise ConfigError(f"pull must be one of {', '.join(PULL_POLICIES)}, not {self.pull!r}")
        if not self.image or self.image.startswith("-") or any(c.isspace() for c in self.image):
            raise ConfigError(f"image {self.image!r} is not an image reference")
        if self.cpus <= 0 or self.tmp_bytes <= 0:
            raise ConfigError("cpus and tmp_bytes must be positive")
        for key, value in self.env.items():
            if not ENV_NAME_RE.match(key) or "\0" in value:
                raise ConfigError(f"env {key!r}: not a valid environment variable")
        if self.run_as().split(":", 1)[0] in ("0", "root"):
            raise ConfigError("a container runtime never runs its program as root (user)")

    def run_as(self) -> str:
        """The --user value."""
        if self.user is not None:
            return self.user
        return NOBODY if os.getuid() == 0 else f"{os.getuid()}:{os.getgid()}"

    def engine_argv(
        self, argv: Sequence[str], *, name: str, engine: str | None = None, stdin: bool = False
    ) -> list[str]:
        """The full ``<engine> run ...`` command line of one run named ``name``."""
        if not argv:
            raise ValueError("argv is empty: nothing to run in the container")
        lim = self.limits
        args = [engine or engine_path(self.engine), "run", "--rm", "--name", name]
        args += ["--label", LABEL, "--pull", self.pull, "--quiet", "--log-driver", "none"]
        if stdin:
            args.append("--interactive")
        if not self.network:
            args += ["--network", "none"]
        args += ["--read-only", "--tmpfs", f"/tmp:rw,nosuid,nodev,size={self.tmp_bytes}"]
        args += ["--mount", _bind(self.workdir.resolve(), CONTAINER_WORKDIR, readonly=False)]
        for path in self.ro_paths:
            args += ["--mount", _bind(Path(path), path, readonly=True)]
        args += ["--workdir", CONTAINER_WORKDIR, "--user", self.run_as()]
        args += ["--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--init"]
        args += ["--memory", str(lim.memory_bytes), "--memory-swap", str(lim.memory_bytes)]
        args += ["--pids-limit", str(lim.processes), "--cpus", f"{self.cpus:g}"]
        args += ["--ulimit", f"nofile={lim.open_files}:{lim.open_files}"]
        args += ["--ulimit", f"cpu={lim.cpu_s}:{lim.cpu_s + 1}"]
        args += ["--ulimit", f"fsize={lim.file_bytes}:{lim.file_bytes}"]
        args += ["--ulimit", "core=0:0"]
        env = {"HOME": CONTAINER_WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8", **self.env}
        for key, value in env.items():
            args += ["--env", f"{key}={value}"]
        return [*args, *self.extra_args, "--", self.image, *argv]

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        stop_when: asyncio.Event | None = None,
    ) -> SandboxResult:
        with traced_run("container", argv) as record:
            return record(await self._run(argv, stdin, stop_when))

    async def _run(
        self, argv: Sequence[str], stdin: bytes | None, stop_when: asyncio.Event | None
    ) -> SandboxResult:
        engine = engine_path(self.engine)
        self.workdir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._hand_over_workdir)
        name = f"treadle-{uuid.uuid4().hex[:12]}"
        cmd = self.engine_argv(argv, name=name, engine=engine, stdin=stdin is not None)
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        # the stop kills the container, then its client: the daemon owns the container, and
        # it stops it also when this call is cancelled (no container outlives its run)
        out = await supervise(proc, self.limits, stdin, lambda: _stop(engine, name, proc),
                              stop_when=stop_when)  # fmt: skip
        wall = time.monotonic() - t0
        rc = proc.returncode
        stopped = out.over_limit is not None or out.timed_out or out.stopped_early
        if rc in (ENGINE_FAILED, CANNOT_INVOKE) and not stopped:
            tail = out.stderr[-2000:]
            markers = ENGINE_ERROR_MARKERS if rc == ENGINE_FAILED else OCI_FAILURE_MARKERS
            if any(marker in tail for marker in markers):
                raise ContainerEngineError(
                    f"{engine} could not run {self.image!r}: "
                    f"{tail.decode(errors='replace').strip()}"
                )
        oom: bool | None = None
        if rc == 128 + signal.SIGKILL and not stopped:
            oom = await _oom_killed(engine, name)
        status, message = _classify(rc, out.stderr, out.timed_out, out.over_limit, oom, self.limits)
        if out.stopped_early:
            status, message = SandboxStatus.SIGNALED, STOPPED_EARLY
        return SandboxResult(status, rc, out.stdout, out.stderr, wall, message)

    def _hand_over_workdir(self) -> None:
        """As root, give the work dir to the container's uid:gid so the program can write it
        (files it creates stay readable and removable by the root runner)."""
        uid_gid = self.run_as().split(":")
        if os.geteuid() != 0 or not all(p.isdigit() for p in uid_gid):
            return
        uid, gid = int(uid_gid[0]), int(uid_gid[-1])
        for root, dirs, files in os.walk(self.workdir):
            for entry in (root, *(os.path.join(root, n) for n in (*dirs, *files))):
                os.chown(entry, uid, gid, follow_symlinks=False)


@dataclass
class ContainerRuntime(Runtime):
    """Containers as an environment's runtime: each exec is a fresh :class:`Container`
    run of ``image`` over the workspace's directory (at /work inside). The image must
    hold what the programs run (``python()`` is its ``python3``). It cannot hand programs
    open file descriptors."""

    kind: ClassVar[str] = "container"
    passes_fds: ClassVar[bool] = False
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ro_paths: Sequence[str] = ()
    image: str = DEFAULT_IMAGE
    engine: str | None = None
    user: str | None = None
    cpus: float = 1.0
    pull: str = "missing"
    extra_args: Sequence[str] = ()
    python_path: str = "python3"
    """The interpreter's name or path inside the image."""

    def __post_init__(self) -> None:
        self._container(Path("/"))  # checks the settings now

    def _container(self, workdir: Path, limits: SandboxLimits | None = None,
                   env: Mapping[str, str] | None = None) -> Container:  # fmt: skip
        return Container(
            workdir, limits or self.limits, self.network, {**self.env, **(env or {})},
            self.ro_paths, self.image, self.engine, self.user, self.cpus,
            tmp_bytes=(limits or self.limits).tmp_bytes, pull=self.pull,
            extra_args=self.extra_args,
        )  # fmt: skip

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
        if pass_fds:
            raise ValueError("the container runtime cannot hand programs file descriptors")
        return await self._container(workdir, limits, env).run(
            argv, stdin=stdin, stop_when=stop_when
        )

    def python(self) -> str:
        return self.python_path

    def path(self, workdir: Path) -> str:
        return CONTAINER_WORKDIR

    def check(self) -> None:
        engine_path(self.engine)

    def describe(self) -> str:
        return f"container {self.image}" + (" (network on)" if self.network else "")


def _bind(source: Path, target: str, *, readonly: bool) -> str:
    """A --mount value; refuses paths the engines' CSV parsing would split."""
    for path in (str(source), target):
        if any(c in path for c in ',"\n') or not path.startswith("/"):
            raise ConfigError(f'cannot bind-mount {path!r}: absolute paths without , or " only')
    spec = f"type=bind,source={source},target={target}"
    return f"{spec},readonly=true" if readonly else spec


async def _engine_call(engine: str, *args: str) -> tuple[int | None, bytes]:
    """Run ``engine *args`` (kill, inspect, rm): its exit code and stdout; None on a hang."""
    proc = await asyncio.create_subprocess_exec(
        engine,
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), ENGINE_CALL_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None, b""
    return proc.returncode, out


async def _stop(engine: str, name: str, proc: asyncio.subprocess.Process) -> None:
    """Kill the container ``name``, then its ``<engine> run`` client. Killing the client alone
    would leave the container running: the daemon owns it."""
    await _engine_call(engine, "kill", name)  # "no such container" when not started yet
    try:
        await asyncio.wait_for(proc.wait(), KILL_GRACE_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    # a container created but never started is not removed by --rm
    await _engine_call(engine, "rm", "--force", name)


async def _oom_killed(engine: str, name: str) -> bool | None:
    """``.State.OOMKilled`` of the container, None when the engine no longer has it."""
    rc, out = await _engine_call(engine, "inspect", "--format", "{{.State.OOMKilled}}", name)
    answer = out.strip().lower()
    if rc != 0 or answer not in (b"true", b"false"):
        return None
    return answer == b"true"


def _classify(
    rc: int | None,
    stderr: bytes,
    timed_out: bool,
    over_limit: str | None,
    oom: bool | None,
    lim: SandboxLimits,
) -> tuple[SandboxStatus, str]:
    S = SandboxStatus
    if over_limit:
        return S.OUTPUT_LIMIT, f"{over_limit} exceeded {lim.output_bytes} bytes; container killed"
    if timed_out:
        return S.TIMEOUT, f"still running after {lim.wall_s:g}s of wall time; container killed"
    if rc == 128 + signal.SIGKILL and oom is not False:
        if oom:
            return S.MEMORY_LIMIT, f"OOM-killed at its {lim.memory_bytes} byte memory limit"
        return S.MEMORY_LIMIT, (
            f"killed by SIGKILL (exit {rc}) and the engine had already removed the container, "
            f"so OOMKilled could not be read; inferred: its {lim.memory_bytes} byte memory limit"
        )
    sig = rc - 128 if rc is not None and rc > 128 else 0  # engines report 128 + signal
    if sig == signal.SIGXCPU:
        return S.CPU_LIMIT, f"used its {lim.cpu_s}s of CPU time; killed"
    tail = stderr[-4000:]
    if b"MemoryError" in tail or b"Cannot allocate memory" in tail or b"std::bad_alloc" in tail:
        return S.MEMORY_LIMIT, f"ran out of memory (limit {lim.memory_bytes} bytes)"
    if b"Resource temporarily unavailable" in tail or b"BlockingIOError" in tail:
        return S.PROCESS_LIMIT, f"hit the limit of {lim.processes} processes"
    if rc == 0:
        return S.OK, ""
    if sig:
        with contextlib.suppress(ValueError):
            return S.SIGNALED, f"killed by {signal.Signals(sig).name}"
    return S.EXIT_NONZERO, f"exited with code {rc}"
