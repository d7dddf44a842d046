"""What a run's object store keeps: trainer.keep_policies and trainer.keep_checkpoints."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from treadle.services.errors import StoreUnreachableError, TreadleError
from treadle.services.export import export_run_policy, policy_prefix, published_versions
from treadle.services.objectstore import MANIFEST_NAME, LocalObjectStore, ObjectInfo
from treadle.trainer import checkpoint, retention
from treadle.trainer.spec import TrainerSection


class RecordingStore(LocalObjectStore):
    """A local store that records the order of its deletions."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.deleted: list[str] = []
        self.listed: list[str] = []

    def _delete(self, key: str) -> None:
        self.deleted.append(key)
        super()._delete(key)

    def _list(self, prefix: str) -> list[ObjectInfo]:
        self.listed.append(prefix)
        return super()._list(prefix)


def publish_policy(store: LocalObjectStore, version: int) -> None:
    files = {
        "config.json": json.dumps({"model_type": "qwen3"}).encode(),
        "model.safetensors": f"weights of step {version}".encode(),
        "sub/extra.bin": b"x",
    }
    store.publish_dir(policy_prefix(version), files, metadata={"format": "hf-safetensors"})


def publish_checkpoint(store: LocalObjectStore, step: int, complete: bool = True) -> None:
    prefix = checkpoint.store_prefix(step)
    if complete:
        store.publish_dir(prefix, {"__0_0.distcp": b"state", "rng/rank0.pt": b"rng"}, {"step": step})
    else:  # its publication did not finish
        store.put_bytes(f"{prefix}/__0_0.distcp", b"half")


@pytest.fixture
def store(tmp_path: Path) -> RecordingStore:
    """Policies 1-9 (10 half published) and checkpoints of steps 3, 6 and 9."""
    s = RecordingStore(tmp_path / "store")
    for v in range(1, 10):
        publish_policy(s, v)
    s.put_bytes(f"{policy_prefix(10)}/model.safetensors", b"half")
    for step in (3, 6, 9):
        publish_checkpoint(s, step)
    return s


def test_keeping_everything_deletes_nothing(store: RecordingStore) -> None:
    assert retention.prune(store, 10, keep_policies=0, keep_checkpoints=0) == ([], [])
    assert store.deleted == store.listed == []  # nor lists the store each step
    assert published_versions(store) == list(range(1, 10))


def test_a_prune_lists_each_kind_once(store: RecordingStore) -> None:
    """Pruning runs after every step: checkpoints and policies are listed once each,
    whatever is deleted."""
    retention.prune(store, 9, keep_policies=2, keep_checkpoints=1)
    assert sorted(store.listed) == ["checkpoints/trainer/", "policies/"]


def test_the_newest_policies_and_those_of_checkpointed_steps_are_kept(
    store: RecordingStore,
) -> None:
    steps, versions = retention.prune(store, 9, keep_policies=2, keep_checkpoints=0)
    assert steps == []
    assert versions == [1, 2, 4, 5, 7]
    assert published_versions(store) == [3, 6, 8, 9]
    # the half-published newer one is not touched; neither is any checkpoint
    assert store.exists(f"{policy_prefix(10)}/model.safetensors")
    assert checkpoint.published_steps(store) == [9, 6, 3]
    # each directory went manifest first, and nothing of it is left, folders included
    for v in versions:
        mine = [k for k in store.deleted if k.startswith(policy_prefix(v) + "/")]
        assert mine[0] == f"{policy_prefix(v)}/{MANIFEST_NAME}"
        assert len(mine) == 4
        assert not (store.root / policy_prefix(v)).exists()
    # a second prune at the same step has nothing left to do
    store.deleted.clear()
    assert retention.prune(store, 9, keep_policies=2, keep_checkpoints=0) == ([], [])
    assert store.deleted == []


def test_a_deleted_checkpoint_no_longer_keeps_its_policy(store: RecordingStore) -> None:
    steps, versions = retention.prune(store, 9, keep_policies=2, keep_checkpoints=1)
    assert steps == [3, 6]
    assert checkpoint.published_steps(store) == [9]
    assert versions == [1, 2, 3, 4, 5, 6, 7]
    assert published_versions(store) == [8, 9]
    assert not (store.root / checkpoint.store_prefix(3)).exists()


def test_an_unfinished_checkpoint_does_not_count_as_kept(store: RecordingStore) -> None:
    publish_checkpoint(store, 12, complete=False)  # a newer one whose upload did not finish
    publish_checkpoint(store, 1, complete=False)  # an older one that never finished
    steps, _ = retention.prune(store, 9, keep_policies=0, keep_checkpoints=2)
    assert steps == [1, 3]
    assert checkpoint.published_steps(store) == [12, 9, 6]
    # the resume still finds the newest complete one
    found = checkpoint.fetch_newest(store, store.root.parent / "restore")
    assert found is not None
    assert found[0] == 9


def test_export_of_a_deleted_version_names_what_is_left(
    store: RecordingStore, tmp_path: Path
) -> None:
    retention.prune(store, 9, keep_policies=3, keep_checkpoints=0)
    with pytest.raises(TreadleError, match=r"version 4 is not in .*published: 3, 6-9"):
        export_run_policy(store, 4, None, tmp_path / "out4")
    version, _ = export_run_policy(store, 3, None, tmp_path / "out3")
    assert version == 3
    assert (tmp_path / "out3" / "model.safetensors").read_text() == "weights of step 3"


def test_a_store_outage_is_logged_and_left_for_a_later_step(
    store: RecordingStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def down(key: str) -> None:
        raise StoreUnreachableError(f"delete {key}: the store is down")

    monkeypatch.setattr(store, "_delete", down)
    monkeypatch.setattr(store, "_patiently", lambda what, op: op())  # no retries in a test
    with caplog.at_level(logging.WARNING):
        assert retention.prune(store, 9, keep_policies=2, keep_checkpoints=0) == ([], [])
    assert "could not delete old policies or checkpoints" in caplog.text
    monkeypatch.undo()
    _, versions = retention.prune(store, 9, keep_policies=2, keep_checkpoints=0)
    assert versions == [1, 2, 4, 5, 7]


def test_keeping_one_policy_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"trainer\.keep_policies = 1"):
        TrainerSection(keep_policies=1)
    assert TrainerSection(keep_policies=2, keep_checkpoints=1).keep_policies == 2
