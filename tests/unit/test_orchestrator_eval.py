"""Evaluation during training: [orchestrator.eval] validation, the round schedule, a
finished round's metrics and rows, and its place in the saved state (the loop itself:
tests/integration/test_rl_loop.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from treadle.orchestrator import evaluation
from treadle.orchestrator.evaluation import EvalRollout, round_metrics
from treadle.orchestrator.samples import rollout_samples
from treadle.orchestrator.spec import OrchestratorConfig, OrchestratorSection
from treadle.orchestrator.state import EvalRound, GroupState, OrchestratorState, eval_group_id
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.config import validate
from treadle.services.errors import ConfigError
from treadle.services.passk import pass_at_k

Kind = rollout_pb2.RolloutStatus.Kind


def heldout(tmp_path: Path, n: int = 3) -> Path:
    p = tmp_path / "heldout.jsonl"
    p.write_text("\n".join(json.dumps({"id": f"h{i}"}) for i in range(n)) + "\n")
    return p


def section(**ev: Any) -> OrchestratorSection:
    return OrchestratorSection.model_validate({"eval": ev})


# --- config ----------------------------------------------------------------------------------
def test_eval_config_is_off_by_default_and_defaults_when_on(tmp_path: Path) -> None:
    assert not OrchestratorSection().eval.enabled
    cfg = section(every_steps=5, tasks=str(heldout(tmp_path)))
    assert cfg.eval.enabled
    assert cfg.eval.at_start
    assert cfg.eval.rollouts_per_task == 1
    assert cfg.eval.num_tasks is None
    assert cfg.eval.env is None
    got = cfg.eval.sampling.resolved(cfg.sampling)
    assert got.temperature == 0.0  # greedy, whatever training samples with
    assert (got.top_p, got.top_k, got.max_tokens) == (1.0, 0, 256)  # the rest as training
    own = OrchestratorSection.model_validate({
        "sampling": {"temperature": 0.9, "max_tokens": 64},
        "eval": {"every_steps": 1, "tasks": str(heldout(tmp_path)),
                 "sampling": {"temperature": 0.5, "top_p": 0.9}},
    })  # fmt: skip
    got = own.eval.sampling.resolved(own.sampling)
    assert (got.temperature, got.top_p, got.max_tokens) == (0.5, 0.9, 64)


@pytest.mark.parametrize(
    ("ev", "match"),
    [
        ({"every_steps": 2}, r"every_steps = 2 needs orchestrator.eval.tasks"),
        ({"every_steps": 2, "tasks": "MISSING"}, r"orchestrator.eval.tasks: task file not found"),
        ({"every_steps": 2, "tasks": "DIR"}, r"orchestrator.eval.tasks: .* is a directory"),
        ({"every_steps": 2, "tasks": "BAD"}, r"orchestrator.eval.tasks: .*bad.jsonl:2: not valid"),
        ({"every_steps": 2, "tasks": "OK", "num_tasks": 4}, r"num_tasks = 4, but .* holds 3"),
        ({"every_steps": -1}, r"eval.every_steps\n.*greater than or equal to 0"),
        ({"every_steps": 1, "tasks": "OK", "rollouts_per_task": 0}, r"rollouts_per_task"),
        ({"every_steps": 1, "tasks": "OK", "env": "no spaces"}, r"orchestrator.eval.env"),
        ({"every_steps": 1, "tasks": "OK", "sampling": {"top_p": 0}}, r"top_p"),
        ({"every_steps": 1, "tasks": "OK", "typo": 1}, r"typo"),
    ],
)
def test_eval_config_bad_values_are_clear_errors(
    tmp_path: Path, ev: dict[str, Any], match: str
) -> None:
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{oops\n')
    paths = {"MISSING": tmp_path / "nope.jsonl", "DIR": tmp_path, "BAD": tmp_path / "bad.jsonl",
             "OK": heldout(tmp_path)}  # fmt: skip
    if "tasks" in ev:
        ev = {**ev, "tasks": str(paths[ev["tasks"]])}
    with pytest.raises(ValueError, match=match):
        section(**ev)


def test_eval_config_error_names_the_setting_through_the_config_loader(tmp_path: Path) -> None:
    from treadle.services.config import RawConfig

    raw = RawConfig({"orchestrator": {"eval": {"every_steps": 3}}}, {})
    with pytest.raises(ConfigError, match=r"orchestrator.eval.*needs orchestrator.eval.tasks"):
        validate(OrchestratorConfig, raw)


def test_eval_config_is_refused_in_an_sft_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"evaluation during training runs in RL runs"):
        OrchestratorSection.model_validate(
            {"mode": "sft", "eval": {"every_steps": 1, "tasks": str(heldout(tmp_path))}}
        )


# --- schedule --------------------------------------------------------------------------------
def test_eval_schedule_includes_start_every_n_and_the_final_step() -> None:
    assert evaluation.schedule(0, 10, True) == []
    assert evaluation.schedule(3, 10, True) == [0, 3, 6, 9, 10]
    assert evaluation.schedule(5, 10, False) == [5, 10]
    assert evaluation.schedule(20, 10, True) == [0, 10]


def test_eval_due_waits_for_the_step_and_skips_rounds_it_is_late_for() -> None:
    plan = [0, 2, 4, 6]
    assert evaluation.due_now(plan, 0, 0) == (0, 0)
    assert evaluation.due_now(plan, 2, 1) is None  # step 2 not published or not served yet
    assert evaluation.due_now(plan, 2, 3) == (2, 0)
    assert evaluation.due_now(plan, 2, 5) == (4, 1)  # 2 is skipped (counted), 4 evaluated
    assert evaluation.due_now(plan, -1, 9) is None  # none left
    assert evaluation.due_now(plan, 3, 3) == (3, 0)  # off the plan (the config changed)
    assert evaluation.next_after(plan, 4) == 6
    assert evaluation.next_after(plan, 6) == -1
    assert evaluation.first_due(plan, 0) == 0
    assert evaluation.first_due(plan, 3) == 4
    assert evaluation.first_due([], 0) == -1


# --- a finished round ------------------------------------------------------------------------
def rollout(rid: str, reward: float, *, kind: int = Kind.KIND_OK, versions: tuple[int, ...] = (3,),
            rewards: dict[str, float] | None = None, metrics: dict[str, float] | None = None,
            ) -> rollout_pb2.Rollout:  # fmt: skip
    r = rollout_pb2.Rollout(rollout_id=rid, reward=reward)
    r.status.kind = kind  # type: ignore[assignment]
    prompt = r.nodes.add(node_id=0, parent_id=-1, role=rollout_pb2.ROLE_USER, content="abc")
    prompt.token_ids.CopyFrom(to_token_array(np.array([1, 2], np.int32)))
    prompt.sampled_mask.CopyFrom(to_token_array(np.zeros(2, np.uint8)))
    prompt.logprobs.CopyFrom(to_token_array(np.zeros(2, np.float32)))
    prompt.policy_versions.CopyFrom(to_token_array(np.full(2, -1, np.int32)))
    k = len(versions)
    answer = r.nodes.add(node_id=1, parent_id=0, role=rollout_pb2.ROLE_ASSISTANT, content="cba")
    answer.token_ids.CopyFrom(to_token_array(np.arange(3, 3 + k, dtype=np.int32)))
    answer.sampled_mask.CopyFrom(to_token_array(np.ones(k, np.uint8)))
    answer.logprobs.CopyFrom(to_token_array(np.full(k, -0.5, np.float32)))
    answer.policy_versions.CopyFrom(to_token_array(np.array(versions, np.int32)))
    for name, value in (rewards or {}).items():
        r.rewards.add(name=name, value=value, weight=1.0)
    for name, value in (metrics or {}).items():
        r.metrics[name] = value
    return r


def done(task: str, k: int, r: rollout_pb2.Rollout) -> EvalRollout:
    return EvalRollout(task, k, r, rollout_samples(r))


def test_eval_round_metrics_means_components_pass_at_k_and_versions() -> None:
    rows = [
        done("a", 0, rollout("a0", 1.0, versions=(4, 5), rewards={"exact": 1.0}, metrics={"len": 2})),
        done("a", 1, rollout("a1", 0.0, versions=(4,), rewards={"exact": 0.0}, metrics={"len": 4})),
        done("b", 0, rollout("b0", 0.5, versions=(6,), rewards={"exact": 0.0, "fmt": 1.0})),
        done("b", 1, rollout("b1", 0.0, kind=Kind.KIND_ERROR, versions=())),
    ]  # fmt: skip
    m = round_metrics(rows, k=2, pass_reward=1.0)
    assert m["eval/num_rollouts"] == 4
    assert m["eval/num_tasks"] == 2
    assert m["eval/num_rollouts_error"] == 1
    assert m["eval/num_rollouts_truncated"] == 0
    assert m["eval/reward_mean"] == pytest.approx(1.5 / 4)  # the error counts, as treadle eval
    assert m["eval/reward_std"] == pytest.approx(float(np.std([1.0, 0.0, 0.5, 0.0])))
    assert m["eval/reward/exact"] == pytest.approx(1 / 3)
    assert m["eval/reward/fmt"] == pytest.approx(1.0)
    assert m["eval/metric/len"] == pytest.approx(3.0)
    assert m["eval/pass@1"] == pytest.approx((pass_at_k(2, 1, 1) + pass_at_k(2, 0, 1)) / 2)
    assert m["eval/pass@2"] == pytest.approx(0.5)  # a passes once in 2, b never
    assert m["eval/policy_version"] == 4
    assert m["eval/policy_version_max"] == 6


def test_eval_round_metrics_of_a_round_of_errors_and_nonfinite_rewards() -> None:
    bad = rollout("x0", math.nan, kind=Kind.KIND_ERROR)
    m = round_metrics([EvalRollout("x", 0, bad, [])], k=1, pass_reward=1.0)
    assert m["eval/num_rollouts_error"] == 1
    assert m["eval/reward_mean"] == 0.0
    assert m["eval/pass@1"] == 0.0
    assert m["eval/policy_version"] == -1  # nothing sampled
    assert round_metrics([], k=1, pass_reward=1.0) == {
        "eval/num_rollouts": 0.0, "eval/num_tasks": 0.0,
        "eval/num_rollouts_error": 0.0, "eval/num_rollouts_truncated": 0.0,
    }  # fmt: skip


def test_eval_result_rows_hold_task_reward_versions_and_the_conversation() -> None:
    rows = [done("a", 1, rollout("a1", 1.0, versions=(2, 3), rewards={"exact": 1.0}))]
    rows.append(EvalRollout("b", 0, rollout("b0", math.inf, kind=Kind.KIND_ERROR), []))
    got = [json.loads(x) for x in evaluation.result_rows(7, rows, 1.0).decode().splitlines()]
    assert got[0]["step"] == 7
    assert got[0]["task_id"] == "a"
    assert got[0]["index"] == 1
    assert got[0]["passed"]
    assert got[0]["rewards"] == {"exact": 1.0}
    assert (got[0]["policy_version_min"], got[0]["policy_version_max"]) == (2, 3)
    assert got[0]["messages"] == [{"role": "user", "content": "abc"},
                                  {"role": "assistant", "content": "cba"}]  # fmt: skip
    assert got[1]["status"] == "error"
    assert got[1]["reward"] == 0.0
    assert not got[1]["passed"]
    assert evaluation.result_rows(7, [], 1.0) == b""
    assert evaluation.results_key(7) == "eval/step-000007.jsonl"


# --- state -----------------------------------------------------------------------------------
def test_eval_round_round_trips_in_the_saved_state() -> None:
    gid = eval_group_id(4, 2)
    assert gid == "e0000004-t00002"
    assert not gid.startswith("g")
    state = OrchestratorState(step=5, eval_next=8)
    state.eval_round = EvalRound(step=4, dispatch_step=5, dispatched_version=4, env="reverse_text",
                                 dispatched_at=1.5, rounds_skipped=1)  # fmt: skip
    state.eval_round.groups[gid] = GroupState(gid, "h2", "{}", [f"{gid}-000", f"{gid}-001"], 4,
                                              completed={f"{gid}-000": 17})  # fmt: skip
    back = OrchestratorState.from_json(state.to_json())
    assert back == state
    assert back.eval_round is not None
    assert not back.eval_round.done
    back.eval_round.groups[gid].completed[f"{gid}-001"] = 18
    assert back.eval_round.done
    # a state saved before evaluation existed loads with nothing planned yet
    old = json.loads(OrchestratorState(step=3).to_json())
    del old["eval_next"], old["eval_round"]
    legacy = OrchestratorState.from_json(json.dumps(old).encode())
    assert legacy.eval_next is None
    assert legacy.eval_round is None


# --- live progress ---------------------------------------------------------------------------
def test_progress_prints_each_eval_round_and_keeps_the_training_values(tmp_path: Path) -> None:
    from treadle.proto.v1 import metrics_pb2
    from treadle.services.progress import Progress

    progress = Progress(tmp_path / "metrics.jsonl", "rl", 10)

    def record(service: str, step: int, **values: float) -> str | None:
        return progress.record(metrics_pb2.MetricsReport(service=service, step=step, values=values))

    assert record("orchestrator", 2, reward_mean=0.25, policy_lag_mean=0.5) is None
    line = record("orchestrator", 2, **{"eval/reward_mean": 0.5, "eval/pass@1": 0.4,
                                        "eval/num_rollouts": 20.0, "eval/num_rollouts_error": 1.0,
                                        "eval/policy_version": 2.0})  # fmt: skip
    assert (
        line == "[rl] eval at step 2  reward 0.500  pass@1 0.400  20 rollouts  1 errors  policy 2"
    )
    trainer = record("trainer", 2, loss=0.1)
    assert trainer is not None
    assert "reward 0.250" in trainer  # the eval row did not hide the training reward
    assert "lag 0.50" in trainer
    progress.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["service"] for r in rows] == ["orchestrator", "orchestrator", "trainer"]
    assert rows[1]["eval/pass@1"] == 0.4
    assert rows[1]["step"] == 2
