"""The trainer service as a real process on a real nats-server: strict step order,
policy publication, checkpoints with batch purge, control plane, resume, old policies and
checkpoints deleted when asked (keep_policies, keep_checkpoints), and a payload with a
wrong sha256 that stops the trainer without acking."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

from testkit.trainer import make_batch, store_batch, tiny_qwen3, vocab_size_of
from treadle.proto.v1 import common_pb2, metrics_pb2, policy_pb2
from treadle.proto.v1 import trainer_service_pb2 as tpb
from treadle.proto.v1 import trainer_service_pb2_grpc as tgrpc
from treadle.services.bus import Bus
from treadle.services.objectstore import LocalObjectStore
from treadle.services.rpc import check_health, open_channel
from treadle.services.sections import NatsSection
from treadle.services.supervisor import ManagedProcess
from treadle.trainer.spec import SPEC as TRAINER

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_runs = itertools.count()


def trainer_argv(root: Path, run: str, nats_url: str, port: int, model: Path) -> list[str]:
    return [
        sys.executable, "-m", "treadle.trainer",
        "--nats.url", nats_url, "--nats.ack_wait_s", "5",
        "--run.name", run, "--run.output_dir", str(root / "out"),
        "--object_store.root", str(root / "store"),
        "--trainer.grpc.port", str(port), "--trainer.model", str(model),
        "--trainer.device", "cpu", "--trainer.checkpoint_every", "2",
        "--trainer.optim.lr", "1e-3",
    ]  # fmt: skip


async def wait_healthy(proc: ManagedProcess, target: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check_health(target, TRAINER.control.full_name):
        if proc.poll() is not None:
            raise proc.failure("died")
        assert time.monotonic() < deadline, "trainer never became healthy"
        await asyncio.sleep(0.2)


async def publish_batch(
    bus: Bus, store: LocalObjectStore, step: int, vocab: int, msg_id: str = ""
) -> None:
    ready = store_batch(store, make_batch(step, vocab_size=vocab))
    await bus.publish(bus.subjects.batches(step), ready, msg_id=msg_id or f"batch-{step}")


async def bus_watching_policies(
    nats_url: str, run: str, store: LocalObjectStore
) -> tuple[Bus, list[int]]:
    """The run's bus (streams made) and the versions PolicyPublished announces, as they come."""
    bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
    await bus.ensure_streams()
    published: list[int] = []

    async def on_policy(msg: Any) -> None:
        published.append(policy_pb2.PolicyPublished.FromString(msg.data).policy_version)

    await bus.nc.subscribe(bus.subjects.policy_published, cb=on_policy)
    return bus, published


async def in_stream(bus: Bus, step: int) -> bool:
    try:
        await bus.js.get_last_msg(bus.subjects.stream_name("BATCHES"), bus.subjects.batches(step))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def until(predicate: Any, proc: ManagedProcess, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if proc.poll() is not None:
            raise proc.failure("died")
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_qwen3(tmp_path_factory.mktemp("model") / "qwen3")


def test_trainer_service_trains_in_order_publishes_checkpoints_and_resumes(
    tmp_path: Path, nats_url: str, free_port: int, model: Path
) -> None:
    run = f"trainsvc{next(_runs)}"
    store = LocalObjectStore(tmp_path / "store")
    vocab = vocab_size_of(model)
    log_file = tmp_path / "trainer.log"
    target = f"127.0.0.1:{free_port}"
    argv = trainer_argv(tmp_path, run, nats_url, free_port, model)

    async def main() -> None:
        bus, published = await bus_watching_policies(nats_url, run, store)
        # step 2 arrives before step 1, and step 1 twice (a redelivered duplicate)
        await publish_batch(bus, store, 2, vocab)
        await publish_batch(bus, store, 1, vocab)
        await publish_batch(bus, store, 1, vocab, msg_id="batch-1-again")
        proc = ManagedProcess("trainer", argv, log_file).start()
        try:
            await wait_healthy(proc, target)
            async with open_channel(target, [TRAINER.control]) as channel:
                stub = tgrpc.TrainerControlStub(channel)

                async def at_step_2_idle() -> bool:
                    s = await stub.GetStatus(common_pb2.GetStatusRequest())
                    return bool(s.step == 2 and s.waiting_for_batch and s.last_checkpoint_step == 2)

                await until(at_step_2_idle, proc)
                status = await stub.GetStatus(common_pb2.GetStatusRequest())
                assert status.policy_version == 2
                assert status.world_size == 1
                assert published == [1, 2]
                # checkpoint of step 2 purged the batches of steps 1 and 2
                assert not await in_stream(bus, 1)
                assert not await in_stream(bus, 2)
                manifest = store.read_manifest("checkpoints/trainer/step000002")
                assert manifest.metadata["step"] == 2
                last = await bus.last(
                    "POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished
                )
                assert last is not None
                assert last.policy_version == 2
                assert last.format == "hf-safetensors"
                assert last.base_model == str(model)
                assert store.read_manifest(last.weights).metadata["policy_version"] == 2
                # a Checkpoint rpc while idle writes one now
                resp = await stub.Checkpoint(tpb.CheckpointRequest())
                assert resp.step == 2
                assert resp.manifest.uri.endswith("step000002/MANIFEST.json")
                await publish_batch(bus, store, 3, vocab)
                await until(lambda: _is(published, [1, 2, 3]), proc)
                await stub.Stop(tpb.StopRequest(reason="test"))
            assert await asyncio.to_thread(proc.proc.wait, 60) == 0  # type: ignore[union-attr]
        finally:
            proc.stop()
        assert store.read_manifest("checkpoints/trainer/step000003").metadata["step"] == 3
        text = log_file.read_text()
        assert "BatchReady of step 1 already trained" in text or text.count("step 1:") == 1
        # metrics of every step on the METRICS stream
        sub = await bus.js.pull_subscribe(
            bus.subjects.metrics("trainer"), durable="t", stream=bus.subjects.stream_name("METRICS")
        )
        msgs = await sub.fetch(10, timeout=5)
        reports = [metrics_pb2.MetricsReport.FromString(m.data) for m in msgs]
        assert [r.step for r in reports] == [1, 2, 3]
        for key in ("loss", "grad_norm", "entropy", "mismatch_kl", "masked_fraction", "ratio_mean",
                    "lr", "tokens", "tokens_per_s", "step_time_s", "policy_lag_mean"):  # fmt: skip
            assert key in reports[0].values, key
        # restart: resumes from the checkpoint of step 3, trains step 4, SIGTERM checkpoints it
        await publish_batch(bus, store, 4, vocab)
        proc = ManagedProcess("trainer", argv, log_file).start()
        try:
            await until(lambda: _is(published, [1, 2, 3, 4]), proc)
        finally:
            code = proc.stop(grace_s=60)
        assert code == 0
        assert "resumed from checkpoint of step 3" in log_file.read_text()
        assert store.read_manifest("checkpoints/trainer/step000004").metadata["step"] == 4
        await bus.close()

    asyncio.run(main())


async def _is(values: list[int], expected: list[int]) -> bool:
    return values == expected


def test_trainer_service_wrong_checksum_stops_without_acking(
    tmp_path: Path, nats_url: str, free_port: int, model: Path
) -> None:
    run = f"trainsvc{next(_runs)}"
    store = LocalObjectStore(tmp_path / "store")

    async def publish() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        await bus.ensure_streams()
        ready = store_batch(store, make_batch(1, vocab_size=vocab_size_of(model)))
        ready.data.sha256 = "f" * 64
        await bus.publish(bus.subjects.batches(1), ready, msg_id="batch-1")
        await bus.close()

    async def still_there() -> bool:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        try:
            return await in_stream(bus, 1)
        finally:
            await bus.close()

    asyncio.run(publish())
    proc = subprocess.run(
        trainer_argv(tmp_path, run, nats_url, free_port, model),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "trainer failed" in line]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "sha256" in errors[0]
    assert "Traceback" not in proc.stderr
    assert asyncio.run(still_there())


def test_trainer_service_missing_model_fails_at_startup(
    tmp_path: Path, nats_url: str, free_port: int
) -> None:
    proc = subprocess.run(
        trainer_argv(tmp_path, f"trainsvc{next(_runs)}", nats_url, free_port, tmp_path / "nope"),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "trainer failed" in line]
    assert len(errors) == 1
    assert "is not a folder" in errors[0]
    assert "Traceback" not in proc.stderr


def test_trainer_service_exports_a_loadable_final_model_at_max_steps(
    tmp_path: Path, nats_url: str, free_port: int, model: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = f"trainsvc{next(_runs)}"
    store = LocalObjectStore(tmp_path / "store")
    argv = [*trainer_argv(tmp_path, run, nats_url, free_port, model), "--trainer.max_steps", "1"]

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run, store=store)
        await bus.ensure_streams()
        await publish_batch(bus, store, 1, vocab_size_of(model))
        proc = ManagedProcess("trainer", argv, tmp_path / "trainer.log").start()
        try:
            assert await asyncio.to_thread(proc.proc.wait, 120) == 0  # type: ignore[union-attr]
        finally:
            proc.stop()
        sub = await bus.js.pull_subscribe(
            bus.subjects.metrics("trainer"), durable="t", stream=bus.subjects.stream_name("METRICS")
        )
        (report,) = [
            metrics_pb2.MetricsReport.FromString(m.data) for m in await sub.fetch(1, timeout=5)
        ]
        assert report.values["wait_s"] >= 0  # idle time before the batch, for the async benchmark
        await bus.close()

    asyncio.run(main())
    final = tmp_path / "out" / run / "final_model"
    assert (final / "model.safetensors").is_file()
    assert (final / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.config.model_type == "qwen3"
    AutoTokenizer.from_pretrained(final)


def test_trainer_service_deletes_old_policies_and_checkpoints_it_was_asked_not_to_keep(
    tmp_path: Path, nats_url: str, free_port: int, model: Path
) -> None:
    from treadle.services.export import published_versions
    from treadle.trainer.checkpoint import published_steps

    run = f"trainsvc{next(_runs)}"
    store = LocalObjectStore(tmp_path / "store")
    vocab = vocab_size_of(model)
    log_file = tmp_path / "trainer.log"
    argv = trainer_argv(tmp_path, run, nats_url, free_port, model)
    argv[argv.index("--trainer.checkpoint_every") + 1] = "3"
    argv += ["--trainer.keep_policies", "2", "--trainer.keep_checkpoints", "1"]
    target = f"127.0.0.1:{free_port}"

    async def main() -> None:
        bus, published = await bus_watching_policies(nats_url, run, store)
        for step in range(1, 8):
            await publish_batch(bus, store, step, vocab)
        proc = ManagedProcess("trainer", argv, log_file).start()
        try:
            await wait_healthy(proc, target)
            async with open_channel(target, [TRAINER.control]) as channel:
                stub = tgrpc.TrainerControlStub(channel)

                async def at_step_7_idle() -> bool:
                    s = await stub.GetStatus(common_pb2.GetStatusRequest())
                    return bool(s.step == 7 and s.waiting_for_batch)

                await until(at_step_7_idle, proc)
                # the newest 2 policies; the checkpoint of step 6 keeps nothing older, as
                # it is the newest 2's own; only the newest checkpoint
                assert published_versions(store) == [6, 7]
                assert published_steps(store) == [6]
                await stub.Stop(tpb.StopRequest(reason="test"))
            assert await asyncio.to_thread(proc.proc.wait, 60) == 0  # type: ignore[union-attr]
        finally:
            proc.stop()
        assert published == list(range(1, 8))
        assert published_steps(store) == [7]  # the checkpoint at stop replaced that of 6
        assert published_versions(store) == [6, 7]
        # a restart resumes from what was kept and goes on pruning
        await publish_batch(bus, store, 8, vocab)
        proc = ManagedProcess("trainer", argv, log_file).start()
        try:
            await until(lambda: _is(published, list(range(1, 9))), proc)
        finally:
            assert proc.stop(grace_s=60) == 0
        assert "resumed from checkpoint of step 7" in log_file.read_text()
        assert published_steps(store) == [8]
        assert published_versions(store) == [7, 8]
        assert not [p for p in (store.root / "policies").iterdir() if p.name < "v000007"]
        await bus.close()

    asyncio.run(main())
