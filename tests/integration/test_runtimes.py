"""Runtimes as an axis: the same surface (start, files in/out, exec under limits,
teardown) on the local runtime, the bubblewrap sandbox and containers (through a FAKE
engine: no container engine runs here, so containment is not shown for containers), and
the runtime chosen per environment, overridden from the run's config, and used by the
rewards that run programs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from testkit.fake_engine import FakeEngine
from testkit.procs import running
from treadle.env_runner.environments import Environment, load_environment, with_runtime
from treadle.env_runner.envs import python_code
from treadle.env_runner.harnesses.command import CommandHarness
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.runtimes import make_runtime
from treadle.env_runner.runtimes.base import Runtime, SandboxLimits, SandboxStatus, Workspace
from treadle.env_runner.runtimes.container import ContainerRuntime
from treadle.env_runner.runtimes.local import LocalRuntime
from treadle.env_runner.runtimes.sandbox import SandboxRuntime, python_executable
from treadle.env_runner.spec import EnvRunnerSection
from treadle.services.errors import ConfigError

pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(wall_s=20, cpu_s=20, memory_bytes=1 << 30, output_bytes=1 << 16)
KINDS = ["local", "sandbox", "container-fake-engine"]


@pytest.fixture(params=KINDS)
def runtime(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Runtime:
    kind = request.param
    if kind == "local":
        return LocalRuntime(LIMITS)
    if kind == "sandbox":
        return SandboxRuntime(LIMITS)
    engine = FakeEngine(tmp_path)
    monkeypatch.setenv("TREADLE_CONTAINER_ENGINE", str(engine.path))
    return ContainerRuntime(LIMITS, python_path=python_executable())


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def exec_py(ws: Workspace, code: str, **kw: object) -> object:
    return await ws.exec([ws.runtime.python(), "-I", "-c", code], **kw)  # type: ignore[arg-type]


def test_runtime_runs_a_program_on_files_put_in_and_taken_out(runtime: Runtime) -> None:
    async def main() -> tuple[object, bytes, Path, str]:
        async with await runtime.start() as ws:
            ws.put("data/in.txt", "olleh")
            code = (
                "import os; s = open('data/in.txt').read();"
                "open('out.txt', 'w').write(s[::-1]); print(os.getcwd())"
            )
            r = await exec_py(ws, code)
            return r, ws.get("out.txt"), ws.workdir, ws.path

    r, out, workdir, path = run(main())  # type: ignore[misc]
    assert r.status == SandboxStatus.OK, r.stderr  # type: ignore[attr-defined]
    assert out == b"hello"
    if isinstance(runtime, LocalRuntime):
        assert path == str(workdir)
    else:  # the fake engine runs in the bind source; a real container sees /work
        assert path == "/work"
    assert not workdir.exists()  # teardown


def test_runtime_kills_a_program_past_its_wall_time(runtime: Runtime, tmp_path: Path) -> None:
    pid_file = "pids.txt"
    code = (
        "import os, subprocess, time; child = subprocess.Popen(['sleep', '60']);"
        f"open({pid_file!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(60)"
    )

    async def main() -> tuple[object, float, str]:
        async with await runtime.start(keep=True) as ws:
            t0 = time.monotonic()
            r = await exec_py(ws, code, limits=SandboxLimits(wall_s=1.5))
            took = time.monotonic() - t0
            pids = ws.get(pid_file).decode() if (ws.workdir / pid_file).exists() else ""
            return r, took, pids

    r, took, pids = run(main())  # type: ignore[misc]
    assert r.status == SandboxStatus.TIMEOUT  # type: ignore[attr-defined]
    assert took < 12
    if isinstance(runtime, LocalRuntime):  # the program's whole group is gone
        time.sleep(0.2)
        alive = [p for p in map(int, pids.split()) if running(p)]
        assert alive == []


def test_runtime_stops_a_program_flooding_its_output(runtime: Runtime) -> None:
    async def main() -> object:
        async with await runtime.start() as ws:
            return await exec_py(ws, "import sys\nwhile True: sys.stdout.write('x' * 65536)")

    r = run(main())
    assert r.status == SandboxStatus.OUTPUT_LIMIT  # type: ignore[attr-defined]
    assert len(r.stdout) == LIMITS.output_bytes  # type: ignore[attr-defined]


def test_runtime_program_gets_none_of_the_runners_secrets(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TREADLE_OBJECT_STORE__SECRET_KEY", "runner-only-4242")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "runner-only-4242")

    async def main() -> object:
        async with await runtime.start() as ws:
            return await exec_py(
                ws, "import os, json; print(json.dumps(dict(os.environ)))", env={"MINE": "1"}
            )

    r = run(main())
    assert r.status == SandboxStatus.OK, r.stderr  # type: ignore[attr-defined]
    env = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert "runner-only-4242" not in json.dumps(env)
    assert env["MINE"] == "1"
    assert not [k for k in env if k.startswith("TREADLE_")]


def test_runtime_with_a_nonzero_exit_or_a_missing_program_is_a_result(runtime: Runtime) -> None:
    async def main() -> tuple[object, object]:
        async with await runtime.start() as ws:
            failed = await exec_py(ws, "import sys; sys.exit(3)")
            missing = await ws.exec(["/nonexistent/program"])
            return failed, missing

    failed, missing = run(main())  # type: ignore[misc]
    assert (failed.status, failed.returncode) == (SandboxStatus.EXIT_NONZERO, 3)  # type: ignore[attr-defined]
    assert missing.status != SandboxStatus.OK  # type: ignore[attr-defined]


def test_workspace_never_reads_through_a_symlink_the_program_planted(
    runtime: Runtime, host_marker: Path
) -> None:
    """A program answers with links to a host file (here a decoy beside the runner's
    files): taking its files out, or putting files in, never follows them (the sandbox
    removes such links after each run; elsewhere they are refused)."""
    host_marker.write_text("host file")

    async def main() -> None:
        async with await runtime.start() as ws:
            r = await exec_py(
                ws, f"import os; os.symlink({str(host_marker)!r}, 'answer.txt'); "
                f"os.mkdir('d'); os.symlink({str(host_marker.parent)!r}, 'd/up')"
            )  # fmt: skip
            assert r.status == SandboxStatus.OK, r.stderr  # type: ignore[attr-defined]
            for rel in ("answer.txt", f"d/up/{host_marker.name}"):
                with pytest.raises((ValueError, FileNotFoundError)):
                    ws.get(rel)
                with contextlib.suppress(ValueError):  # or written inside the work dir
                    ws.put(rel, "overwritten")

    run(main())
    assert host_marker.read_text() == "host file"


def test_workspace_refuses_paths_out_of_its_directory(tmp_path: Path) -> None:
    async def main() -> None:
        async with await LocalRuntime().start(tmp_path / "w") as ws:
            for bad in ("../escape.txt", "/etc/passwd", "a/../../x", ""):
                with pytest.raises(ValueError, match="relative path inside"):
                    ws.put(bad, "x")
                with pytest.raises(ValueError, match="relative path inside"):
                    ws.get(bad)
            (ws.workdir / "fifo").parent.mkdir(exist_ok=True)
            os.mkfifo(ws.workdir / "fifo")
            with pytest.raises(ValueError, match="not a regular file"):
                ws.get("fifo")  # never blocks on a pipe
            with pytest.raises(ValueError, match="cannot be written"):
                ws.put("fifo", "x")  # nor on writing one

    run(main())
    assert not (tmp_path / "escape.txt").exists()


def test_runtime_passing_file_descriptors(runtime: Runtime) -> None:
    """Local and sandbox hand a program the fds it is given; containers refuse."""

    async def main() -> object:
        r_fd, w_fd = os.pipe()
        try:
            async with await runtime.start() as ws:
                result = await exec_py(
                    ws, f"import os; os.write({w_fd}, b'through the pipe')", pass_fds=(w_fd,)
                )
            return result, os.read(r_fd, 100)  # the runtime closed our copy of w_fd
        finally:
            os.close(r_fd)
            with contextlib.suppress(OSError):  # refused before the runtime took it
                os.close(w_fd)

    if not runtime.passes_fds:
        with pytest.raises(ValueError, match="file descriptors"):
            run(main())
        return
    result, data = run(main())  # type: ignore[misc]
    assert result.status == SandboxStatus.OK, result.stderr  # type: ignore[attr-defined]
    assert data == b"through the pipe"


def test_sandbox_address_space_limit_is_its_own_or_the_memory_limit() -> None:
    """RLIMIT_AS defaults to memory_bytes; address_space_bytes raises it alone (for programs
    such as Bun that reserve far more than they use)."""
    code = "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])"

    async def main(limits: SandboxLimits) -> int:
        async with await SandboxRuntime(limits).start() as ws:
            r = await exec_py(ws, code)
            assert r.status == SandboxStatus.OK, r.stderr  # type: ignore[attr-defined]
            return int(r.stdout)  # type: ignore[attr-defined]

    assert run(main(LIMITS)) == LIMITS.memory_bytes
    wide = dataclasses.replace(LIMITS, address_space_bytes=16 << 30)
    assert run(main(wide)) == 16 << 30


# -- the runtime of an environment ----------------------------------------------------------


def test_make_runtime_from_kinds_tables_and_bad_settings() -> None:
    assert isinstance(make_runtime(None), SandboxRuntime)  # the default
    assert isinstance(make_runtime("local"), LocalRuntime)
    rt = make_runtime({"kind": "sandbox", "network": True, "limits": {"wall_s": 5}})
    assert isinstance(rt, SandboxRuntime)
    assert rt.network
    assert rt.limits.wall_s == 5
    rt = make_runtime({"kind": "container", "image": "python:3.12-slim"})
    assert isinstance(rt, ContainerRuntime)
    assert rt.image == "python:3.12-slim"
    third_party = make_runtime({"kind": "treadle.env_runner.runtimes.local:LocalRuntime"})
    assert isinstance(third_party, LocalRuntime)
    for bad, says in [
        ("vm", "unknown runtime 'vm'"),
        ({"image": "x"}, "needs kind"),
        ({"kind": "sandbox", "imag": "x"}, "imag"),
        ({"kind": "sandbox", "limits": {"wall_s": -1}}, "wall_s must be a positive"),
        ({"kind": "sandbox", "limits": {"wal_s": 1}}, "wal_s"),
        ({"kind": "local", "network": False}, "cannot cut programs off the network"),
        ({"kind": "container", "image": "-v /:/host"}, "not an image reference"),
        ({"kind": "sandbox", "ro_paths": ["/tmp/agent"]}, "under /tmp"),
        ({"kind": "os:path"}, "not a Runtime subclass"),
        ({"kind": "no.such.module:R"}, "cannot import"),
    ]:
        with pytest.raises(ConfigError, match=says):
            make_runtime(bad)


def test_env_runner_config_names_the_bad_runtime_setting() -> None:
    EnvRunnerSection(runtimes={"python_code": "local", "agent": {"kind": "container"}})
    with pytest.raises(ValidationError, match=r"env_runner\.runtimes\.python_code: .*'vm'"):
        EnvRunnerSection(runtimes={"python_code": "vm"})


def test_environment_runtime_is_its_own_unless_the_config_overrides_it() -> None:
    plain = Environment("e", prompt=lambda t: "hi")
    assert isinstance(plain.runtime, SandboxRuntime)  # untrusted by default
    assert isinstance(
        Environment("e", prompt=lambda t: "hi", runtime="local").runtime, LocalRuntime
    )
    overridden = load_environment(
        "python_code", runtimes={"python_code": {"kind": "local", "limits": {"wall_s": 7}}}
    )
    assert isinstance(overridden.runtime, LocalRuntime)
    assert overridden.runtime.limits.wall_s == 7
    assert isinstance(load_environment("python_code").runtime, SandboxRuntime)  # untouched
    other = load_environment("python_code", runtimes={"countdown": "local"})
    assert isinstance(other.runtime, SandboxRuntime)


def test_a_container_runtime_on_a_machine_without_an_engine_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TREADLE_CONTAINER_ENGINE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker, no podman
    with pytest.raises(
        ConfigError, match=r"env_runner\.runtimes\.countdown: .*no container engine"
    ):
        load_environment("countdown", runtimes={"countdown": "container"})


def test_a_harness_that_does_not_fit_its_environments_runtime_is_refused_when_built() -> None:
    """An agent installed under /tmp is invisible in the sandbox (its /tmp is private):
    refused when the environment is built or its runtime overridden, not at each rollout."""
    harness = CommandHarness(["/tmp/agent/bin/agent"], ro_paths=["/tmp/agent"])
    with pytest.raises(ConfigError, match=r"environment 'agent': .*under /tmp"):
        Environment("agent", prompt=lambda t: "hi", harness=harness)  # sandbox by default
    local = Environment("agent", prompt=lambda t: "hi", harness=harness, runtime="local")
    with pytest.raises(ConfigError, match=r"env_runner\.runtimes\.agent: .*under /tmp"):
        with_runtime(local, "sandbox")
    assert isinstance(with_runtime(local, {"kind": "local"}).runtime, LocalRuntime)


# -- rewards that run programs run them in the rollout's runtime -----------------------------


@pytest.fixture
def host_marker() -> Iterator[Path]:
    """A file in the host's /tmp: visible to a local program, not to a sandboxed one."""
    fd, path = tempfile.mkstemp(prefix="treadle-marker-", dir="/tmp")
    os.close(fd)
    os.chmod(path, 0o644)
    yield Path(path)
    os.unlink(path)


def test_python_code_grades_in_the_rollouts_runtime(host_marker: Path) -> None:
    task = {"id": "sees", "entry_point": "sees", "prompt": "",
            "tests": f"assert sees() is True  # {host_marker}"}  # fmt: skip
    answer = (
        f"```python\nimport os\ndef sees():\n    return os.path.exists({str(host_marker)!r})\n```"
    )

    def grade(runtime: Runtime) -> python_code.Grade:
        state = RolloutState(task=task, runtime=runtime)
        return asyncio.run(python_code.grade(task, answer, state))

    local, sandboxed = grade(LocalRuntime()), grade(SandboxRuntime())
    assert local.outcome == "passed", local.stderr_tail
    assert sandboxed.outcome == "failed"  # the sandbox's /tmp is its own
    assert sandboxed.sandbox_status == "ok"


def test_python_code_refuses_a_runtime_that_cannot_link_its_grader() -> None:
    task = dict(python_code.TASKS[0])
    with pytest.raises(ConfigError, match="container runtime cannot hand"):
        asyncio.run(python_code.run_tests(task, "def fizzbuzz(n): return []",
                                          runtime=ContainerRuntime()))  # fmt: skip


def test_runtime_local_rlimits_reach_the_program(tmp_path: Path) -> None:
    """The local runtime isolates nothing, but its CPU-time and file-size limits hold."""

    async def main() -> object:
        async with await LocalRuntime(SandboxLimits(cpu_s=1, file_bytes=1 << 20)).start() as ws:
            return await exec_py(ws, "while True: pass")

    before = resource.getrlimit(resource.RLIMIT_CPU)
    r = run(main())
    assert r.status == SandboxStatus.CPU_LIMIT, (r.status, r.stderr)  # type: ignore[attr-defined]
    assert resource.getrlimit(resource.RLIMIT_CPU) == before  # the runner's own: untouched
