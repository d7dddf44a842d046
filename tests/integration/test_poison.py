"""Poison and faults on the bus, against a real nats-server (design invariant 6).

The fuzz test publishes hypothesis-made poison (random bytes, mutated and truncated valid
messages, missing or wrong type headers, broken claim checks) between good messages into
every stream a service consumes, and runs each service's real consumer and handler: the
orchestrator's (RLLoop.on_completed), the trainer's (TrainerApp._handle over a fake
Trainer), the inference service's (InferenceApp._on_policy over a fake weight updater),
the env runner's (EnvRunnerApp.handle, serving no environment) and the launcher's
(Progress.record into metrics.jsonl). Every message must be handled or terminated, every
terminated one counted and kept on the dead-letter subject, and every consumer must go on
to the next good message.

The other tests replay the faults of the trust issue one by one: an undecodable
PolicyPublished under the orchestrator's poller, an undecodable batches.<step+1> at an
orchestrator restart, forged RolloutCompleted in a running loop, ROLLOUTS deleted under
the orchestrator, and a second orchestrator of the same run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from treadle.env_runner.rollout import RolloutContext
from treadle.env_runner.service import EnvRunnerApp
from treadle.env_runner.spec import SPEC as ENV_SPEC
from treadle.env_runner.spec import EnvRunnerConfig
from treadle.inference.service import InferenceApp
from treadle.inference.spec import SPEC as INFERENCE_SPEC
from treadle.inference.spec import InferenceConfig
from treadle.orchestrator.loop import RLLoop
from treadle.orchestrator.service import OrchestratorApp
from treadle.orchestrator.spec import SPEC as ORCH_SPEC
from treadle.orchestrator.spec import OrchestratorConfig
from treadle.orchestrator.state import GroupState, OrchestratorState, save_state
from treadle.proto.v1 import batch_pb2, common_pb2, metrics_pb2, policy_pb2, rollout_pb2
from treadle.services.bus import (
    HDR_CLAIM_CHECK,
    HDR_DL_REASON,
    HDR_DL_SUBJECT,
    HDR_TYPE,
    Bus,
    Delivery,
    PullConsumer,
)
from treadle.services.codecs import to_token_array, type_name
from treadle.services.errors import BusUnavailableError, TreadleError
from treadle.services.host import ServiceContext
from treadle.services.lease import LeaseHeldError
from treadle.services.objectstore import LocalObjectStore
from treadle.services.progress import Progress
from treadle.trainer.service import TrainerApp
from treadle.trainer.spec import SPEC as TRAINER_SPEC
from treadle.trainer.spec import TrainerConfig

pytestmark = pytest.mark.integration

_runs = itertools.count()


def run_name(prefix: str) -> str:
    return f"{prefix}{next(_runs)}x{random.randrange(10**6)}"


# --- good messages ------------------------------------------------------------------------
def rollout(rid: str, group_id: str, *, ids: list[int] | None = None, version: int = 0,
            reward: float = 1.0) -> rollout_pb2.Rollout:  # fmt: skip
    r = rollout_pb2.Rollout(rollout_id=rid, group_id=group_id, env="reverse_text", reward=reward)
    prompt, sampled = [5, 6, 7], ids if ids is not None else [8, 9, 10]
    for parent, tok, is_sampled in ((-1, prompt, False), (0, sampled, True)):
        n = r.nodes.add(node_id=len(r.nodes), parent_id=parent)
        k = len(tok)
        n.token_ids.CopyFrom(to_token_array(np.array(tok, np.int64).astype(np.int32)))
        n.sampled_mask.CopyFrom(to_token_array(np.full(k, int(is_sampled), np.uint8)))
        n.logprobs.CopyFrom(to_token_array(np.full(k, -1.0 if is_sampled else 0.0, np.float32)))
        n.policy_versions.CopyFrom(
            to_token_array(np.full(k, version if is_sampled else -1, np.int32))
        )
    r.status.kind = rollout_pb2.RolloutStatus.Kind.KIND_OK
    return r


GOOD: dict[str, Any] = {
    "ROLLOUTS": rollout_pb2.RolloutCompleted(rollout=rollout("g0-000", "g0")),
    "BATCHES": batch_pb2.BatchReady(step=1, rollout_ids=["a"], num_samples=1),
    "POLICY": policy_pb2.PolicyPublished(policy_version=1, format="hf-safetensors"),
    "ROLLOUT_REQUESTS": rollout_pb2.RolloutRequested(
        rollout_id="req", group_id="q", env="nowhere", task_json="{}"
    ),
    "METRICS": metrics_pb2.MetricsReport(service="fuzz", step=1, values={"loss": 1.0}),
}


# --- poison --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Poison:
    kind: str
    data: bytes
    headers: dict[str, str]
    certain: bool  # undecodable whatever the bytes are (a header or claim-check fault)


def _claim_refs(store: LocalObjectStore) -> list[tuple[str, common_pb2.ObjectRef]]:
    blob = b"not a message at all"
    real = store.put_bytes("claims/fuzz/blob", blob)
    return [
        (
            "claim_uri_outside",
            common_pb2.ObjectRef(uri="file:///etc/passwd", sha256="0" * 64, size_bytes=10),
        ),
        (
            "claim_uri_garbage",
            common_pb2.ObjectRef(uri="\x00::nope", sha256="a" * 64, size_bytes=1),
        ),
        ("claim_empty_sha", common_pb2.ObjectRef(uri=real.uri, sha256="", size_bytes=len(blob))),
        (
            "claim_wrong_sha",
            common_pb2.ObjectRef(uri=real.uri, sha256="b" * 64, size_bytes=len(blob)),
        ),
        (
            "claim_missing",
            common_pb2.ObjectRef(uri=store.uri("claims/fuzz/none"), sha256="c" * 64, size_bytes=3),
        ),
        (
            "claim_dotdot",
            common_pb2.ObjectRef(
                uri=store.uri("claims") + "/../../x", sha256="d" * 64, size_bytes=3
            ),
        ),
        ("claim_not_message", real),  # intact object, but its bytes are not the message
    ]


@st.composite
def poison_for(
    draw: st.DrawFn, stream: str, refs: list[tuple[str, common_pb2.ObjectRef]]
) -> Poison:
    good = GOOD[stream]
    valid = good.SerializeToString()
    typed = {HDR_TYPE: type_name(good)}
    kind = draw(st.sampled_from(
        ["bytes", "flip", "truncate", "no_type", "wrong_type", "claim_bytes", "claim_ref"]
    ))  # fmt: skip
    if kind == "bytes":
        return Poison(kind, draw(st.binary(max_size=300)), typed, False)
    if kind == "flip":
        data = bytearray(valid)
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        return Poison(kind, bytes(data), typed, False)
    if kind == "truncate":
        return Poison(kind, valid[: draw(st.integers(0, len(valid) - 1))], typed, False)
    if kind == "no_type":
        return Poison(kind, draw(st.sampled_from([valid, b""])), {}, True)
    if kind == "wrong_type":
        other = draw(st.sampled_from([
            t for t in ("treadle.proto.v1.Rollout", "treadle.proto.v1.MetricsReport", "x" * 40, " ")
            if t != type_name(good)  # METRICS' own type would be no poison at all
        ]))  # fmt: skip
        return Poison(kind, valid, {HDR_TYPE: other}, True)
    if kind == "claim_bytes":
        return Poison(kind, draw(st.binary(max_size=100)), {**typed, HDR_CLAIM_CHECK: "1"}, True)
    name, ref = draw(st.sampled_from(refs))
    return Poison(name, ref.SerializeToString(), {**typed, HDR_CLAIM_CHECK: "1"}, True)


# --- the services' consumers, each with its real handler -----------------------------------
class FakeTrainer:
    """Stands in for treadle.trainer.trainer.Trainer: no model, records what it trains."""

    def __init__(self) -> None:
        self.step = 0
        self.last_checkpoint_step = 0
        self.base_model = "fake"
        self.weights_format = "hf-safetensors"
        self.topology = type(
            "Topology", (), {"rank": 0, "world_size": 1, "is_main": True, "distributed": False}
        )()
        self.trained: list[int] = []

    def check_ready(self, ready: batch_pb2.BatchReady) -> None:
        pass

    def fetch_batch_bytes(self, ready: batch_pb2.BatchReady) -> bytes:
        return b""

    def train_step(self, ready: batch_pb2.BatchReady, data: bytes) -> Any:
        self.step = ready.step
        self.trained.append(ready.step)
        weights = common_pb2.ObjectRef(uri="file:///w", sha256="e" * 64, size_bytes=1)
        return type("R", (), {"step": ready.step, "weights": weights, "metrics": {"loss": 0.0}})()

    def save_checkpoint(self) -> None:
        self.last_checkpoint_step = self.step


class FakeUpdater:
    """Stands in for the inference WeightUpdater: records the versions it is asked for."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.served = type("Served", (), {"policy_version": 0, "adapter": None})()
        self.engine = type("Engine", (), {"base_url": "http://fake"})()

    async def update(self, version: int, weights: common_pb2.ObjectRef) -> Any:
        self.versions.append(version)
        return type("U", (), {"already_loaded": False})()


@dataclass
class Harness:
    bus: Bus
    store: LocalObjectStore
    consumers: dict[str, PullConsumer[Any]] = field(default_factory=dict)
    loop: RLLoop | None = None
    trainer: FakeTrainer | None = None
    updater: FakeUpdater | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    progress: Progress | None = None

    async def start(self, tmp_path: Path) -> None:
        bus, store, run = self.bus, self.store, self.bus.subjects.run
        base = {"run": {"name": run}, "nats": {"url": "nats://127.0.0.1:1"}}
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"id": "t0"}) + "\n")
        ocfg = OrchestratorConfig.model_validate({**base, "orchestrator": {"tasks": str(tasks)}})
        self.loop = RLLoop(ServiceContext(ORCH_SPEC, ocfg, "orch", bus, store), ocfg.orchestrator)
        self.loop.state.groups["g0"] = GroupState("g0", "t0", "{}", ["g0-000", "g0-001"], 0)
        tcfg = TrainerConfig.model_validate({**base, "trainer": {"checkpoint_every": 1}})
        self.trainer = FakeTrainer()
        trainer_app = TrainerApp(ServiceContext(TRAINER_SPEC, tcfg, "tr", bus, store), self.trainer)
        icfg = InferenceConfig.model_validate(base)
        self.updater = FakeUpdater()
        inference_app = InferenceApp(
            ServiceContext(INFERENCE_SPEC, icfg, "inf", bus, store),
            self.updater,  # type: ignore[arg-type]
        )
        ecfg = EnvRunnerConfig.model_validate(base)
        runner = EnvRunnerApp(ServiceContext(ENV_SPEC, ecfg, "env", bus, store), ecfg.env_runner,
                              {}, RolloutContext(None, None, "fuzz"))  # fmt: skip
        self.progress = progress = Progress(tmp_path / "metrics.jsonl", "rl", None)

        async def on_metrics(report: metrics_pb2.MetricsReport, d: Delivery) -> None:
            progress.record(report)  # what the launcher's follow_metrics does

        s = bus.subjects
        specs = [
            ("ROLLOUTS", "orchestrator", s.rollouts_completed, rollout_pb2.RolloutCompleted,
             self.loop.on_completed),
            ("BATCHES", "trainer-r0-step1", s.batches(1), batch_pb2.BatchReady,
             trainer_app._handle),
            ("POLICY", "inference-fuzz", s.policy_published, policy_pb2.PolicyPublished,
             inference_app._on_policy),
            ("ROLLOUT_REQUESTS", "env-runner-nowhere", s.rollouts_requested("nowhere"),
             rollout_pb2.RolloutRequested, runner.handle),
            ("METRICS", "launcher", s.metrics_any, metrics_pb2.MetricsReport, on_metrics),
        ]  # fmt: skip
        for stream, durable, subject, msg_type, handler in specs:
            c = await bus.consumer(stream, durable, subject, msg_type)
            self.consumers[stream] = c
            self.tasks.append(asyncio.create_task(c.run(handler, self.stop, fetch_timeout_s=0.1)))

    async def accounted(self, timeout_s: float = 20.0) -> None:
        """Wait until every message of every consumed stream was handled or terminated."""
        deadline = time.monotonic() + timeout_s
        while True:
            pending = {}
            for stream, c in self.consumers.items():
                name = self.bus.subjects.stream_name(stream)
                info = await self.bus.js.consumer_info(name, c.durable)
                total = (await self.bus.js.stream_info(name)).state.last_seq  # a fresh run
                done = c.stats.handled + c.stats.undecodable + c.stats.dropped
                if info.num_pending or info.num_ack_pending or c.stats.retried:
                    pending[stream] = (done, total, info.num_pending, info.num_ack_pending)
                elif done != total and stream != "POLICY":  # POLICY keeps the last only
                    pending[stream] = (done, total)
            for t in self.tasks:
                if t.done():
                    t.result()  # a consumer must never end on poison
            if not pending:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"messages not accounted for: {pending}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)
        if self.progress is not None:
            self.progress.close()


async def dead_letters(bus: Bus) -> list[Any]:
    stream = bus.subjects.stream_name("DEAD_LETTERS")
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        if info.state.messages:
            out.append(await bus.js.get_msg(stream, seq=seq))
    return out


# bounded for CI (~0.3 s an example); no shrinking: a failure prints the poison it drew
@settings(
    max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate]
)
@given(data=st.data())
def test_poison_fuzz_every_consumer_terminates_counts_and_dead_letters(
    data: st.DataObject, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp_path = tmp_path_factory.mktemp("fuzz")
    store = LocalObjectStore(tmp_path / "store")
    (store.root / "claims").mkdir(parents=True, exist_ok=True)
    refs = _claim_refs(store)
    plan = {s: data.draw(st.lists(poison_for(s, refs), min_size=1, max_size=5), label=s)
            for s in GOOD}  # fmt: skip

    async def main() -> None:
        bus = await Bus.connect(Bus_cfg(nats_url), run_name("fuzz"), store=store)
        await bus.ensure_streams()
        h = Harness(bus, store)
        await h.start(tmp_path)
        s = bus.subjects
        subjects = {"ROLLOUTS": s.rollouts_completed, "BATCHES": s.batches(1),
                    "POLICY": s.policy_published, "ROLLOUT_REQUESTS": s.rollouts_requested("nowhere"),
                    "METRICS": s.metrics("fuzz")}  # fmt: skip
        try:
            for stream in sorted(plan, key=lambda name: name != "POLICY"):
                for p in plan[stream]:
                    await bus.js.publish(subjects[stream], p.data, headers=p.headers or None)
                    if stream == "POLICY":  # last value: the next would replace it unread
                        await h.accounted()
                # the next good message after the poison
                await bus.publish(subjects[stream], GOOD[stream], msg_id=f"good-{stream}")
            await h.accounted()
            certain = {st_: sum(p.certain for p in ps) for st_, ps in plan.items()}
            for stream, c in h.consumers.items():
                assert c.stats.undecodable >= certain[stream], (stream, c.stats)
                assert c.stats.dead_lettered == c.stats.undecodable + c.stats.dropped
            # the good messages got through the poison
            assert h.loop is not None
            assert "g0-000" in h.loop.state.groups["g0"].completed
            assert h.trainer is not None
            assert h.trainer.step == 1
            assert h.updater is not None
            assert 1 in h.updater.versions
            assert h.consumers["ROLLOUT_REQUESTS"].stats.handled >= 1
            assert h.consumers["METRICS"].stats.handled >= 1
            kept = await dead_letters(bus)
            terminated = sum(c.stats.undecodable + c.stats.dropped for c in h.consumers.values())
            refused = h.loop.state.rejected  # decoded, but failed the rollout sanity checks
            assert len(kept) == terminated + refused == bus.stats.dead_lettered
            assert bus.stats.undecodable == sum(c.stats.undecodable for c in h.consumers.values())
            assert all(m.headers and m.headers.get(HDR_DL_REASON) for m in kept)
            assert {m.headers[HDR_DL_SUBJECT] for m in kept} <= set(subjects.values()) | {
                s.policy_published  # the fake trainer's own PolicyPublished is good
            }
        finally:
            await h.close()
            await bus.close()

    asyncio.run(main())


def Bus_cfg(url: str, **kw: Any) -> Any:
    from treadle.services.sections import NatsSection

    return NatsSection(url=url, **kw)


# --- the faults of the trust issue, one by one ---------------------------------------------
class World:
    """A fake env runner (good rollouts at the served version) and a fake trainer."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.version = 0
        self.batches: list[batch_pb2.BatchReady] = []

    async def runner(self, req: rollout_pb2.RolloutRequested, d: Delivery) -> None:
        r = rollout(req.rollout_id, req.group_id, version=self.version,
                    reward=random.random())  # fmt: skip
        r.group_index = req.group_index
        await self.bus.publish(self.bus.subjects.rollouts_completed,
                               rollout_pb2.RolloutCompleted(rollout=r), msg_id=r.rollout_id)  # fmt: skip

    async def trainer(self, ready: batch_pb2.BatchReady, d: Delivery) -> None:
        self.batches.append(ready)
        await self.bus.publish(self.bus.subjects.policy_published,
                               policy_pb2.PolicyPublished(policy_version=ready.step),
                               msg_id=f"policy-{ready.step}")  # fmt: skip
        self.version = ready.step

    async def start(self, stop: asyncio.Event) -> list[asyncio.Task[None]]:
        s = self.bus.subjects
        runner = await self.bus.consumer("ROLLOUT_REQUESTS", "fake-runner", s.rollouts_requested_any,
                                         rollout_pb2.RolloutRequested)  # fmt: skip
        trainer = await self.bus.consumer("BATCHES", "fake-trainer", s.batches_any,
                                          batch_pb2.BatchReady)  # fmt: skip
        return [
            asyncio.create_task(runner.run(self.runner, stop, concurrency=4, fetch_timeout_s=0.1)),
            asyncio.create_task(trainer.run(self.trainer, stop, fetch_timeout_s=0.1)),
        ]


def orch_config(tmp_path: Path, url: str, run: str, **orch: Any) -> OrchestratorConfig:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"id": f"t{i}"}) for i in range(10)))
    section = {"tasks": str(tasks), "max_steps": 3, "group_size": 3, "groups_per_step": 1,
               "max_groups_in_flight": 2, "max_async_level": 1, "max_off_policy_steps": 1,
               "seq_len": 32, "status_poll_s": 0.05, **orch}  # fmt: skip
    return OrchestratorConfig.model_validate(
        {"run": {"name": run}, "nats": {"url": url}, "orchestrator": section}
    )


async def open_loop(tmp_path: Path, url: str, prefix: str, **orch: Any) -> tuple[Bus, RLLoop]:
    cfg = orch_config(tmp_path, url, run_name(prefix), **orch)
    store = LocalObjectStore(tmp_path / "store")
    bus = await Bus.connect(cfg.nats, cfg.run.name, store=store)
    await bus.ensure_streams()
    return bus, RLLoop(ServiceContext(ORCH_SPEC, cfg, "orch-test", bus, store), cfg.orchestrator)


def test_poison_policy_poller_survives_an_undecodable_policy(tmp_path: Path, nats_url: str) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "poll")
        stop = asyncio.Event()
        poller = asyncio.create_task(loop.poll_versions(stop))
        try:
            typed = {HDR_TYPE: type_name(policy_pb2.PolicyPublished)}
            await bus.js.publish(bus.subjects.policy_published, b"\xff\xff\xff", headers=typed)
            await asyncio.sleep(0.5)  # ~10 polls of the same poison
            assert not poller.done()
            assert bus.stats.undecodable == 1  # counted (and dead-lettered) once
            assert len(await dead_letters(bus)) == 1
            await bus.publish(bus.subjects.policy_published,
                              policy_pb2.PolicyPublished(policy_version=3), msg_id="p3")  # fmt: skip
            async with asyncio.timeout(5):
                while loop.inference_version != 3:  # noqa: ASYNC110 - polling the loop's state
                    await asyncio.sleep(0.02)
        finally:
            stop.set()
            await poller
            await bus.close()

    asyncio.run(main())


def test_poison_restart_sets_aside_an_undecodable_next_batch(tmp_path: Path, nats_url: str) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "restart")
        try:
            await asyncio.to_thread(save_state, loop.ctx.store, OrchestratorState())
            typed = {HDR_TYPE: type_name(batch_pb2.BatchReady)}
            await bus.js.publish(bus.subjects.batches(1), b"\x08", headers=None)  # no type
            await bus.js.publish(bus.subjects.batches(1), b"\xff\x00", headers=typed)
            await loop.recover()  # used to raise on every start
            assert loop.state.step == 0
            info = await bus.js.stream_info(bus.subjects.stream_name("BATCHES"))
            assert info.state.messages == 0  # both set aside
            kept = await dead_letters(bus)
            assert [m.headers[HDR_DL_SUBJECT] for m in kept] == [bus.subjects.batches(1)] * 2
        finally:
            await bus.close()

    asyncio.run(main())


def _trained_token_ids(store: LocalObjectStore, ready: batch_pb2.BatchReady) -> np.ndarray:
    batch = batch_pb2.Batch()
    batch.ParseFromString(store.get_bytes(ready.data))
    from treadle.services.codecs import to_array

    return np.concatenate([to_array(mb.input_ids) for mb in batch.micro_batches])


def test_poison_forged_rollouts_are_refused_before_training(tmp_path: Path, nats_url: str) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "forged", vocab_size=100)
        world = World(
            await Bus.connect(loop.ctx.config.nats, bus.subjects.run, store=loop.ctx.store)
        )
        stop, side_stop = asyncio.Event(), asyncio.Event()
        forged = [
            rollout("g0000000-000", "g0000000", ids=[-5, 1]),  # negative token id
            rollout("g0000000-001", "g0000000", ids=[2_000_000_000, 1]),  # beyond the vocabulary
            rollout("g0000000-002", "g0000000", version=7),  # a policy nobody published
        ]
        run = asyncio.create_task(loop.run(stop))
        side: list[asyncio.Task[None]] = []
        try:
            async with asyncio.timeout(60):
                while "g0000000" not in loop.state.groups:  # noqa: ASYNC110 - polling the loop's state
                    await asyncio.sleep(0.01)
                for r in forged:  # the forger is first: the runner's own completions come later
                    await bus.publish(bus.subjects.rollouts_completed,
                                      rollout_pb2.RolloutCompleted(rollout=r), msg_id=None)  # fmt: skip
                while loop.state.rejected < 3:  # noqa: ASYNC110 - polling the loop's state
                    await asyncio.sleep(0.01)
                side = await world.start(side_stop)
                await run
        finally:
            stop.set()
            await asyncio.gather(run, return_exceptions=True)
            side_stop.set()
            await asyncio.gather(*side)
            await world.bus.close()
        assert loop.state.step == 3
        assert loop.state.rejected == 3
        assert "g0000000-000" not in {rid for b in world.batches for rid in b.rollout_ids}
        for ready in world.batches:
            ids = _trained_token_ids(loop.ctx.store, ready)
            assert ids.min() >= 0
            assert ids.max() < 100
        kept = await dead_letters(bus)
        assert len(kept) == 3
        assert all("refused" in m.headers[HDR_DL_REASON] for m in kept)
        await bus.close()

    asyncio.run(main())


def test_poison_rollouts_stream_deleted_ends_clearly_and_restart_loses_nothing(
    tmp_path: Path, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "deleted", max_steps=30)
        world = World(
            await Bus.connect(loop.ctx.config.nats, bus.subjects.run, store=loop.ctx.store)
        )
        side_stop = asyncio.Event()
        side = await world.start(side_stop)
        try:
            run = asyncio.create_task(loop.run(asyncio.Event()))
            async with asyncio.timeout(30):
                while loop.state.step < 1 or not any(  # noqa: ASYNC110 - polling the loop's state
                    g.completed for g in loop.state.groups.values()
                ):
                    await asyncio.sleep(0.01)
            await bus.js.delete_stream(bus.subjects.stream_name("ROLLOUTS"))  # the attack
            with pytest.raises(BusUnavailableError, match=r"is gone.*start the orchestrator again"):
                async with asyncio.timeout(30):
                    await run
            # restart: the stream is recreated, lost completions are requested again
            await bus.ensure_streams()
            again = RLLoop(loop.ctx, loop.cfg)
            async with asyncio.timeout(60):
                await again.run(asyncio.Event())
            assert again.state.step == 30
            assert "stream was recreated since the last save" in caplog.text
            steps = [b.step for b in world.batches]
            assert sorted(set(steps)) == list(range(1, 31))
            trained = [rid for b in world.batches for rid in b.rollout_ids]
            assert len(trained) == len(set(trained))  # nothing trained twice
        finally:
            side_stop.set()
            await asyncio.gather(*side)
            await world.bus.close()
            await bus.close()

    asyncio.run(main())


async def _lease_holder(bus: Bus) -> str:
    """Who holds the run's orchestrator lease now ("" when nobody)."""
    import nats.js.errors

    try:
        kv = await bus.js.key_value(bus.subjects.lease_bucket)
        entry = await kv.get("orchestrator")
    except nats.js.errors.NotFoundError:
        return ""
    return str(json.loads(entry.value or b"{}").get("holder", ""))


def test_poison_second_orchestrator_of_a_run_exits_clearly(tmp_path: Path, nats_url: str) -> None:
    async def main() -> None:
        cfg = orch_config(tmp_path, nats_url, run_name("lease"), lease_ttl_s=1)
        store = LocalObjectStore(tmp_path / "store")
        buses = [await Bus.connect(cfg.nats, cfg.run.name, store=store) for _ in range(3)]
        await buses[0].ensure_streams()
        apps = [
            OrchestratorApp(ServiceContext(ORCH_SPEC, cfg, f"orch-{i}", b, store), cfg.orchestrator)
            for i, b in enumerate(buses)
        ]
        first_stop = asyncio.Event()
        first = asyncio.create_task(apps[0].run(first_stop))
        try:
            async with asyncio.timeout(10):
                while not await _lease_holder(buses[0]):  # noqa: ASYNC110 - polling NATS KV
                    await asyncio.sleep(0.05)
            started = time.monotonic()
            with pytest.raises(LeaseHeldError, match=r"orch-0.*only one may run"):
                await apps[1].run(asyncio.Event())
            assert time.monotonic() - started < 6
            assert apps[1].work.state.next_group == 0  # it dispatched nothing
            first_stop.set()
            await first
            third_stop = asyncio.Event()
            third = asyncio.create_task(apps[2].run(third_stop))  # released: taken at once
            await asyncio.sleep(0.5)
            assert not third.done()
            third_stop.set()
            await third
        finally:
            first_stop.set()
            await asyncio.gather(first, return_exceptions=True)
            for b in buses:
                await b.close()

    asyncio.run(main())


def test_poison_lease_lost_stops_the_holder(tmp_path: Path, nats_url: str) -> None:
    async def main() -> None:
        from treadle.services.lease import Lease, LeaseLostError

        bus = await Bus.connect(Bus_cfg(nats_url), run_name("lost"))
        try:
            lease = Lease(bus, "orchestrator", "a", ttl_s=1)
            await lease.acquire()
            kv = await bus.js.key_value(bus.subjects.lease_bucket)
            await kv.put("orchestrator", b'{"holder": "b"}')  # another holder took it
            with pytest.raises(LeaseLostError, match="taken by b"):
                async with asyncio.timeout(5):
                    await lease.keep(asyncio.Event())
        finally:
            await bus.close()

    asyncio.run(main())


def test_poison_threshold_above_server_max_payload_uses_the_store(
    tmp_path: Path, nats_url: str
) -> None:
    async def main() -> None:
        store = LocalObjectStore(tmp_path / "store")
        cfg = Bus_cfg(nats_url, claim_check_threshold_bytes=64 << 20)
        bus = await Bus.connect(cfg, run_name("big"), store=store)
        try:
            await bus.ensure_streams()
            server_max = bus.nc.max_payload
            assert bus.claim_threshold_bytes < server_max
            big = rollout_pb2.RolloutRequested(rollout_id="big", task_json="x" * server_max)
            sent = await bus.publish(bus.subjects.rollouts_requested("e"), big, msg_id="big")
            assert sent.claim_check  # not a raw MaxPayloadError
            raw = await bus.js.get_msg(bus.subjects.stream_name("ROLLOUT_REQUESTS"), seq=sent.seq)
            got = await bus.decode_stored("ROLLOUT_REQUESTS", raw, rollout_pb2.RolloutRequested)
            assert got == big
        finally:
            await bus.close()

    asyncio.run(main())


def test_poison_lease_of_a_dead_process_on_this_host_is_taken_at_once(
    tmp_path: Path, nats_url: str
) -> None:
    import socket
    import subprocess
    import sys

    from treadle.services.lease import Lease

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a crashed orchestrator: its pid no longer exists

    async def main() -> None:
        bus = await Bus.connect(Bus_cfg(nats_url), run_name("dead"))
        try:
            first = Lease(bus, "orchestrator", "crashed", ttl_s=60)
            await first.acquire()
            kv = await bus.js.key_value(bus.subjects.lease_bucket)
            doc = {"holder": "crashed", "host": socket.gethostname(), "pid": gone.pid}
            await kv.put("orchestrator", json.dumps(doc).encode())
            started = time.monotonic()
            await Lease(bus, "orchestrator", "restarted", ttl_s=60).acquire(wait_s=0)
            assert time.monotonic() - started < 2  # not the 60 s ttl
            with pytest.raises(LeaseHeldError, match="restarted"):  # and it is held now
                await Lease(bus, "orchestrator", "third", ttl_s=60).acquire(wait_s=0)
        finally:
            await bus.close()

    asyncio.run(main())


def test_poison_a_dying_background_task_ends_the_loop_clearly(
    tmp_path: Path, nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "dies")

        async def broken_poller(stop: asyncio.Event) -> None:
            raise RuntimeError("a bug in the poller")

        loop.poll_versions = broken_poller  # type: ignore[method-assign]
        try:
            with pytest.raises(TreadleError, match="policy version poller died: RuntimeError"):
                async with asyncio.timeout(10):
                    await loop.run(asyncio.Event())
        finally:
            await bus.close()

    asyncio.run(main())
    assert "a bug in the poller" in caplog.text  # its traceback is in the log, once


def test_poison_restart_requests_completions_it_cannot_reread(
    tmp_path: Path, nats_url: str
) -> None:
    async def main() -> None:
        bus, loop = await open_loop(tmp_path, nats_url, "reread")
        try:
            info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUTS"))
            other = rollout_pb2.RolloutCompleted(rollout=rollout("x-000", "x"))
            await bus.publish(bus.subjects.rollouts_completed, other, msg_id="x-000")  # seq 1
            group = GroupState("g0", "t0", "{}", ["g0-000", "g0-001"], 0)
            group.completed = {"g0-000": 1, "g0-001": 99}  # seq 1 holds another rollout, 99 none
            state = OrchestratorState(groups={"g0": group}, rollouts_stream=str(info.created))
            await asyncio.to_thread(save_state, loop.ctx.store, state)
            await loop.recover()
            assert loop.state.lost == 2
            assert loop.state.groups["g0"].completed == {}
            queue = bus.subjects.stream_name("ROLLOUT_REQUESTS")
            requested = (await bus.js.stream_info(queue)).state.messages
            assert requested == 2  # both requested again (fresh Nats-Msg-Ids)
        finally:
            await bus.close()

    asyncio.run(main())
