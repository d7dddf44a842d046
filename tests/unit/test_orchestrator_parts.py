"""Orchestrator building blocks: tasks, samples, batches, state (advantages:
test_algorithms.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from treadle.orchestrator.batching import build_batch
from treadle.orchestrator.samples import rollout_samples
from treadle.orchestrator.state import (
    TRAINED_TAIL,
    GroupState,
    OrchestratorState,
    load_state,
    save_state,
)
from treadle.orchestrator.tasks import Cursor, TaskSampler, load_tasks
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_array, to_token_array
from treadle.services.errors import ConfigError, DecodeError, IntegrityError
from treadle.services.objectstore import LocalObjectStore


def write_tasks(tmp_path: Path, rows: list[object]) -> Path:
    p = tmp_path / "tasks.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def test_tasks_load_and_reject_bad_lines(tmp_path: Path) -> None:
    tasks = load_tasks(write_tasks(tmp_path, [{"id": "a", "text": "x"}, {"text": "y"}]))
    assert [t.task_id for t in tasks] == ["a", "line2"]
    assert json.loads(tasks[0].json) == {"id": "a", "text": "x"}
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: not valid JSON"):
        load_tasks(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="duplicate task id 'a'"):
        load_tasks(write_tasks(tmp_path, [{"id": "a"}, {"id": "a"}]))
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_tasks(write_tasks(tmp_path, [[1, 2]]))
    with pytest.raises(ConfigError, match="not found"):
        load_tasks(tmp_path / "missing.jsonl")


def test_task_sampler_is_deterministic_resumable_and_covers_each_epoch(tmp_path: Path) -> None:
    tasks = load_tasks(write_tasks(tmp_path, [{"id": str(i)} for i in range(7)]))
    a = TaskSampler(tasks, seed=3)
    first = [a.next()[0].task_id for _ in range(10)]
    assert sorted(first[:7]) == [str(i) for i in range(7)]  # an epoch visits every task once
    assert a.cursor == Cursor(1, 3)
    b = TaskSampler(tasks, seed=3, cursor=Cursor(1, 0))  # resume at epoch 1
    assert [b.next()[0].task_id for _ in range(3)] == first[7:]
    other = TaskSampler(tasks, seed=4)
    assert [other.next()[0].task_id for _ in range(7)] != first[:7]  # the seed matters


def node(
    r: rollout_pb2.Rollout, parent: int, ids: list[int], sampled: bool, version: int = 0
) -> None:
    n = r.nodes.add(node_id=len(r.nodes), parent_id=parent)
    k = len(ids)
    n.token_ids.CopyFrom(to_token_array(np.array(ids, np.int32)))
    n.sampled_mask.CopyFrom(to_token_array(np.full(k, int(sampled), np.uint8)))
    n.logprobs.CopyFrom(to_token_array(np.full(k, -0.5 if sampled else 0.0, np.float32)))
    n.policy_versions.CopyFrom(to_token_array(np.full(k, version if sampled else -1, np.int32)))


def make_rollout(rid: str = "r1") -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(rollout_id=rid)
    node(r, -1, [1, 2, 3], False)
    node(r, 0, [4, 5], True, version=2)
    node(r, 0, [6], True, version=1)  # a second branch from the prompt
    return r


def test_samples_are_root_to_leaf_branches() -> None:
    s1, s2 = rollout_samples(make_rollout())
    assert s1.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert s1.loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert s1.policy_versions.tolist() == [-1, -1, -1, 2, 2]
    assert s1.min_policy_version == 2
    assert s2.token_ids.tolist() == [1, 2, 3, 6]
    assert s2.min_policy_version == 1


def test_samples_reject_inconsistent_nodes() -> None:
    r = make_rollout()
    r.nodes[1].logprobs.CopyFrom(to_token_array(np.zeros(5, np.float32)))  # 2 tokens, 5 logprobs
    with pytest.raises(DecodeError, match="node 1 logprobs: expected 2 elements, got 5"):
        rollout_samples(r)
    r = make_rollout()
    r.nodes[1].parent_id = 2
    with pytest.raises(DecodeError, match="does not come before it"):
        rollout_samples(r)


def test_build_batch_layout_and_arrays() -> None:
    samples = rollout_samples(make_rollout("a")) + rollout_samples(make_rollout("b"))
    for i, s in enumerate(samples):
        s.advantage = float(i)
    built = build_batch(7, samples, seq_len=8, num_ranks=2, pad_token_id=0, temperature=0.7)
    ready = built.ready
    assert ready.step == 7
    assert ready.temperature == pytest.approx(0.7)  # the trainer scores tokens at it
    assert list(ready.rollout_ids) == ["a", "b"]
    assert ready.num_samples == 4
    assert ready.num_tokens == 18
    assert (ready.min_policy_version, ready.max_policy_version) == (1, 2)
    assert len(built.batch.micro_batches) == len(ready.layout)
    assert {mb.rank for mb in built.batch.micro_batches} == {0, 1}
    seen = []
    for mb in built.batch.micro_batches:
        ids = to_array(mb.input_ids, expect_dtype="int32", expect_len=8)
        cu = to_array(mb.cu_seqlens)
        index = to_array(mb.sample_index)
        adv = to_array(mb.advantages, expect_len=8)
        mask = to_array(mb.loss_mask, expect_len=8)
        for d, si in enumerate(index):
            doc = ids[cu[d] : cu[d + 1]].tolist()
            assert doc == samples[si].token_ids.tolist()
            assert set(adv[cu[d] : cu[d + 1]][mask[cu[d] : cu[d + 1]] == 1].tolist()) <= {float(si)}
            seen.append(int(si))
    assert sorted(seen) == [0, 1, 2, 3]


def test_state_round_trip_and_corruption() -> None:
    st = OrchestratorState(step=3, epoch=1, position=4, next_group=9, trained=["x"])
    st.groups["g1"] = GroupState("g1", "t", "{}", ["g1-000", "g1-001"], 2, {"g1-000": 17})
    again = OrchestratorState.from_json(st.to_json())
    assert again == st
    assert not again.groups["g1"].done
    with pytest.raises(IntegrityError, match="unreadable"):
        OrchestratorState.from_json(b'{"format": "something else"}')


def test_state_saves_a_bounded_tail_of_trained_ids(tmp_path: Path) -> None:
    """The state is saved on every completion: its size must not grow with the run."""
    store = LocalObjectStore(tmp_path)
    st = OrchestratorState(trained=[f"r{i}" for i in range(TRAINED_TAIL + 500)])
    save_state(store, st)
    again = load_state(store)
    assert again is not None
    assert again.trained == [f"r{i}" for i in range(500, TRAINED_TAIL + 500)]
