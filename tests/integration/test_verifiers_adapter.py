"""Environments built on verifiers' own public API (PyPI ``verifiers`` 0.3.1, in a
virtualenv of its own: testkit.agents), run by Treadle: the tasks are the environment's
dataset, its own rollout loop calls the model through the rollout's interception
endpoint (every call recorded token-exactly), and its rubric's score is the reward.
Single-turn, tool use and a multi-turn environment with its own env_response; in the
local runtime and the sandbox; through `treadle eval` too."""

from __future__ import annotations

import asyncio
import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit import agents
from testkit.chat_endpoint import ScriptedEndpoint
from testkit.fake_model import ScriptedGenerator, encode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.adapters.verifiers import verifiers_environment
from treadle.env_runner.environments import Environment
from treadle.env_runner.evaluate import EvalConfig, evaluate
from treadle.env_runner.interception import InterceptionServer
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import RolloutState
from treadle.env_runner.runtimes.base import SandboxLimits
from treadle.env_runner.runtimes.sandbox import SandboxRuntime
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array
from treadle.services.errors import ConfigError

pytestmark = pytest.mark.integration

Kind = rollout_pb2.RolloutStatus.Kind

# Three environments written as verifiers' users write them (its documented API only).
ENV_MODULES = {
    "vf_reverse": """
        import verifiers as vf
        from datasets import Dataset

        def load_environment(num_examples: int = 4) -> vf.Environment:
            words = ["hello", "world", "treadle", "loom", "shuttle", "warp"][:num_examples]
            rows = [{"question": f"Reverse the word: {w}", "answer": w[::-1]} for w in words]
            dataset = Dataset.from_list(rows)

            def exact(completion, answer) -> float:
                return float(str(completion[-1]["content"]).strip() == answer)

            def length(completion) -> float:
                return float(len(str(completion[-1]["content"])))

            return vf.SingleTurnEnv(
                dataset=dataset, eval_dataset=dataset,
                system_prompt="Answer with the reversed word only.",
                rubric=vf.Rubric(funcs=[exact, length], weights=[1.0, 0.0]))
    """,
    "vf_tools": '''
        import verifiers as vf
        from datasets import Dataset

        def reverse_text(text: str) -> str:
            """Reverse a piece of text.

            Args:
                text: the text to reverse
            """
            return text[::-1]

        def load_environment() -> vf.Environment:
            rows = [{"question": f"Use the tool to reverse '{w}', then answer with it.",
                     "answer": w[::-1]} for w in ["hello", "loom"]]
            dataset = Dataset.from_list(rows)

            def correct(completion, answer) -> float:
                return float(str(completion[-1]["content"]).strip() == answer)

            return vf.ToolEnv(tools=[reverse_text], dataset=dataset, eval_dataset=dataset,
                              rubric=vf.Rubric(funcs=[correct]), max_turns=4)
    ''',
    "vf_again": """
        import verifiers as vf
        from datasets import Dataset

        class AskTwice(vf.MultiTurnEnv):
            async def env_response(self, messages, state, **kwargs):
                return [{"role": "user", "content": "again, please"}]

        def load_environment() -> vf.Environment:
            dataset = Dataset.from_list([{"question": "Reverse: hello", "answer": "olleh"}])

            def both_right(completion, answer) -> float:
                said = [m["content"] for m in completion if m["role"] == "assistant"]
                return float(len(said) == 2 and all(s.strip() == answer for s in said))

            return AskTwice(dataset=dataset, eval_dataset=dataset,
                            rubric=vf.Rubric(funcs=[both_right]), max_turns=2)
    """,
}


@pytest.fixture(scope="module")
def vf_python() -> str:
    python = agents.pip_install(agents.VERIFIERS, "python")
    if python is None:
        pytest.skip("no virtualenv can be made here")
    return str(python)


@pytest.fixture(scope="module")
def env_dir() -> Path:
    """The environments' modules, outside /tmp and /work (the sandbox replaces both)."""
    text = json.dumps(ENV_MODULES, sort_keys=True)
    folder = agents.ROOT / "verifiers-envs" / hashlib.sha256(text.encode()).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in ENV_MODULES.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return folder


@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def rollout(env: Environment, task: dict[str, Any], renderer: treadle_native.Renderer,
            gen: ScriptedGenerator) -> tuple[rollout_pb2.Rollout, RolloutState]:  # fmt: skip
    states: list[RolloutState] = []

    async def main() -> rollout_pb2.Rollout:
        async with InterceptionServer() as server:
            req = rollout_pb2.RolloutRequested(
                rollout_id="vf-1", group_id="g", env=env.name, task_id=task["id"],
                task_json=json.dumps(task),
                sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0),
            )  # fmt: skip
            rc = RolloutContext(renderer, gen, "runner-1", services={"interception": server})
            return await run_rollout(req, env, rc, states)

    return asyncio.run(main()), states[0]


def qwen3_text(ids: list[int]) -> str:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(shared_tokenizer("qwen3") / "tokenizer.json"))
    return str(tokenizer.decode(ids, skip_special_tokens=False))


SANDBOX = SandboxRuntime(SandboxLimits(wall_s=120, cpu_s=120, memory_bytes=4 << 30))


@pytest.mark.parametrize("where", ["local", "sandbox"])
def test_verifiers_single_turn_env_scores_with_its_rubric(
    vf_python: str, env_dir: Path, renderer: treadle_native.Renderer, where: str
) -> None:
    env = verifiers_environment("vf_reverse", python=vf_python, pythonpath=[env_dir],
                                split="eval", env_args={"num_examples": 3},
                                runtime="local" if where == "local" else SANDBOX)  # fmt: skip
    tasks = list(env.task_set())
    assert [t["answer"] for t in tasks] == ["olleh", "dlrow", "eldaert"]  # its args applied
    assert tasks[0]["prompt"][0] == {
        "role": "system",
        "content": "Answer with the reversed word only.",
    }
    right, _ = rollout(env, tasks[0], renderer, gen := ScriptedGenerator(["olleh<|im_end|>"]))
    assert right.status.kind == Kind.KIND_OK, right.status.message
    assert right.reward == 1.0
    assert right.metrics["verifiers_metrics.exact"] == 1.0
    assert right.metrics["verifiers_metrics.length"] == 5.0
    (prompt,) = gen.calls
    ids = np.concatenate([to_array(n.token_ids) for n in right.nodes]).tolist()
    assert ids == prompt + encode_qwen3("olleh<|im_end|>")  # the call, token-exact
    assert (
        prompt == renderer.render(tasks[0]["prompt"], add_generation_prompt=True).token_ids.tolist()
    )
    wrong, _ = rollout(env, tasks[1], renderer, ScriptedGenerator(["olleh<|im_end|>"]))
    assert wrong.status.kind == Kind.KIND_OK, wrong.status.message
    assert wrong.reward == 0.0


def test_verifiers_tool_env_runs_its_tools_and_records_one_branch(
    vf_python: str, env_dir: Path, renderer: treadle_native.Renderer
) -> None:
    env = verifiers_environment("vf_tools", python=vf_python, pythonpath=[env_dir],
                                runtime=SANDBOX)  # fmt: skip
    task = next(iter(env.task_set()))
    call = '{"name": "reverse_text", "arguments": {"text": "hello"}}'
    turns = [f"<tool_call>\n{call}\n</tool_call><|im_end|>", "olleh<|im_end|>"]
    gen = ScriptedGenerator(turns)
    r, state = rollout(env, task, renderer, gen)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["verifiers_metrics.reverse_text_calls"] == 1.0  # verifiers ran its tool
    assert r.metrics["num_branches"] == 1
    first, second = gen.calls
    assert '"name": "reverse_text"' in qwen3_text(first)  # its tool schema was shown
    assert second[: len(first) + len(encode_qwen3(turns[0]))] == first + encode_qwen3(turns[0])
    tool = next(m for m in state.messages if m["role"] == "tool")
    assert tool["content"] == "olleh"


def test_verifiers_multi_turn_env_response_is_context_never_trained(
    vf_python: str, env_dir: Path, renderer: treadle_native.Renderer
) -> None:
    env = verifiers_environment("vf_again", python=vf_python, pythonpath=[env_dir],
                                runtime="local")  # fmt: skip
    task = next(iter(env.task_set()))
    gen = ScriptedGenerator(["olleh<|im_end|>"])
    r, state = rollout(env, task, renderer, gen)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert [m["role"] for m in state.messages] == ["user", "assistant", "user", "assistant"]
    assert state.messages[2]["content"] == "again, please"  # the environment's own turn
    first, second = gen.calls
    assert second[: len(first) + 3] == first + encode_qwen3("olleh<|im_end|>")  # bridged
    users = [n for n in r.nodes if n.role == rollout_pb2.Role.ROLE_USER]
    assert any(n.content == "again, please" for n in users)
    assert not any(to_array(n.sampled_mask).any() for n in users)


def test_verifiers_environment_that_cannot_load_is_refused_naming_it(
    vf_python: str, env_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ConfigError, match=r"'vf_nope' did not load \(exit 1\): ValueError: Could not import"
    ):
        verifiers_environment("vf_nope", python=vf_python, pythonpath=[env_dir])
    with pytest.raises(
        ConfigError,
        match=r"(?s)'vf_reverse' did not load .*unexpected keyword argument 'num_exmaples'",
    ):
        verifiers_environment("vf_reverse", python=vf_python, pythonpath=[env_dir],
                              env_args={"num_exmaples": 2})  # fmt: skip
    with pytest.raises(ConfigError, match="no interpreter"):
        verifiers_environment("vf_reverse", python=tmp_path / "bin" / "python")


def test_verifiers_env_through_treadle_eval(
    vf_python: str, env_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`treadle eval` with a verifiers environment (a module naming it) against an
    OpenAI-compatible model that reverses every word but "world"."""
    module = tmp_path / "vf_eval_env.py"
    module.write_text(
        "from treadle.env_runner.adapters.verifiers import verifiers_environment\n"
        f"ENV = verifiers_environment('vf_reverse', python={vf_python!r}, "
        f"pythonpath=[{str(env_dir)!r}], runtime='local')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def reverser(body: dict[str, Any]) -> str:
        word = body["messages"][-1]["content"].rsplit(" ", 1)[-1]
        return "nope" if word == "world" else word[::-1]

    with ScriptedEndpoint(reverser) as url:
        cfg = EvalConfig.model_validate({
            "run": {"name": "vf", "output_dir": str(tmp_path)},
            "eval": {"env": "vf_eval_env:ENV", "base_url": url, "model": "m", "num_tasks": 3,
                     "rollouts_per_task": 1, "sampling": {"seed": 0, "temperature": 1.0}},
        })  # fmt: skip
        with open("/dev/null", "w") as quiet:
            summary = asyncio.run(evaluate(cfg, stream=quiet))
    assert summary["num_rollouts"] == 3
    assert summary["statuses"] == {"ok": 3}
    assert summary["means"]["reward"] == pytest.approx(2 / 3)  # "world" answered wrong
