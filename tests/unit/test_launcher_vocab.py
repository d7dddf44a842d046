"""`treadle stack`/`rl` hand the policy model's vocabulary size to the orchestrator, so a
forged rollout with a token id outside it is refused before batching by default, and the
trainer's world size, so batches are packed for the ranks that train them.

The orchestrator's config is loaded from the very command line the launcher gives the
child; the forged rollout goes through the orchestrator's own sanity check under it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from treadle.orchestrator.samples import InvalidRollout, checked_samples
from treadle.orchestrator.spec import SPEC as ORCHESTRATOR
from treadle.orchestrator.spec import OrchestratorConfig
from treadle.proto.v1 import rollout_pb2
from treadle.services.codecs import to_token_array
from treadle.services.config import split_argv
from treadle.services.errors import ConfigError
from treadle.services.host import load_service_config
from treadle.services.launcher import (
    _wiring,
    child_sources,
    orchestrator_num_ranks,
    orchestrator_vocab_size,
    resolve,
)

VOCAB = 320


def model_folder(tmp_path: Path, vocab_size: int = VOCAB) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": vocab_size}))
    return folder


def orchestrator_config(argv: list[str], job: str = "stack") -> OrchestratorConfig:
    """The orchestrator's config as the child the launcher starts reads it."""
    sources = split_argv(argv)
    _, specs = resolve(sources, job)
    vocab = orchestrator_vocab_size(specs)
    child_argv, _ = child_sources(sources)
    wired = _wiring(ORCHESTRATOR, job, {}, vocab_size=vocab)
    cfg, _ = load_service_config(ORCHESTRATOR, [*child_argv, *wired])
    assert isinstance(cfg, OrchestratorConfig)
    return cfg


def forged(token_id: int) -> rollout_pb2.Rollout:
    """A completed rollout whose one sampled token is ``token_id``."""
    r = rollout_pb2.Rollout(rollout_id="forged", reward=1.0)
    n = r.nodes.add(node_id=0, parent_id=-1)
    n.token_ids.CopyFrom(to_token_array(np.array([1, token_id], np.int32)))
    n.sampled_mask.CopyFrom(to_token_array(np.array([0, 1], np.uint8)))
    n.logprobs.CopyFrom(to_token_array(np.array([0.0, -1.0], np.float32)))
    n.policy_versions.CopyFrom(to_token_array(np.array([-1, 0], np.int32)))
    return r


@pytest.mark.parametrize("model_flag", ["--trainer.model", "--inference.model"])
def test_stack_orchestrator_refuses_token_ids_outside_the_model_s_vocabulary(
    tmp_path: Path, model_flag: str
) -> None:
    folder = model_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")  # inference.model must look like a model
    cfg = orchestrator_config([model_flag, str(folder)])
    assert cfg.orchestrator.vocab_size == VOCAB
    checked_samples(forged(VOCAB - 1), max_policy_version=0, vocab_size=cfg.orchestrator.vocab_size)
    with pytest.raises(InvalidRollout, match="outside the vocabulary"):
        checked_samples(forged(VOCAB), max_policy_version=0, vocab_size=cfg.orchestrator.vocab_size)


def test_rl_job_orchestrator_gets_the_trainer_s_vocabulary(tmp_path: Path) -> None:
    folder = model_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    argv = ["--trainer.model", str(folder), "--inference.model", str(folder),
            "--orchestrator.tasks", "t.jsonl", "--env_runner.tokenizer", str(folder)]  # fmt: skip
    assert orchestrator_config(argv, "rl").orchestrator.vocab_size == VOCAB


def test_stack_keeps_a_vocab_size_the_run_file_set_and_warns_when_it_differs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = model_folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        cfg = orchestrator_config(
            ["--trainer.model", str(folder), "--orchestrator.vocab_size", "100"]
        )
    assert cfg.orchestrator.vocab_size == 100
    assert "orchestrator.vocab_size = 100" in caplog.text
    assert f"{VOCAB}" in caplog.text


def test_stack_without_a_policy_model_leaves_vocab_size_unset(tmp_path: Path) -> None:
    assert orchestrator_config([]).orchestrator.vocab_size is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    assert orchestrator_config(["--trainer.model", str(broken)]).orchestrator.vocab_size is None


def packed_ranks(argv: list[str], job: str = "rl") -> int:
    """orchestrator.num_ranks as the orchestrator child of this launch reads it."""
    sources = split_argv(argv)
    _, specs = resolve(sources, job)
    child_argv, _ = child_sources(sources)
    wired = _wiring(ORCHESTRATOR, job, {}, num_ranks=orchestrator_num_ranks(specs))
    cfg, _ = load_service_config(ORCHESTRATOR, [*child_argv, *wired])
    assert isinstance(cfg, OrchestratorConfig)
    return cfg.orchestrator.num_ranks


def test_rl_packs_batches_for_the_trainer_s_world_size(tmp_path: Path) -> None:
    # a 2-rank trainer refuses batches packed for 1: the launcher derives num_ranks
    folder = model_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"")
    base = ["--trainer.model", str(folder), "--inference.model", str(folder),
            "--orchestrator.tasks", "t.jsonl", "--env_runner.tokenizer", str(folder)]  # fmt: skip
    assert packed_ranks(base) == 1
    assert packed_ranks([*base, "--trainer.distributed.nproc_per_node", "2"]) == 2
    two_nodes = ["--trainer.distributed.nproc_per_node", "2", "--trainer.distributed.nnodes", "2"]
    assert packed_ranks([*base, *two_nodes]) == 4
    # set to the same value: kept; set to another: refused before anything starts
    assert packed_ranks([*base, *two_nodes, "--orchestrator.num_ranks", "4"]) == 4
    with pytest.raises(ConfigError, match=r"orchestrator.num_ranks = 2, but the trainer runs 4"):
        packed_ranks([*base, *two_nodes, "--orchestrator.num_ranks", "2"])
