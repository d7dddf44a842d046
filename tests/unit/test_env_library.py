"""The environment library: task sets, rubrics (group rewards, judge), tools, the
tool-use harness recorded token-exactly, built-in verifiers."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment, load_environment
from treadle.env_runner.envs import countdown, tool_search
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import JudgeReward, RewardError, RolloutState, Rubric
from treadle.env_runner.tasksets import TaskError, TaskSet
from treadle.env_runner.tools import Tool, ToolSet
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array

Kind = rollout_pb2.RolloutStatus.Kind
ErrorKind = rollout_pb2.RolloutStatus.ErrorKind
Truncation = rollout_pb2.RolloutStatus.Truncation


# --- task sets ---------------------------------------------------------------------------
def test_taskset_from_jsonl_names_bad_rows(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "q": 1}\n\n{"q": 2}\n{"x": 3}\n', encoding="utf-8")
    with pytest.raises(TaskError, match=r"t\[2\]: missing field 'q'"):
        TaskSet.from_jsonl(p, required=("q",))
    ts = TaskSet.from_jsonl(p, required=("q",), on_bad_row="skip")
    assert [t["id"] for t in ts] == ["a", "line3"]
    assert len(ts.skipped) == 1
    p.write_text('{"q": 1}\nnot json\n', encoding="utf-8")
    with pytest.raises(TaskError, match=r"t.jsonl:2: not valid JSON"):
        TaskSet.from_jsonl(p)


def test_taskset_from_a_hugging_face_dataset(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"q": "2+2", "a": 4}\n{"q": "3*3", "a": 9}\n{"q": "1-1", "a": 0}\n')
    ts = TaskSet.from_hf(
        "json", split="train", data_files=str(data), limit=2,
        map_row=lambda r: {"question": r["q"], "answer": r["a"]}, required=("question", "answer"),
    )  # fmt: skip
    assert [(t["id"], t["question"], t["answer"]) for t in ts] == [
        ("train-0", "2+2", 4),
        ("train-1", "3*3", 9),
    ]
    with pytest.raises(TaskError, match="missing field 'answer'"):
        TaskSet.from_hf("json", split="train", data_files=str(data), required=("answer",))


def test_generated_tasks_do_not_depend_on_n() -> None:
    a = TaskSet.from_generator(countdown.make_countdown, n=5, seed=3)
    b = TaskSet.from_generator(countdown.make_countdown, n=50, seed=3)
    assert a.rows == b.rows[:5]
    assert TaskSet.from_generator(countdown.make_countdown, n=5, seed=4).rows != a.rows


# --- rubrics --------------------------------------------------------------------------------
def _state(completion: str, **task: Any) -> RolloutState:
    return RolloutState(task=task, messages=[{"role": "assistant", "content": completion}])


def test_rubric_weights_named_arguments_and_async_rewards() -> None:
    def exact(completion: str, answer: str) -> float:
        return float(completion == answer)

    async def short(completion: str) -> float:
        return float(len(completion) < 3)

    def parts(state: RolloutState) -> dict[str, float]:
        return {"a": 1.0, "b": 0.5}

    rubric = Rubric(
        rewards=[exact, (short, 0.5), (parts, 2.0)], metrics=[lambda completion: len(completion)]
    )
    score = asyncio.run(rubric.score(_state("42", answer="42")))
    assert score.rewards == [
        ("exact", 1.0, 1.0),
        ("short", 1.0, 0.5),
        ("parts.a", 1.0, 2.0),
        ("parts.b", 0.5, 2.0),
    ]
    assert score.total == pytest.approx(1 + 0.5 + 2 + 1)
    assert score.metrics == {"<lambda>": 2.0}
    with pytest.raises(RewardError, match="exact raised TypeError: asks for answer"):
        asyncio.run(rubric.score(_state("42")))


def test_group_reward_brevity_bonus_among_correct_answers() -> None:
    def brevity(completions: list[str], answer: str) -> list[float]:
        correct = [len(c) for c in completions if answer in c]
        return [float(answer in c and len(c) == min(correct)) for c in completions]

    rubric = Rubric(group_rewards=[(brevity, 0.1)])
    states = [_state(c, answer="7") for c in ["it is 7", "7", "8", "seven or 7"]]
    out = asyncio.run(rubric.score_group(states))
    assert [r.rewards[0][1] for r in out] == [0.0, 1.0, 0.0, 0.0]
    assert all(r.rewards[0][2] == 0.1 for r in out)
    bad = Rubric(group_rewards=[lambda completions: [1.0]])
    with pytest.raises(RewardError, match="returned 1 values for 4 rollouts"):
        asyncio.run(bad.score_group(states))


class _Judge(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        verdict = "yes" if "Paris" in body["messages"][0]["content"] else "no"
        data = json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": verdict}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_llm_judge_reward_and_unreachable_judge() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        judge = JudgeReward(
            f"http://127.0.0.1:{server.server_port}/v1",
            "judge",
            "Q: {q}\nA: {completion}\nCorrect?",
        )
        rubric = Rubric(rewards=[judge])
        assert asyncio.run(rubric.score(_state("Paris", q="capital?"))).total == 1.0
        assert asyncio.run(rubric.score(_state("Rome", q="capital?"))).total == 0.0
    finally:
        server.shutdown()
        server.server_close()
    dead = Rubric(
        rewards=[
            JudgeReward(
                f"http://127.0.0.1:{server.server_port}/v1", "j", "{completion}", timeout_s=2
            )
        ]
    )
    with pytest.raises(RewardError, match=r"judge raised ConnectionError: judge at .* unreachable"):
        asyncio.run(dead.score(_state("Paris")))


# --- tools ----------------------------------------------------------------------------------
def test_tool_schema_from_signature_and_docstring() -> None:
    def lookup(
        city: str, unit: Literal["c", "f"] = "c", days: int | None = None, state: Any = None
    ) -> str:
        """Weather of a city.

        Args:
            city: the city name.
            unit: temperature unit.
        """
        return city

    s = Tool(lookup).schema()["function"]
    assert s["name"] == "lookup"
    assert s["description"] == "Weather of a city."
    assert s["parameters"] == {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city name."},
            "unit": {
                "enum": ["c", "f"],
                "type": "string",
                "description": "temperature unit.",
                "default": "c",
            },
            "days": {"type": "integer", "default": None},
        },
        "required": ["city"],
    }  # state is hidden from the model


def test_toolset_bad_calls_are_results_not_exceptions() -> None:
    tools = ToolSet([tool_search.calculator])

    def call(name: str, args: str) -> tuple[str, str]:
        r = asyncio.run(tools.call(name, args))
        return r.status, r.content

    assert call("calculator", '{"expression": "2*(3+4)"}') == ("ok", "14")
    assert call("nope", "{}")[0] == "unknown_tool"
    assert call("calculator", "{oops")[0] == "malformed"
    assert call("calculator", "[1]")[0] == "invalid_arguments"
    assert call("calculator", "{}") == (
        "invalid_arguments",
        "error: missing argument(s): expression",
    )
    assert call("calculator", '{"expression": 3}')[0] == "invalid_arguments"
    status, content = call("calculator", '{"expression": "import os"}')
    assert status == "error"
    assert "cannot evaluate" in content


# --- verifiers ------------------------------------------------------------------------------
def test_countdown_verifies_exactly() -> None:
    task = {"numbers": [3, 7, 25, 50], "target": 82}
    assert countdown.countdown_correct(task, "<answer>50 + 25 + 7</answer>") == 1.0
    assert countdown.countdown_correct(task, "50 + 25 + 7 = 82") == 1.0
    assert (
        countdown.countdown_correct(task, "<answer>50 + 25 + 7 + 0</answer>") == 0.0
    )  # 0 not given
    assert (
        countdown.countdown_correct(task, "<answer>50 + 25 + 7 + 7 - 7</answer>") == 0.0
    )  # 7 twice
    assert countdown.countdown_correct(task, "<answer>__import__('os')</answer>") == 0.0
    assert (
        countdown.countdown_correct({"numbers": [1, 3], "target": 0}, "<answer>1/3 - 1/3</answer>")
        == 0.0
    )
    assert (
        countdown.countdown_correct(
            {"numbers": [6, 4, 3], "target": 8}, "<answer>6 / 3 * 4</answer>"
        )
        == 1.0
    )
    for t in TaskSet.from_generator(countdown.make_countdown, n=20):
        assert 1 <= t["target"] <= 200 or t["target"] == sum(t["numbers"][:3])
    assert countdown.arithmetic_correct({"answer": 33}, "The answer is 33.") == 1.0
    assert countdown.arithmetic_correct({"answer": 33}, "33 or 34") == 0.0


# --- the tool-use harness, end to end with a scripted model --------------------------------
@pytest.fixture(scope="module")
def renderer() -> treadle_native.Renderer:
    return treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))


def _run(env: Environment, task: dict[str, Any], gen: ScriptedGenerator,
         renderer: treadle_native.Renderer, max_total_tokens: int = 0) -> rollout_pb2.Rollout:  # fmt: skip
    req = rollout_pb2.RolloutRequested(
        rollout_id="r", group_id="g", env=env.name, task_id=str(task.get("id", "t")), task_json=json.dumps(task),
        sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0, max_total_tokens=max_total_tokens),
    )  # fmt: skip
    return asyncio.run(run_rollout(req, env, RolloutContext(renderer, gen, "runner")))


def _call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def test_tool_use_rollout_is_recorded_token_exactly(renderer: treadle_native.Renderer) -> None:
    env = load_environment("tool_search")
    task = {
        "id": "q2",
        "question": "How many years after Brindle was Corvath founded?",
        "answer": 37,
    }
    gen = ScriptedGenerator([
        _call("search", {"query": "Brindle Corvath founded"}),
        _call("calculator", {"expression": "1749 - 1712"}),
        "<think>\n\n</think>\n\nCorvath was founded 37 years later.<|im_end|>",
    ])  # fmt: skip
    r = _run(env, task, gen, renderer)
    assert r.status.kind == Kind.KIND_OK, r.status.message
    assert r.reward == 1.0
    assert r.metrics["searches"] == 1
    assert r.metrics["calculations"] == 1
    assert r.metrics["num_turns"] == 3
    # one branch: each node's parent is the node before it
    assert [n.parent_id for n in r.nodes] == list(range(-1, len(r.nodes) - 1))
    roles = [rollout_pb2.Role.Name(n.role) for n in r.nodes]
    assert roles == [
        "ROLE_SYSTEM",
        "ROLE_USER",
        "ROLE_ASSISTANT",
        "ROLE_TOOL",
        "ROLE_ASSISTANT",
        "ROLE_TOOL",
        "ROLE_ASSISTANT",
    ]
    ids = np.concatenate([to_array(n.token_ids) for n in r.nodes]).tolist()
    # token-exact: the branch is the last prompt the model saw plus what it sampled
    assert ids == gen.calls[-1] + gen.answers[-1]
    # each call extends the previous prompt + sampled ids append-only (bridge, no re-encoding)
    assert gen.calls[1][: len(gen.calls[0]) + len(gen.answers[0])] == gen.calls[0] + gen.answers[0]
    mask = np.concatenate([to_array(n.sampled_mask) for n in r.nodes])
    assert int(mask.sum()) == sum(len(a) for a in gen.answers)
    assert "1712" in r.nodes[3].content  # the search result
    assert r.nodes[2].tool_calls[0].name == "search"
    assert r.nodes[2].tool_calls[0].status == rollout_pb2.ToolCall.Status.STATUS_OK
    # the tool-use prompt carries the tool schemas (rendered by the template)
    assert (
        "calculator"
        in renderer.render(
            [{"role": "user", "content": "x"}], tools=ToolSet(env.tools).schemas()
        ).text
    )


def test_bad_model_output_is_a_metric_and_the_rollout_goes_on(
    renderer: treadle_native.Renderer,
) -> None:
    env = load_environment("tool_search")
    task = {"id": "q0", "question": "In what year was Brindle founded?", "answer": 1712}
    gen = ScriptedGenerator([
        '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call><|im_end|>',
        _call("browse", {"url": "x"}),
        "It was founded in 1712.<|im_end|>",
    ])  # fmt: skip
    r = _run(env, task, gen, renderer)
    assert r.status.kind == Kind.KIND_OK
    assert r.reward == 1.0
    assert r.metrics["malformed_tool_calls"] == 1
    assert r.metrics["tool_unknown_tool"] == 1
    calls = [(c.name, c.status) for n in r.nodes for c in n.tool_calls]
    assert calls == [("", rollout_pb2.ToolCall.Status.STATUS_MALFORMED),
                     ("browse", rollout_pb2.ToolCall.Status.STATUS_UNKNOWN_TOOL)]  # fmt: skip
    assert "unknown tool 'browse'" in r.nodes[-2].content
    # the template cannot reproduce a malformed call, so the next turn re-renders: a new
    # branch whose assistant turn shows the raw call text the model wrote
    assert r.metrics["num_branches"] == 2
    assert '"arguments": {"query": }' in r.nodes[5].content


def test_tool_use_limits_truncate(renderer: treadle_native.Renderer) -> None:
    env = load_environment("tool_search")
    task = {"id": "q0", "question": "In what year was Brindle founded?", "answer": 1712}
    looping = ScriptedGenerator([_call("search", {"query": "Brindle"})])
    r = _run(env, task, looping, renderer)
    assert r.status.kind == Kind.KIND_TRUNCATED
    assert r.status.truncation == Truncation.TRUNCATION_MAX_TURNS
    assert r.reward == 0.0
    assert len(looping.calls) == 8
    assert rollout_pb2.Role.Name(r.nodes[-1].role) == "ROLE_TOOL"  # the last result is recorded
    r = _run(
        env,
        task,
        ScriptedGenerator([_call("search", {"query": "Brindle"})]),
        renderer,
        max_total_tokens=400,
    )
    assert r.status.truncation == Truncation.TRUNCATION_MAX_TOTAL_TOKENS


def test_harness_that_rewrites_history_starts_a_new_branch(
    renderer: treadle_native.Renderer,
) -> None:
    class Rewriter:
        async def run(self, env: Any, task: Any, session: Any, state: Any, run_sync: Any) -> None:
            await session.chat([{"role": "user", "content": "first"}])
            await session.chat([{"role": "user", "content": "second, from scratch"}])

    env = Environment(
        "rw", prompt=lambda t: "x", harness=Rewriter(), rubric=Rubric(rewards=[lambda: 1.0])
    )
    r = _run(env, {"id": "t"}, ScriptedGenerator(["a<|im_end|>"]), renderer)
    assert r.status.kind == Kind.KIND_OK
    assert [n.parent_id for n in r.nodes] == [-1, 0, -1, 2]
    assert r.metrics["num_branches"] == 2


def test_multi_turn_rollouts_become_training_samples(renderer: treadle_native.Renderer) -> None:
    """The orchestrator's view: each branch of a tool-use rollout is one sample whose loss
    mask covers exactly the sampled ids (tool results and template tokens are context)."""
    from treadle.orchestrator.samples import rollout_samples

    env = load_environment("tool_search")
    task = {"id": "q0", "question": "In what year was Brindle founded?", "answer": 1712}
    gen = ScriptedGenerator([_call("search", {"query": "Brindle"}), "Founded in 1712.<|im_end|>"])
    (sample,) = rollout_samples(_run(env, task, gen, renderer))
    assert sample.token_ids.tolist() == gen.calls[-1] + gen.answers[-1]
    sampled = [
        t for t, m in zip(sample.token_ids.tolist(), sample.loss_mask.tolist(), strict=True) if m
    ]
    assert sampled == gen.answers[0] + gen.answers[1]
    assert set(sample.logprobs[sample.loss_mask == 1].tolist()) == {-0.5}
    # a malformed call re-renders: two branches, two samples, each ending in sampled ids
    gen = ScriptedGenerator(['<tool_call>\n{"name": }\n</tool_call><|im_end|>', "1712<|im_end|>"])
    samples = rollout_samples(_run(env, task, gen, renderer))
    assert len(samples) == 2
    assert samples[1].token_ids.tolist() == gen.calls[-1] + gen.answers[-1]
