"""An object store outage costs time, never data: a store opened for services waits out
an outage (a real S3 server stopped and started again, a local store remounted
read-only), gives up clearly after its patience; the orchestrator does not ack a
completion it could not save, and a trainer (fake core) whose new weights cannot be
stored stops instead of announcing the previous weights as the new version."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import SecretStr

from testkit.seaweed import SeaweedS3
from treadle.orchestrator.loop import RLLoop
from treadle.orchestrator.spec import SPEC, OrchestratorConfig
from treadle.orchestrator.state import load_state
from treadle.proto.v1 import batch_pb2, rollout_pb2
from treadle.services.bus import Bus, Delivery
from treadle.services.errors import StoreUnreachableError
from treadle.services.host import ServiceContext
from treadle.services.objectstore import LocalObjectStore, open_store
from treadle.services.sections import ObjectStoreSection
from treadle.services.supervisor import ManagedProcess

pytestmark = pytest.mark.integration


def test_store_waits_out_an_s3_server_that_is_down(tmp_path: Path) -> None:
    s3 = SeaweedS3(tmp_path / "s3").start()
    try:
        section = ObjectStoreSection(
            backend="s3", endpoint=s3.endpoint, access_key=s3.access_key,
            secret_key=SecretStr(s3.secret_key), bucket="outage", max_retries=0,
        )  # fmt: skip
        store = open_store(section, "run", tmp_path)
        assert store.patience_s > 0
        store.put_bytes("before", b"1")
        old = s3.process
        assert old is not None
        assert old.proc is not None
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        done: dict[str, Any] = {}

        def put_during_the_outage() -> None:
            started = time.monotonic()
            done["ref"] = store.put_bytes("during", b"2")
            done["s"] = time.monotonic() - started

        writer = threading.Thread(target=put_during_the_outage)
        writer.start()
        time.sleep(3)
        assert "ref" not in done  # still waiting, not failed
        s3.process = ManagedProcess(old.name, old.argv, old.log_file).start()
        writer.join(timeout=120)
        assert done["s"] >= 3
        assert store.get_bytes(done["ref"]) == b"2"
        assert store.get_bytes("before") == b"1"
    finally:
        s3.stop()


def test_store_waits_out_a_local_disk_remounted_read_only(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip("needs permission to mount a tmpfs (root with CAP_SYS_ADMIN)")
    try:
        store = open_store(ObjectStoreSection(root=mnt / "store"), "run", tmp_path)
        store.put_bytes("a/before", b"1")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        errors: list[BaseException] = []
        writer = threading.Thread(
            target=lambda: _capture(errors, lambda: store.put_bytes("a/during", b"2"))
        )
        writer.start()
        time.sleep(2)
        assert writer.is_alive()  # waiting out the read-only disk
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        writer.join(timeout=60)
        assert not errors
        assert store.get_bytes("a/during") == b"2"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _capture(errors: list[BaseException], fn: Any) -> None:
    try:
        fn()
    except BaseException as e:
        errors.append(e)


def test_store_gives_up_after_its_patience_with_one_clear_error(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    store.patience_s = 1.0
    calls = []

    def unreachable(*args: Any) -> None:
        calls.append(time.monotonic())
        raise StoreUnreachableError("local object store: cannot write k: Read-only file system")

    store._write_stream = unreachable  # type: ignore[method-assign]
    with pytest.raises(
        StoreUnreachableError, match=r"Read-only file system \(still failing after 1s"
    ):
        store.put_bytes("k", b"x")
    assert len(calls) >= 2
    assert calls[-1] - calls[0] < 5


# --- the orchestrator ----------------------------------------------------------------------
class FlakyStore(LocalObjectStore):
    """A local store whose writes fail (unreachable) while ``down``."""

    down = False

    def _write_stream(self, key: str, stream: Any, size: int, media_type: str) -> None:
        if self.down:
            raise StoreUnreachableError(f"store down: cannot write {key}")
        super()._write_stream(key, stream, size, media_type)


def test_orchestrator_does_not_ack_a_completion_it_could_not_save(
    tmp_path: Path, nats_url: str
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t0", "text": "abc"}) + "\n")
    cfg = OrchestratorConfig.model_validate({
        "run": {"name": "outage"}, "nats": {"url": nats_url},
        "orchestrator": {"tasks": str(tasks), "group_size": 2, "max_steps": 2},
    })  # fmt: skip

    async def main() -> None:
        store = FlakyStore(tmp_path / "store")
        bus = await Bus.connect(cfg.nats, "outage", store=store)
        try:
            await bus.ensure_streams()
            loop = RLLoop(ServiceContext(SPEC, cfg, "orch-test", bus, store), cfg.orchestrator)
            group = await loop.dispatch_group(loop.mixture())
            rid = group.rollout_ids[0]
            done = rollout_pb2.RolloutCompleted(
                rollout=rollout_pb2.Rollout(rollout_id=rid, group_id=group.group_id)
            )
            delivery = Delivery(bus.subjects.rollouts_completed, rid, 7, 1, {})
            store.down = True
            with pytest.raises(StoreUnreachableError):
                await loop.on_completed(done, delivery)
            assert rid not in group.completed  # the handler failed: the message is nak'ed
            store.down = False
            await loop.on_completed(done, Delivery(delivery.subject, rid, 7, 2, {}))
            assert loop.state.duplicates_ignored == 0  # the redelivery was recorded
            saved = load_state(store)
            assert saved is not None
            assert saved.groups[group.group_id].completed == {rid: 7}
        finally:
            await bus.close()

    asyncio.run(main())


# --- the trainer (a fake core: the service's handling is what is tested) ---------------------
class FakeCoreWhoseWeightsCannotBeStored:
    """Trains (advances its step), then fails to publish the weights, as Trainer.train_step
    does when the store stays unreachable past its patience."""

    def __init__(self) -> None:
        self.step = 1
        self.last_checkpoint_step = 1
        self.topology = SimpleNamespace(rank=0, world_size=1, is_main=True, distributed=False)
        self.base_model = "tiny"

    def check_ready(self, ready: Any) -> None:
        pass

    def fetch_batch_bytes(self, ready: Any) -> bytes:
        return b""

    def train_step(self, ready: Any, data: bytes) -> Any:
        self.step = int(ready.step)
        raise StoreUnreachableError("cannot write policies/v000002/model.safetensors")


def test_trainer_service_fake_core_unstorable_weights_stop_it_and_announce_nothing() -> None:
    from treadle.trainer.service import TrainerApp

    published: list[Any] = []

    async def publish(subject: str, msg: Any, *, msg_id: str | None) -> None:
        published.append(msg)

    async def main() -> None:
        bus = SimpleNamespace(publish=publish, subjects=SimpleNamespace(policy_published="p"))
        ctx = SimpleNamespace(
            bus=bus, message="", config=SimpleNamespace(trainer=SimpleNamespace(
                checkpoint_every=2, max_steps=4, model=None)),
        )  # fmt: skip
        app = TrainerApp(ctx, FakeCoreWhoseWeightsCannotBeStored())  # type: ignore[arg-type]
        ready = batch_pb2.BatchReady(step=2)
        first = Delivery("batches.2", "batch-2", 2, 1, {})
        with pytest.raises(StoreUnreachableError):
            await app._handle(ready, first)
        assert isinstance(app.fatal, StoreUnreachableError)  # the service stops
        # had it been redelivered instead, the step would count as trained and version 2
        # would have been announced with version 1's weights
        assert published == []

    asyncio.run(main())
