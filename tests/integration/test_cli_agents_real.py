"""Third-party CLI agents, unmodified (agents.py presets), as rollout harnesses: their model
calls go through the interception server to a scripted model and are recorded
token-exactly; the tools they run act in the rollout's work dir, locally and in the
bubblewrap sandbox (no network but the model). The agents come from npm and PyPI
(testkit.agents)."""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit import agents
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment
from treadle.env_runner.harnesses.agents import claude_code, codex, mini_swe_agent, opencode
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState, Rubric
from treadle.env_runner.runtimes.base import SandboxLimits
from treadle.env_runner.runtimes.local import LocalRuntime
from treadle.env_runner.runtimes.sandbox import Sandbox, SandboxRuntime
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind


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


# Bun (opencode) reserves far more address space than it uses; memory stays at 4 GiB
LIMITS = SandboxLimits(wall_s=120, cpu_s=120, memory_bytes=4 << 30, address_space_bytes=64 << 30)


# per agent: its installer, its preset, the model's call of its shell tool, its last turn
# (mini-swe-agent ends on a tool call: the submit command), and what stdout says at the end
SUBMIT = '{"name": "bash", "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}'
AGENTS: dict[str, tuple[Callable[[], Path | None], Callable[..., Any], str, str, str]] = {
    "claude_code": (agents.claude_code, claude_code,
                    '{"name": "Bash", "arguments": {"command": "printf olleh > answer.txt", '
                    '"description": "write the answer"}}', "done", '"result":"done"'),
    "codex": (agents.codex, codex,
              '{"name": "exec_command", "arguments": {"cmd": "printf olleh > answer.txt"}}',
              "done", "done"),
    "opencode": (agents.opencode, opencode,
                 '{"name": "bash", "arguments": {"command": "printf olleh > answer.txt", '
                 '"description": "write the answer"}}', "done", "done"),
    "mini_swe_agent": (agents.mini_swe_agent, mini_swe_agent,
                       '{"name": "bash", "arguments": {"command": "printf olleh > answer.txt"}}',
                       f"<tool_call>\n{SUBMIT}\n</tool_call>", "Saved trajectory"),
}  # fmt: skip


@pytest.mark.parametrize("sandboxed", [False, True], ids=["local", "sandbox"])
@pytest.mark.parametrize("agent", list(AGENTS))
def test_agent_runs_its_tool_and_every_call_is_recorded_token_exact(
    agent: str, renderer: treadle_native.Renderer, sandboxed: bool
) -> None:
    """The agent gets the task as its prompt and calls the model in its own dialect
    (Claude Code: Anthropic Messages; Codex: Responses; both streamed) with its own
    system prompt and tools, runs the shell tool call the model made in the work dir,
    sends the result back and ends on the model's answer. The second call extends the
    first, so the rollout is one token-exact branch."""
    install, preset, call, last, said = AGENTS[agent]
    exe = install()
    if exe is None:
        pytest.skip("npm is not installed")
    turns = [encode_qwen3(f"<tool_call>\n{call}\n</tool_call><|im_end|>"),
             encode_qwen3(f"{last}<|im_end|>")]  # fmt: skip
    gen = ScriptedGenerator(turns)
    root = Path(tempfile.mkdtemp(prefix="ag-", dir="/tmp"))  # the sandbox's socket path is short
    runtime = SandboxRuntime(LIMITS) if sandboxed else LocalRuntime()
    harness = preset(exe, timeout_s=120, workdir_root=root, runtime=runtime)
    try:
        r, state = run(harness, renderer, gen, "Write the reverse of 'hello' into answer.txt.")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0  # the tool ran: the file is there
    assert r.metrics["agent_requests"] == 2
    first, second = gen.calls
    assert len(first) > 500  # the agent's own instructions and tool schemas
    assert second[: len(first) + len(turns[0])] == first + turns[0]  # bridged
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    assert ids == second + turns[1]
    sampled = np.concatenate([to_array(n.sampled_mask) for n in r.nodes]).astype(bool)
    assert np.asarray(ids)[sampled].tolist() == turns[0] + turns[1]
    roles = [m["role"] for m in state.messages]
    assert roles[-3:] == ["assistant", "tool", "assistant"]
    assert "Write the reverse of 'hello'" in json.dumps(state.messages)
    if agent == "claude_code":  # --output-format json
        result = json.loads(state.info["stdout"])
        assert (result["result"], result["num_turns"]) == ("done", 2)
    else:
        assert said in state.info["stdout"][-400:]


def test_claude_code_preset_refuses_an_install_the_sandbox_would_hide(tmp_path: Path) -> None:
    exe = tmp_path / "claude"
    exe.write_text("#!/bin/sh\n")
    with pytest.raises(ValueError, match=r"under /tmp, which the sandbox replaces"):
        claude_code(exe, runtime=SandboxRuntime(LIMITS))
    claude_code(exe, runtime="local")  # local: any path
    with pytest.raises(ValueError, match=r"under /work, which the sandbox replaces"):
        Sandbox(tmp_path / "w", LIMITS, ro_paths=["/work/venv/lib"])
    with pytest.raises(ValueError, match="no such executable"):
        claude_code(tmp_path / "missing")
