"""Self-distillation: the policy, given privileged context in its prompt, is the teacher.

The env runner renders each branch's prompt again with the context; the teacher scores
those ids followed by the branch's own ids. The alignment is checked against an
independent rollout in which the model *was* given the context from the start: the
teacher's sequence must be exactly that rollout's tokens (multi-turn, tool calls, a
re-rendered branch), under a family port and the generic (Jinja) renderer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest

import treadle_native
from testkit.fake_model import ScriptedGenerator, decode_qwen3
from testkit.paths import shared_tokenizer
from treadle.env_runner.environments import Environment, load_environment
from treadle.env_runner.rollout import RolloutContext, run_rollout
from treadle.env_runner.rubric import Rubric
from treadle.env_runner.session import with_privileged
from treadle.orchestrator.algorithms import AlgorithmError, Algorithms, Group, resolve
from treadle.orchestrator.samples import Sample, checked_samples, rollout_samples
from treadle.orchestrator.spec import OrchestratorSection, TeacherSection
from treadle.orchestrator.teacher import NoPrivilegedContext, Teacher, view_of
from treadle.proto.v1 import rollout_pb2
from treadle.services.errors import ConfigError
from treadle.services.inference_client import PromptTopK

Kind = rollout_pb2.RolloutStatus.Kind
HINT = "(The answer is 1712.)"


@pytest.fixture(scope="module", params=["qwen3", "jinja"])
def renderer(request: pytest.FixtureRequest) -> treadle_native.Renderer:
    return treadle_native.Renderer(request.param, shared_tokenizer("qwen3"))


def _call(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def _run(env: Environment, task: dict[str, Any], gen: ScriptedGenerator,
         renderer: treadle_native.Renderer, *, want: bool = True) -> rollout_pb2.Rollout:  # fmt: skip
    req = rollout_pb2.RolloutRequested(
        rollout_id="r", group_id="g", env=env.name, task_id="t", task_json=json.dumps(task),
        sampling=rollout_pb2.SamplingParams(max_tokens=64, temperature=1.0),
        want_privileged_prompts=want,
    )  # fmt: skip
    return asyncio.run(run_rollout(req, env, RolloutContext(renderer, gen, "runner")))


def _envs() -> tuple[Environment, Environment]:
    """tool_search with privileged context, and the same environment whose prompt holds
    that context from the start (what the teacher is meant to have seen)."""
    base = load_environment("tool_search")
    student = Environment(
        "tool_search", prompt=base.prompt_fn, rubric=base.rubric, tools=base.tools,
        system_prompt=base.system_prompt, required=base.required, privileged=lambda t: HINT,
    )  # fmt: skip
    told = Environment(
        "tool_search", prompt=lambda t: with_privileged(base.prompt(t), HINT),
        rubric=base.rubric, tools=base.tools, required=base.required,
    )  # fmt: skip
    return student, told


TASK = {"id": "q0", "question": "In what year was Brindle founded?", "answer": 1712}
GROUP = Group("g", "tool_search", "{}", [], np.zeros(0), [], np.zeros(0, np.int64))


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(["Brindle was founded in 1712.<|im_end|>"], id="single-turn"),
        pytest.param(
            [
                _call("search", {"query": "Brindle founded"}),
                _call("calculator", {"expression": "1749 - 37"}),
                "<think>\nchecked\n</think>\n\nIt was founded in 1712.<|im_end|>",
            ],
            id="tool-calls",
        ),
        pytest.param(
            [
                '<tool_call>\n{"name": }\n</tool_call><|im_end|>',
                _call("search", {"query": "x"}),
                "1712<|im_end|>",
            ],
            id="re-rendered-branch",
        ),
    ],
)
def test_teacher_sequence_is_the_rollout_the_model_would_have_had_with_the_context(
    renderer: treadle_native.Renderer, script: list[str]
) -> None:
    student_env, told_env = _envs()
    student_gen, told_gen = ScriptedGenerator(script), ScriptedGenerator(script)
    student = _run(student_env, TASK, student_gen, renderer)
    told = _run(told_env, TASK, told_gen, renderer, want=False)
    assert student.status.kind == told.status.kind == Kind.KIND_OK, student.status.message
    assert len(student.privileged_prompts) == student.metrics["num_branches"]
    samples, told_samples = rollout_samples(student), rollout_samples(told)
    assert len(samples) == len(told_samples) >= 1
    for smp, ref in zip(samples, told_samples, strict=True):
        view = view_of(smp, GROUP, self_distill=True)
        # the teacher scores exactly the tokens of the rollout given the context ...
        assert view.token_ids.tolist() == ref.token_ids.tolist()
        # ... and each of the student's sampled tokens sits where the teacher scores it
        on = np.flatnonzero(smp.loss_mask)
        assert (view.token_ids[on + view.offset] == smp.token_ids[on]).all()
        assert (ref.loss_mask[on + view.offset] == 1).all()
        assert int(ref.loss_mask.sum()) == on.size
        # the context is in the teacher's prompt and not in the student's
        text = decode_qwen3(view.token_ids[: smp.num_replaced + view.offset].tolist())
        assert HINT in text
        assert HINT not in decode_qwen3(smp.token_ids.tolist())


class PrefixServer:
    """A teacher server whose logprob at each position depends on the whole prefix, so
    an off-by-one or a wrong offset shows up as a different number."""

    base_url = "http://policy:1"

    def __init__(self) -> None:
        self.requests: list[list[int]] = []

    @staticmethod
    def logprob(prefix: list[int]) -> float:
        return -float(hash(tuple(prefix)) % 997) / 100

    async def prompt_topk_many(
        self, sequences: Any, top_k: int, *, timeout_s: float | None = None
    ) -> list[PromptTopK]:
        assert top_k == 0, "distill asks only the sampled tokens' logprobs"
        out = []
        for seq in sequences:
            ids = [int(t) for t in seq]
            self.requests.append(ids)
            lp = np.array([self.logprob(ids[: i + 1]) for i in range(1, len(ids))], np.float32)
            out.append(PromptTopK(lp, np.zeros((lp.size, 0), np.int32),
                                  np.zeros((lp.size, 0), np.float32)))  # fmt: skip
        return out

    async def aclose(self) -> None: ...


def _group(rollout: rollout_pb2.Rollout, env: str = "tool_search") -> Group:
    samples = rollout_samples(rollout)
    return Group("g", env, "{}", [rollout], np.array([rollout.reward]), samples,
                 np.zeros(len(samples), np.int64))  # fmt: skip


def test_self_teacher_logprobs_are_the_policys_given_the_context() -> None:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    student_env, _ = _envs()
    script = [_call("search", {"query": "Brindle"}), "Founded in 1712.<|im_end|>"]
    rollout = _run(student_env, TASK, ScriptedGenerator(script), renderer)
    server = PrefixServer()
    teacher = Teacher(TeacherSection(self_distill=True, student_url=server.base_url), [server])
    group = _group(rollout)
    (got,) = asyncio.run(teacher(group))
    (smp,) = group.samples
    view = view_of(smp, group, self_distill=True)
    assert server.requests == [view.token_ids.tolist()]
    teacher_ids = view.token_ids.tolist()
    for j in range(smp.num_tokens):
        want = PrefixServer.logprob(teacher_ids[: j + view.offset + 1]) if smp.loss_mask[j] else 0.0
        assert got[j] == pytest.approx(want), j
    assert teacher.take_metrics()["teacher_num_tokens"] == int(smp.loss_mask.sum())


def test_self_distill_advantage_through_the_distill_algorithm() -> None:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    student_env, _ = _envs()
    rollouts = []
    for k in range(2):
        r = _run(student_env, TASK, ScriptedGenerator([f"{1712 + k}<|im_end|>"]), renderer)
        r.rollout_id = f"r{k}"
        rollouts.append(r)
    server = PrefixServer()
    teacher = Teacher(TeacherSection(self_distill=True, student_url=server.base_url), [server])
    algos = Algorithms({"tool_search": resolve("distill", {}, "orchestrator.algorithm")},
                       {"teacher_logprobs": teacher})  # fmt: skip
    out = asyncio.run(algos.score("tool_search", "g", "{}", rollouts, max_policy_version=0,
                                  vocab_size=None))  # fmt: skip
    assert len(out.samples) == 2
    assert not out.refused
    assert out.num_errors == 0
    for smp in out.samples:
        on = smp.loss_mask == 1
        assert smp.advantages is not None
        assert np.all(smp.advantages[~on] == 0)
        assert np.any(smp.advantages[on] != 0)


def test_a_group_without_privileged_prompts_stops_the_run_naming_the_environment() -> None:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    plain = load_environment("tool_search")  # no privileged context
    rollout = _run(plain, TASK, ScriptedGenerator(["1712<|im_end|>"]), renderer)
    assert not rollout.privileged_prompts
    server = PrefixServer()
    teacher = Teacher(TeacherSection(self_distill=True, student_url=server.base_url), [server])
    with pytest.raises(
        NoPrivilegedContext, match=r"'tool_search'.*Environment\(privileged=\.\.\.\)"
    ):
        asyncio.run(teacher(_group(rollout)))
    assert server.requests == []


def test_a_sample_without_privileged_prompt_beside_others_refuses_its_group() -> None:
    """Some rollouts of the group carry one and this one does not (its branch has no user
    message to add the context to): that group is refused, the run goes on."""
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    student, _ = _envs()
    rollout = _run(student, TASK, ScriptedGenerator(["1712<|im_end|>"]), renderer)
    assert rollout.privileged_prompts
    bare = rollout_pb2.Rollout()
    bare.CopyFrom(rollout)
    del bare.privileged_prompts[:]
    bare.rollout_id = rollout.rollout_id + "-bare"
    samples = rollout_samples(rollout) + rollout_samples(bare)
    group = Group("g", "tool_search", "{}", [rollout, bare], np.zeros(2), samples,
                  np.zeros(len(samples), np.int64))  # fmt: skip
    server = PrefixServer()
    teacher = Teacher(TeacherSection(self_distill=True, student_url=server.base_url), [server])
    with pytest.raises(AlgorithmError, match="no privileged prompt for its branch"):
        asyncio.run(teacher(group))
    assert server.requests == []
    assert teacher.take_metrics()["num_teacher_errors"] == 1


def test_privileged_prompts_only_when_asked_and_environment_errors_are_data() -> None:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    student_env, _ = _envs()
    r = _run(student_env, TASK, ScriptedGenerator(["1712<|im_end|>"]), renderer, want=False)
    assert r.status.kind == Kind.KIND_OK
    assert not r.privileged_prompts

    def broken(task: dict[str, Any]) -> str:
        raise KeyError("answer")

    env = Environment("e", prompt=lambda t: "q", rubric=Rubric(rewards=[lambda: 1.0]),
                      privileged=broken)  # fmt: skip
    r = _run(env, {"id": "t"}, ScriptedGenerator(["a<|im_end|>"]), renderer)
    assert r.status.error_kind == rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_ENV
    assert "privileged context" in r.status.message
    # a conversation without a user message records no privileged prompt (counted)
    env = Environment("e", prompt=lambda t: [{"role": "system", "content": "go"}],
                      rubric=Rubric(rewards=[lambda: 1.0]), privileged=lambda t: "hint")  # fmt: skip
    r = _run(env, {"id": "t"}, ScriptedGenerator(["a<|im_end|>"]), renderer)
    assert r.status.kind == Kind.KIND_OK
    assert not r.privileged_prompts
    assert r.metrics["privileged_prompt_errors"] == 1


def test_with_privileged_adds_to_the_first_user_message() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "user", "content": "q2"}]  # fmt: skip
    out = with_privileged(msgs, "H")
    assert [m["content"] for m in out] == ["s", "q\n\nH", "q2"]
    assert msgs[1]["content"] == "q"  # the input is left as it was
    parts = with_privileged([{"role": "user", "content": [{"type": "text", "text": "q"}]}], "H")
    assert parts[0]["content"][-1] == {"type": "text", "text": "H"}
    with pytest.raises(ValueError, match="no user message"):
        with_privileged([{"role": "system", "content": "s"}], "H")


def test_forged_privileged_prompts_are_refused() -> None:
    renderer = treadle_native.Renderer("qwen3", shared_tokenizer("qwen3"))
    student_env, _ = _envs()
    good = _run(student_env, TASK, ScriptedGenerator(["1712<|im_end|>"]), renderer)

    def forged(**change: Any) -> rollout_pb2.Rollout:
        r = rollout_pb2.Rollout()
        r.CopyFrom(good)
        p = r.privileged_prompts[0]
        for k, v in change.items():
            setattr(p, k, v)
        return r

    first_sampled = int(np.flatnonzero(rollout_samples(good)[0].loss_mask)[0])
    for change, match in [
        ({"num_replaced": first_sampled + 1}, "past the branch's first sampled token"),
        ({"root_node_id": 1}, "not a root"),
        ({"root_node_id": 99}, "no such node"),
        ({"num_replaced": -1}, "replaces -1 tokens"),
    ]:
        with pytest.raises(Exception, match=match):
            checked_samples(forged(**change), max_policy_version=0, vocab_size=None)
    # ids outside the vocabulary never reach the teacher
    r = forged()
    r.privileged_prompts[0].token_ids.data = np.array([10**6], np.int32).tobytes()
    r.privileged_prompts[0].token_ids.shape[:] = [1]
    with pytest.raises(Exception, match="outside the vocabulary"):
        checked_samples(r, max_policy_version=0, vocab_size=151669)


def test_config_self_distill_needs_no_teacher_urls() -> None:
    cfg = OrchestratorSection.model_validate(
        {"env": "arithmetic", "algorithm": "distill", "teacher": {"self_distill": True}}
    )
    assert cfg.teacher.enabled
    assert cfg.teacher.servers == []
    with pytest.raises(ConfigError, match="student_url"):
        Teacher(cfg.teacher)
    section = TeacherSection(self_distill=True, student_url="http://127.0.0.1:9")
    assert section.servers == ["http://127.0.0.1:9"]
    assert TeacherSection(self_distill=True, urls=["http://a:1"]).servers == ["http://a:1"]


def test_sample_without_privileged_prompt_keeps_plain_distillation() -> None:
    smp = Sample("r", 1, np.array([1, 2, 3], np.int32), np.array([0, 1, 1], np.uint8),
                 np.zeros(3, np.float32), np.zeros(3, np.int32))  # fmt: skip
    view = view_of(smp, GROUP, self_distill=False)
    assert view.token_ids is smp.token_ids
    assert (view.start, view.offset) == (1, 0)
