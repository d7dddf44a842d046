"""The JetStream bus against a real nats-server: streams, dedupe, claim checks,
explicit acks, heartbeats, redelivery and bad payloads."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from treadle.proto.v1 import common_pb2, policy_pb2, rollout_pb2
from treadle.services import bus_time
from treadle.services.bus import HDR_CLAIM_CHECK, HDR_TYPE, Bus, Delivery
from treadle.services.errors import BusUnavailableError, PublishRejectedError
from treadle.services.objectstore import LocalObjectStore
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration

_run_ids = itertools.count()


def run_name() -> str:
    return f"bus{next(_run_ids)}"


async def connect(url: str, run: str, store: LocalObjectStore | None = None, **cfg: Any) -> Bus:
    bus = await Bus.connect(NatsSection(url=url, **cfg), run, store=store)
    await bus.ensure_streams()
    return bus


def request(i: int, payload: str = "") -> rollout_pb2.RolloutRequested:
    return rollout_pb2.RolloutRequested(
        rollout_id=f"r{i}", group_id="g", env="echo", task_json=payload or "{}"
    )


async def run_consumer(
    bus: Bus,
    handler: Callable[[rollout_pb2.RolloutRequested, Delivery], Awaitable[None]],
    *,
    until: Callable[[], bool],
    durable: str = "runner",
    timeout_s: float = 20.0,
) -> Any:
    consumer = await bus.consumer(
        "ROLLOUT_REQUESTS",
        durable,
        bus.subjects.rollouts_requested_any,
        rollout_pb2.RolloutRequested,
    )
    stop = asyncio.Event()

    async def stopper() -> None:
        async with asyncio.timeout(timeout_s):
            while not until():  # noqa: ASYNC110 - polling a plain predicate
                await asyncio.sleep(0.05)
        stop.set()

    await asyncio.gather(consumer.run(handler, stop, fetch_timeout_s=0.2), stopper())
    return consumer


def test_bus_creates_streams_with_design_retention(nats_url: str) -> None:
    async def main() -> None:
        run = run_name()
        bus = await connect(nats_url, run)
        assert await bus.ensure_streams() == [
            f"{b}_{run}"
            for b in (
                "ROLLOUT_REQUESTS",
                "ROLLOUTS",
                "BATCHES",
                "POLICY",
                "METRICS",
                "USAGE",
                "DEAD_LETTERS",
            )
        ]
        info = {
            n: (await bus.js.stream_info(f"{n}_{run}")).config
            for n in ("ROLLOUT_REQUESTS", "ROLLOUTS", "POLICY", "USAGE")
        }
        # the usage ledger is kept: no age limit
        assert str(getattr(info["USAGE"].retention, "value", info["USAGE"].retention)) == "limits"
        assert not info["USAGE"].max_age
        assert (
            str(
                getattr(
                    info["ROLLOUT_REQUESTS"].retention, "value", info["ROLLOUT_REQUESTS"].retention
                )
            )
            == "workqueue"
        )
        assert (
            str(
                getattr(info["ROLLOUT_REQUESTS"].discard, "value", info["ROLLOUT_REQUESTS"].discard)
            )
            == "new"
        )
        assert (
            str(getattr(info["ROLLOUTS"].retention, "value", info["ROLLOUTS"].retention))
            == "limits"
        )
        assert info["POLICY"].max_msgs_per_subject == 1
        await bus.close()

    asyncio.run(main())


def test_bus_drops_duplicate_msg_ids(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name())
        subject = bus.subjects.rollouts_completed
        done = rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="abc"))
        first = await bus.publish(subject, done, msg_id="abc")
        second = await bus.publish(subject, done, msg_id="abc")
        assert not first.duplicate
        assert second.duplicate
        info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUTS"))
        assert info.state.messages == 1
        await bus.close()

    asyncio.run(main())


def test_bus_claim_check_round_trip(nats_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        store = LocalObjectStore(tmp_path / "store")
        bus = await connect(nats_url, run_name(), store, claim_check_threshold_bytes=1024)
        big = request(1, "x" * 50_000)
        res = await bus.publish(bus.subjects.rollouts_requested("echo"), big, msg_id="r1")
        assert res.claim_check
        assert len(store.list("claims/")) == 1
        got: list[rollout_pb2.RolloutRequested] = []

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            got.append(msg)

        await run_consumer(bus, handler, until=lambda: len(got) == 1)
        assert got[0] == big
        await bus.close()

    asyncio.run(main())


def test_bus_work_is_timed_per_kind(nats_url: str, tmp_path: Path) -> None:
    async def main() -> dict[str, tuple[float, int]]:
        store = LocalObjectStore(tmp_path / "store")
        bus = await connect(nats_url, run_name(), store, claim_check_threshold_bytes=1024)
        got: list[rollout_pb2.RolloutRequested] = []

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            got.append(msg)

        before = bus_time.snapshot()
        await bus.publish(
            bus.subjects.rollouts_requested("echo"), request(1, "x" * 5000), msg_id="r1"
        )
        await bus.publish(bus.subjects.rollouts_requested("echo"), request(2), msg_id="r2")
        await run_consumer(bus, handler, until=lambda: len(got) == 2)
        await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
        after = bus_time.snapshot()
        await bus.close()
        return {op: (after[op][0] - before[op][0], after[op][1] - before[op][1]) for op in after}

    delta = asyncio.run(main())
    # two messages out and in, one of them by claim check (put and get), one direct read
    for op, n in (("encode", 2), ("publish", 2), ("decode", 2), ("ack", 2), ("claim_check", 2),
                  ("read", 1)):  # fmt: skip
        assert delta[op][1] == n, (op, delta[op])
        assert delta[op][0] > 0
    assert 1 <= delta["fetch"][1] <= 2  # fetches that returned messages only
    assert delta["request"] == (0.0, 0)


def test_bus_claim_check_with_wrong_sha256_is_dropped_not_handled(
    nats_url: str, tmp_path: Path
) -> None:
    async def main() -> None:
        store = LocalObjectStore(tmp_path / "store")
        bus = await connect(nats_url, run_name(), store, claim_check_threshold_bytes=1024)
        await bus.publish(
            bus.subjects.rollouts_requested("echo"), request(1, "y" * 5000), msg_id="r1"
        )
        (obj,) = store.list("claims/")
        stored = bytearray(store.get_bytes(obj.key))
        stored[-1] ^= 0xFF  # same size, one byte flipped: only the sha256 can tell
        store.put_bytes(obj.key, bytes(stored))
        await bus.publish(bus.subjects.rollouts_requested("echo"), request(2), msg_id="r2")
        got: list[str] = []

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            got.append(msg.rollout_id)

        consumer = await run_consumer(bus, handler, until=lambda: got == ["r2"])
        assert consumer.stats.undecodable == 1
        assert "sha256" in consumer.stats.last_error
        await bus.close()

    asyncio.run(main())


def test_bus_malformed_protobuf_is_terminated_and_the_loop_goes_on(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name())
        subject = bus.subjects.rollouts_requested("echo")
        await bus.js.publish(
            subject,
            b"\xff\xfe not a protobuf",
            headers={HDR_TYPE: "treadle.proto.v1.RolloutRequested"},
        )
        await bus.js.publish(
            subject, b"{}", headers={HDR_TYPE: "treadle.proto.v1.Batch"}
        )  # wrong type
        await bus.publish(subject, request(7), msg_id="r7")
        got: list[str] = []

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            got.append(msg.rollout_id)

        consumer = await run_consumer(bus, handler, until=lambda: got == ["r7"])
        assert consumer.stats.undecodable == 2
        await asyncio.sleep(0.3)
        info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUT_REQUESTS"))
        assert info.state.messages == 0  # terminated messages leave the work queue
        await bus.close()

    asyncio.run(main())


def test_bus_failed_handler_gets_a_redelivery_and_acks_after_success(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name())
        await bus.publish(bus.subjects.rollouts_requested("echo"), request(1), msg_id="r1")
        deliveries: list[int] = []

        async def flaky(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            deliveries.append(d.num_delivered)
            if d.num_delivered == 1:
                raise RuntimeError("transient failure")

        consumer = await run_consumer(bus, flaky, until=lambda: len(deliveries) == 2)
        assert deliveries == [1, 2]
        assert consumer.stats.retried == 1
        assert consumer.stats.handled == 1
        await bus.close()

    asyncio.run(main())


def test_bus_heartbeats_keep_a_slow_handler_s_message(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name(), ack_wait_s=1.0)
        await bus.publish(bus.subjects.rollouts_requested("echo"), request(1), msg_id="r1")
        calls: list[int] = []

        async def slow(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            calls.append(d.num_delivered)
            await asyncio.sleep(3.5)  # 3.5 x ack_wait: only heartbeats prevent a redelivery

        consumer = await bus.consumer(
            "ROLLOUT_REQUESTS",
            "slow",
            bus.subjects.rollouts_requested_any,
            rollout_pb2.RolloutRequested,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(consumer.run(slow, stop, concurrency=2, fetch_timeout_s=0.2))
        await asyncio.sleep(5.0)
        stop.set()
        await task
        assert calls == [1]
        assert consumer.stats.handled == 1
        await bus.close()

    asyncio.run(main())


def test_bus_consumer_killed_mid_handler_causes_redelivery(nats_url: str) -> None:
    async def main() -> None:
        run = run_name()
        a = await connect(nats_url, run, ack_wait_s=1.0)
        await a.publish(a.subjects.rollouts_requested("echo"), request(1), msg_id="r1")
        started = asyncio.Event()

        async def hang(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            started.set()
            await asyncio.sleep(3600)

        consumer_a = await a.consumer(
            "ROLLOUT_REQUESTS",
            "runner",
            a.subjects.rollouts_requested_any,
            rollout_pb2.RolloutRequested,
        )
        task = asyncio.create_task(consumer_a.run(hang, asyncio.Event(), fetch_timeout_s=0.2))
        await asyncio.wait_for(started.wait(), 10)
        await a.nc.close()  # the runner "dies": no ack, no nak, heartbeats stop
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        b = await connect(nats_url, run, ack_wait_s=1.0)
        got: list[int] = []

        async def handler(msg: rollout_pb2.RolloutRequested, d: Delivery) -> None:
            got.append(d.num_delivered)

        await run_consumer(b, handler, until=lambda: len(got) == 1)
        assert got == [2]
        await b.close()

    asyncio.run(main())


def test_bus_full_work_queue_refuses_new_requests(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name(), max_pending_rollout_requests=2)
        subject = bus.subjects.rollouts_requested("echo")
        await bus.publish(subject, request(1), msg_id="r1")
        await bus.publish(subject, request(2), msg_id="r2")
        with pytest.raises(PublishRejectedError, match="maximum messages"):
            await bus.publish(subject, request(3), msg_id="r3")
        await bus.close()

    asyncio.run(main())


def test_bus_policy_stream_keeps_the_last_value(nats_url: str) -> None:
    async def main() -> None:
        bus = await connect(nats_url, run_name())
        assert (
            await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
            is None
        )
        for v in (1, 2, 3):
            msg = policy_pb2.PolicyPublished(
                policy_version=v, weights=common_pb2.ObjectRef(uri=f"file:///w/{v}")
            )
            await bus.publish(bus.subjects.policy_published, msg, msg_id=f"policy-{v}")
        last = await bus.last("POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished)
        assert last is not None
        assert last.policy_version == 3
        info = await bus.js.stream_info(bus.subjects.stream_name("POLICY"))
        assert info.state.messages == 1
        await bus.close()

    asyncio.run(main())


def test_bus_publish_without_streams_is_explained(nats_url: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), run_name())
        with pytest.raises(PublishRejectedError, match="ensure_streams"):
            await bus.publish(
                bus.subjects.rollouts_completed, rollout_pb2.RolloutCompleted(), msg_id="x"
            )
        await bus.close()

    asyncio.run(main())


def test_bus_unreachable_server_fails_fast(free_port: int) -> None:
    with pytest.raises(
        BusUnavailableError, match=rf"cannot reach NATS at nats://127.0.0.1:{free_port}"
    ):
        asyncio.run(
            Bus.connect(NatsSection(url=f"nats://127.0.0.1:{free_port}", connect_timeout_s=1), "r")
        )
    with pytest.raises(BusUnavailableError, match=r"nats\.url is not set"):
        asyncio.run(Bus.connect(NatsSection(), "r"))


def test_bus_claim_check_header_is_set_only_for_big_messages(nats_url: str, tmp_path: Path) -> None:
    async def main() -> None:
        bus = await connect(
            nats_url, run_name(), LocalObjectStore(tmp_path), claim_check_threshold_bytes=100
        )
        subject = bus.subjects.rollouts_completed
        await bus.publish(
            subject,
            rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="s")),
            msg_id="s",
        )
        await bus.publish(
            subject,
            rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="b" * 5000)),
            msg_id="b",
        )
        stream = bus.subjects.stream_name("ROLLOUTS")
        small = await bus.js.get_msg(stream, seq=1)
        big = await bus.js.get_msg(stream, seq=2)
        assert HDR_CLAIM_CHECK not in (small.headers or {})
        assert (big.headers or {}).get(HDR_CLAIM_CHECK) == "1"
        assert len(big.data or b"") < 1000  # the bus carries only the ObjectRef, not 5 kB
        await bus.close()

    asyncio.run(main())
