"""Runs added to and removed from a running hosted trainer (trainer.hosted.accept_runs,
the HostedRuns RPCs), over one real nats-server with per-run credentials:

- a trainer started with no runs takes alpha (AddRun), then beta while alpha trains; both
  train; RemoveRun of alpha between its steps checkpoints it and frees its adapter, while
  beta trains on to its max_steps untouched (equal to beta trained alone) and stays
  listed, stopped; alpha added again resumes from its checkpoint and its last policy equals
  alpha trained alone without a break. The trainer outlives every run and stops cleanly.
- AddRun refusals name the problem and leave nothing behind, the hosted run training on:
  a LoRA rank that does not fit (INVALID_ARGUMENT), a name already hosted
  (ALREADY_EXISTS), a missing file (INVALID_ARGUMENT), a run whose checkpoint cannot be
  resumed (INVALID_ARGUMENT, after its adapter was made: freed again), a call without the
  control token (UNAUTHENTICATED). A run at its AddRun quota fails alone and stays listed,
  failed, until removed.
- SharedBase.remove_run frees the run's adapter tensors, optimizer state and fair-share
  entry (in process); RemoveRun of a run that is not hosted is harmless.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import torch

from testkit.hosted import host_argv, nats_cfg, run_nats_section, start_shared_nats, write_config
from testkit.procs import wait_healthy
from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import common_pb2, platform_service_pb2, platform_service_pb2_grpc
from treadle.services.bus import Bus
from treadle.services.credentials import RunCredentials
from treadle.services.nats_server import EmbeddedNats
from treadle.services.objectstore import LocalObjectStore
from treadle.services.rpc import ControlSecurity, open_channel
from treadle.services.supervisor import ManagedProcess, tail
from treadle.trainer.hosted import HOSTED_RUNS, HostedApp, HostedRuns
from treadle.trainer.models.hf import load_safetensors
from treadle.trainer.spec import SPEC, TrainerSection
from treadle.trainer.tenancy import SharedBase
from treadle.trainer.trainer import Trainer

PB = platform_service_pb2
RUNS = ("platform", "alpha", "beta", "gamma", "delta", "epsilon")  # platform: the host's own
SEEDS = {"alpha": 1, "beta": 2, "gamma": 3, "delta": 4, "epsilon": 5}
LORA = {"enabled": True, "rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}
ATOL = 1e-6  # another process, the same ops on the same CPU: equal up to thread scheduling


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmbeddedNats, dict[str, RunCredentials]]]:
    server, creds = start_shared_nats(tmp_path_factory.mktemp("hosted-runtime"), RUNS)
    yield server, creds
    server.stop()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def write_run_file(
    root: Path, run: str, server: EmbeddedNats, creds: RunCredentials, trainer: dict[str, Any],
    *, name: str | None = None,
) -> Path:  # fmt: skip
    """``root``/``run``/run.toml: run ``name`` (default ``run``) as ``run``'s users."""
    folder = root / run
    return write_config(folder / "run.toml", {
        "run": {"name": name or run, "output_dir": folder / "out"},
        "nats": run_nats_section(server, creds, "trainer"),
        "object_store": {"root": folder / "store"},
        "trainer": trainer,
    })  # fmt: skip


class Host:
    """A hosted trainer process accepting runs, and its clients."""

    def __init__(
        self, root: Path, server: EmbeddedNats, creds: RunCredentials, model: Path, port: int,
        token: str | None = None,
    ):  # fmt: skip
        argv = host_argv("trainer", root, server, creds, [])  # python -m treadle.trainer
        argv += [
            "--trainer.hosted.accept_runs", "true", "--trainer.grpc.port", str(port),
            "--trainer.model", str(model), "--trainer.device", "cpu",
            "--trainer.lora.enabled", "true", "--trainer.lora.rank", "4",
            "--trainer.lora.alpha", "8", "--trainer.lora.target_modules", '["q_proj", "v_proj"]',
        ]  # fmt: skip
        if token is not None:
            token_file = root / "control.token"
            token_file.write_text(token)
            token_file.chmod(0o600)
            argv += ["--control.token_file", str(token_file)]
        self.target = f"127.0.0.1:{port}"
        self.security = ControlSecurity(token=token)
        self.log = root / "host.log"
        self.proc = ManagedProcess("hosted-trainer", argv, self.log)

    def __enter__(self) -> Host:
        self.proc.start()
        try:
            asyncio.run(wait_healthy(self.proc, self.target, timeout_s=120))
        except BaseException:
            self.proc.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(30)

    def tail(self) -> str:
        return tail(self.log, 60)

    def channel(self, security: ControlSecurity | None = None) -> grpc.aio.Channel:
        return open_channel(
            self.target, [SPEC.control, HOSTED_RUNS], security=security or self.security
        )


async def add(ch: grpc.aio.Channel, run_file: Path, **quota: Any) -> Any:
    stub = platform_service_pb2_grpc.HostedRunsStub(ch)
    request = PB.AddRunRequest(run_file=str(run_file), quota=PB.HostedQuota(**quota))
    return await stub.AddRun(request, timeout=120)


async def remove(ch: grpc.aio.Channel, run: str, reason: str = "") -> Any:
    stub = platform_service_pb2_grpc.HostedRunsStub(ch)
    return await stub.RemoveRun(PB.RemoveRunRequest(run=run, reason=reason), timeout=120)


async def status(ch: grpc.aio.Channel, run: str = "") -> Any:
    return await SPEC.stub(ch).GetStatus(common_pb2.GetStatusRequest(run=run), timeout=10)


async def wait_status(
    host: Host, ch: grpc.aio.Channel, run: str, done: Any, timeout_s: float = 60
) -> Any:
    """GetStatus(run) once ``done(status)`` holds (AssertionError with the host's log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await status(ch, run)
        if done(got):
            return got
        assert time.monotonic() < deadline, f"{run}: {got}\n{host.tail()}"
        await asyncio.sleep(0.2)


async def publish_batch(
    server: EmbeddedNats, creds: RunCredentials, store: LocalObjectStore, step: int, vocab: int
) -> None:
    """The run's orchestrator (its own user) publishes its BatchReady of ``step``."""
    cfg = nats_cfg(server, creds, "orchestrator")
    bus = await Bus.connect(cfg, creds.run, name=f"orch-{creds.run}", role="orchestrator")
    try:
        ready = store_batch(store, make_batch(step, vocab_size=vocab, seed=SEEDS[creds.run]))
        await bus.publish(bus.subjects.batches(step), ready, msg_id=f"b{step}")
    finally:
        await bus.close()


def trained_alone(
    trainer: dict[str, Any], model: Path, root: Path, steps: int
) -> dict[str, torch.Tensor]:
    """The adapter the run publishes at ``steps`` when trained alone in this process."""
    alone = Trainer(
        TrainerSection(model=model, device="cpu", **trainer),
        LocalObjectStore(root / "store"),
        checkpoint_dir=root / "ckpt",
    )
    seed = trainer["seed"]
    vocab = vocab_size_of(model)
    for step in range(1, steps + 1):
        result = alone.train_step(
            store_batch(alone.store, make_batch(step, vocab_size=vocab, seed=seed))
        )
    assert result.weights is not None
    alone.store.fetch_dir(result.weights, root / "out")
    return load_safetensors(root / "out")


def assert_published_equal(
    store: LocalObjectStore, version: int, expected: dict[str, torch.Tensor], into: Path
) -> None:
    store.fetch_dir(f"policies/v{version:06d}", into)
    got = load_safetensors(into)
    assert got.keys() == expected.keys()
    worst = max(float((got[k] - expected[k]).abs().max()) for k in got)
    assert worst <= ATOL, f"v{version} differs from the run trained alone: {worst}"


@pytest.mark.integration
@pytest.mark.slow
def test_trainer_hosted_adds_runs_at_runtime_and_removes_one_mid_training(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]],
    model: Path,
    tmp_path: Path,
    free_port: int,
) -> None:
    server, creds = shared
    vocab = vocab_size_of(model)
    trainers = {
        "alpha": {"seed": SEEDS["alpha"], "max_steps": 3, "checkpoint_every": 0,
                  "optim": {"lr": 1e-2}, "lora": LORA},
        "beta": {"seed": SEEDS["beta"], "max_steps": 2, "checkpoint_every": 0,
                 "optim": {"lr": 3e-3}, "lora": LORA},
    }  # fmt: skip
    files = {
        run: write_run_file(tmp_path, run, server, creds[run],
                            {"model": model, "device": "cpu", **section})
        for run, section in trainers.items()
    }  # fmt: skip
    stores = {run: LocalObjectStore(tmp_path / run / "store") for run in trainers}

    def batch(run: str, step: int) -> Any:
        return publish_batch(server, creds[run], stores[run], step, vocab)

    def at_step(n: int) -> Any:
        return lambda s: s.step >= n

    with Host(tmp_path, server, creds["platform"], model, free_port) as host:

        async def main() -> None:
            async with host.channel() as ch:
                assert (await status(ch)).info.message.startswith("0 adapters")
                added = await add(ch, files["alpha"])
                assert (added.run, added.step) == ("alpha", 0)
                await batch("alpha", 1)
                await wait_status(host, ch, "alpha", at_step(1))
                await batch("alpha", 2)  # alpha trains while beta is added
                added = await add(ch, files["beta"])
                assert (added.run, added.step) == ("beta", 0)
                await batch("beta", 1)
                await wait_status(host, ch, "alpha", at_step(2))
                await wait_status(host, ch, "beta", at_step(1))

                # alpha leaves after step 2 of 3: it checkpoints, its adapter is freed
                removed = await remove(ch, "alpha", "cancelled by its tenant")
                assert (removed.step, removed.was_hosted) == (2, True)
                manifest = stores["alpha"].read_manifest("checkpoints/trainer/step000002")
                assert manifest.metadata["lora"]
                with pytest.raises(grpc.aio.AioRpcError) as gone:
                    await status(ch, "alpha")
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                host_message = (await status(ch)).info.message
                assert host_message.startswith("1 adapters"), host_message
                assert "alpha" not in host_message
                again = await remove(ch, "alpha")
                assert (again.step, again.was_hosted) == (0, False)

                # beta trains on to its max_steps, then stays listed, stopped; the host
                # goes on serving
                await batch("beta", 2)
                beta = await wait_status(host, ch, "beta", lambda s: s.info.state
                                         == common_pb2.SERVICE_STATE_STOPPED)  # fmt: skip
                assert beta.step == 2
                assert beta.info.message == "stopped"
                assert host.proc.poll() is None

                # alpha comes back: it resumes from its checkpoint and trains its last step
                added = await add(ch, files["alpha"])
                assert (added.run, added.step) == ("alpha", 2)
                await batch("alpha", 3)
                alpha = await wait_status(host, ch, "alpha", lambda s: s.info.state
                                          == common_pb2.SERVICE_STATE_STOPPED)  # fmt: skip
                assert alpha.step == 3
                listed = (await status(ch)).info.message
                assert listed.startswith("2 adapters"), listed

        asyncio.run(main())
        code = host.proc.stop(30)
        log = host.log.read_text()
        assert code == 0, log[-3000:]
    assert "run alpha: removing it (cancelled by its tenant)" in log
    assert "run alpha: adapter of" in log

    expected = trained_alone(trainers["beta"], model, tmp_path / "alone-beta", 2)
    assert_published_equal(stores["beta"], 2, expected, tmp_path / "got-beta")
    expected = trained_alone(trainers["alpha"], model, tmp_path / "alone-alpha", 3)
    assert_published_equal(stores["alpha"], 3, expected, tmp_path / "got-alpha")


@pytest.mark.integration
@pytest.mark.slow
def test_trainer_hosted_add_run_refusals_name_the_problem_and_leave_the_others_training(
    shared: tuple[EmbeddedNats, dict[str, RunCredentials]],
    model: Path,
    tmp_path: Path,
    free_port: int,
) -> None:
    server, creds = shared
    vocab = vocab_size_of(model)
    good = {"model": model, "device": "cpu", "max_steps": 3, "lora": LORA}
    gamma = write_run_file(tmp_path, "gamma", server, creds["gamma"],
                           good | {"seed": SEEDS["gamma"]})  # fmt: skip
    misfit = write_run_file(tmp_path, "delta", server, creds["delta"],
                            good | {"lora": LORA | {"rank": 8}})  # fmt: skip
    # another file naming run gamma
    twin = write_run_file(tmp_path, "twin", server, creds["gamma"], good, name="gamma")
    missing = tmp_path / "nowhere" / "run.toml"
    # epsilon's store holds a checkpoint of full weights: its adapter is made, then resume
    # refuses the checkpoint
    broken = write_run_file(tmp_path, "epsilon", server, creds["epsilon"], good)
    full = Trainer(
        TrainerSection(model=model, device="cpu"),
        LocalObjectStore(tmp_path / "epsilon" / "store"),
        checkpoint_dir=tmp_path / "epsilon-ckpt",
    )
    full.save_checkpoint()
    gamma_store = LocalObjectStore(tmp_path / "gamma" / "store")

    async def refused(ch: grpc.aio.Channel, run_file: Path) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await add(ch, run_file)
        return caught.value

    with Host(tmp_path, server, creds["platform"], model, free_port, token="s3cret") as host:

        async def main() -> None:
            async with host.channel(ControlSecurity()) as anonymous:
                e = await refused(anonymous, gamma)
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED
            async with host.channel() as ch:
                added = await add(ch, gamma, trained_tokens=1)  # one step, then its quota
                assert (added.run, added.step) == ("gamma", 0)

                e = await refused(ch, misfit)
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert str(misfit) in e.details()
                assert "run 'delta': trainer.lora.rank = 8 but the adapters on this base " \
                       "have 4" in e.details()  # fmt: skip
                e = await refused(ch, twin)
                assert e.code() == grpc.StatusCode.ALREADY_EXISTS
                assert f"run 'gamma' of {twin} is hosted already, from {gamma}" in e.details()
                e = await refused(ch, missing)
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"config file not found: {missing}" in e.details()
                e = await refused(ch, broken)
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert str(broken) in e.details()
                assert "holds full weights but trainer.lora is enabled" in e.details()

                listed = (await status(ch)).info.message
                assert listed.startswith("1 adapters"), listed  # epsilon's was freed
                for run in ("delta", "epsilon"):
                    with pytest.raises(grpc.aio.AioRpcError) as absent:
                        await status(ch, run)
                    assert absent.value.code() == grpc.StatusCode.NOT_FOUND
                    assert (await remove(ch, run)).was_hosted is False

                # gamma trains, untouched; at its quota it fails alone and stays listed
                await publish_batch(server, creds["gamma"], gamma_store, 1, vocab)
                await publish_batch(server, creds["gamma"], gamma_store, 2, vocab)
                failed = await wait_status(host, ch, "gamma", lambda s: s.info.state
                                           == common_pb2.SERVICE_STATE_FAILED)  # fmt: skip
                assert failed.step == 1
                assert "QuotaExceededError: run 'gamma' has used" in failed.info.message
                assert "of its quota of 1 " in failed.info.message
                assert host.proc.poll() is None
                removed = await remove(ch, "gamma", "failed")
                assert (removed.step, removed.was_hosted) == (1, True)
                assert (await status(ch)).info.message.startswith("0 adapters")

        asyncio.run(main())
        code = host.proc.stop(30)
        assert code == 0, host.log.read_text()[-3000:]
    assert gamma_store.read_manifest("policies/v000001")


def test_hosted_remove_run_of_a_run_not_hosted_is_harmless() -> None:
    app = HostedApp(ctx=cast(Any, None), base=None)
    request = PB.RemoveRunRequest(run="nobody", reason="cleanup")
    response = asyncio.run(HostedRuns(app).RemoveRun(request, cast(Any, None)))
    assert (response.step, response.was_hosted) == (0, False)


def test_tenancy_remove_run_frees_adapter_optimizer_state_and_turn(
    model: Path, tmp_path: Path
) -> None:
    section = TrainerSection(model=model, device="cpu", lora=LORA, optim={"lr": 1e-2})
    base = SharedBase(section)
    trainers = {
        run: base.add_run(run, section.model_copy(update={"seed": SEEDS[run]}),
                          LocalObjectStore(tmp_path / run), checkpoint_dir=tmp_path / f"{run}-ck")
        for run in ("alpha", "beta")
    }  # fmt: skip
    vocab = vocab_size_of(model)
    for trainer in trainers.values():
        trainer.train_step(store_batch(trainer.store, make_batch(1, vocab_size=vocab, seed=1)))
    alpha = trainers.pop("alpha")
    with base.holding("alpha"):  # the model's adapter parameters hold alpha's tensors
        pass
    held = [weakref.ref(t) for t in base.bank._slots["alpha"].tensors.values()]
    assert any(opt.state for opt in alpha.optimizers)

    alpha_bytes = base.bank.nbytes("alpha")

    base.remove_run("alpha")
    gc.collect()
    assert "alpha" not in base.bank
    assert "alpha" not in base.runs
    assert len(base.bank) == 1
    # nothing holds alpha's adapter: not its slot, nor the model's adapter parameters,
    # which held its tensors last
    assert all(ref() is None for ref in held), "alpha's adapter tensors are still alive"
    params = base.bank.params.values()
    assert sum(p.untyped_storage().nbytes() for p in params) < alpha_bytes
    assert not any(opt.state for opt in alpha.optimizers)
    assert "alpha" not in base.share.used_s
    assert "alpha" not in base.share.turns
    with pytest.raises(ValueError, match="'alpha' is not registered"):
        alpha.save_checkpoint()

    beta = trainers["beta"]  # goes on; alpha's name can be taken again, afresh
    beta.train_step(store_batch(beta.store, make_batch(2, vocab_size=vocab, seed=2)))
    assert beta.step == 2
    again = base.add_run("alpha", section, LocalObjectStore(tmp_path / "again"),
                         checkpoint_dir=tmp_path / "again-ck")  # fmt: skip
    assert again.step == 0
    assert base.share.used_s["alpha"] == 0.0
