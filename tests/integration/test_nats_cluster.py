"""The bus on a 3-node JetStream cluster (``sync_interval: always``): the run's streams
and lease bucket are R3, and a killed node loses and blocks nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from testkit.chaos import Nats
from treadle.proto.v1 import rollout_pb2
from treadle.services.bus import Bus, stream_replicas
from treadle.services.lease import Lease
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration


def test_stream_replicas_follow_the_cluster() -> None:
    assert stream_replicas({"server_name": "solo"}) == 1
    assert stream_replicas({"cluster": "c", "connect_urls": ["a:1", "b:1", "c:1", "d:1"]}) == 3
    # a node down when a service (re)starts: the streams stay R3, not scaled down
    assert stream_replicas({"cluster": "c", "connect_urls": ["a:1", "b:1"]}) == 3


def test_bus_on_a_single_server_keeps_one_replica(nats_url: str) -> None:
    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), "solo")
        try:
            await bus.ensure_streams()
            info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUTS"))
            assert info.config.num_replicas == 1
        finally:
            await bus.close()

    asyncio.run(main())


def test_cluster_streams_are_r3_and_survive_a_killed_node(tmp_path: Path) -> None:
    nats = Nats(tmp_path, num_nodes=3)
    nats.start()

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats.url), "r3")
        try:
            names = await bus.ensure_streams()  # waits while the cluster elects its leader
            for name in names:
                assert (await bus.js.stream_info(name)).config.num_replicas == 3, name
            lease = Lease(bus, "orchestrator", "me")
            await lease.acquire()
            kv = await bus.js.stream_info(f"KV_{bus.subjects.lease_bucket}")
            assert kv.config.num_replicas == 3
            stream = bus.subjects.stream_name("ROLLOUTS")
            leader = (await bus.js.stream_info(stream)).cluster.leader
            victim = 1 if leader == "treadle-n1" else int(leader.rsplit("n", 1)[1]) - 1
            rollout = rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="r1"))
            await bus.publish(bus.subjects.rollouts_completed, rollout, msg_id="r1")
            nats.kill(victim)  # the stream's leader (or a follower when we talk to the leader)
            done = rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="r2"))
            result = await bus.publish(bus.subjects.rollouts_completed, done, msg_id="r2")
            assert result.seq == 2
            info = await bus.js.stream_info(stream)
            assert info.state.messages == 2
            assert info.cluster.leader != f"treadle-n{victim + 1}"
            await lease.release()
            # a service (re)started while the node is down: streams stay R3, consumers work
            again = await Bus.connect(NatsSection(url=nats.url), "r3")
            try:
                await again.ensure_streams()
                assert (await again.js.stream_info(stream)).config.num_replicas == 3
                consumer = await again.consumer(
                    "ROLLOUTS", "after-the-kill", again.subjects.rollouts_completed,
                    rollout_pb2.RolloutCompleted,
                )  # fmt: skip
                # through the consumer's own loop: a consumer made while a node is down
                # answers 503 until its leader is elected, which the loop rides out
                got: list[str] = []
                stop = asyncio.Event()

                async def take(m: rollout_pb2.RolloutCompleted, _: object) -> None:
                    got.append(m.rollout.rollout_id)
                    if len(got) == 2:
                        stop.set()

                await asyncio.wait_for(consumer.run(take, stop), 60)
                assert got == ["r1", "r2"]
            finally:
                await again.close()
        finally:
            await bus.close()

    try:
        asyncio.run(main())
    finally:
        nats.stop()
