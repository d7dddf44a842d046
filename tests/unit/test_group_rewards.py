"""Built-in group rewards: the conciseness bonus, the pairwise and ranking judges (against
a scripted OpenAI-compatible judge, testkit.chat_endpoint.ScriptedEndpoint), their
shuffle record, retries and typed errors, config tables, the RL reply, and `treadle eval`."""

from __future__ import annotations

import asyncio
import io
import json
import re
import time
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

from testkit.chat_endpoint import ScriptedEndpoint
from treadle.env_runner import Environment, Rubric
from treadle.env_runner.environments import load_environment
from treadle.env_runner.evaluate import EvalConfig, evaluate
from treadle.env_runner.group import score_group
from treadle.env_runner.group_rewards import (
    NEUTRAL,
    ConcisenessBonus,
    PairwiseJudge,
    RankingJudge,
    from_spec,
    round_robin,
)
from treadle.env_runner.judge import (
    JudgeAnswerError,
    JudgeUnavailable,
    MalformedAnswer,
    parse_preference,
    parse_ranking,
)
from treadle.env_runner.rubric import RewardError, RolloutState, Score
from treadle.env_runner.spec import EnvRunnerSection
from treadle.proto.v1 import rollout_pb2
from treadle.services.errors import ConfigError

TASK = {"id": "t1", "question": "3 + 4", "answer": 7}


def states(completions: list[str], tokens: list[int] | None = None, task: dict[str, Any] = TASK) -> list[RolloutState]:  # fmt: skip
    out = []
    for i, c in enumerate(completions):
        correct = float(re.findall(r"\d+", c)[-1:] == [str(task["answer"])])
        out.append(RolloutState(
            task=task, messages=[{"role": "user", "content": f"Compute {task['question']}."},
                                 {"role": "assistant", "content": c}],
            metrics={"completion_tokens": float(tokens[i])} if tokens else {},
            reward=correct, rewards={"correct": correct},
        ))  # fmt: skip
    return out


def score(fn: Any, group: list[RolloutState], weight: float = 1.0) -> list[Score]:
    return asyncio.run(Rubric(group_rewards=[(fn, weight)]).score_group(group))


def values(scored: list[Score]) -> list[float]:
    return [s.rewards[0][1] for s in scored]


# --- conciseness ----------------------------------------------------------------------------
def test_conciseness_linear_ties_share_the_best_rank_and_incorrect_get_nothing() -> None:
    group = states(["it is 7", "7", "8", "so: 7", "seven, so 7"], tokens=[4, 1, 1, 4, 9])
    out = score(ConcisenessBonus(), group, weight=0.2)
    # correct lengths 4, 1, 4, 9 -> ranks 1, 0, 1, 3 of 4: 1 - rank / 3
    assert values(out) == pytest.approx([2 / 3, 1.0, 0.0, 2 / 3, 0.0])
    assert all(s.rewards[0][0] == "conciseness" and s.rewards[0][2] == 0.2 for s in out)
    assert [s.metrics["conciseness.correct"] for s in out] == [1, 1, 0, 1, 1]
    assert [s.metrics["conciseness.length"] for s in out] == [4, 1, 1, 4, 9]
    assert all(s.metrics["conciseness.length_in_tokens"] == 1.0 for s in out)
    # the same group in another order: the same bonus per rollout (deterministic ties)
    again = score(ConcisenessBonus(), group[::-1])
    assert values(again)[::-1] == values(out)


def test_conciseness_shortest_only_counts_characters_without_tokens() -> None:
    group = states(["it is 7", "so 7", "8", "ok 7"])  # no completion_tokens: characters
    out = score(ConcisenessBonus(shape="shortest"), group)
    assert values(out) == [0.0, 1.0, 0.0, 1.0]  # "so 7" and "ok 7" tie at 4 characters
    assert all(s.metrics["conciseness.length_in_tokens"] == 0.0 for s in out)
    mixed = states(["it is 7", "so 7"], tokens=[5, 0])  # one without usage: characters for all
    assert [s.metrics["conciseness.length"] for s in score(ConcisenessBonus(), mixed)] == [7, 4]
    with pytest.raises(RewardError, match="has no completion_tokens"):
        score(ConcisenessBonus(length="tokens"), mixed)


def test_conciseness_all_incorrect_a_group_of_one_and_a_lone_correct_answer() -> None:
    assert values(score(ConcisenessBonus(), states(["8", "9 or 8"]))) == [0.0, 0.0]
    assert values(score(ConcisenessBonus(), states(["7"]))) == [0.0]  # nothing to be shorter than
    assert values(score(ConcisenessBonus(), states(["a long way to 7", "8"]))) == [1.0, 0.0]


def test_conciseness_correct_by_a_named_component_or_a_predicate() -> None:
    group = states(["it is 7", "7"], tokens=[3, 1])
    group[1].rewards["format"] = 0.0
    group[0].rewards["format"] = 1.0
    assert values(score(ConcisenessBonus(correct="format", threshold=0.5), group)) == [1.0, 0.0]
    assert values(score(ConcisenessBonus(correct=lambda s: "is" in s.completion), group)) == [1.0, 0.0]  # fmt: skip
    with pytest.raises(RewardError, match="correct = 'exact' names no reward of the rollout; it has: correct, format"):  # fmt: skip
        score(ConcisenessBonus(correct="exact"), group)


# --- parsers and schedule -------------------------------------------------------------------
def test_parse_preference_accepts_one_verdict_only() -> None:
    assert parse_preference("A is wrong, B is right. [[B]]") == 0.0
    assert parse_preference("<think>maybe [[B]]</think>Final: [[a]]") == 1.0
    assert parse_preference("  tie. ") == 0.5
    for bad in ("B is better", "[[A]] no wait [[B]]", "", "[[C]]"):
        with pytest.raises(MalformedAnswer):
            parse_preference(bad)


def test_parse_ranking_needs_each_response_exactly_once() -> None:
    assert parse_ranking("2 is best.\nRANKING: 2 > 3 > 1", 3) == [2, 3, 1]
    assert parse_ranking("ranking: [3], [1], [2]\n", 3) == [3, 1, 2]
    assert parse_ranking("3 > 1 > 2", 3) == [3, 1, 2]
    for bad, why in [("RANKING: 2 > 1", "leaves out response"), ("RANKING: 1 > 1 > 2", "more than once"),
                     ("RANKING: 4 > 1 > 2", "only 1..3 exist"), ("the second one", "no line")]:  # fmt: skip
        with pytest.raises(MalformedAnswer, match=why):
            parse_ranking(bad, 3)


def test_round_robin_compares_every_pair_once_in_balanced_rounds() -> None:
    for n in range(1, 8):
        pairs = round_robin(n)
        assert sorted(pairs) == list(combinations(range(n), 2))
    first_round = round_robin(6)[:3]  # a round: everyone once
    assert sorted(i for p in first_round for i in p) == list(range(6))


# --- judges -----------------------------------------------------------------------------------
def _responses(content: str) -> list[str]:
    return [
        m.strip()
        for m in re.findall(
            r"\[Response \w+\]\n(.*?)(?=\n\n\[Response|\n\n(?:Which|Rank))", content, re.S
        )
    ]


def _better(x: str, y: str) -> float:
    """1.0 when x is better: right (ends with 7) first, then shorter; 0.5 when equal."""
    kx, ky = (not x.endswith("7"), len(x)), (not y.endswith("7"), len(y))
    return 1.0 if kx < ky else 0.0 if kx > ky else 0.5


def pairwise_script(body: dict[str, Any]) -> str:
    a, b = _responses(body["messages"][-1]["content"])
    return "Reasoning... " + {1.0: "[[A]]", 0.0: "[[B]]", 0.5: "[[tie]]"}[_better(a, b)]


def ranking_script(body: dict[str, Any]) -> str:
    shown = _responses(body["messages"][-1]["content"])
    best_first = sorted(
        range(len(shown)), key=lambda i: (not shown[i].endswith("7"), len(shown[i]))
    )
    return "Thinking.\nRANKING: " + " > ".join(str(i + 1) for i in best_first)


COMPLETIONS = ["it is 7", "7", "8", "the answer is 7", "maybe 9"]


def test_pairwise_judge_win_rates_and_the_recorded_shuffle(span_exporter: Any) -> None:
    ep = ScriptedEndpoint(pairwise_script)
    with ep as url:
        judge = PairwiseJudge(url, "judge", retry_backoff_s=0)
        out = score(judge, states(COMPLETIONS))
        again = score(judge, states(COMPLETIONS))
    # best..worst: "7", "it is 7", "the answer is 7", "8", "maybe 9" (4, 3, 2, 1, 0 wins)
    assert values(out) == pytest.approx([3 / 4, 1.0, 1 / 4, 2 / 4, 0.0])
    assert [s.metrics["pairwise_judge.comparisons"] for s in out] == [4.0] * 5
    assert [s.metrics["pairwise_judge.wins"] for s in out] == [3.0, 4.0, 1.0, 2.0, 0.0]
    assert len(ep.calls) == 2 * 10  # every pair once, per scoring
    positions = [int(s.metrics["pairwise_judge.position"]) for s in out]
    assert sorted(positions) == list(range(5))
    assert positions != list(range(5))  # shuffled (this seed's permutation is not the identity)
    assert sum(s.metrics["pairwise_judge.shown_first"] for s in out) == 10
    assert [s.metrics for s in again] == [s.metrics for s in out]  # the same group: the same record
    shown = {frozenset(_responses(c["messages"][-1]["content"])) for c in ep.calls}
    assert len(shown) == 10  # ten different pairs
    order = sorted(range(5), key=lambda i: positions[i])
    # each judge call is a span (like a model call) naming the positions shown and the verdict
    calls = [s for s in span_exporter.get_finished_spans() if s.name == "judge_call"]
    assert len(calls) == 20
    for span in calls[:10]:
        a, b = (int(x) for x in re.findall(r"\d", span.attributes["treadle.judge.shown"]))
        expect = _better(COMPLETIONS[order[a]], COMPLETIONS[order[b]])
        assert float(span.attributes["treadle.judge.verdict"]) == expect
    groups = [s for s in span_exporter.get_finished_spans() if s.name == "group_reward"]
    assert [g.attributes["treadle.judge.num_calls"] for g in groups] == [10, 10]
    assert groups[0].attributes["treadle.judge.seed"] == groups[1].attributes["treadle.judge.seed"]
    for c in ep.calls:  # the judge saw the task, and two of the group's answers
        content = c["messages"][-1]["content"]
        assert "Compute 3 + 4." in content
        assert set(_responses(content)) <= set(COMPLETIONS)
        assert c["model"] == "judge"
        assert c["temperature"] == 0.0
    other = PairwiseJudge("http://127.0.0.1:9/v1", "judge", seed=1)
    assert other.shuffle(TASK, COMPLETIONS)[0] != order  # another seed, another order


def test_pairwise_judge_bounded_comparisons_and_a_group_of_one() -> None:
    ep = ScriptedEndpoint(pairwise_script)
    with ep as url:
        out = score(PairwiseJudge(url, "judge", max_comparisons=3), states(COMPLETIONS[:4]))
        assert len(ep.calls) == 2 + 1  # the first round (2 pairs), then one more
        order = sorted(range(4), key=lambda i: out[i].metrics["pairwise_judge.position"])
        shown = {frozenset(_responses(c["messages"][-1]["content"])) for c in ep.calls}
        # the record is what the judge saw: round-robin pairs of the recorded positions
        assert shown == {frozenset({COMPLETIONS[order[p]], COMPLETIONS[order[q]]})
                         for p, q in round_robin(4)[:3]}  # fmt: skip
        assert sorted(s.metrics["pairwise_judge.comparisons"] for s in out) == [1, 1, 2, 2]
        lone = score(PairwiseJudge(url, "judge"), states(["7"]))
        assert len(ep.calls) == 3  # nothing to compare: no call
    assert values(lone) == [NEUTRAL]
    assert lone[0].metrics["pairwise_judge.comparisons"] == 0.0


def test_ranking_judge_one_call_reward_from_rank_and_the_order_shown() -> None:
    ep = ScriptedEndpoint(ranking_script)
    with ep as url:
        judge = RankingJudge(url, "judge", system_prompt="Be strict.", retry_backoff_s=0)
        out = score(judge, states(COMPLETIONS))
        lone = score(judge, states(["7"]))
    assert len(ep.calls) == 1
    msgs = ep.calls[0]["messages"]
    assert msgs[0] == {"role": "system", "content": "Be strict."}
    shown = _responses(msgs[-1]["content"])
    positions = [int(s.metrics["ranking_judge.position"]) for s in out]
    assert [shown[p] for p in positions] == COMPLETIONS  # the record says where each was shown
    assert [s.metrics["ranking_judge.rank"] for s in out] == [1, 0, 3, 2, 4]
    assert values(out) == pytest.approx([3 / 4, 1.0, 1 / 4, 2 / 4, 0.0])
    assert values(lone) == [NEUTRAL]
    assert lone[0].metrics["ranking_judge.rank"] == -1


def test_judge_retries_a_malformed_answer_then_gives_a_typed_error() -> None:
    answers = iter(["I like the first one.", "RANKING: 1 > 1 > 2"])

    def flaky(body: dict[str, Any]) -> str:
        return next(answers, None) or ranking_script(body)

    ep = ScriptedEndpoint(flaky)
    with ep as url:
        out = score(
            RankingJudge(url, "judge", attempts=3, retry_backoff_s=0), states(COMPLETIONS[:3])
        )
        assert len(ep.calls) == 3
        assert values(out) == pytest.approx([0.5, 1.0, 0.0])
        ep.script = lambda body: "They are all fine."
        with pytest.raises(RewardError) as err:
            score(
                PairwiseJudge(url, "judge", attempts=2, retry_backoff_s=0), states(COMPLETIONS[:2])
            )
    assert isinstance(err.value.error, JudgeAnswerError)
    assert "pairwise_judge raised JudgeAnswerError: judge 'judge' at" in str(err.value)
    assert "no usable pairwise verdict in 2 attempt(s)" in str(err.value)
    assert "no verdict [[A]], [[B]] or [[tie]] (answer: 'They are all fine.')" in str(err.value)
    assert len(ep.calls) == 3 + 2


def test_judge_down_slow_or_refusing_is_a_typed_error_after_bounded_attempts() -> None:
    dead = PairwiseJudge("http://127.0.0.1:9/v1", "judge", attempts=2, retry_backoff_s=0)
    with pytest.raises(
        RewardError, match=r"JudgeUnavailable: .* in 2 attempt\(s\); last: unreachable"
    ):
        score(dead, states(COMPLETIONS[:2]))

    def slow(body: dict[str, Any]) -> str:
        time.sleep(1.0)
        return "[[A]]"

    statuses = iter([(503, "overloaded"), (200, "not json")])
    ep = ScriptedEndpoint(slow)
    with ep as url:
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"JudgeUnavailable: .*last: no answer within 0.2 s"):
            score(PairwiseJudge(url, "judge", timeout_s=0.2, attempts=2, retry_backoff_s=0),
                  states(COMPLETIONS[:2]))  # fmt: skip
        assert time.monotonic() - t0 < 1.5
        ep.script = lambda body: next(statuses, None) or pairwise_script(body)
        out = score(PairwiseJudge(url, "judge", attempts=3, retry_backoff_s=0), states(["7", "8"]))
        assert values(out) == [1.0, 0.0]  # a 503 and a body that is no completion were retried
        n = len(ep.calls)
        ep.script = lambda body: (401, '{"error": "bad key"}')
        with pytest.raises(RewardError, match=r"answered HTTP 401 \(not retried\)") as err:
            score(PairwiseJudge(url, "judge", attempts=3), states(["7", "8"]))
        assert isinstance(err.value.error, JudgeUnavailable)
        assert len(ep.calls) == n + 1


def test_judge_sends_the_key_from_its_env_var_and_checks_its_template(monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    ep = ScriptedEndpoint(pairwise_script)
    with ep as url:
        monkeypatch.setenv("MY_JUDGE_KEY", "sk-test")
        judge = PairwiseJudge(url, "judge", api_key_env="MY_JUDGE_KEY",
                              prompt="Q {task[question]} = {answer}?\n[Response A]\n{a}\n\n[Response B]\n{b}\n\nWhich?")  # fmt: skip
        assert values(score(judge, states(["7", "8"]))) == [1.0, 0.0]
    assert ep.calls[0]["messages"][0]["content"].startswith("Q 3 + 4 = 7?")
    assert ep.headers[0]["Authorization"] == "Bearer sk-test"
    with pytest.raises(
        ValueError, match=r"pairwise_judge prompt names \{question\}; it may use: \{a\}"
    ):
        PairwiseJudge(url, "judge", prompt="{question} {a} {b}")
    with pytest.raises(ValueError, match="not an http"):
        RankingJudge("judge:8000", "judge")


# --- config and the RL path -------------------------------------------------------------------
def test_group_rewards_from_config_tables() -> None:
    fn, weight = from_spec({"kind": "conciseness", "weight": 0.1, "shape": "shortest"})
    assert isinstance(fn, ConcisenessBonus)
    assert (weight, fn.shape) == (0.1, "shortest")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"kind": "brevity"}, "kind 'brevity': use one of conciseness, pairwise_judge"),
        ({"kind": "conciseness", "shape": "cubic"}, "shape 'cubic'"),
        ({"kind": "conciseness", "bonus": 2}, "unexpected keyword argument 'bonus'"),
        ({"kind": "pairwise_judge"}, "missing 2 required positional arguments"),
    ]
    for spec, why in cases:
        with pytest.raises(ValueError, match=why):
            from_spec(spec)
    with pytest.raises(
        ValueError, match=r"env_runner.group_rewards.countdown\[0\]: group reward kind"
    ):
        EnvRunnerSection.model_validate({"group_rewards": {"countdown": [{"kind": "x"}]}})
    env = load_environment("arithmetic", group_rewards={"arithmetic": [{"kind": "conciseness"}]})
    assert [g.name for g in env.rubric.group_rewards] == ["conciseness"]
    assert not load_environment("arithmetic").rubric.group_rewards  # the built-in is untouched
    with pytest.raises(ConfigError, match=r"env_runner\.group_rewards\.arithmetic"):
        load_environment("arithmetic", group_rewards={"arithmetic": [{"kind": "nope"}]})


def test_rl_group_score_reply_carries_the_rewards_and_the_metrics() -> None:
    """What an env runner answers the orchestrator: states rebuilt from the rollouts
    (their own rewards and completion_tokens), group rewards and the judge's record."""
    req = rollout_pb2.GroupScoreRequest(env="arithmetic", group_id="g", task_json=json.dumps(TASK))
    for i, (text, ok, tokens) in enumerate([("it is 7", 1.0, 4), ("7", 1.0, 1), ("8", 0.0, 1)]):
        r = req.rollouts.add(rollout_id=f"r{i}", reward=ok)
        r.nodes.add(
            node_id=0, parent_id=-1, role=rollout_pb2.Role.ROLE_USER, content="Compute 3 + 4."
        )
        r.nodes.add(node_id=1, parent_id=0, role=rollout_pb2.Role.ROLE_ASSISTANT, content=text)
        r.rewards.add(name="arithmetic_correct", value=ok, weight=1.0)
        r.metrics["completion_tokens"] = tokens
    ep = ScriptedEndpoint(ranking_script)
    with ep as url:
        env = Environment("arithmetic", prompt=lambda t: "x", rubric=Rubric(
            group_rewards=[(ConcisenessBonus(), 0.1), (RankingJudge(url, "judge"), 0.5)]))  # fmt: skip

        async def run_sync(fn: Any) -> Any:
            return fn()

        reply = asyncio.run(score_group(env, req, run_sync))
    assert not reply.error
    got = {g.rollout_id: g for g in reply.rollouts}
    assert {r.name: r.value for r in got["r1"].rewards} == {
        "conciseness": 1.0,
        "ranking_judge": 1.0,
    }
    assert {r.name: r.value for r in got["r0"].rewards} == {
        "conciseness": 0.0,
        "ranking_judge": 0.5,
    }
    assert all(r.from_group for g in reply.rollouts for r in g.rewards)
    assert got["r0"].metrics["conciseness.length"] == 4.0  # by tokens
    assert sorted(g.metrics["ranking_judge.position"] for g in reply.rollouts) == [0, 1, 2]


# --- treadle eval -----------------------------------------------------------------------------
def policy_script(body: dict[str, Any]) -> str:
    """Arithmetic; seed 0: right and terse, 1: wrong, 2: right and wordy, 3: wrong and wordy."""
    q = re.search(r"Compute (.+)\. Answer", body["messages"][-1]["content"])
    value = eval(q.group(1)) if q else 0
    seed = body.get("seed", 0)
    return [f"{value}", f"{value + 1}", f"So the result is {value}", f"I think it is {value + 1}"][
        seed % 4
    ]


def judge_script(body: dict[str, Any]) -> str:
    content = body["messages"][-1]["content"]
    q = re.search(r"Compute (.+)\. Answer", content)
    answer = str(eval(q.group(1))) if q else "?"
    a, b = _responses(content)
    key = [(not x.endswith(answer), len(x)) for x in (a, b)]
    return "[[A]]" if key[0] < key[1] else "[[B]]" if key[0] > key[1] else "[[tie]]"


def test_eval_applies_built_in_group_rewards_from_config(tmp_path: Path) -> None:
    policy, judge = ScriptedEndpoint(policy_script), ScriptedEndpoint(judge_script)
    with policy as policy_url, judge as judge_url:

        def cfg(name: str) -> EvalConfig:
            return EvalConfig.model_validate({
                "run": {"name": name, "output_dir": str(tmp_path)},
                "eval": {"env": "arithmetic", "base_url": policy_url, "model": "m", "num_tasks": 2,
                         "rollouts_per_task": 4, "sampling": {"seed": 0, "temperature": 1.0}},
                "env_runner": {"group_rewards": {"arithmetic": [
                    {"kind": "conciseness", "weight": 0.1},
                    {"kind": "pairwise_judge", "base_url": judge_url, "model": "j", "weight": 0.5,
                     "retry_backoff_s": 0}]}},
            })  # fmt: skip

        summary = asyncio.run(evaluate(cfg("ok"), stream=io.StringIO()))
        assert len(judge.calls) == 2 * 6  # two groups of four: every pair once
        judge.script = lambda body: "Both are fine."
        broken = asyncio.run(evaluate(cfg("bad"), stream=io.StringIO()))
    rows = [
        json.loads(x) for x in (tmp_path / "ok" / "eval" / "results.jsonl").read_text().splitlines()
    ]
    assert summary["statuses"] == {"ok": 8}
    for r in rows:  # seed = index: right+terse, wrong, right+wordy, wrong+wordy
        expect = {0: (1.0, 1.0), 1: (0.0, 1 / 3), 2: (0.0, 2 / 3), 3: (0.0, 0.0)}[r["index"]]
        assert (r["rewards"]["conciseness"], r["rewards"]["pairwise_judge"]) == pytest.approx(
            expect
        )
        assert r["reward"] == pytest.approx(
            r["rewards"]["arithmetic_correct"] + 0.1 * expect[0] + 0.5 * expect[1]
        )
        assert r["metrics"]["conciseness.length_in_tokens"] == 1.0
    for task_id in {r["task_id"] for r in rows}:
        group = [r for r in rows if r["task_id"] == task_id]
        assert sorted(r["metrics"]["pairwise_judge.position"] for r in group) == [0, 1, 2, 3]
    assert broken["statuses"] == {"error:reward": 8}  # counted, never a crash or a wrong reward
    bad = json.loads((tmp_path / "bad" / "eval" / "results.jsonl").read_text().splitlines()[0])
    assert "pairwise_judge raised JudgeAnswerError" in bad["message"]
    assert "pairwise_judge" not in bad["rewards"]
    assert bad["metrics"]["reward_error"] == 1.0


def test_orchestrator_adds_a_group_reply_to_its_rollouts_with_fake_bus() -> None:
    """The orchestrator's half of the RL path (RLLoop._score_group against a fake bus that
    answers as an env runner would): rewards and the judge's record land on the rollouts."""
    from types import SimpleNamespace

    from treadle.orchestrator.loop import RLLoop

    valid = [rollout_pb2.Rollout(rollout_id=f"r{i}", reward=1.0) for i in range(2)]
    reply = rollout_pb2.GroupScoreReply()
    for i, r in enumerate(valid):
        g = reply.rollouts.add(rollout_id=r.rollout_id)
        g.rewards.add(name="ranking_judge", value=1.0 - i, weight=0.5, from_group=True)
        g.metrics["ranking_judge.position"] = float(1 - i)

    async def request(*args: Any, **kwargs: Any) -> rollout_pb2.GroupScoreReply:
        return reply

    subjects = SimpleNamespace(groups_score=lambda env: f"groups.score.{env}")
    bus = SimpleNamespace(request=request, subjects=subjects)
    fake = SimpleNamespace(ctx=SimpleNamespace(bus=bus), env_of=lambda g: g.env,
                           cfg=SimpleNamespace(env="e", group_reward_timeout_s=1.0))  # fmt: skip
    group = SimpleNamespace(group_id="g", task_json="{}", env="e")
    assert asyncio.run(RLLoop._score_group(fake, group, valid)) == 0  # type: ignore[arg-type]
    assert [r.reward for r in valid] == [1.5, 1.0]
    assert [r.metrics["ranking_judge.position"] for r in valid] == [1.0, 0.0]
