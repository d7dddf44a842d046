"""The container runtime against a REAL engine: rootful Podman with runc, where this
machine has them (Debian's ``podman`` and ``runc``; the test skips, saying why, when a
plain probe container cannot run, so a machine without an engine is not a failure, while
a probe that runs and ours that does not is).

No image can be pulled here, so the image is an exploded root filesystem (``podman run
--rootfs``): a few folders and links, the host's ``/usr`` bind-mounted read-only through
the runtime's ``ro_paths``. What runs is the runtime's own command line, every isolation
flag and limit included; what is asserted is the containment the engine provides: a
non-root user, no network, a read-only root, the work dir the only writable place, the
memory and wall-time limits, and a CLI agent reaching its model through the relay."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator
from testkit.one_call_agent import answered, put_agent
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses.command import CommandHarness
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import Rubric
from treadle.env_runner.runtimes.base import SandboxLimits, SandboxStatus
from treadle.env_runner.runtimes.container import ContainerEngineError, ContainerRuntime
from treadle.proto.v1 import rollout_pb2

pytestmark = pytest.mark.integration

PYTHON = "/usr/bin/python3"  # the host's, seen through the /usr bind mount
# runc (crun refuses hybrid cgroups here); an explicit nproc (podman's own default is
# above what the host allows, and any explicit --ulimit drops containers.conf's defaults)
ENGINE_ARGS = ["--runtime", "runc", "--ulimit", "nproc=4096:4096", "--rootfs"]
LIMITS = SandboxLimits(wall_s=30, cpu_s=30, memory_bytes=256 << 20, output_bytes=1 << 16)


@pytest.fixture(scope="module")
def rootfs() -> Iterator[Path]:
    podman, runc = shutil.which("podman"), shutil.which("runc")
    if podman is None or runc is None or not os.path.exists(PYTHON):
        pytest.skip("no podman and runc here (Debian: apt install podman runc)")
    root = Path(tempfile.mkdtemp(prefix="treadle-rootfs-"))
    root.chmod(0o755)  # the container's / (mkdtemp makes it 0700: nobody could enter)
    for d in ("usr", "etc", "tmp", "work", "proc", "dev", "sys"):
        (root / d).mkdir()
    for link in ("bin", "lib", "lib64", "sbin"):
        (root / link).symlink_to(f"usr/{link}")
    (root / "etc" / "passwd").write_text(
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
    )
    (root / "etc" / "group").write_text("nogroup:x:65534:\n")
    probe = subprocess.run(
        [podman, "run", "--rm", "--ulimit", "nofile=1024:1024", *ENGINE_ARGS, "--mount", "type=bind,source=/usr,target=/usr,readonly=true",
         "--network", "none", str(root), PYTHON, "-c", "print('probe')"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode != 0 or probe.stdout.strip() != "probe":
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"podman cannot run a plain container here: {probe.stderr.strip()[-300:]}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def runtime(rootfs: Path, **kw: Any) -> ContainerRuntime:
    return ContainerRuntime(kw.pop("limits", LIMITS), image=str(rootfs), engine="podman",
                            extra_args=ENGINE_ARGS, ro_paths=["/usr"], python_path=PYTHON,
                            **kw)  # fmt: skip


def run_py(rt: ContainerRuntime, code: str, **kw: Any) -> Any:
    async def main() -> Any:
        async with await rt.start() as ws:
            ws.put("in.txt", "olleh")
            r = await ws.exec([PYTHON, "-I", "-c", code], **kw)
            written = ws.get("out.txt") if (ws.workdir / "out.txt").exists() else None
            return r, written

    return asyncio.run(main())


PROBE = r"""
import json, os, socket
out = {"uid": os.getuid(), "cwd": os.getcwd(), "read": open("in.txt").read()}
try:
    socket.create_connection(("1.1.1.1", 80), timeout=2)
    out["net"] = "open"
except OSError as e:
    out["net"] = e.errno
for path in ("/usr/evil", "/etc/evil", "/evil"):
    try:
        open(path, "w")
        out[path] = "written"
    except OSError as e:
        out[path] = e.errno
open("out.txt", "w").write("from the container")
print(json.dumps(out))
"""


def test_container_engine_runs_the_program_confined(rootfs: Path) -> None:
    r, written = run_py(runtime(rootfs), PROBE)
    assert r.status == SandboxStatus.OK, r.stderr
    seen = json.loads(r.stdout)
    assert seen["uid"] == 65534  # never root
    assert seen["cwd"] == "/work"
    assert seen["read"] == "olleh"  # files in
    assert written == b"from the container"  # files out
    assert seen["net"] != "open"  # --network none
    assert [seen[p] for p in ("/usr/evil", "/etc/evil", "/evil")] == [30, 30, 30]  # EROFS


def test_container_engine_enforces_memory_and_wall_time(rootfs: Path) -> None:
    bomb, _ = run_py(runtime(rootfs), "x = []\nwhile True: x.append(bytearray(1 << 24))")
    assert bomb.status == SandboxStatus.MEMORY_LIMIT, (bomb.status, bomb.stderr[-300:])
    slow, _ = run_py(runtime(rootfs), "import time; time.sleep(60)",
                     limits=SandboxLimits(wall_s=3))  # fmt: skip
    assert slow.status == SandboxStatus.TIMEOUT


def test_container_engine_failure_is_an_engine_error_not_the_programs(rootfs: Path) -> None:
    """The OCI runtime cannot create the container (an rlimit the host refuses): exit 126
    from podman, which is the engine's failure, never scored as the program's."""
    rt = ContainerRuntime(LIMITS, image=str(rootfs), engine="podman", ro_paths=["/usr"],
                          extra_args=["--runtime", "runc", "--ulimit", "nproc=999999999:999999999",
                                      "--rootfs"], python_path=PYTHON)  # fmt: skip
    with pytest.raises(ContainerEngineError, match="could not run"):
        run_py(rt, "print(1)")


def agent_rollout(env: Environment, gen: ScriptedGenerator, rollout_id: str) -> rollout_pb2.Rollout:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))

    async def main() -> rollout_pb2.Rollout:
        async with InterceptionServer() as server:
            req = rollout_pb2.RolloutRequested(
                rollout_id=rollout_id, group_id="g", env="agent", task_id="t", task_json="{}",
                sampling=rollout_pb2.SamplingParams(max_tokens=16),
            )  # fmt: skip
            rc = RolloutContext(renderer, gen, "r", services={"interception": server})
            return await run_rollout(req, env, rc)

    return asyncio.run(main())


def test_cli_agent_in_a_real_container_reaches_its_model_through_the_relay(
    rootfs: Path,
) -> None:
    """In all three dialects: the agent (no network) reaches the interception server
    through the relay and the unix socket in its bind-mounted work dir."""
    root = Path(tempfile.mkdtemp(prefix="ag-", dir="/tmp"))
    outcomes = []
    try:
        for dialect in ("openai_chat", "openai_responses", "anthropic"):
            gen = ScriptedGenerator(["olleh<|im_end|>"])
            harness = CommandHarness([PYTHON, "-I", "{workdir}/agent.py", dialect],
                                     setup=put_agent, workdir_root=root, timeout_s=60)  # fmt: skip
            env = Environment("agent", prompt=lambda t: "Reverse: hello", harness=harness,
                              rubric=Rubric(rewards=[answered]), runtime=runtime(rootfs))  # fmt: skip
            r = agent_rollout(env, gen, f"pod-{dialect}")
            outcomes.append((dialect, r.status.kind, r.reward, len(gen.calls), r.status.message))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ok = rollout_pb2.RolloutStatus.Kind.KIND_OK
    assert [o[1:4] for o in outcomes] == [(ok, 1.0, 1)] * 3, outcomes
