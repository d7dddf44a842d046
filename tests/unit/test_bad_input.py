"""Bad input gets a clear error, never a traceback or a silent wrong value (design
invariant 6): task files, metrics.jsonl, object-store refs and symlinks, rollout requests
and the rollout sanity checks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from treadle.env_runner.service import request_problem
from treadle.orchestrator.samples import InvalidRollout, checked_samples
from treadle.orchestrator.tasks import load_tasks
from treadle.proto.v1 import common_pb2, metrics_pb2, rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.errors import ConfigError, IntegrityError, StoreUnavailableError
from treadle.services.objectstore import LocalObjectStore
from treadle.services.progress import Progress


def test_load_tasks_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is a directory"):
        load_tasks(tmp_path)


def test_load_tasks_binary_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_tasks(path)


def test_load_tasks_deeply_nested_json_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_tasks(path)


def test_progress_writes_non_finite_metrics_as_null(tmp_path: Path) -> None:
    progress = Progress(tmp_path / "metrics.jsonl", "rl", None)
    progress.record(metrics_pb2.MetricsReport(
        service="trainer", step=1, values={"loss": math.nan, "grad_norm": math.inf, "lr": 0.5}
    ))  # fmt: skip
    progress.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert row["loss"] is None
    assert row["grad_norm"] is None
    assert row["lr"] == 0.5


def test_local_store_refuses_symlinks_out_of_its_root(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    secret = tmp_path / "secret"
    secret.write_text("do not read")
    (store.root / "claims").mkdir()
    (store.root / "claims" / "link").symlink_to(secret)
    (store.root / "dir").symlink_to(tmp_path)
    with pytest.raises(ValueError, match="symlink"):
        store.get_bytes("claims/link")
    with pytest.raises(ValueError, match="symlink"):
        store.get_bytes("dir/secret")
    with pytest.raises(ValueError, match="symlink"):
        store.put_bytes("dir/planted", b"x")
    assert not (tmp_path / "planted").exists()


def test_local_store_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailableError, match="is a file"):
        LocalObjectStore(tmp_path / "file" / "store")


def test_local_store_refuses_a_ref_without_sha256(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    ref = store.put_bytes("a/b", b"payload")
    unchecked = common_pb2.ObjectRef(uri=ref.uri, size_bytes=ref.size_bytes)
    with pytest.raises(IntegrityError, match="no valid sha256"):
        store.get_bytes(unchecked)
    with pytest.raises(IntegrityError, match="no valid sha256"):
        store.get_file(unchecked, tmp_path / "out")
    assert store.get_bytes(ref) == b"payload"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", math.nan, "temperature"),
        ("temperature", -1.0, "temperature"),
        ("top_p", math.inf, "top_p"),
        ("top_p", 2.0, "top_p"),
        ("top_k", -3, "top_k"),
        ("max_tokens", -1, "max_tokens"),
    ],
)
def test_request_problem_names_the_bad_sampling_field(
    field: str, value: float, message: str
) -> None:
    req = rollout_pb2.RolloutRequested(rollout_id="r", env="e")
    setattr(req.sampling, field, value)
    assert message in request_problem(req)


def test_request_problem_accepts_defaults() -> None:
    assert request_problem(rollout_pb2.RolloutRequested(rollout_id="r", env="e")) == ""


def _rollout(ids: list[int], versions: int = 0, mask: int = 1) -> rollout_pb2.Rollout:
    r = rollout_pb2.Rollout(rollout_id="r", reward=1.0)
    n = r.nodes.add(node_id=0, parent_id=-1)
    k = len(ids)
    n.token_ids.CopyFrom(to_token_array(np.array(ids, np.int64).astype(np.int32)))
    n.sampled_mask.CopyFrom(to_token_array(np.full(k, mask, np.uint8)))
    n.logprobs.CopyFrom(to_token_array(np.full(k, -1.0, np.float32)))
    n.policy_versions.CopyFrom(to_token_array(np.full(k, versions, np.int32)))
    return r


def test_checked_samples_refuses_forged_rollouts() -> None:
    ok = checked_samples(_rollout([1, 2]), max_policy_version=0, vocab_size=10)
    assert [s.num_tokens for s in ok] == [2]
    for bad, match in [
        (_rollout([-5, 1]), "outside the vocabulary"),
        (_rollout([2_000_000_000]), "outside the vocabulary"),
        (_rollout([1], versions=7), "policy versions"),
        (_rollout([1], mask=3), "sampled_mask"),
    ]:
        with pytest.raises(InvalidRollout, match=match):
            checked_samples(bad, max_policy_version=0, vocab_size=10)
    nan_reward = _rollout([1])
    nan_reward.reward = math.nan
    with pytest.raises(InvalidRollout, match="reward"):
        checked_samples(nan_reward, max_policy_version=0, vocab_size=10)
    short = _rollout([1, 2])
    short.nodes[0].logprobs.CopyFrom(to_token_array(np.zeros(1, np.float32)))
    with pytest.raises(InvalidRollout, match="expected 2 elements"):
        checked_samples(short, max_policy_version=0, vocab_size=None)
