"""The trainer's loss corrections end to end on CPU: the KL penalty's frozen reference
(built from the initial weights, never updated, compared on the same tokens) and the
sequence mask, through real train steps of a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from testkit.trainer import make_batch, store_batch, tiny_llama3, tiny_qwen3, vocab_size_of
from treadle.services.objectstore import LocalObjectStore
from treadle.trainer.errors import ModelFolderError
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def make_trainer(model_dir: Path, root: Path, loss: dict[str, object]) -> Trainer:
    section = TrainerSection(model=model_dir, optim={"lr": 1e-2}, loss=loss)  # type: ignore[arg-type]
    return Trainer(section, LocalObjectStore(root / "store"), checkpoint_dir=root / "ckpt")


def test_trainer_kl_reference_is_a_frozen_copy_of_the_initial_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    trainer = make_trainer(model_dir, tmp_path, {"kl_coef": 0.1, "sequence_mask": "geometric"})
    assert trainer.reference is not None
    frozen = {k: v.clone() for k, v in trainer.reference.hf_state_dict().items()}
    vocab = vocab_size_of(model_dir)
    first = trainer.train_step(store_batch(trainer.store, make_batch(1, vocab_size=vocab))).metrics
    assert first["kl_ref"] == 0.0  # the policy still is the reference: identical logprobs
    assert "seq_masked_fraction" in first
    second = trainer.train_step(store_batch(trainer.store, make_batch(2, vocab_size=vocab))).metrics
    assert second["kl_ref"] > 0.0  # the policy moved; the reference did not
    after = trainer.reference.hf_state_dict()
    assert all(torch.equal(after[k], frozen[k]) for k in frozen)
    assert all(not p.requires_grad for p in trainer.reference.model.parameters())


def test_trainer_without_kl_builds_no_reference(model_dir: Path, tmp_path: Path) -> None:
    trainer = make_trainer(model_dir, tmp_path, {"kind": "tis"})
    assert trainer.reference is None
    m = trainer.train_step(
        store_batch(
            trainer.store, make_batch(1, vocab_size=vocab_size_of(model_dir), logprob_scale=40)
        )
    ).metrics
    assert "kl_ref" not in m
    assert 0.0 < m["truncated_fraction"] < 1.0  # noisy behaviour logprobs: some r > 2


def test_trainer_reference_with_another_vocabulary_is_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    other = tiny_llama3(tmp_path / "llama", vocab_size=320)
    with pytest.raises(
        ModelFolderError, match=r"trainer.loss.reference_model = .*llama: vocabulary of 320 tokens"
    ):
        make_trainer(model_dir, tmp_path, {"kl_coef": 0.1, "reference_model": str(other)})
