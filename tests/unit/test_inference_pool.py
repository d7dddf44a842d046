"""The inference pool against fake replicas (threaded HTTP fakes of vLLM's generate route
and /health): least outstanding requests, a rollout kept on one replica, failover when a
replica dies mid-call (token-exact: only the answering replica's tokens come back), the
probe that takes a replica serving another model or version out of rotation, and the
orchestrator's gate over several replicas' versions (real gRPC, fake InferenceAdmin)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
import pytest

from treadle.services.errors import ObjectNotFoundError
from treadle.services.export import policy_prefix
from treadle.services.inference_client import InferenceUnreachableError
from treadle.services.inference_pool import (
    IN_ROTATION,
    UNREACHABLE,
    WRONG,
    InferencePool,
    Probe,
    probe_from_metadata,
)

PROBE_IDS = (5, 9, 14, 3, 27, 8)


def model_logprob(token: int, pos: int, shift: float = 0.0) -> float:
    """The fake model: log p(token at pos | prefix), a function of (token, pos)."""
    return -(0.5 + ((token * 7 + pos) % 5) * 0.3) - shift


class FakeReplica:
    """One fake inference server: samples ``[token] * max_tokens`` labelled ``version``;
    its prompt logprobs are ``model_logprob`` moved by ``shift`` (another model). Modes:
    "ok", "drop" (closes the connection of every generate without answering: killed
    mid-call), "hang" (never answers), "busy" (answers 503, /health too); ``healthy``
    is what /health says otherwise. ``kill``/``revive`` close and reopen its port."""

    def __init__(self, token: int, version: int = 3, delay_s: float = 0.0):
        self.token = token
        self.version = version
        self.delay_s = delay_s
        self.shift = 0.0
        self.mode = "ok"
        self.healthy = True  # what /health says
        self.generates = 0  # generate requests answered (probes excluded)
        self.probes = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.port = 0
        self._serve()

    def _serve(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._send(200 if fake.healthy and fake.mode != "busy" else 503, {})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if fake.mode == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return
                if fake.mode == "hang":  # a server shutting down that never answers
                    fake.closing.wait()
                    return
                if fake.mode == "busy":
                    self._send(503, {"error": {"message": "restarting"}})
                    return
                self._send(200, fake.answer(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        sp = body["sampling_params"]
        ids = body["token_ids"]
        probe = "prompt_logprobs" in sp
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if not probe and self.delay_s and not self.closing.wait(self.delay_s):
                pass
            n = sp["max_tokens"]
            out = [self.token] * n
            doc: dict[str, Any] = {
                "request_id": "r",
                "prompt_token_ids": ids,
                "choices": [{
                    "index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": out,
                    "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in out]},
                    "weight_versions": [{"version": str(self.version), "start": 0, "end": n}],
                }],
            }  # fmt: skip
            if probe:
                doc["prompt_logprobs"] = [None] + [
                    {str(t): {"logprob": model_logprob(t, i, self.shift), "rank": 1}}
                    for i, t in enumerate(ids[1:], start=1)
                ]
        finally:
            with self.lock:
                self.in_flight -= 1
                if probe:
                    self.probes += 1
                else:
                    self.generates += 1
        return doc

    def kill(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def revive(self) -> None:
        self.closing.clear()
        self._serve()


def published(version: int) -> Probe:
    """What the trainer published with ``version``: the true model's probe logprobs."""
    return Probe(PROBE_IDS, tuple(model_logprob(t, i) for i, t in enumerate(PROBE_IDS[1:], 1)))


async def lookup(version: int) -> Probe | None:
    if version == 0:
        return None
    if version > 10:
        raise ObjectNotFoundError(f"no published directory at {policy_prefix(version)}")
    return published(version)


@pytest.fixture
def replicas() -> Iterator[list[FakeReplica]]:
    made = [FakeReplica(201), FakeReplica(202)]
    yield made
    for r in made:
        if not r.closing.is_set():
            r.kill()


def pool_of(reps: list[FakeReplica], **kwargs: Any) -> InferencePool:
    kwargs.setdefault("lookup", lookup)
    kwargs.setdefault("probe_interval_s", 0)
    kwargs.setdefault("recheck_s", 0.1)
    return InferencePool([r.url for r in reps], 10.0, **kwargs)


def test_pool_spreads_calls_by_least_outstanding_requests(replicas: list[FakeReplica]) -> None:
    slow, fast = replicas
    slow.delay_s = 1.0

    async def main() -> list[int]:
        async with pool_of(replicas) as pool:
            held = asyncio.create_task(pool.generate([1, 2], max_tokens=2))
            await asyncio.sleep(0.2)  # the slow replica holds one call
            firsts = [int((await pool.generate([1, 2], max_tokens=2)).token_ids[0])
                      for _ in range(4)]  # fmt: skip
            await held
            return firsts

    firsts = asyncio.run(main())
    # the first call went to one replica; while it runs, every other call goes to the other
    assert slow.generates + fast.generates == 5
    assert slow.generates == 1 or fast.generates == 1
    busy = 201 if slow.generates == 1 else 202
    assert busy not in firsts


def test_pool_balances_concurrent_calls(replicas: list[FakeReplica]) -> None:
    for r in replicas:
        r.delay_s = 0.3

    async def main() -> None:
        async with pool_of(replicas) as pool:
            await asyncio.gather(*(pool.generate([1], max_tokens=1) for _ in range(6)))

    asyncio.run(main())
    assert [r.generates for r in replicas] == [3, 3]
    assert all(r.max_in_flight <= 3 for r in replicas)


def test_pool_keeps_a_rollouts_turns_on_one_replica(replicas: list[FakeReplica]) -> None:
    async def main() -> tuple[list[int], list[int]]:
        async with pool_of(replicas) as pool:
            a, b = pool.for_rollout("r-a"), pool.for_rollout("r-b")
            ta, tb = [], []
            for _ in range(3):  # interleaved turns of two rollouts, replicas idle in between
                ta.append(int((await a.generate([1, 2], max_tokens=1)).token_ids[0]))
                tb.append(int((await b.generate([1, 2], max_tokens=1)).token_ids[0]))
            return ta, tb

    ta, tb = asyncio.run(main())
    assert len(set(ta)) == 1, ta
    assert len(set(tb)) == 1, tb
    assert ta[0] != tb[0]  # two new rollouts start on two replicas
    assert [r.generates for r in replicas] == [3, 3]


def test_pool_fails_over_a_call_cut_off_by_a_dying_replica(
    replicas: list[FakeReplica], caplog: pytest.LogCaptureFixture
) -> None:
    """A replica killed mid-call: the call runs again on the other one, and what comes back
    is entirely that replica's answer (its ids, logprobs and versions), once."""
    first, second = replicas
    second.version = 4

    async def main() -> tuple[Any, Any, InferencePool]:
        pool = pool_of(replicas)
        rollout = pool.for_rollout("r")
        before = await rollout.generate([1, 2], max_tokens=3)
        assert rollout.replica is not None
        dying = first if rollout.replica.url == first.url else second
        dying.mode = "drop"  # answers nothing: the connection closes mid-call
        after = await rollout.generate([1, 2, 3], max_tokens=3)
        await pool.aclose()
        return before, after, pool

    with caplog.at_level(logging.WARNING, "treadle.services.inference_pool"):
        before, after, pool = asyncio.run(main())
    moved_from = 201 if int(before.token_ids[0]) == 201 else 202
    other = replicas[1] if moved_from == 201 else replicas[0]
    assert after.token_ids.tolist() == [other.token] * 3
    assert after.policy_versions.tolist() == [other.version] * 3
    assert after.logprobs.tolist() == [-0.25] * 3
    assert pool.num_failovers == 1
    dead = pool.replicas[0] if moved_from == 201 else pool.replicas[1]
    assert dead.state == UNREACHABLE
    assert "out of rotation (unreachable)" in caplog.text


def test_pool_moves_calls_off_a_replica_that_hangs_and_fails_its_health(
    replicas: list[FakeReplica],
) -> None:
    """A killed server may keep its connections open without answering: when its /health
    fails, the calls waiting on it run again elsewhere instead of waiting for a timeout."""

    async def main() -> tuple[Any, float, InferencePool]:
        pool = pool_of(replicas)
        rollout = pool.for_rollout("r")
        await rollout.generate([1, 2], max_tokens=1)
        assert rollout.replica is not None
        hung = replicas[0] if rollout.replica.url == replicas[0].url else replicas[1]
        hung.mode = "hang"
        t0 = time.monotonic()
        call = asyncio.create_task(rollout.generate([1, 2, 3], max_tokens=2))
        await asyncio.sleep(0.5)
        assert not call.done()  # waiting on the hung replica
        hung.healthy = False
        result = await call
        waited = time.monotonic() - t0
        await pool.aclose()
        return result, waited, pool

    result, waited, pool = asyncio.run(main())
    hung = next(r for r in replicas if r.mode == "hang")
    other = next(r for r in replicas if r is not hung)
    assert result.token_ids.tolist() == [other.token] * 2
    assert waited < 3
    assert pool.num_failovers == 1
    assert next(r for r in pool.replicas if r.url == hung.url).state == UNREACHABLE


def test_pool_brings_a_replica_back_when_it_answers_again(replicas: list[FakeReplica]) -> None:
    first, second = replicas

    async def main() -> InferencePool:
        pool = pool_of(replicas)
        first.kill()
        for _ in range(4):  # every call lands on the living replica
            await pool.generate([1], max_tokens=1)
        assert pool.replicas[0].state == UNREACHABLE
        first.revive()
        deadline = time.monotonic() + 5
        while not pool.replicas[0].in_rotation:
            assert time.monotonic() < deadline, pool.describe()
            await asyncio.sleep(0.05)
        await pool.aclose()
        return pool

    pool = asyncio.run(main())
    assert second.generates == 4
    assert first.probes >= 1  # probed before it came back
    assert pool.replicas[0].state == IN_ROTATION


def test_pool_waits_for_a_replica_then_gives_up_at_the_deadline(
    replicas: list[FakeReplica],
) -> None:
    for r in replicas:
        r.mode = "busy"

    async def main() -> float:
        async with pool_of(replicas) as pool:
            t0 = time.monotonic()
            with pytest.raises(InferenceUnreachableError, match="no inference replica in rotation"):
                await pool.generate([1], max_tokens=1, timeout_s=0.8)
            return time.monotonic() - t0

    waited = asyncio.run(main())
    assert 0.7 < waited < 3


def test_pool_probe_takes_out_a_replica_serving_another_model(
    replicas: list[FakeReplica], caplog: pytest.LogCaptureFixture
) -> None:
    """Both claim version 3; one serves other weights: it leaves rotation, calls avoid it,
    and it comes back once it serves what it claims."""
    good, liar = replicas
    liar.shift = 0.7

    async def main() -> InferencePool:
        pool = pool_of(replicas, probe_interval_s=0.1)
        for _ in range(2):  # learn the versions the replicas claim
            await pool.generate([1], max_tokens=1)
        deadline = time.monotonic() + 5
        while pool.replicas[1].state != WRONG:
            assert time.monotonic() < deadline, pool.describe()
            await asyncio.sleep(0.05)
        calls = good.generates
        for _ in range(4):
            await pool.generate([1], max_tokens=1)
        assert good.generates == calls + 4
        liar.shift = 0.0  # fixed: right again
        while not pool.replicas[1].in_rotation:
            assert time.monotonic() < deadline + 5, pool.describe()
            await asyncio.sleep(0.05)
        await pool.aclose()
        return pool

    with caplog.at_level(logging.WARNING, "treadle.services.inference_pool"):
        pool = asyncio.run(main())
    assert pool.num_probe_failures == 1
    assert pool.stats()["inference_probe_failures_total"] == 1.0
    assert "labels its answers policy version 3, but its probe logprobs differ" in caplog.text
    assert "back in rotation" in caplog.text
    assert pool.replicas[0].state == IN_ROTATION


def test_pool_probe_takes_out_a_replica_claiming_an_unpublished_version(
    replicas: list[FakeReplica],
) -> None:
    replicas[1].version = 99  # never published

    async def main() -> InferencePool:
        async with pool_of(replicas, probe_interval_s=60) as pool:
            for r in pool.replicas:  # the first check of a replica probes it
                await pool.check(r)
            return pool

    pool = asyncio.run(main())
    assert pool.replicas[0].state == IN_ROTATION
    assert pool.replicas[1].state == WRONG
    assert "policy version 99, which was never published" in pool.replicas[1].reason


def test_pool_probe_accepts_what_it_cannot_check_and_what_matches(
    replicas: list[FakeReplica],
) -> None:
    """Version 0 has no published probe (not compared); a small difference within the
    tolerance (bfloat16 serving) passes."""
    replicas[0].version, replicas[0].shift = 0, 5.0
    replicas[1].shift = 0.05

    async def main() -> InferencePool:
        async with pool_of(replicas, probe_interval_s=60) as pool:
            for r in pool.replicas:  # the first check of a replica probes it
                await pool.check(r)
            return pool

    pool = asyncio.run(main())
    assert [r.state for r in pool.replicas] == [IN_ROTATION, IN_ROTATION]
    assert replicas[1].probes == 2  # learned the label, then the version's own probe


def test_pool_refuses_bad_replica_lists() -> None:
    with pytest.raises(ValueError, match="repeat"):
        InferencePool(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one"):
        InferencePool([])


def test_probe_from_metadata_checks_the_published_probe() -> None:
    meta = {"probe": {"token_ids": [1, 2, 3], "logprobs": [-0.1, -0.2]}}
    assert probe_from_metadata(meta, "x") == Probe((1, 2, 3), (-0.1, -0.2))
    with pytest.raises(ValueError, match=r"metadata\.probe"):
        probe_from_metadata({"probe": {"token_ids": [1, 2], "logprobs": []}}, "x")


# --- the orchestrator's gate over several replicas ----------------------------------------------
async def serve_admin(version: int) -> tuple[grpc.aio.Server, str]:
    """A fake inference control plane whose status says ``version`` for run "r" (a
    deployment hosting several runs answers for the run named; no other is served)."""
    from treadle.proto.v1 import inference_service_pb2, inference_service_pb2_grpc

    class Admin(inference_service_pb2_grpc.InferenceAdminServicer):
        async def GetStatus(self, request: Any, context: Any) -> Any:
            if request.run != "r":
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {request.run!r}")
            return inference_service_pb2.InferenceStatus(policy_version=version)

    server = grpc.aio.server()
    inference_service_pb2_grpc.add_InferenceAdminServicer_to_server(Admin(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_orchestrator_gate_uses_the_oldest_version_a_live_replica_serves() -> None:
    from types import SimpleNamespace

    from treadle.orchestrator.loop import RLLoop

    async def main() -> tuple[int | None, int | None, int | None]:
        from treadle.services.rpc import open_channel

        (s1, t1), (s2, t2) = await serve_admin(5), await serve_admin(3)
        loop = RLLoop.__new__(RLLoop)  # only the version poll is exercised
        loop.ctx = SimpleNamespace(config=SimpleNamespace(run=SimpleNamespace(name="r")))
        channels = {t: open_channel(t, default_timeout_s=2, max_attempts=1) for t in (t1, t2)}
        silent: set[str] = set()
        both = await loop._oldest_served(channels, silent)
        await s2.stop(None)  # the replica on version 3 dies: the gate leaves it out
        one = await loop._oldest_served(channels, silent)
        assert silent == {t2}
        await s1.stop(None)
        none = await loop._oldest_served(channels, silent)
        for ch in channels.values():
            await ch.close()
        return both, one, none

    assert asyncio.run(main()) == (3, 5, None)


# --- discovery: replicas announced in NATS join and leave ----------------------------------
async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_pool_without_urls_or_discovery_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one replica URL, or discovery"):
        InferencePool([], 10.0)


@pytest.mark.integration
def test_pool_follows_the_replicas_announced_in_nats(
    replicas: list[FakeReplica], nats_url: str
) -> None:
    """Inference replicas announce themselves in the run's NATS bucket; a pool with no
    listed replica finds the first, takes in the second when it appears, moves calls off
    the first when it withdraws (and keeps it out while it is healthy but unannounced),
    and takes it back when it announces itself again."""
    from treadle.services.bus import Bus
    from treadle.services.discovery import Announcement, Announcer, announced
    from treadle.services.sections import NatsSection

    a, b = replicas

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), f"disc{time.time_ns() % 10**9}")
        stops = {r.port: asyncio.Event() for r in replicas}
        tasks: dict[int, asyncio.Task[None]] = {}

        def announce(r: FakeReplica) -> None:
            stops[r.port].clear()
            ann = Announcer(bus, f"inference-test-{r.port}",
                            Announcement(r.url, f"127.0.0.1:{r.port}", "policy"), ttl_s=5.0)  # fmt: skip
            tasks[r.port] = asyncio.create_task(ann.run(stops[r.port]))

        async def discover() -> list[str]:
            return [x.url for x in await announced(bus)]

        async def firsts(n: int) -> set[int]:
            return {int((await pool.generate([1, 2], max_tokens=1)).token_ids[0]) for _ in range(n)}

        pool = InferencePool([], 10.0, lookup=lookup, probe_interval_s=0, recheck_s=0.1,
                             discover=discover, discover_s=0.1)  # fmt: skip
        try:
            announce(a)
            assert await firsts(3) == {201}  # waits for the first replica to be announced
            announce(b)
            await _until(lambda: sum(r.in_rotation for r in pool.replicas) == 2)
            assert await firsts(6) == {201, 202}
            stops[a.port].set()
            await tasks[a.port]  # withdrawn: its entry is deleted
            await _until(lambda: [r.url for r in pool.replicas if r.in_rotation] == [b.url])
            gone = next(r for r in pool.replicas if r.url == a.url)
            assert gone.reason == "no longer announced in NATS"
            await asyncio.sleep(0.5)  # healthy, but not announced: it stays out
            assert not gone.in_rotation
            assert await firsts(4) == {202}
            announce(a)
            await _until(lambda: gone.in_rotation)
            assert pool.stats()["inference_replicas"] == 2.0
        finally:
            for stop in stops.values():
                stop.set()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await pool.aclose()
            await bus.close()

    asyncio.run(main())


@pytest.mark.integration
def test_orchestrator_gate_asks_the_replicas_announced_in_nats(nats_url: str) -> None:
    """The gate opens a channel to each replica announced in NATS and closes it when the
    replica withdraws; listed replicas stay whatever is announced."""
    from types import SimpleNamespace

    from treadle.orchestrator.loop import RLLoop
    from treadle.services.bus import Bus
    from treadle.services.discovery import Announcement, Announcer
    from treadle.services.rpc import open_channel
    from treadle.services.sections import NatsSection

    async def main() -> None:
        bus = await Bus.connect(NatsSection(url=nats_url), f"gate{time.time_ns() % 10**9}")
        (s1, listed), (s2, found) = await serve_admin(7), await serve_admin(4)
        loop = RLLoop.__new__(RLLoop)  # only the version poll is exercised
        loop.cfg = SimpleNamespace(inference_grpc=[listed], inference_discovery=True)
        loop.ctx = SimpleNamespace(bus=bus, config=SimpleNamespace(run=SimpleNamespace(name="r")))
        channels = {listed: open_channel(listed, default_timeout_s=2, max_attempts=1)}
        silent: set[str] = set()
        ann = Announcer(
            bus, "inference-gate-1", Announcement("http://127.0.0.1:1", found, "policy")
        )
        try:
            await loop._follow_announced(channels)
            assert set(channels) == {listed}  # nothing announced yet
            await ann.put()
            await loop._follow_announced(channels)
            assert set(channels) == {listed, found}
            assert await loop._oldest_served(channels, silent) == 4
            await ann.withdraw()
            await loop._follow_announced(channels)
            assert set(channels) == {listed}
            assert await loop._oldest_served(channels, silent) == 7
        finally:
            for ch in channels.values():
                await ch.close()
            await s1.stop(None)
            await s2.stop(None)
            await bus.close()

    asyncio.run(main())


def test_orchestrator_waits_for_inference_to_serve_before_its_first_dispatch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``orchestrator.inference_wait_s`` (a launch starts the orchestrator while vLLM
    starts): a service that answers STARTING, or READY without a policy, is not yet
    serving, nor is a replica that does not answer; the wait ends when one serves, or
    after inference_wait_s with a warning (dispatching regardless)."""
    import socket
    from types import SimpleNamespace

    from treadle.orchestrator.loop import RLLoop
    from treadle.proto.v1 import common_pb2, inference_service_pb2, inference_service_pb2_grpc

    status = {"state": common_pb2.SERVICE_STATE_STARTING, "version": 0, "asked": 0}

    class Admin(inference_service_pb2_grpc.InferenceAdminServicer):
        async def GetStatus(self, request: Any, context: Any) -> Any:
            status["asked"] += 1
            if status["asked"] == 3:  # its engine answers, no policy loaded yet
                status["state"], status["version"] = common_pb2.SERVICE_STATE_READY, -1
            elif status["asked"] == 5:
                status["version"] = 0
            return inference_service_pb2.InferenceStatus(
                info=common_pb2.ServiceInfo(state=status["state"]),
                policy_version=status["version"],
            )

    with socket.socket() as s:  # a replica that never answers: nothing listens there
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    async def main() -> tuple[dict[str, int], dict[str, int]]:
        server = grpc.aio.server()
        inference_service_pb2_grpc.add_InferenceAdminServicer_to_server(Admin(), server)
        live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        loop = RLLoop.__new__(RLLoop)  # only the wait is exercised
        loop.ctx = SimpleNamespace(config=SimpleNamespace(run=SimpleNamespace(name="r")))
        loop.cfg = SimpleNamespace(inference_grpc=[dead, live], inference_wait_s=60.0)
        await loop.wait_for_inference(asyncio.Event())
        served = dict(status)
        status.update(state=common_pb2.SERVICE_STATE_STARTING, asked=100)  # never again
        loop.cfg = SimpleNamespace(inference_grpc=[live], inference_wait_s=0.3)
        await loop.wait_for_inference(asyncio.Event())
        await server.stop(None)
        return served, status

    with caplog.at_level(logging.INFO, logger="treadle.orchestrator.loop"):
        served, after = asyncio.run(main())
    # went on at the first answer serving a policy, not before
    assert served["asked"] == 5, served
    assert served["version"] == 0, served
    assert "inference serves after" in caplog.text
    assert after["asked"] > 101  # asked again and again, then gave up
    assert "does not serve after 0s (orchestrator.inference_wait_s); dispatching regardless" in (
        caplog.text
    )
