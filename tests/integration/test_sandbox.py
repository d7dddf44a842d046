"""The bubblewrap sandbox against hostile programs: each is contained, ends with a clear
status, and the sandbox keeps running other programs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path

import pytest

from testkit.grpc_busy import grpc_busy
from treadle.env_runner.runtimes import sandbox as sandbox_module
from treadle.env_runner.runtimes.base import SandboxLimits, SandboxResult, SandboxStatus
from treadle.env_runner.runtimes.sandbox import Sandbox, python_executable, python_runtime

pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(wall_s=10, cpu_s=3, memory_bytes=512 << 20, processes=32)


def run_py(tmp_path: Path, code: str) -> SandboxResult:
    sandbox = Sandbox(tmp_path / "work", LIMITS, ro_paths=python_runtime())
    return asyncio.run(sandbox.run([python_executable(), "-c", code]))


def test_sandbox_runs_a_program_in_its_own_workdir(tmp_path: Path) -> None:
    r = run_py(tmp_path, "open('out.txt', 'w').write('hi'); import os; print(os.getcwd())")
    assert r.status == SandboxStatus.OK, r.stderr
    assert r.stdout == b"/work\n"
    assert (tmp_path / "work" / "out.txt").read_text() == "hi"


def test_sandbox_program_reads_the_system_files_it_is_given(tmp_path: Path) -> None:
    """As nobody (a root runner) too: /etc holds only what the sandbox binds, readable
    (TLS settings and certificates; a Node.js program fails at start without them)."""
    code = """
import json, os
print(json.dumps(sorted(os.listdir('/etc'))))
print(len(open('/etc/ssl/openssl.cnf').read()) > 0, len(os.listdir('/etc/ssl/certs')) > 0)
print(os.path.exists('/etc/shadow'), os.path.exists('/etc/passwd'))
"""
    r = run_py(tmp_path, code)
    assert r.status == SandboxStatus.OK, r.stderr
    listing, readable, secrets = r.stdout.decode().splitlines()
    assert set(json.loads(listing)) <= {"ld.so.cache", "localtime", "alternatives", "ssl"}
    assert readable == "True True"
    assert secrets == "False False"


def test_sandbox_has_no_network(tmp_path: Path) -> None:
    with socket.socket() as server:  # a server on the host's loopback
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        r = run_py(
            tmp_path, f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3)"
        )
    assert r.status == SandboxStatus.EXIT_NONZERO
    assert b"ConnectionRefusedError" in r.stderr or b"unreachable" in r.stderr


def test_sandbox_cannot_write_outside_its_dir(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    code = f"""
import os
import re
for path in [{str(outside)!r}, '/usr/pwned', '/etc/pwned', '/pwned']:
    try:
        open(path, 'w').write('x')
        print('wrote', path)
    except OSError as e:
        print('refused', path, e.errno)
open('/tmp/private', 'w').write('x')  # its own tmpfs: allowed, never the host's /tmp
"""
    r = run_py(tmp_path, code)
    assert r.status == SandboxStatus.OK, r.stderr
    assert b"wrote" not in r.stdout
    assert r.stdout.count(b"refused") == 4
    assert not outside.exists()
    assert not Path("/tmp/private").exists()


def test_sandbox_cannot_read_host_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_TEST_SECRET", "s3cret")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    home = Path.home()
    code = f"""
import os
import re
print(sorted(os.environ))
print('secret' if 's3cret' in repr(dict(os.environ)) else 'no-env')
for path in [{str(secret)!r}, {str(home / ".bashrc")!r}, '/etc/shadow', '/proc/1/environ']:
    try:
        data = open(path).read()
        print('read', path, 's3cret' in data)
    except OSError as e:
        print('refused', path, e.errno)
"""
    r = run_py(tmp_path, code)
    out = r.stdout.decode()
    assert r.status == SandboxStatus.OK, r.stderr
    assert "no-env" in out
    assert "s3cret" not in out
    assert f"refused {secret}" in out
    assert f"refused {home / '.bashrc'}" in out
    assert "refused /etc/shadow" in out
    assert "True" not in out  # /proc/1 is the sandbox's own init: nothing of the host


def test_sandbox_fork_bomb_hits_the_process_limit(tmp_path: Path) -> None:
    r = run_py(tmp_path, "import os\nwhile True: os.fork()")
    assert r.status in (SandboxStatus.PROCESS_LIMIT, SandboxStatus.TIMEOUT), r.stderr
    assert r.message


def test_sandbox_memory_bomb_is_a_memory_limit(tmp_path: Path) -> None:
    r = run_py(tmp_path, "blocks = []\nwhile True: blocks.append(bytearray(64 << 20))")
    assert r.status == SandboxStatus.MEMORY_LIMIT, r.stderr
    # out of address space (RLIMIT_AS), or, on a loaded machine, at the memory cgroup's
    # limit while the kernel's reclaiming used up its CPU time first
    assert "address space" in r.message or "memory limit" in r.message, r.message


def test_cpu_time_spent_at_the_memory_limit_is_reported_as_the_memory_limit() -> None:
    """The classification alone: a sandbox over its CPU time is a CPU limit, unless its
    memory cgroup reached its limit meanwhile (reclaim is charged as the sandbox's CPU)."""
    tripped = [("cpu", "3.20s of CPU time")]
    status, message = sandbox_module._classify(-9, b"", False, None, LIMITS, tripped)
    assert status == SandboxStatus.CPU_LIMIT
    assert "3.20s of CPU time" in message
    status, message = sandbox_module._classify(
        -9, b"", False, None, LIMITS, tripped, memory_hits=12
    )
    assert status == SandboxStatus.MEMORY_LIMIT
    assert f"memory limit of {LIMITS.memory_bytes} bytes (12 times)" in message
    assert "3.20s of CPU time" in message


def test_sandbox_busy_loop_is_a_cpu_limit_and_a_sleeper_a_timeout(tmp_path: Path) -> None:
    r = run_py(tmp_path, "while True: pass")
    assert r.status == SandboxStatus.CPU_LIMIT
    sandbox = Sandbox(tmp_path / "w2", SandboxLimits(wall_s=1.5), ro_paths=python_runtime())
    r = asyncio.run(sandbox.run([python_executable(), "-c", "import time; time.sleep(60)"]))
    assert r.status == SandboxStatus.TIMEOUT
    assert r.wall_s < 30  # killed, not waited for


def processes_with_argv(argv: list[str]) -> list[int]:
    """Host pids of the live processes whose command line is exactly ``argv`` (a zombie's
    command line reads empty)."""
    want = "\0".join(argv).encode() + b"\0"
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to read
            if (proc / "cmdline").read_bytes() == want:
                found.append(int(proc.name))
    return found


def test_sandbox_kills_its_program_when_the_caller_is_cancelled(tmp_path: Path) -> None:
    argv = ["sleep", f"60.{secrets.randbelow(10**6):06d}"]  # a command line no one else runs

    async def cancel_once_started() -> list[int]:
        run = asyncio.create_task(Sandbox(tmp_path / "work", LIMITS).run(argv))
        await asyncio.sleep(0.5)
        for _ in range(100):  # up to 10 s more when bubblewrap starts slowly
            if pids := processes_with_argv(argv):
                break
            await asyncio.sleep(0.1)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return pids

    pids = asyncio.run(cancel_once_started())
    assert pids, "the program never started"
    deadline = time.monotonic() + 5
    while processes_with_argv(argv) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with_argv(argv) == []  # killed with the cancelled run, not left to sleep


def test_sandbox_huge_stdout_is_cut_and_killed(tmp_path: Path) -> None:
    r = run_py(tmp_path, "import sys\nwhile True: sys.stdout.write('x' * 65536)")
    assert r.status == SandboxStatus.OUTPUT_LIMIT
    assert len(r.stdout) == LIMITS.output_bytes


def test_sandbox_keeps_serving_while_a_hostile_program_runs(tmp_path: Path) -> None:
    async def both() -> list[SandboxResult]:
        bomb = Sandbox(tmp_path / "bomb", LIMITS, ro_paths=python_runtime())
        good = Sandbox(tmp_path / "good", LIMITS, ro_paths=python_runtime())
        return await asyncio.gather(
            bomb.run([python_executable(), "-c", "while True: pass"]),
            good.run([python_executable(), "-c", "print(6 * 7)"]),
        )

    bad, ok = asyncio.run(both())
    assert bad.status == SandboxStatus.CPU_LIMIT
    assert ok.status == SandboxStatus.OK
    assert ok.stdout == b"42\n"


def test_sandbox_hands_pass_fds_to_the_program_and_closes_them_here(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    opened = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    secret = os.dup2(opened, 250)  # a runner fd, not handed over (a number no one else uses)
    os.close(opened)
    try:
        code = f"import os; os.write({write_end}, b'via the pipe'); os.fstat({secret})"
        sandbox = Sandbox(tmp_path / "work", LIMITS, ro_paths=python_runtime())
        r = asyncio.run(sandbox.run([python_executable(), "-c", code], pass_fds=[write_end]))
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(write_end)  # closed here once the program started
        assert os.read(read_end, 100) == b"via the pipe"
        assert os.read(read_end, 100) == b""  # no other writer left
        assert r.status == SandboxStatus.EXIT_NONZERO  # fstat of the runner's fd: EBADF
        assert b"Bad file descriptor" in r.stderr
    finally:
        os.close(read_end)
        os.close(secret)


def test_sandbox_never_runs_its_program_as_root(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the program's uid is chosen only by a root runner")
    with pytest.raises(ValueError, match="uid or gid 0"):
        asyncio.run(Sandbox(tmp_path / "work", LIMITS, user=(0, 0)).run(["true"]))
    r = asyncio.run(Sandbox(tmp_path / "work", LIMITS, user=(4242, 4243)).run(["id", "-u"]))
    assert r.stdout == b"4242\n"
    assert r.enforcement["user"] == "userns-uid:4242"


def test_sandbox_runs_every_program_while_the_runner_is_busy_with_grpc(tmp_path: Path) -> None:
    """An env runner serves gRPC and exports over it while its sandboxes start. Confined
    by Python code between fork and exec, 44 of 100 programs died (SIGSEGV) in that copy
    of a gRPC-busy runner, each a wrong reward; now every one runs and answers."""

    async def main() -> list[tuple[SandboxStatus, bytes]]:
        out = []
        async with grpc_busy():
            for i in range(60):
                work = tmp_path / f"w{i}"
                work.mkdir()
                r = await Sandbox(work).run(["/bin/echo", f"run {i}"])
                out.append((r.status, r.stdout))
        return out

    results = asyncio.run(main())
    assert results == [(SandboxStatus.OK, f"run {i}\n".encode()) for i in range(60)]


def test_sandbox_confine_sets_the_limits_on_a_live_process_and_skips_a_gone_one() -> None:
    import subprocess

    from treadle.env_runner.runtimes.sandbox import _confine

    live = subprocess.Popen(["sleep", "30"])
    try:
        assert _confine(live.pid, live.pid, LIMITS, 7, None)
        limits = Path(f"/proc/{live.pid}/limits").read_text()
        assert re.search(r"Max processes\s+7\s+7", limits), limits
        assert re.search(rf"Max address space\s+{LIMITS.memory_bytes}\s", limits), limits
        assert re.search(rf"Max cpu time\s+{LIMITS.cpu_s}\s+{LIMITS.cpu_s + 1}", limits), limits
    finally:
        live.kill()
        live.wait()
    assert not _confine(live.pid, live.pid, LIMITS, 7, None)  # exited: nothing to confine
