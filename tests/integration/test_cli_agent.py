"""CommandHarness: a real program (a small Python "CLI agent" using urllib) talks to the
rollout's model through the interception server, in the environment's runtime: local and
the bubblewrap sandbox."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit.fake_engine import FakeEngine
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from testkit.procs import running
from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses.command import CommandHarness
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.runtimes.base import Runtime, SandboxLimits
from treadle.env_runner.runtimes.container import ContainerRuntime
from treadle.env_runner.runtimes.local import LocalRuntime
from treadle.env_runner.runtimes.sandbox import SandboxRuntime, python_executable
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind
ErrorKind = rollout_pb2.RolloutStatus.ErrorKind
Truncation = rollout_pb2.RolloutStatus.Truncation

AGENT = r"""
import json, os, subprocess, sys, time, urllib.error, urllib.request

task = json.load(open(sys.argv[1]))
assert task == json.loads(os.environ["TREADLE_TASK"])
base = os.environ["OPENAI_BASE_URL"]
key = "treadle" if task.get("wrong_key") else os.environ["OPENAI_API_KEY"]
if task.get("dump_env"):
    open("env.json", "w").write(json.dumps(dict(os.environ)))

def chat(messages):
    req = urllib.request.Request(
        base + "/chat/completions", data=json.dumps({"model": "agent", "messages": messages}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer " + key},
    )
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.load(r)["choices"][0]["message"]

if task.get("hang"):
    child = subprocess.Popen(["sleep", "60"])
    open("pids.txt", "w").write(f"{os.getpid()} {child.pid}")
    time.sleep(60)
if "probe_port" in task:  # the host's loopback, where the interception server listens
    import socket
    try:
        socket.create_connection(("127.0.0.1", task["probe_port"]), timeout=3)
        print("network: reachable")
    except OSError:
        print("network: blocked")
if task.get("daemon"):  # escapes the process group and keeps stdout open
    daemon = subprocess.Popen(["sleep", "30"], start_new_session=True)
    open("daemon.txt", "w").write(str(daemon.pid))
    time.sleep(0.3)
messages = json.load(open(os.path.join(os.path.dirname(sys.argv[1]), "messages.json")))
try:
    for follow_up in ["again, please"]:
        messages.append(chat(messages))
        messages.append({"role": "user", "content": follow_up})
    messages.append(chat(messages))
except urllib.error.HTTPError as e:
    print("model refused:", e.read().decode(), file=sys.stderr)
    sys.exit(4)
open("answer.txt", "w").write(messages[-1]["content"])
print("final:", messages[-1]["content"])
if task.get("exit_code"):
    print("exit %d on purpose" % task["exit_code"], file=sys.stderr)
    sys.exit(task["exit_code"])
"""


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


@pytest.fixture(scope="module")
def answer() -> list[int]:
    return encode_qwen3("olleh<|im_end|>")


def short_root(tmp_path: Path) -> Path:
    """A work-dir root whose socket paths fit in 107 bytes wherever pytest puts tmp_path
    (its per-worker folders make them longer); removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="agents-", dir="/tmp"))
    (tmp_path / "agents").symlink_to(root)
    _short_roots.append(root)
    return root


_short_roots: list[Path] = []


@pytest.fixture(autouse=True)
def _remove_short_roots() -> Iterator[None]:
    yield
    while _short_roots:
        shutil.rmtree(_short_roots.pop(), ignore_errors=True)


def answer_file(state: RolloutState) -> float:
    """Reads what the agent left in its work dir (after the harness returned)."""
    path = Path(state.info["workdir"]) / "answer.txt"
    return float(path.exists() and path.read_text() == "olleh")


def rollout(
    tmp_path: Path,
    renderer: treadle_native.Renderer,
    gen: ScriptedGenerator,
    task: dict[str, Any],
    *,
    sandbox: SandboxLimits | None = None,
    timeout_s: float = 20.0,
    max_total_tokens: int = 0,
    keep_workdir: bool = True,
    max_turns: int = 0,
    source: str = AGENT,
    runtime: Runtime | None = None,
) -> tuple[rollout_pb2.Rollout, RolloutState]:
    """One rollout of ``source`` as the harness, locally, in the sandbox (``sandbox``
    limits) or in ``runtime``."""
    agent = tmp_path / "agent.py"
    agent.write_text(source)
    if runtime is None:
        runtime = LocalRuntime() if sandbox is None else SandboxRuntime(sandbox)
    if isinstance(runtime, LocalRuntime):
        argv = [sys.executable, str(agent), "{task_file}"]
        setup = None
    else:  # the host's /tmp is not visible in the runtime: the agent travels in the work dir
        argv = [python_executable(), "{workdir}/agent.py", "{task_file}"]

        def setup(task: dict[str, Any], workdir: Path) -> None:
            shutil.copy(agent, workdir / "agent.py")

    states: list[RolloutState] = []

    async def main() -> rollout_pb2.Rollout:
        async with InterceptionServer() as server:
            task.setdefault("text", "hello")
            if task.pop("probe", False):
                task["probe_port"] = server.port
            harness = CommandHarness(argv, timeout_s=timeout_s, setup=setup,
                                     workdir_root=short_root(tmp_path), keep_workdir=keep_workdir,
                                     max_turns=max_turns)  # fmt: skip
            env = Environment("agent", prompt=lambda t: f"Reverse: {t['text']}",
                              rubric=Rubric(rewards=[answer_file]), harness=harness,
                              runtime=runtime)  # fmt: skip
            req = rollout_pb2.RolloutRequested(
                rollout_id="r-1", group_id="g", env="agent", task_id="t", task_json=json.dumps(task),
                sampling=rollout_pb2.SamplingParams(max_tokens=16, temperature=1.0, max_total_tokens=max_total_tokens),
            )  # fmt: skip
            rc = RolloutContext(renderer, gen, "runner-1", services={"interception": server})
            return await run_rollout(req, env, rc, states)

    return asyncio.run(main()), states[0]


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_cli_agent_two_turns_are_recorded_token_exact(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    gen = ScriptedGenerator([answer])
    limits = SandboxLimits(wall_s=20, cpu_s=20, memory_bytes=1 << 30) if sandboxed else None
    r, state = rollout(tmp_path, renderer, gen, {"probe": sandboxed}, sandbox=limits)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["num_turns"] == 2
    assert len(gen.calls) == 2
    first, second = gen.calls
    assert second[: len(first) + len(answer)] == first + answer  # the second turn bridged
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    assert ids == second + answer
    assert [n.role for n in r.nodes].count(rollout_pb2.ROLE_ASSISTANT) == 2
    assert [m["role"] for m in state.messages] == ["user", "assistant", "user", "assistant"]
    assert state.messages[2]["content"] == "again, please"
    assert "final: olleh" in state.info["stdout"]
    if sandboxed:  # the model was reachable through the relay, the host's loopback was not
        assert "network: blocked" in state.info["stdout"]
        assert state.info["workdir"] != "/work"


def test_cli_agent_in_a_container_runtime_through_a_fake_engine(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The environment's runtime is a container: the agent runs behind the relay (the
    runtime's Python), reaching the model through the unix socket in its work dir, as it
    would with no network. A FAKE engine runs the container's command locally: this checks
    the wiring (argv, the relay, the isolation flags asked for), never containment."""
    engine = FakeEngine(tmp_path)
    monkeypatch.setenv("TREADLE_CONTAINER_ENGINE", str(engine.path))
    runtime = ContainerRuntime(SandboxLimits(wall_s=20), python_path=python_executable())
    gen = ScriptedGenerator([answer])
    r, _ = rollout(tmp_path, renderer, gen, {}, runtime=runtime)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert len(gen.calls) == 2
    first, second = gen.calls
    assert second[: len(first) + len(answer)] == first + answer
    (run,) = [c for c in engine.calls() if c[0] == "run"]
    assert run[run.index("--network") + 1] == "none"
    command = run[run.index("--") + 2 :]  # after the image
    assert command[:3] == [python_executable(), "-I", "-c"]  # the relay, then the agent
    assert command[4] == "/work/.treadle/api.sock"
    assert command[-2:] == ["/work/agent.py", "/work/.treadle/task.json"]


def test_cli_agent_whose_container_engine_fails_is_a_sandbox_error_through_a_fake_engine(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The engine cannot run the image (the fake engine refuses images named missing*):
    the rollout's runtime failed, not the agent, and not the environment's code."""
    engine = FakeEngine(tmp_path)
    monkeypatch.setenv("TREADLE_CONTAINER_ENGINE", str(engine.path))
    runtime = ContainerRuntime(SandboxLimits(wall_s=20), image="missing-image:1")
    gen = ScriptedGenerator([answer])
    r, _ = rollout(tmp_path, renderer, gen, {}, runtime=runtime)
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == ErrorKind.ERROR_KIND_SANDBOX, r.status.message
    assert "container runtime could not run" in r.status.message
    assert gen.calls == []


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_cli_agent_nonzero_exit_is_a_harness_error(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    limits = SandboxLimits(wall_s=20, cpu_s=20, memory_bytes=1 << 30) if sandboxed else None
    r, _ = rollout(
        tmp_path, renderer, ScriptedGenerator([answer]), {"exit_code": 3}, sandbox=limits
    )
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == ErrorKind.ERROR_KIND_HARNESS
    assert "exited with code 3" in r.status.message
    assert "exit 3 on purpose" in r.status.message  # the tail of stderr


def test_cli_agent_hanging_agent_times_out_and_is_killed(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    t0 = time.monotonic()
    r, state = rollout(
        tmp_path, renderer, ScriptedGenerator([answer]), {"hang": True}, timeout_s=1.5
    )
    assert time.monotonic() - t0 < 15
    assert r.status.kind == Kind.KIND_TRUNCATED
    assert r.status.truncation == Truncation.TRUNCATION_TIMEOUT
    pids = [int(p) for p in (Path(state.info["workdir"]) / "pids.txt").read_text().split()]
    time.sleep(0.2)
    assert [pid for pid in pids if running(pid)] == []  # the agent and its child: the group is gone


def test_cli_agent_daemon_holding_stdout_does_not_stall_the_rollout(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    t0 = time.monotonic()
    r, state = rollout(tmp_path, renderer, ScriptedGenerator([answer]), {"daemon": True})
    daemon = int((Path(state.info["workdir"]) / "daemon.txt").read_text())
    try:
        assert time.monotonic() - t0 < 10  # not the daemon's 30 s
        assert r.status.kind == Kind.KIND_OK, r.status.message
        assert "final: olleh" in state.info["stdout"]  # output read up to the agent's exit
    finally:
        os.kill(daemon, signal.SIGKILL)


def test_cli_agent_workdir_goes_with_the_rollout_state(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    r, state = rollout(tmp_path, renderer, ScriptedGenerator([answer]), {}, keep_workdir=False)
    assert r.reward == 1.0  # the reward still read the work dir after the harness returned
    workdir = Path(state.info["workdir"])
    assert (workdir / "answer.txt").exists()
    del state
    gc.collect()
    deadline = time.monotonic() + 5
    while workdir.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workdir.exists()


def test_cli_agent_token_limit_during_a_call_is_the_rollouts_truncation(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    """The server refuses the second turn (over max_total_tokens); the agent exits non-zero
    because of it, and the rollout says truncated, not harness error."""
    gen = ScriptedGenerator([answer])
    probe = renderer.render(
        [{"role": "user", "content": "Reverse: hello"}], add_generation_prompt=True
    )
    r, state = rollout(tmp_path, renderer, gen, {}, max_total_tokens=len(probe) + len(answer) + 3)
    assert r.status.kind == Kind.KIND_TRUNCATED, r.status.message
    assert r.status.truncation == Truncation.TRUNCATION_MAX_TOTAL_TOKENS
    assert len(gen.calls) == 1
    assert "context_length_exceeded" in state.info["stderr"]
    assert state.info["returncode"] == 4


def test_cli_agent_turn_limit_truncates_the_rollout(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    """The agent wants two model calls; with max_turns=1 the second is refused and the
    rollout is truncated (MAX_TURNS), not a harness error."""
    gen = ScriptedGenerator([answer])
    r, state = rollout(tmp_path, renderer, gen, {}, max_turns=1)
    assert r.status.kind == Kind.KIND_TRUNCATED, r.status.message
    assert r.status.truncation == Truncation.TRUNCATION_MAX_TURNS
    assert len(gen.calls) == 1
    assert "rollout_ended" in state.info["stderr"]


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_cli_agent_flooding_its_output_passes_a_runtime_limit(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    """A program that prints without end is stopped at its runtime's output cap: a typed
    sandbox error, not a hung or crashed runner."""
    flood = "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n"
    limits = SandboxLimits(wall_s=20, cpu_s=20, memory_bytes=1 << 30, output_bytes=1 << 20)
    r, state = rollout(tmp_path, renderer, ScriptedGenerator([answer]), {}, source=flood,
                       sandbox=limits if sandboxed else None)  # fmt: skip
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == ErrorKind.ERROR_KIND_SANDBOX, r.status.message
    assert "output_limit" in r.status.message
    assert len(state.info["stdout"]) == 1 << 20  # what it printed up to the cap, kept


def test_cli_agent_that_never_calls_the_model_is_a_harness_error(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int]
) -> None:
    gen = ScriptedGenerator([answer])
    r, _ = rollout(tmp_path, renderer, gen, {}, source="print('nothing to do')")
    assert r.status.kind == Kind.KIND_ERROR
    assert r.status.error_kind == ErrorKind.ERROR_KIND_HARNESS
    assert "without calling the model" in r.status.message
    assert gen.calls == []
    assert r.metrics["agent_requests"] == 0


# An agent that does not take no for an answer: it calls again and again, for a minute.
PERSISTENT_AGENT = r"""
import json, os, time, urllib.error, urllib.request
messages = [{"role": "user", "content": "hi"}]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "agent", "messages": messages}).encode(),
        headers={"Content-Type": "application/json",
                 "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
    )
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            messages += [json.load(r)["choices"][0]["message"], {"role": "user", "content": "more"}]
    except urllib.error.HTTPError as e:
        print("refused:", e.code, flush=True)
        time.sleep(0.2)
"""


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_cli_agent_calling_after_its_rollout_ended_is_stopped_soon(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    """The rollout ends at its turn limit; the agent keeps calling (and is refused each
    time). It is stopped a few seconds later, not at its 60 s of wall time, and the
    rollout is the truncation, with nothing generated after it."""
    gen = ScriptedGenerator([answer])
    limits = SandboxLimits(wall_s=60, cpu_s=60, memory_bytes=1 << 30) if sandboxed else None
    t0 = time.monotonic()
    r, state = rollout(tmp_path, renderer, gen, {}, sandbox=limits, timeout_s=60, max_turns=1,
                       source=PERSISTENT_AGENT)  # fmt: skip
    took = time.monotonic() - t0
    assert r.status.kind == Kind.KIND_TRUNCATED, r.status.message
    assert r.status.truncation == Truncation.TRUNCATION_MAX_TURNS
    assert took < 30, took  # STOP_GRACE_S after the end, not the agent's 60 s
    assert len(gen.calls) == 1
    assert state.info["stdout"].count("refused: 400") >= 2  # it did keep calling


def test_cli_agent_without_sandbox_gets_none_of_the_runner_s_secrets(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    secret = "runner-only-secret-4242"
    monkeypatch.setenv("TREADLE_OBJECT_STORE__SECRET_KEY", secret)
    monkeypatch.setenv("TREADLE_NATS__CREDENTIALS", "/run/creds/env_runner.nk")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    r, state = rollout(tmp_path, renderer, ScriptedGenerator([answer]), {"dump_env": True})
    assert r.status.kind == Kind.KIND_OK, r.status.message
    env = json.loads((Path(state.info["workdir"]) / "env.json").read_text())
    assert secret not in json.dumps(env)
    assert not [k for k in env if k.startswith("TREADLE_") and k not in (
        "TREADLE_TASK", "TREADLE_TASK_FILE", "TREADLE_MESSAGES_FILE", "TREADLE_ROLLOUT_ID",
        "TREADLE_MODEL", "TREADLE_WORKDIR")]  # fmt: skip
    assert env["PATH"] == os.environ["PATH"]
    assert len(env["OPENAI_API_KEY"]) >= 40  # the rollout's own key, not a constant


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_cli_agent_without_the_rollout_key_is_refused(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    gen = ScriptedGenerator([answer])
    limits = SandboxLimits(wall_s=20, cpu_s=20, memory_bytes=1 << 30) if sandboxed else None
    r, _ = rollout(tmp_path, renderer, gen, {"wrong_key": True}, sandbox=limits)
    assert r.status.kind == Kind.KIND_ERROR
    assert "invalid_api_key" in r.status.message
    assert gen.calls == []


# An agent written with the vendors' SDKs, configured only by the environment the harness
# gives it: a first turn in Anthropic Messages, the second in OpenAI Responses (streamed).
SDK_AGENT = r"""
import json, os, sys
import anthropic, openai

model = os.environ["TREADLE_MODEL"]
prompt = json.load(open(os.environ["TREADLE_MESSAGES_FILE"]))[-1]["content"]
claude = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
first = claude.messages.create(model=model, max_tokens=64, messages=[{"role": "user", "content": prompt}])
text = first.content[0].text
gpt = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL, OPENAI_API_KEY
items = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text},
         {"role": "user", "content": "again, please"}]
with gpt.responses.stream(model=model, input=items) as stream:
    final = stream.get_final_response().output_text
open("answer.txt", "w").write(final)
print("final:", first.stop_reason, final)
"""

# The same agent with the standard library only: the sandbox hides the SDKs' install (its
# /work is the work dir), and the base URLs it gets are the relay's.
STDLIB_AGENT = r"""
import json, os, sys, urllib.request

def post(url, body, headers):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=20) as r:
        return json.load(r)

model = os.environ["TREADLE_MODEL"]
prompt = json.load(open(os.environ["TREADLE_MESSAGES_FILE"]))[-1]["content"]
first = post(os.environ["ANTHROPIC_BASE_URL"] + "/v1/messages",
             {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
             {"x-api-key": os.environ["ANTHROPIC_API_KEY"], "anthropic-version": "2023-06-01"})
text = first["content"][0]["text"]
items = [{"role": "user", "content": prompt}, {"role": "assistant", "content": text},
         {"role": "user", "content": "again, please"}]
second = post(os.environ["OPENAI_BASE_URL"] + "/responses", {"model": model, "input": items},
              {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
final = second["output"][-1]["content"][0]["text"]
open("answer.txt", "w").write(final)
print("final:", first["stop_reason"], final)
"""


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local-sdk", "sandbox-stdlib"])
def test_cli_agent_speaks_anthropic_then_responses_token_exact(
    tmp_path: Path, renderer: treadle_native.Renderer, answer: list[int], sandboxed: bool
) -> None:
    gen = ScriptedGenerator([answer])
    limits = SandboxLimits(wall_s=30, cpu_s=30, memory_bytes=1 << 30) if sandboxed else None
    r, state = rollout(tmp_path, renderer, gen, {}, sandbox=limits, timeout_s=30,
                       source=STDLIB_AGENT if sandboxed else SDK_AGENT)  # fmt: skip
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert "final: end_turn olleh" in state.info["stdout"]
    first, second = gen.calls
    assert second[: len(first) + len(answer)] == first + answer  # bridged across dialects
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    assert ids == second + answer
    assert r.metrics["agent_requests"] == 2
