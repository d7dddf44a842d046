"""The sandbox runtime against the attacks of the trust issue, each run for real, twice: by a root
runner (the program runs as nobody in its own user namespace; cgroups enforce memory,
processes and CPU time) and by an unprivileged runner (a driver run under ``setpriv`` as an
unused uid: the program runs as that uid in its own user namespace; the limits no cgroup
enforces are checked by scanning). Each test asserts the mechanism that contained it
(``SandboxResult.enforcement``).
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from testkit.paths import REPO_ROOT
from treadle.env_runner.runtimes.sandbox import (
    SandboxLimits,
    _Cgroups,
    bwrap_path,
    python_executable,
    python_runtime,
)

pytestmark = pytest.mark.integration

if os.geteuid() != 0:
    pytest.skip("these tests run the runner as root and as another uid", allow_module_level=True)

OTHER_UID = 64123  # the unprivileged runner (root runs nobody); must be unused
SETPRIV = shutil.which("setpriv")

# Runs one sandboxed program and prints its SandboxResult as JSON (argv[1]: the job).
DRIVER = """
import asyncio, json, sys
from pathlib import Path
from treadle.env_runner.runtimes.base import SandboxLimits
from treadle.env_runner.runtimes.sandbox import SandboxRuntime
job = json.loads(sys.argv[1])
runtime = SandboxRuntime(SandboxLimits(**job["limits"]))  # as an environment's runtime runs it
r = asyncio.run(runtime.exec(Path(job["workdir"]), [runtime.python(), "-c", job["code"]]))
print(json.dumps({"status": r.status.value, "message": r.message, "wall_s": r.wall_s,
                  "stdout": r.stdout.decode(errors="replace"),
                  "stderr": r.stderr.decode(errors="replace"),
                  "enforcement": r.enforcement, "removed": r.removed}))
"""


def world_reachable(path: str) -> bool:
    """Every directory above ``path`` is searchable and the file readable by anyone."""
    p = Path(path).resolve()
    return all(q.stat().st_mode & 0o001 for q in p.parents) and bool(p.stat().st_mode & 0o005)


def unprivileged_python() -> str | None:
    """An interpreter (>= 3.11) an unprivileged uid may run: ours if reachable, else the
    system's."""
    for candidate in (python_executable(), "/usr/bin/python3"):
        if not os.path.exists(candidate) or not world_reachable(candidate):
            continue
        version = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info >= (3, 11))"],
            capture_output=True,
            text=True,
        )
        if version.stdout.strip() == "True":
            return candidate
    return None


@dataclass
class Runner:
    """Runs sandboxed programs as ``mode`` ("root" or "unprivileged")."""

    mode: str
    base: Path  # holds the work dirs; owned by the runner's uid

    @property
    def uid(self) -> int:
        return 0 if self.mode == "root" else OTHER_UID

    @property
    def program_uid(self) -> int:
        return 65534 if self.mode == "root" else OTHER_UID

    @property
    def other_uid(self) -> int:
        """A user that is neither the runner nor the program."""
        return OTHER_UID if self.mode == "root" else 65534

    def command(self) -> tuple[list[str], dict[str, str]]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TREADLE_BWRAP": bwrap_path()}
        if self.mode == "root":
            return [sys.executable, "-c", DRIVER], {**os.environ, **env}
        python = unprivileged_python()
        assert python is not None
        assert SETPRIV is not None
        env["PYTHONPATH"] = f"{REPO_ROOT / 'env_runner'}:{REPO_ROOT / 'services'}"
        who = [f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
        return [SETPRIV, *who, python, "-c", DRIVER], env

    def start(self, code: str, name: str = "work", **limits: Any) -> subprocess.Popen[str]:
        workdir = self.base / name
        job = {"workdir": str(workdir), "code": textwrap.dedent(code),
               "limits": {"wall_s": 20, "cpu_s": 10, "memory_bytes": 512 << 20, "processes": 32,
                          **limits}}  # fmt: skip
        cmd, env = self.command()
        return subprocess.Popen(
            [*cmd, json.dumps(job)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, cwd="/",
        )  # fmt: skip

    def finish(self, proc: subprocess.Popen[str]) -> dict[str, Any]:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def run(self, code: str, name: str = "work", **limits: Any) -> dict[str, Any]:
        return self.finish(self.start(code, name, **limits))


def root_cgroups() -> dict[str, str]:
    """What a root runner's sandbox gets from cgroups here, per limit ("memory", "pids",
    "cpu" -> "cgroup-v1" / "cgroup-v2"): probed the way the sandbox does it."""
    cgroups = _Cgroups.create(SandboxLimits())
    if cgroups is None:
        return {}
    cgroups.remove()
    return dict.fromkeys(cgroups.dirs, f"cgroup-v{cgroups.version}")


def mechanism(r: Runner, limit: str, fallback: str = "scan") -> str:
    """The mechanism the sandbox must report for ``limit`` under runner ``r``."""
    return root_cgroups().get(limit, fallback) if r.mode == "root" else fallback


@pytest.fixture(params=["root", "unprivileged"])
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    mode = request.param
    if mode == "unprivileged":
        with pytest.raises(KeyError):
            pwd.getpwuid(OTHER_UID)  # the uid must be nobody's
        if SETPRIV is None or unprivileged_python() is None:
            pytest.skip("no setpriv, or no Python >= 3.11 an unprivileged user can run")
        if not world_reachable(bwrap_path()):
            pytest.skip(f"{bwrap_path()} is not reachable by an unprivileged user")
    base = Path(tempfile.mkdtemp(prefix="treadle-sec-"))
    try:
        if mode == "unprivileged":
            os.chown(base, OTHER_UID, OTHER_UID)
        yield Runner(mode, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_sandbox_security_program_is_unprivileged_and_cannot_remount(runner: Runner) -> None:
    name = f"pwned-{os.getpid()}"
    prefix = python_runtime()[0] if python_runtime() else "/usr/lib"
    code = f"""
    import ctypes, errno, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
    out = {{"uid": os.getuid(), "euid": os.geteuid(), "gid": os.getgid(),
            "groups": os.getgroups(), "cap_eff": status["CapEff"].strip(),
            "cap_prm": status["CapPrm"].strip(), "nnp": status["NoNewPrivs"].strip()}}
    def attempt(name, rc):
        out[name] = "ok" if rc == 0 else errno.errorcode[ctypes.get_errno()]
    MS_REMOUNT, MS_BIND = 0x20, 0x1000
    for target in ("/usr", {prefix!r}, "/work", "/"):
        attempt("remount " + target, libc.mount(b"none", target.encode(), None, MS_REMOUNT | MS_BIND, None))
    attempt("unshare user", libc.unshare(0x10000000))
    attempt("unshare mount", libc.unshare(0x00020000))
    attempt("setuid 0", libc.setuid(0))
    attempt("chroot", libc.chroot(b"/tmp"))
    for path in ("/usr/{name}", {prefix!r} + "/{name}", "/etc/{name}"):
        try:
            open(path, "w").write("x")
            out["write " + path] = "ok"
        except OSError as e:
            out["write " + path] = errno.errorcode[e.errno]
    print(json.dumps(out))
    """
    r = runner.run(code)
    assert r["status"] == "ok", r
    out = json.loads(r["stdout"])
    assert (out["uid"], out["euid"], out["gid"]) == (runner.program_uid,) * 3
    assert out["groups"] in ([], [runner.program_uid])
    assert int(out["cap_eff"], 16) == 0
    assert int(out["cap_prm"], 16) == 0
    assert out["nnp"] == "1"
    attempts = {k: v for k, v in out.items() if k.split()[0] in ("remount", "unshare", "setuid", "chroot", "write")}  # fmt: skip
    assert len(attempts) == 11
    assert [k for k, v in attempts.items() if v == "ok"] == [], attempts
    assert not Path(f"/usr/{name}").exists()
    assert not Path(prefix, name).exists()
    assert r["enforcement"]["user"] == f"userns-uid:{runner.program_uid}"
    assert r["enforcement"]["userns"].startswith("seccomp")


def test_sandbox_security_planted_setuid_binary_never_grants_root(runner: Runner) -> None:
    code = """
    import os, shutil, stat, time
    shutil.copy("/usr/bin/id", "/work/id")
    data = open("/usr/bin/id", "rb").read()
    attempts = {
        "chmod": lambda: os.chmod("/work/id", 0o6755),
        "fchmod": lambda: os.fchmod(os.open("/work/id", os.O_RDONLY), 0o4755),
        "open O_CREAT 04755": lambda: os.write(os.open("/work/id2", os.O_CREAT | os.O_WRONLY, 0o4755), data),
        "mknod 02755": lambda: os.mknod("/work/id3", 0o2755 | stat.S_IFREG),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            print("allowed", name)
        except OSError as e:
            print("refused", name, e.errno)
    os.chmod("/work/id", 0o755)
    os.chmod("/work", 0o777)  # try to make it reachable for others during the run
    open("/work/planted", "w").close()
    time.sleep(4)
    """
    proc = runner.start(code)
    planted = runner.base / "work" / "id"
    as_other = [SETPRIV or "setpriv", f"--reuid={runner.other_uid}",
                f"--regid={runner.other_uid}", "--clear-groups", str(planted), "-u"]  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not (runner.base / "work" / "planted").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        during = planted.stat()
        os.chmod(runner.base, 0o755)  # as reachable as a host path can be
        ran_during = subprocess.run(as_other, capture_output=True, text=True)
        r = runner.finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert r["status"] == "ok", r
    # setuid/setgid bits are refused (seccomp), and the file is the program's uid's anyway
    assert r["stdout"].count("refused") == 4, r["stdout"]
    assert not during.st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert during.st_uid == runner.program_uid != 0
    assert ran_during.stdout.strip() != "0"
    # afterwards: the runner's file, setuid and setgid bits cleared, the dir 0700 again
    after = planted.stat()
    assert after.st_uid == runner.uid
    assert not after.st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert stat.S_IMODE((runner.base / "work").stat().st_mode) == 0o700
    os.chmod(runner.base / "work", 0o755)
    ran_after = subprocess.run(as_other, capture_output=True, text=True)
    assert ran_after.stdout.strip() == str(runner.other_uid), ran_after


def test_sandbox_security_memory_limit_covers_all_processes(runner: Runner) -> None:
    code = """
    import os, time
    for _ in range(4):
        if os.fork() == 0:
            block = b"x" * (400 << 20)  # touched: resident
            time.sleep(10)
            os._exit(0)
    for _ in range(4):
        os.wait()
    """
    r = runner.run(code, memory_bytes=512 << 20)
    used = mechanism(runner, "memory")
    assert r["enforcement"]["memory"] == used
    assert r["status"] == "memory_limit", r
    assert ("OOM-killed" if used.startswith("cgroup") else "resident sets") in r["message"]
    assert r["wall_s"] < 10  # killed, not waited for


def test_sandbox_security_tmp_and_shm_are_capped_tmpfs(runner: Runner) -> None:
    code = """
    import errno
    for path in ("/tmp/fill", "/dev/shm/fill"):
        written = 0
        try:
            with open(path, "wb") as f:
                for _ in range(96):  # 1.5 GiB
                    f.write(b"x" * (16 << 20))
                    f.flush()
                    written += 16 << 20
        except OSError as e:
            print("stopped", path, errno.errorcode[e.errno], written)
    for path in ("/dev/x", "/x"):
        try:
            open(path, "w").write("x")
            print("wrote", path)
        except OSError as e:
            print("refused", path)
    """
    r = runner.run(code, tmp_bytes=64 << 20, shm_bytes=32 << 20, file_bytes=2 << 30)
    assert r["enforcement"]["tmp"] == "tmpfs"
    assert r["status"] == "ok", r
    lines = [line.split() for line in r["stdout"].splitlines()]
    assert lines[0][:3] == ["stopped", "/tmp/fill", "ENOSPC"], r["stdout"]
    assert int(lines[0][3]) <= 64 << 20
    assert lines[1][:3] == ["stopped", "/dev/shm/fill", "ENOSPC"], r["stdout"]
    assert int(lines[1][3]) <= 32 << 20
    assert lines[2:] == [["refused", "/dev/x"], ["refused", "/x"]]


def test_sandbox_security_tmp_counts_against_the_memory_limit(runner: Runner) -> None:
    code = """
    import time
    with open("/tmp/fill", "wb") as f:
        for _ in range(32):  # 512 MiB into a 1 GiB tmpfs, with 256 MiB of memory
            f.write(b"x" * (16 << 20))
    time.sleep(5)  # held: a check between writes or after them sees it
    print("kept 512 MiB")
    """
    r = runner.run(code, tmp_bytes=1 << 30, memory_bytes=256 << 20, file_bytes=2 << 30)
    used = mechanism(runner, "memory")
    assert r["enforcement"]["memory"] == used
    assert r["status"] == "memory_limit", r
    assert ("OOM-killed" if used.startswith("cgroup") else "/dev/shm") in r["message"]
    assert "kept" not in r["stdout"]


def test_sandbox_security_work_total_size_is_limited(runner: Runner) -> None:
    code = """
    for i in range(40):  # 40 x 16 MiB: each file within file_bytes
        with open(f"/work/f{i}", "wb") as f:
            f.write(b"x" * (16 << 20))
    print("wrote 640 MiB")
    """
    r = runner.run(code, work_bytes=64 << 20, file_bytes=16 << 20)
    files = list((runner.base / "work").glob("f*"))
    size = sum(f.stat().st_blocks * 512 for f in files)
    assert r["enforcement"]["work"] == "scan"
    assert r["status"] == "disk_limit", r
    assert "wrote" not in r["stdout"]
    assert len(files) < 40
    assert size < 640 << 20


def test_sandbox_security_symlinks_and_fifos_never_reach_host_readers(runner: Runner) -> None:
    code = """
    import os
    os.symlink("/etc/shadow", "/work/shadow")
    os.symlink("/etc", "/work/etc")
    os.makedirs("/work/sub/deeper")
    os.symlink("../../../../../../etc/shadow", "/work/sub/deeper/rel")
    os.mkfifo("/work/sub/fifo")
    open("/work/sub/result.txt", "w").write("fine")
    """
    r = runner.run(code)
    work = runner.base / "work"
    assert r["status"] == "ok", r
    assert r["removed"] == ["etc", "shadow", "sub/deeper/rel", "sub/fifo"]
    for path in ("shadow", "etc", "sub/deeper/rel", "sub/fifo"):
        assert not os.path.lexists(work / path)
    with pytest.raises(FileNotFoundError):
        (work / "shadow").read_text()
    assert (work / "sub" / "result.txt").read_text() == "fine"
    owners = {p.lstat().st_uid for p in work.rglob("*")}
    assert owners == {runner.uid}


def test_sandbox_security_cpu_time_counts_every_process(runner: Runner) -> None:
    code = """
    import os
    for _ in range(4):
        if os.fork() == 0:
            while True:
                pass
    while True:
        pass
    """
    r = runner.run(code, cpu_s=2, wall_s=30)
    assert r["enforcement"]["cpu"] == mechanism(runner, "cpu")
    assert r["status"] == "cpu_limit", r
    assert "the sandbox used" in r["message"]  # the whole sandbox, not one process's rlimit


def test_sandbox_security_fork_bomb_hits_the_process_limit(runner: Runner) -> None:
    r = runner.run("import os\nwhile True:\n    os.fork()", processes=32, wall_s=10)
    assert r["enforcement"]["processes"] == mechanism(runner, "pids", "rlimit")
    assert r["status"] in ("process_limit", "timeout"), r
