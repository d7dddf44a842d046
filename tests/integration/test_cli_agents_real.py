"""Third-party CLI agents, unmodified (agents.py presets), as rollout harnesses: their model
calls go through the interception server to a scripted model and are recorded
token-exactly; the tools they run act in the rollout's work dir, locally and in the
bubblewrap sandbox (no network but the model). The agents come from npm (testkit.agents)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit import agents
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.agents import claude_code, codex
from treadle.env_runner.environments import Environment
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.sandbox import Sandbox, SandboxLimits
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind


@pytest.fixture(scope="module")
def claude() -> Path:
    exe = agents.claude_code()
    if exe is None:
        pytest.skip("npm is not installed")
    return exe


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def answer_file(state: RolloutState) -> float:
    path = Path(state.info["workdir"]) / "answer.txt"
    return float(path.exists() and path.read_text() == "olleh")


def run(
    harness: Any, renderer: treadle_native.Renderer, gen: ScriptedGenerator, prompt: str
) -> tuple[rollout_pb2.Rollout, RolloutState]:
    states: list[RolloutState] = []

    async def main() -> rollout_pb2.Rollout:
        async with InterceptionServer() as server:
            env = Environment("agent", prompt=lambda t: prompt,
                              rubric=Rubric(rewards=[answer_file]), harness=harness)  # fmt: skip
            req = rollout_pb2.RolloutRequested(
                rollout_id="cc-1", group_id="g", env="agent", task_id="t", task_json="{}",
                sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0),
            )  # fmt: skip
            rc = RolloutContext(renderer, gen, "runner-1", services={"interception": server})
            return await run_rollout(req, env, rc, states)

    return asyncio.run(main()), states[0]


LIMITS = SandboxLimits(wall_s=120, cpu_s=120, memory_bytes=4 << 30)


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_claude_code_runs_its_tool_and_every_call_is_recorded_token_exact(
    tmp_path: Path, claude: Path, renderer: treadle_native.Renderer, sandboxed: bool
) -> None:
    """Claude Code gets the task as its prompt, calls the model (Anthropic Messages,
    streamed), runs the Bash tool call the model made in the work dir, sends the result
    back and ends on the model's answer. Both calls hold its own system prompt and tools;
    the second extends the first, so the rollout is one token-exact branch."""
    call = ('<tool_call>\n{"name": "Bash", "arguments": {"command": "printf olleh > answer.txt",'
            ' "description": "write the answer"}}\n</tool_call><|im_end|>')  # fmt: skip
    turns = [encode_qwen3(call), encode_qwen3("done<|im_end|>")]
    gen = ScriptedGenerator(turns)
    root = Path(tempfile.mkdtemp(prefix="cc-", dir="/tmp"))  # the sandbox's socket path is short
    harness = claude_code(claude, timeout_s=120, workdir_root=root,
                          sandbox=LIMITS if sandboxed else None)  # fmt: skip
    try:
        r, state = run(harness, renderer, gen, "Write the reverse of 'hello' into answer.txt.")
        check(r, state, gen, turns)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = json.loads(state.info["stdout"])
    assert result["result"] == "done"
    assert result["num_turns"] == 2
    assert len(gen.calls[0]) > 5000  # Claude Code's own system prompt and tool schemas


def check(r: rollout_pb2.Rollout, state: RolloutState, gen: ScriptedGenerator,
          turns: list[list[int]]) -> None:  # fmt: skip
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0  # the tool ran: the file is there
    assert r.metrics["agent_requests"] == 2
    first, second = gen.calls
    assert second[: len(first) + len(turns[0])] == first + turns[0]  # bridged
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    assert ids == second + turns[1]
    sampled = np.concatenate([to_array(n.sampled_mask) for n in r.nodes]).astype(bool)
    assert np.asarray(ids)[sampled].tolist() == turns[0] + turns[1]
    roles = [m["role"] for m in state.messages]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    assert "Write the reverse of 'hello'" in json.dumps(state.messages)


@pytest.fixture(scope="module")
def codex_cli() -> Path:
    exe = agents.codex()
    if exe is None:
        pytest.skip("npm is not installed")
    return exe


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
def test_codex_runs_its_tool_and_every_call_is_recorded_token_exact(
    codex_cli: Path, renderer: treadle_native.Renderer, sandboxed: bool
) -> None:
    """Codex CLI speaks the Responses dialect (streamed) through its own provider: the
    model's exec_command call runs in the work dir, its output goes back, the turn ends on
    the model's answer; one token-exact branch."""
    call = ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "printf olleh > answer.txt"}}'
            "\n</tool_call><|im_end|>")  # fmt: skip
    turns = [encode_qwen3(call), encode_qwen3("done<|im_end|>")]
    gen = ScriptedGenerator(turns)
    root = Path(tempfile.mkdtemp(prefix="cx-", dir="/tmp"))
    harness = codex(codex_cli, timeout_s=120, workdir_root=root,
                    sandbox=LIMITS if sandboxed else None)  # fmt: skip
    try:
        r, state = run(harness, renderer, gen, "Write the reverse of 'hello' into answer.txt.")
        check(r, state, gen, turns)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert "done" in state.info["stdout"]  # its last message
    assert len(gen.calls[0]) > 2000  # Codex's own instructions and tool schemas


def test_claude_code_preset_refuses_an_install_the_sandbox_would_hide(tmp_path: Path) -> None:
    exe = tmp_path / "claude"
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match=r"under /tmp, which the sandbox replaces"):
        claude_code(exe, sandbox=LIMITS)
    claude_code(exe)  # local: any path
    with pytest.raises(ValueError, match=r"under /work, which the sandbox replaces"):
        Sandbox(tmp_path / "w", LIMITS, ro_paths=["/work/venv/lib"])
    with pytest.raises(ValueError, match="no such executable"):
        claude_code(tmp_path / "missing")
