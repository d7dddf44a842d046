"""How a trainer process starts a torchrun job: the flags, torchrun's command line, the
one line a failed job ends with, and which rank uploads which checkpoint file. The job
itself runs in tests/integration/test_trainer_ranks.py."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from treadle.services.host import load_service_config
from treadle.trainer.launch import describe_failures, expand_aliases, torchrun_argv
from treadle.trainer.spec import SPEC, DistributedSection


def test_launch_short_flags_are_config_keys() -> None:
    argv = expand_aliases(
        ["@", "run.toml", "--nproc-per-node", "4", "--nnodes=2", "--node_rank", "1",
         "--master-addr", "n0", "--master-port=29400", "--trainer.optim.lr", "1e-5"]
    )  # fmt: skip
    cfg, _ = load_service_config(SPEC, [a for a in argv if a not in ("@", "run.toml")])
    d = cfg.trainer.distributed  # type: ignore[attr-defined]
    assert (d.nproc_per_node, d.nnodes, d.node_rank) == (4, 2, 1)
    assert (d.master_addr, d.master_port, d.world_size) == ("n0", 29400, 8)
    assert argv[:2] == ["@", "run.toml"]
    assert argv[-2:] == ["--trainer.optim.lr", "1e-5"]


def test_launch_node_rank_must_be_below_nnodes() -> None:
    with pytest.raises(ValidationError, match="node ranks go from 0 to nnodes - 1"):
        DistributedSection(nnodes=2, node_rank=2)


def test_launch_torchrun_argv_one_node_and_several() -> None:
    def cfg(**kw: object) -> SimpleNamespace:
        return SimpleNamespace(trainer=SimpleNamespace(distributed=DistributedSection(**kw)))  # type: ignore[arg-type]

    one = torchrun_argv(cfg(nproc_per_node=2), ["--trainer.model", "m"])
    assert "--nproc-per-node=2" in one
    assert not any(a.startswith("--master") for a in one)  # a free localhost port
    assert one[-4:] == ["-m", "treadle.trainer", "--trainer.model", "m"]
    two = torchrun_argv(cfg(nproc_per_node=8, nnodes=2, node_rank=1, master_addr="n0"), [])
    assert {"--nnodes=2", "--node-rank=1", "--master-addr=n0", "--master-port=29500"} <= set(two)
    assert "--max-restarts=0" in two


def test_launch_failure_line_names_the_rank_that_died_first() -> None:
    def failure(local_rank: int, pid: int, exitcode: int, timestamp: int) -> SimpleNamespace:
        return SimpleNamespace(
            local_rank=local_rank, pid=pid, exitcode=exitcode, timestamp=timestamp
        )

    # torchrun SIGTERMed rank 0 after rank 1 died: rank 1 is the cause even at the same second
    line = describe_failures(
        {0: failure(0, 10, -signal.SIGTERM, 5), 1: failure(1, 11, -signal.SIGKILL, 5)}
    )
    assert line.startswith("rank 1 (local rank 1, pid 11) was killed by SIGKILL; then rank 0")
    assert "resumes from the newest checkpoint" in line
    line = describe_failures({3: failure(1, 12, 1, 7)})
    assert line.startswith("rank 3 (local rank 1, pid 12) exited with 1.")


def test_launch_each_rank_uploads_the_checkpoint_files_it_wrote() -> None:
    from treadle.trainer.checkpoint import owner

    assert owner(".metadata") == 0
    assert owner("__0_0.distcp") == 0
    assert owner("__3_0.distcp") == 3
    assert owner("rng/rank2.pt") == 2
    assert owner("rng/rank2.pt.tmp") == 0
