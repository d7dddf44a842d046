"""The closed bus: a real nats-server with the run's TLS and per-role nkey users.

Each attack is the real thing — an anonymous or plaintext client, a forged
PolicyPublished / BatchReady / RolloutCompleted from a credential that lacks the
permission, a stream deletion, eavesdropping on another role's replies — and each test
asserts the server refused it and the streams are untouched. The legitimate flows of
each role (pull + ack, publish, request/reply) are asserted to work under the same users.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from treadle.proto.v1 import batch_pb2, metrics_pb2, policy_pb2, rollout_pb2
from treadle.services.bus import Bus, Delivery
from treadle.services.credentials import RunCredentials, generate
from treadle.services.errors import BusRefusedError, BusUnavailableError, ConfigError
from treadle.services.lease import Lease
from treadle.services.nats_auth import make_work_queue_consumers, work_queue_durable
from treadle.services.nats_server import EmbeddedNats
from treadle.services.sections import NatsSection

pytestmark = pytest.mark.integration

RUN = "authrun"
REFUSED_S = 1.0  # a refused publish is never acknowledged: give up after this
# ...and then the client says why: the server's own words on that publish
PUBLISH_REFUSED = r"NATS refused (the \w+ user|this client's user) of run \w+: permissions violation for publish to"


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EmbeddedNats, RunCredentials]]:
    root = tmp_path_factory.mktemp("natsauth")
    creds = generate(root / "credentials", RUN)
    server = EmbeddedNats(root / "store", root / "nats-server.log", config_file=creds.nats_conf)
    server.start()
    yield server, creds
    server.stop()


def cfg(server: EmbeddedNats, creds: RunCredentials, role: str | None, **extra: Any) -> NatsSection:
    assert server.url
    fields: dict[str, Any] = {
        "url": server.url,
        "credentials": creds.seed(role) if role else None,
        "tls_ca": creds.ca,
        "connect_timeout_s": 2.0,
    }
    return NatsSection(**(fields | extra))


async def as_role(server: EmbeddedNats, creds: RunCredentials, role: str) -> Bus:
    return await Bus.connect(cfg(server, creds, role), RUN, name=f"test-{role}", role=role)


async def admin_bus(server: EmbeddedNats, creds: RunCredentials) -> Bus:
    bus = await as_role(server, creds, "admin")
    await bus.ensure_streams()
    return bus


async def num_msgs(bus: Bus, base: str) -> int:
    info = await bus.js.stream_info(bus.subjects.stream_name(base))
    return int(info.state.messages)


def policy(version: int) -> policy_pb2.PolicyPublished:
    return policy_pb2.PolicyPublished(policy_version=version)


async def refused_publish(bus: Bus, subject: str, message: Any) -> None:
    with pytest.raises(BusRefusedError, match=PUBLISH_REFUSED):
        await bus.publish(subject, message, msg_id=None, timeout_s=REFUSED_S)


def test_credentials_folder_is_private(secured: tuple[EmbeddedNats, RunCredentials]) -> None:
    _, creds = secured
    assert stat.S_IMODE(creds.root.stat().st_mode) == 0o700
    files = [p for p in creds.root.rglob("*") if p.is_file()]
    assert files
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_bus_auth_anonymous_client_is_refused(secured: tuple[EmbeddedNats, RunCredentials]) -> None:
    server, creds = secured

    async def main() -> None:
        with pytest.raises(BusUnavailableError, match=r"(?i)authorization"):
            await Bus.connect(cfg(server, creds, None), RUN)

    asyncio.run(main())


def test_bus_auth_plaintext_client_is_refused(secured: tuple[EmbeddedNats, RunCredentials]) -> None:
    """A client that speaks the protocol in clear (no TLS handshake) never gets a PONG."""
    server, _ = secured
    assert server.url
    host, port = server.url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        info = s.recv(4096).decode()
        assert info.startswith("INFO ")
        assert json.loads(info[5:])["tls_required"] is True
        s.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        answer = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(4096):
                answer += chunk
    assert b"PONG" not in answer


def test_bus_auth_seed_file_readable_by_others_is_a_config_error(
    secured: tuple[EmbeddedNats, RunCredentials], tmp_path: Path
) -> None:
    server, creds = secured
    loose = tmp_path / "loose.nk"
    loose.write_bytes(creds.seed("trainer").read_bytes())
    os.chmod(loose, 0o644)

    async def main() -> None:
        with pytest.raises(ConfigError, match="chmod 600"):
            await Bus.connect(cfg(server, creds, None, credentials=loose), RUN, role="trainer")

    asyncio.run(main())


def test_bus_auth_env_runner_cannot_forge_policy_batches_or_delete_streams(
    secured: tuple[EmbeddedNats, RunCredentials], caplog: pytest.LogCaptureFixture
) -> None:
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        runner = await as_role(server, creds, "env_runner")
        try:
            policy_before = await num_msgs(admin, "POLICY")
            batches_before = await num_msgs(admin, "BATCHES")
            await refused_publish(runner, runner.subjects.policy_published, policy(99))
            await refused_publish(
                runner, runner.subjects.batches(1), batch_pb2.BatchReady(step=1, rollout_ids=["x"])
            )
            # and it cannot manage streams: delete / purge / create are never answered
            for attempt in (
                runner.js.delete_stream(runner.subjects.stream_name("ROLLOUTS")),
                runner.js.purge_stream(runner.subjects.stream_name("POLICY")),
                runner.js.delete_consumer(runner.subjects.stream_name("ROLLOUTS"), "orchestrator"),
            ):
                with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                    await asyncio.wait_for(attempt, REFUSED_S)
            assert await num_msgs(admin, "POLICY") == policy_before
            assert await num_msgs(admin, "BATCHES") == batches_before
            info = await admin.js.stream_info(admin.subjects.stream_name("ROLLOUTS"))
            assert info.config.name == admin.subjects.stream_name("ROLLOUTS")
            said = caplog.text.lower()  # what the server answered each attempt
            for subject in (runner.subjects.policy_published, runner.subjects.batches(1),
                            f"$js.api.stream.delete.{info.config.name}"):  # fmt: skip
                assert f'permissions violation for publish to "{subject.lower()}"' in said
        finally:
            await runner.close()
            await admin.close()

    asyncio.run(main())


def test_bus_auth_only_the_trainer_publishes_policy(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        buses = {
            r: await as_role(server, creds, r) for r in ("orchestrator", "inference", "trainer")
        }
        try:
            for role in ("orchestrator", "inference"):
                await refused_publish(buses[role], buses[role].subjects.policy_published, policy(7))
            await refused_publish(admin, admin.subjects.policy_published, policy(7))
            trainer = buses["trainer"]
            ack = await trainer.publish(trainer.subjects.policy_published, policy(3), msg_id="p3")
            assert ack.stream == trainer.subjects.stream_name("POLICY")
            last = await buses["orchestrator"].last(
                "POLICY", trainer.subjects.policy_published, policy_pb2.PolicyPublished
            )
            assert last is not None
            assert last.policy_version == 3
            # only the orchestrator publishes batches
            await refused_publish(
                trainer, trainer.subjects.batches(5), batch_pb2.BatchReady(step=5)
            )
        finally:
            for bus in buses.values():
                await bus.close()
            await admin.close()

    asyncio.run(main())


def test_bus_auth_forged_completion_from_inference_is_refused(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        inference = await as_role(server, creds, "inference")
        try:
            before = await num_msgs(admin, "ROLLOUTS")
            forged = rollout_pb2.RolloutCompleted(rollout=rollout_pb2.Rollout(rollout_id="forged"))
            await refused_publish(inference, inference.subjects.rollouts_completed, forged)
            assert await num_msgs(admin, "ROLLOUTS") == before
        finally:
            await inference.close()
            await admin.close()

    asyncio.run(main())


def test_bus_auth_roles_do_their_own_work(secured: tuple[EmbeddedNats, RunCredentials]) -> None:
    """orchestrator -> request -> env runner (pull + ack) -> completion -> orchestrator,
    and a group-score request answered by the env runner, all under their own users."""
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        orch = await as_role(server, creds, "orchestrator")
        runner = await as_role(server, creds, "env_runner")
        try:
            req = rollout_pb2.RolloutRequested(rollout_id="ok-1", group_id="g", env="echo")
            await orch.publish(orch.subjects.rollouts_requested("echo"), req, msg_id="ok-1")
            got: list[str] = []
            stop = asyncio.Event()

            async def on_request(r: rollout_pb2.RolloutRequested, d: Delivery) -> None:
                done = rollout_pb2.RolloutCompleted(
                    rollout=rollout_pb2.Rollout(rollout_id=r.rollout_id)
                )
                await runner.publish(runner.subjects.rollouts_completed, done, msg_id=r.rollout_id)
                got.append(r.rollout_id)
                stop.set()

            assert await make_work_queue_consumers(admin, ["echo"]) == ["env-runner-echo"]
            consumer = await runner.consumer(
                "ROLLOUT_REQUESTS", work_queue_durable("echo"),
                runner.subjects.rollouts_requested("echo"), rollout_pb2.RolloutRequested,
            )  # fmt: skip
            await asyncio.wait_for(consumer.run(on_request, stop, fetch_timeout_s=0.3), 20)
            assert got == ["ok-1"]
            assert await num_msgs(admin, "ROLLOUT_REQUESTS") == 0  # acked: gone from the queue

            completions: list[str] = []
            stop2 = asyncio.Event()

            async def on_done(c: rollout_pb2.RolloutCompleted, d: Delivery) -> None:
                completions.append(c.rollout.rollout_id)
                stop2.set()

            collector = await orch.consumer(
                "ROLLOUTS", "orchestrator", orch.subjects.rollouts_completed,
                rollout_pb2.RolloutCompleted,
            )  # fmt: skip
            await asyncio.wait_for(collector.run(on_done, stop2, fetch_timeout_s=0.3), 20)
            assert "ok-1" in completions

            async def score(r: rollout_pb2.GroupScoreRequest) -> rollout_pb2.GroupScoreReply:
                return rollout_pb2.GroupScoreReply()

            sub = await runner.serve(
                runner.subjects.groups_score("echo"), "env-runner-echo",
                rollout_pb2.GroupScoreRequest, score,
            )  # fmt: skip
            await runner.nc.flush()
            reply = await orch.request(
                orch.subjects.groups_score("echo"), rollout_pb2.GroupScoreRequest(),
                rollout_pb2.GroupScoreReply, timeout_s=5,
            )  # fmt: skip
            assert reply is not None
            await sub.unsubscribe()
        finally:
            await runner.close()
            await orch.close()
            await admin.close()

    asyncio.run(main())


def test_bus_auth_no_role_reads_another_role_s_subjects(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, creds = secured

    async def main() -> None:
        errors: list[str] = []

        async def on_error(e: Exception) -> None:
            errors.append(str(e))

        nc = await nats.connect(
            server.url, nkeys_seed=str(creds.seed("env_runner")), error_cb=on_error,
            tls=cfg_tls(creds), inbox_prefix=f"_INBOX.{RUN}.env_runner",
        )  # fmt: skip
        try:
            for subject in (f"_INBOX.{RUN}.orchestrator.>", f"treadle.{RUN}.>", ">"):
                await nc.subscribe(subject)
                await nc.flush()
            await asyncio.sleep(0.3)
        finally:
            await nc.close()
        violations = [e for e in errors if "permissions violation for subscription" in e.lower()]
        assert len(violations) == 3, errors

    asyncio.run(main())


def test_bus_auth_credentials_of_one_run_do_not_reach_another(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, creds = secured

    async def main() -> None:
        trainer = await Bus.connect(cfg(server, creds, "trainer"), "otherrun", role="trainer")
        try:
            with pytest.raises(BusRefusedError, match=PUBLISH_REFUSED):
                await trainer.publish(trainer.subjects.policy_published, policy(1), msg_id=None,
                                      timeout_s=REFUSED_S)  # fmt: skip
        finally:
            await trainer.close()

    asyncio.run(main())


def cfg_tls(creds: RunCredentials) -> Any:
    import ssl

    return ssl.create_default_context(cafile=str(creds.ca))


def test_bus_auth_credentials_cli_writes_the_folder_and_creates_streams(tmp_path: Path) -> None:
    """The compose path: the CLI writes the folder, nats-server starts with it, the CLI
    creates the streams as admin; a bad URL is one line on stderr, not a traceback."""
    cli = [
        sys.executable,
        "-m",
        "treadle.services.credentials",
        str(tmp_path / "creds"),
        "--run",
        "cli",
    ]
    first = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    conf = (tmp_path / "creds" / "nats-server.conf").read_bytes()
    kept = subprocess.run([*cli, "--keep"], capture_output=True, text=True, timeout=60)
    assert kept.returncode == 0
    assert (tmp_path / "creds" / "nats-server.conf").read_bytes() == conf
    server = EmbeddedNats(tmp_path / "store", tmp_path / "nats.log",
                          config_file=tmp_path / "creds" / "nats-server.conf")  # fmt: skip
    server.start()
    try:
        assert server.url
        made = subprocess.run([*cli, "--create-streams", server.url],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert made.returncode == 0, made.stderr
        assert "ROLLOUTS_cli" in made.stdout
        bad = subprocess.run([*cli, "--create-streams", "tls://127.0.0.1:1"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert bad.returncode == 1
        assert bad.stderr.count("\n") == 1
        assert "Traceback" not in bad.stderr
    finally:
        server.stop()


def test_bus_auth_env_runner_cannot_make_a_consumer_that_delivers_into_policy(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    """A push consumer on the work queue whose deliver subject is POLICY's would have the
    server itself publish into POLICY: env runners may create no consumer at all."""
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        orch = await as_role(server, creds, "orchestrator")
        runner = await as_role(server, creds, "env_runner")
        try:
            req = rollout_pb2.RolloutRequested(rollout_id="bait", env="bait")
            await orch.publish(orch.subjects.rollouts_requested("bait"), req, msg_id="bait")
            before = await num_msgs(admin, "POLICY")
            evil = api.ConsumerConfig(
                durable_name="evil", deliver_subject=runner.subjects.policy_published,
                ack_policy=api.AckPolicy.EXPLICIT,
                filter_subject=runner.subjects.rollouts_requested("bait"),
            )  # fmt: skip
            stream = runner.subjects.stream_name("ROLLOUT_REQUESTS")
            with pytest.raises((nats.errors.TimeoutError, TimeoutError)):
                await asyncio.wait_for(runner.js.add_consumer(stream, evil), REFUSED_S)
            await asyncio.sleep(0.5)
            assert await num_msgs(admin, "POLICY") == before
            with pytest.raises(nats.js.errors.NotFoundError):
                await admin.js.consumer_info(stream, "evil")
        finally:
            await runner.close()
            await orch.close()
            await admin.close()

    asyncio.run(main())


def test_bus_auth_each_role_can_do_what_its_service_does(
    secured: tuple[EmbeddedNats, RunCredentials], caplog: pytest.LogCaptureFixture
) -> None:
    """The service-side operations beyond publish/pull under each role's own user: the
    orchestrator's lease and its reads/deletes, the trainer's consumer deletion and purge,
    the inference consumer of POLICY, metrics and dead letters — no permission violation."""
    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        buses = {r: await as_role(server, creds, r) for r in ("orchestrator", "trainer", "inference", "env_runner")}  # fmt: skip
        try:
            orch, trainer, inference = buses["orchestrator"], buses["trainer"], buses["inference"]
            lease = Lease(orch, "orchestrator", "test-holder", ttl_s=5)
            await asyncio.wait_for(lease.acquire(), 10)
            await lease.release()
            ready = batch_pb2.BatchReady(step=41, rollout_ids=["a"])
            ack = await orch.publish(orch.subjects.batches(41), ready, msg_id="b41")
            raw = await orch.js.get_msg(orch.subjects.stream_name("BATCHES"), seq=ack.seq)
            assert raw.seq == ack.seq
            await orch.js.delete_msg(orch.subjects.stream_name("BATCHES"), ack.seq)
            await orch.publish(orch.subjects.batches(42), ready, msg_id="b42")
            c = await trainer.consumer("BATCHES", "trainer-r0-step42", trainer.subjects.batches(42),
                                       batch_pb2.BatchReady, max_ack_pending=1)  # fmt: skip
            await c.sub.unsubscribe()
            await trainer.js.delete_consumer(
                trainer.subjects.stream_name("BATCHES"), "trainer-r0-step42"
            )
            await trainer.purge_subject("BATCHES", trainer.subjects.batches(42))
            await trainer.publish(trainer.subjects.policy_published, policy(42), msg_id="p42")
            p = await inference.consumer("POLICY", "inference-1", inference.subjects.policy_published,
                                         policy_pb2.PolicyPublished, max_ack_pending=1)  # fmt: skip
            await p.sub.unsubscribe()
            # what inference reads at startup to catch up with the trainer
            latest = await asyncio.wait_for(inference.last(
                "POLICY", inference.subjects.policy_published, policy_pb2.PolicyPublished
            ), 10)  # fmt: skip
            assert latest is not None
            assert latest.policy_version == 42
            for role, bus in buses.items():
                report = metrics_pb2.MetricsReport(service=role, step=1)
                await bus.publish(bus.subjects.metrics(role), report, msg_id=None)
            for role, base in (("env_runner", "ROLLOUT_REQUESTS"), ("orchestrator", "ROLLOUTS"),
                               ("trainer", "BATCHES"), ("inference", "POLICY")):  # fmt: skip
                assert await buses[role].dead_letter(base, "x", 1, b"junk", {}, "test"), role
        finally:
            for bus in buses.values():
                await bus.close()
            await admin.close()

    asyncio.run(main())
    assert "permissions violation" not in caplog.text.lower()


def test_bus_auth_replicas_announce_themselves_and_env_runners_only_read(
    secured: tuple[EmbeddedNats, RunCredentials], caplog: pytest.LogCaptureFixture
) -> None:
    """Discovery under the closed bus: an inference replica announces itself, env runners
    and the orchestrator read the announcements (no consumer needed), and an env runner,
    which sits beside untrusted code, cannot announce a replica of its own."""
    from treadle.services.discovery import Announcement, Announcer, announced

    server, creds = secured

    async def main() -> None:
        admin = await admin_bus(server, creds)
        inference = await as_role(server, creds, "inference")
        runner = await as_role(server, creds, "env_runner")
        orch = await as_role(server, creds, "orchestrator")
        try:
            me = Announcement("http://gpu-1:8000", "gpu-1:50061", "policy")
            ann = Announcer(inference, "inference-gpu-1-8000", me)
            await ann.put()
            assert await announced(runner) == [me]
            assert await announced(orch) == [me]
            kv = await runner.js.key_value(runner.subjects.replicas_bucket)
            evil = json.dumps({"url": "http://evil:1", "grpc": "evil:1"}).encode()
            with pytest.raises(
                (nats.errors.TimeoutError, TimeoutError, nats.errors.NoRespondersError)
            ):
                await asyncio.wait_for(kv.put("inference-evil-1", evil), REFUSED_S)
            assert await announced(orch) == [me]
            subject = f"$kv.{runner.subjects.replicas_bucket}.inference-evil-1".lower()
            assert f'permissions violation for publish to "{subject}"' in caplog.text.lower()
            await ann.withdraw()
            assert await announced(runner) == []
        finally:
            for bus in (orch, runner, inference, admin):
                await bus.close()

    asyncio.run(main())
