"""Several runs on one trainer process (trainer.hosted) over one real nats-server with
per-run credentials (``credentials.generate_shared``):

- `python -m treadle.trainer` hosting runs alpha, beta and gamma on one shared base: each
  run's batches arrive on its own subjects under its own NATS users; alpha and beta train
  2 steps each, announce each policy on their own POLICY stream, publish adapters in their
  own store, and export a final adapter; each published adapter equals the same run
  trained alone in this process. gamma's batch payload is corrupt: gamma stops with that
  error, alpha and beta finish untouched, and the process exits 1 naming gamma.
- A run that does not fit the base is refused before any run starts, naming the run and
  the setting.
- Isolation on the shared server (the real attack): a run's users cannot publish to,
  read, or create consumers on another run's subjects and streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.errors
import pytest
import torch

from testkit.hosted import (
    host_argv,
    last_policy,
    nats_cfg,
    run_nats_section,
    start_shared_nats,
    write_config,
)
from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import batch_pb2, policy_pb2
from treadle.services import usage
from treadle.services.bus import Bus
from treadle.services.credentials import RunCredentials
from treadle.services.errors import BusRefusedError
from treadle.services.nats_server import EmbeddedNats
from treadle.services.objectstore import LocalObjectStore
from treadle.services.supervisor import ManagedProcess
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import Trainer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUNS = ("platform", "alpha", "beta", "gamma", "delta", "epsilon")  # platform: the host's own
SEEDS = {"alpha": 1, "beta": 2, "gamma": 3, "delta": 4, "epsilon": 5}
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
ATOL = 1e-6  # another process, the same ops on the same CPU: equal up to thread scheduling


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmbeddedNats, dict[str, RunCredentials]]]:
    server, creds = start_shared_nats(tmp_path_factory.mktemp("hosted"), RUNS)
    yield server, creds
    server.stop()


def write_run_file(
    path: Path, run: str, server: EmbeddedNats, creds: RunCredentials, trainer: dict[str, Any]
) -> Path:
    return write_config(path, {
        "run": {"name": run, "output_dir": path.parent / "out"},
        "nats": run_nats_section(server, creds, "trainer"),
        "object_store": {"root": path.parent / f"store-{run}"},
        "trainer": trainer,
    })  # fmt: skip


def trainer_argv(
    tmp: Path, server: EmbeddedNats, creds: RunCredentials, model: Path, port: int,
    run_files: list[Path],
) -> list[str]:  # fmt: skip
    return [
        *host_argv("trainer", tmp, server, creds, run_files),
        "--trainer.grpc.port", str(port), "--trainer.model", str(model),
        "--trainer.device", "cpu",
        "--trainer.lora.enabled", "true", "--trainer.lora.rank", "4", "--trainer.lora.alpha", "8",
        "--trainer.lora.target_modules", '["q_proj", "v_proj"]',
    ]  # fmt: skip


async def orchestrator_of(server: EmbeddedNats, creds: RunCredentials) -> Bus:
    """A bus as the run's orchestrator user (what a run's own orchestrator holds)."""
    cfg = nats_cfg(server, creds, "orchestrator")
    return await Bus.connect(cfg, creds.run, name=f"orch-{creds.run}", role="orchestrator")


def run_host(argv: list[str], log_path: Path, timeout_s: float) -> tuple[int, str]:
    """Run the hosted trainer to its end; (exit code, its log)."""
    proc = ManagedProcess("hosted-trainer", argv, log_path).start()
    try:
        code = proc.proc.wait(timeout_s)  # type: ignore[union-attr]
    finally:
        proc.stop()
    return code, log_path.read_text()


def run_trainer(section: dict[str, Any], model: Path) -> TrainerSection:
    return TrainerSection(model=model, device="cpu", **section)


def test_trainer_hosted_runs_train_apart_on_one_base_and_one_failure_stays_its_own(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]], tmp_path: Path, free_port: int
) -> None:
    server, creds = shared
    model = tiny_qwen3(tmp_path / "model")
    vocab = vocab_size_of(model)
    sections = {
        run: {
            "seed": SEEDS[run],
            "max_steps": 2,
            "checkpoint_every": 1,
            "optim": {"lr": 1e-2 if run == "alpha" else 3e-3},
            "lora": LORA,
        }
        for run in ("alpha", "beta", "gamma")
    }
    files = [
        write_run_file(
            tmp_path / run / "run.toml",
            run,
            server,
            creds[run],
            {"model": model, "device": "cpu", **sections[run]},
        )
        for run in sections
    ]
    stores = {run: LocalObjectStore(tmp_path / run / f"store-{run}") for run in sections}
    batches = {
        run: {s: make_batch(s, vocab_size=vocab, seed=SEEDS[run]) for s in (1, 2)}
        for run in sections
    }

    async def orchestrate() -> None:
        """Each run's orchestrator (its own user) publishes its two batches; gamma's step 1
        names a payload whose sha256 is not its bytes."""
        for run in sections:
            bus = await orchestrator_of(server, creds[run])
            try:
                for step in (1, 2):
                    ready = store_batch(stores[run], batches[run][step])
                    if run == "gamma" and step == 1:
                        ready.data.sha256 = "0" * 64
                    await bus.publish(bus.subjects.batches(step), ready, msg_id=f"b{step}")
            finally:
                await bus.close()

    asyncio.run(orchestrate())
    argv = trainer_argv(tmp_path, server, creds["platform"], model, free_port, files)
    code, log = run_host(argv, tmp_path / "host.log", 300)
    assert code == 1, log[-3000:]
    assert "hosting runs alpha, beta, gamma" in log
    assert "hosted runs failed: {'gamma'" in log
    assert "sha256" in log.split("hosted runs failed")[1]

    for run in ("alpha", "beta"):
        last = asyncio.run(last_policy(server, creds[run]))
        assert last is not None
        assert (last.policy_version, last.format, last.base_model) == (2, "peft-lora", str(model))
        alone = Trainer(
            run_trainer(sections[run], model),
            LocalObjectStore(tmp_path / "alone" / run / "store"),
            checkpoint_dir=tmp_path / "alone" / run / "ckpt",
        )
        for step in (1, 2):
            result = alone.train_step(store_batch(alone.store, batches[run][step]))
            assert result.weights is not None
            mine = tmp_path / "alone" / run / f"v{step}"
            alone.store.fetch_dir(result.weights, mine)
            theirs = tmp_path / run / f"got-v{step}"
            stores[run].fetch_dir(f"policies/v{step:06d}", theirs)
            a, b = load_safetensors(mine), load_safetensors(theirs)
            assert a.keys() == b.keys()
            worst = max(float((a[k] - b[k]).abs().max()) for k in a)
            assert worst <= ATOL, f"{run} v{step} differs from the run trained alone: {worst}"
        assert (tmp_path / run / "out" / run / "final_adapter" / "adapter_config.json").is_file()
        assert stores[run].read_manifest("checkpoints/trainer/step000002").metadata["lora"]
    # the two runs' adapters differ (their own seeds, rates and batches)
    a2 = load_safetensors(tmp_path / "alpha" / "got-v2")
    b2 = load_safetensors(tmp_path / "beta" / "got-v2")
    assert any(not torch.equal(a2[k], b2[k]) for k in a2)
    # gamma trained nothing and published nothing
    assert asyncio.run(last_policy(server, creds["gamma"])) is None
    assert not (tmp_path / "gamma" / "store-gamma" / "policies").exists()


def test_trainer_hosted_refuses_a_run_that_does_not_fit_before_any_starts(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]], tmp_path: Path, free_port: int
) -> None:
    server, creds = shared
    model = tiny_qwen3(tmp_path / "model")
    good = write_run_file(
        tmp_path / "alpha" / "run.toml",
        "alpha",
        server,
        creds["alpha"],
        {"model": model, "device": "cpu", "lora": LORA},
    )
    bad = write_run_file(
        tmp_path / "beta" / "run.toml",
        "beta",
        server,
        creds["beta"],
        {"model": model, "device": "cpu", "lora": LORA | {"rank": 8}},
    )
    argv = trainer_argv(tmp_path, server, creds["platform"], model, free_port, [good, bad])
    code, log = run_host(argv, tmp_path / "host.log", 120)
    assert code != 0
    assert "run 'beta': trainer.lora.rank = 8" in log
    assert not (tmp_path / "alpha" / "store-alpha" / "policies").exists()


def test_trainer_hosted_runs_cannot_reach_each_others_subjects(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]], caplog: pytest.LogCaptureFixture
) -> None:
    """alpha's users against beta's namespace on the shared server: all refused."""
    server, creds = shared

    async def main() -> None:
        buses = {
            role: await Bus.connect(
                nats_cfg(server, creds["alpha"], role), "alpha", name=f"alpha-{role}", role=role
            )
            for role in ("trainer", "orchestrator", "inference", "admin")
        }
        beta = await Bus.connect(
            nats_cfg(server, creds["beta"], "admin"), "beta", name="beta-admin", role="admin"
        )
        try:
            before = {
                s: (await beta.js.stream_info(beta.subjects.stream_name(s))).state.messages
                for s in ("POLICY", "BATCHES")
            }
            forged = {
                "trainer": ("treadle.beta.policy.published", policy_pb2.PolicyPublished()),
                "orchestrator": ("treadle.beta.batches.1", batch_pb2.BatchReady(step=1)),
            }
            for role, (subject, message) in forged.items():
                with pytest.raises(
                    BusRefusedError,
                    match=f"the {role} user of run alpha: "
                    f'permissions violation for publish to "{subject}"',
                ):
                    await buses[role].publish(subject, message, msg_id=None, timeout_s=1.0)
            # reading beta's streams: a consumer on them, or a direct get, is never answered
            for role in ("trainer", "orchestrator", "inference", "admin"):
                js = buses[role].js
                for attempt in (
                    js.add_consumer(beta.subjects.stream_name("BATCHES"), durable_name="spy"),
                    js.get_last_msg(
                        beta.subjects.stream_name("POLICY"), "treadle.beta.policy.published"
                    ),
                    js.stream_info(beta.subjects.stream_name("ROLLOUTS")),
                ):
                    with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                        await asyncio.wait_for(attempt, 1.0)
            # and subscribing to beta's subjects directly is refused by the server
            sub = await buses["admin"].nc.subscribe("treadle.beta.>")
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await sub.next_msg(timeout=0.5)
            after = {
                s: (await beta.js.stream_info(beta.subjects.stream_name(s))).state.messages
                for s in ("POLICY", "BATCHES")
            }
            assert after == before
        finally:
            for bus in [*buses.values(), beta]:
                await bus.close()

    asyncio.run(main())
    said = caplog.text.lower()
    assert 'permissions violation for publish to "treadle.beta.policy.published"' in said
    assert 'permissions violation for subscription to "treadle.beta.>"' in said


def test_trainer_hosted_run_at_its_quota_stops_alone_counting_its_use_before(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]], tmp_path: Path, free_port: int
) -> None:
    server, creds = shared
    model = tiny_qwen3(tmp_path / "model")
    vocab = vocab_size_of(model)
    runs = ("delta", "epsilon")
    files = [
        write_run_file(
            tmp_path / run / "run.toml",
            run,
            server,
            creds[run],
            {"model": model, "device": "cpu", "seed": SEEDS[run], "max_steps": 1, "lora": LORA},
        )
        for run in runs
    ]

    async def prepare() -> None:
        """delta's ledger already bills 150 trained tokens (an earlier trainer process);
        each run's orchestrator publishes its step-1 batch."""
        cfg = nats_cfg(server, creds["delta"], "trainer")
        bus = await Bus.connect(cfg, "delta", role="trainer")
        try:
            await usage.record(bus, "trainer", "step/1", "delta", trained_tokens=150)
        finally:
            await bus.close()
        for run in runs:
            store = LocalObjectStore(tmp_path / run / f"store-{run}")
            bus = await orchestrator_of(server, creds[run])
            try:
                ready = store_batch(store, make_batch(1, vocab_size=vocab, seed=SEEDS[run]))
                await bus.publish(bus.subjects.batches(1), ready, msg_id="b1")
            finally:
                await bus.close()

    asyncio.run(prepare())
    argv = trainer_argv(tmp_path, server, creds["platform"], model, free_port, files)
    argv += ["--trainer.hosted.quotas", "{delta = {trained_tokens = 100}}"]
    code, log = run_host(argv, tmp_path / "host.log", 300)
    assert code == 1, log[-3000:]
    assert (
        "run delta: quota {'trained_tokens': 100.0}, used before 0.0 trainer s, 150 tokens" in log
    )
    failed = log.split("hosted runs failed")[1]
    assert (
        "'delta': \"QuotaExceededError: run 'delta' has used 150 trained tokens of its quota of 100"
        in failed
    )
    assert "epsilon" not in failed

    epsilon = asyncio.run(last_policy(server, creds["epsilon"]))
    assert epsilon.policy_version == 1  # trained, untouched by delta's quota
    assert asyncio.run(last_policy(server, creds["delta"])) is None
