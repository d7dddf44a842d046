"""The data-plane bus: NATS JetStream with protobuf payloads, claim checks and tracing.

    publisher ── publish(subject, msg, msg_id) ──▶ JetStream stream ──▶ PullConsumer.run(handler)
                  │ > threshold: bytes → object store,                  │ fetch → decode (claim check,
                  │ ObjectRef on the bus                                │ sha256 verified) → handler
                  │ headers: Nats-Msg-Id, Treadle-Type, traceparent     │ heartbeat while it runs
                  ▼                                                     ▼ ack after it returns

Delivery is at-least-once: a message is acked only after its handler returned (i.e. after
the handler's durable side effect), so a consumer killed mid-handler causes a redelivery.
Publishers set ``Nats-Msg-Id`` so a repeated publish inside the stream's duplicate window
is dropped by the server; consumers stay idempotent by id for the rest.

Poison (design invariant 6): a message that cannot be decoded (no or a wrong
``Treadle-Type`` header, bad protobuf, a claim check that is malformed, points outside the
object store, is missing or fails its sha256) is terminated — redelivering it would fail
the same way — logged once with its subject and sequence, counted (``ConsumerStats``,
``BusStats``) and kept, bytes and headers, on the run's dead-letter subject
(``subjects.dead_letter``). A handler that raises gets the message redelivered with
backoff, up to ``nats.max_deliver`` times, then it is dead-lettered the same way;
``DropMessage`` dead-letters it at once. A consumer whose stream or durable consumer is
deleted under it stops with a ``BusUnavailableError`` that says so (never a traceback).

Outages cost time, not data: a publish JetStream cannot answer for now (a stream electing
a new leader after a cluster node died, a restarted server recovering its streams) is
sent again for up to ``PUBLISH_RETRY_S`` (a timed-out one only with a ``Nats-Msg-Id``),
and ``ensure_streams`` waits up to ``JETSTREAM_READY_S`` for a JetStream that does not
answer yet. In a JetStream cluster the run's streams are R3 (``stream_replicas``). A
connected client the server stops accepting (its user removed, its seed changed or gone)
closes its connection after ``REFUSED_S`` and raises ``BusRefusedError`` saying so, where
it would otherwise wait out those minutes.

Cost: encoding, decoding, publishes, fetches that returned messages, acks, direct reads
and claim checks are timed into process-wide counters (``bus_time.py``).

Not here: what the messages mean. Subjects come from ``subjects.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from google.protobuf.message import Message
from nats.js import api
from opentelemetry import trace

from treadle.proto.v1 import common_pb2
from treadle.services import bus_time, telemetry
from treadle.services.codecs import decode_message, type_name
from treadle.services.errors import (
    BusRefusedError,
    BusUnavailableError,
    ConfigError,
    DecodeError,
    DropMessage,
    IntegrityError,
    ObjectNotFoundError,
    PublishRejectedError,
    StoreUnavailableError,
    TreadleError,
)
from treadle.services.nats_auth import connect_options
from treadle.services.objectstore import ObjectStore
from treadle.services.ports import is_listening
from treadle.services.redact import redact_urls
from treadle.services.sections import NatsSection, nats_address
from treadle.services.subjects import Retention, StreamSpec, Subjects

log = logging.getLogger(__name__)
_violations = telemetry.meter(__name__).create_counter(
    "treadle.nats.permission_violations", description="operations the NATS server refused our user"
)

P = TypeVar("P", bound=Message)

HDR_MSG_ID = "Nats-Msg-Id"
HDR_TYPE = "Treadle-Type"
HDR_CLAIM_CHECK = "Treadle-Claim-Check"
CLAIM_PREFIX = "claims"
# headers of a dead letter: where it came from and why it was refused
HDR_DL_SUBJECT = "Treadle-Dead-Letter-Subject"
HDR_DL_SEQ = "Treadle-Dead-Letter-Seq"
HDR_DL_REASON = "Treadle-Dead-Letter-Reason"
HDR_DL_MSG_ID = "Treadle-Dead-Letter-Msg-Id"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_HEADER_VALUE_MAX = 1024  # characters of a reason kept in a dead letter's header
JETSTREAM_READY_S = 60.0  # seconds ensure_streams waits for a JetStream that does not answer
PUBLISH_RETRY_S = 60.0  # seconds a publish is sent again while JetStream cannot answer
REFUSED_S = 3.0  # seconds a connected client is turned away on every reconnect before it stops


def _closed_quietly(closing: asyncio.Future[None]) -> None:
    """A refused client's close: the socket the server shut may fail its last flush."""
    if not closing.cancelled() and closing.exception() is not None:
        log.debug("closing a refused connection: %r", closing.exception())


@dataclass
class _Refusal:
    """A client that was connected and is now turned away on every reconnect: its NATS
    user was removed (a run the platform let go) or its seed changed. nats.py would try
    again forever and every operation would time out after a minute; after ``REFUSED_S``
    the connection is closed instead and every operation raises ``BusRefusedError`` with
    ``reason``."""

    since: float | None = None  # first refusal since the last good connection
    reason: str = ""  # set once the client stopped
    closing: asyncio.Future[None] | None = None


@dataclass(frozen=True)
class PublishResult:
    stream: str
    seq: int
    duplicate: bool  # the server already had this Nats-Msg-Id
    claim_check: bool  # payload went through the object store


class Slots:
    """A concurrency budget shared by several consumers (e.g. one env runner pulling the
    requests of many environments with one ``max_concurrency``). Fair: freed slots go to
    waiting consumers first-come first-served, so a consumer whose fetches come back empty
    cannot take them all back before another one that has work."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"slots must be >= 1, got {n}")
        self.total = n
        self.free = n
        self._waiters: deque[tuple[int, asyncio.Future[int]]] = deque()

    async def take(self, most: int, stop: asyncio.Event) -> int:
        """Wait for a free slot and take up to ``most``; 0 once ``stop`` is set."""
        if stop.is_set():
            return 0
        if self.free > 0 and not self._waiters:
            k = min(most, self.free)
            self.free -= k
            return k
        granted: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append((most, granted))
        stopping = asyncio.ensure_future(stop.wait())
        either: list[asyncio.Future[Any]] = [granted, stopping]
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not granted.done():
                granted.cancel()
                self._waiters = deque(w for w in self._waiters if w[1] is not granted)
        if granted.cancelled():
            return 0
        if stop.is_set():
            self.give(granted.result())
            return 0
        return granted.result()

    def give(self, k: int) -> None:
        self.free += k
        while self.free > 0 and self._waiters:
            most, granted = self._waiters.popleft()
            if granted.done():
                continue
            n = min(most, self.free)
            self.free -= n
            granted.set_result(n)


@dataclass(frozen=True)
class Delivery:
    """Transport facts about one delivered message."""

    subject: str
    msg_id: str
    stream_seq: int
    num_delivered: int  # 1 on first delivery
    headers: dict[str, str]


@dataclass
class ConsumerStats:
    handled: int = 0  # handler returned, message acked
    retried: int = 0  # handler raised, message nak'ed for redelivery
    dropped: int = 0  # terminated: DropMessage or max_deliver reached
    undecodable: int = 0  # terminated: could not decode
    dead_lettered: int = 0  # terminated messages kept on the dead-letter subject
    last_error: str = ""


@dataclass
class BusStats:
    """Poison seen by every consumer and reader of one Bus (reported as metrics)."""

    undecodable: int = 0  # messages that could not be decoded (consumers and ``last``)
    refused: int = 0  # decoded but refused: DropMessage, or max_deliver reached
    dead_lettered: int = 0  # of those, kept on the dead-letter subject
    dead_letter_failed: int = 0  # could not be kept (logged)

    def metrics(self) -> dict[str, float]:
        return {
            "bus_undecodable_total": float(self.undecodable),
            "bus_refused_total": float(self.refused),
            "bus_dead_lettered_total": float(self.dead_lettered),
        }


def _header_value(text: str) -> str:
    """A header-safe one-line ASCII version of ``text``."""
    flat = " ".join(text.split())
    return flat.encode("ascii", "replace").decode("ascii")[:_HEADER_VALUE_MAX]


def _temporarily_unavailable(e: nats.js.errors.APIError) -> bool:
    """JetStream's "system temporarily unavailable" (err_code 10008: a cluster without a
    meta leader, a server still starting), as opposed to a refusal such as a full stream."""
    return e.err_code == 10008 or "temporarily unavailable" in str(e.description or "").lower()


def stream_replicas(server_info: dict[str, Any]) -> int:
    """Replicas of the run's streams on the server that sent ``server_info`` (its INFO):
    1 on a single server, 3 in a JetStream cluster (R3, DESIGN.md section 4: a node may
    die without losing or blocking anything). Never fewer because a node is down now: a
    service restarted during a node's outage would scale every stream down to R2; a
    cluster that cannot place 3 replicas gets a clear error from ensure_streams instead."""
    return 3 if server_info.get("cluster") else 1


def _stream_config(spec: StreamSpec, replicas: int = 1) -> api.StreamConfig:
    common: dict[str, Any] = {
        "name": spec.name,
        "num_replicas": replicas,
        "subjects": list(spec.subjects),
        "storage": api.StorageType.FILE,
        "duplicate_window": spec.duplicate_window_s,
        "max_msgs": spec.max_msgs,
        "max_bytes": spec.max_bytes,
        "max_age": spec.max_age_s,
    }
    if spec.retention is Retention.WORK_QUEUE:
        return api.StreamConfig(
            retention=api.RetentionPolicy.WORK_QUEUE, discard=api.DiscardPolicy.NEW, **common
        )
    if spec.retention is Retention.LAST_VALUE:
        return api.StreamConfig(
            retention=api.RetentionPolicy.LIMITS,
            discard=api.DiscardPolicy.OLD,
            max_msgs_per_subject=1,
            **common,
        )
    return api.StreamConfig(
        retention=api.RetentionPolicy.LIMITS, discard=api.DiscardPolicy.OLD, **common
    )


class Bus:
    """A connected JetStream client bound to one run's subjects."""

    def __init__(self, nc: Any, cfg: NatsSection, subjects: Subjects, store: ObjectStore | None):
        self.nc = nc
        self.js = nc.jetstream()
        self.cfg = cfg
        self.subjects = subjects
        self.store = store
        self.stats = BusStats()
        self._poison_read: set[tuple[str, int]] = set()  # undecodable, read by sequence
        self._closing = {"now": False}  # shared with the connection callbacks
        self._refusal = _Refusal()
        self._denials: deque[tuple[float, str]] = deque(maxlen=32)  # (when, the server's words)
        self.role = ""
        self._shown = redact_urls(cfg.url or "")

    @classmethod
    async def connect(
        cls,
        cfg: NatsSection,
        run: str,
        *,
        store: ObjectStore | None = None,
        name: str = "treadle",
        role: str | None = None,
    ) -> Bus:
        """Connect to ``cfg.url``; unreachable servers fail fast with a clear error.

        ``role`` (a service name, or "admin") picks the inbox prefix that role's NATS
        user may subscribe to when ``cfg.credentials`` is set (see nats_auth.py)."""
        if not cfg.url:
            raise BusUnavailableError(
                "nats.url is not set: point it at a NATS server with JetStream "
                "(e.g. --nats.url nats://127.0.0.1:4222), or run the local stack with `treadle rl`"
            )
        url = cfg.url if "://" in cfg.url else f"nats://{cfg.url}"
        options = connect_options(cfg, url, run, role)
        shown = redact_urls(url)
        try:
            host, port = nats_address(url)
        except ValueError as e:  # only a NatsSection built without validation gets here
            raise ConfigError(f"nats.url {shown!r} {e}") from None
        if not await asyncio.to_thread(is_listening, host, port, cfg.connect_timeout_s):
            raise BusUnavailableError(
                f"cannot reach NATS at {shown}: nothing accepts connections there. "
                "Start nats-server (with -js) or fix nats.url"
            )

        refused = asyncio.Event()  # the server turned our credentials away
        connected: list[Bus] = []  # the bus, once connected

        async def on_error(e: Exception) -> None:
            turned_away = "Authorization Violation" in str(e) or "Authentication" in str(e)
            if turned_away:
                refused.set()
            if connected and (turned_away or isinstance(e, FileNotFoundError)):
                connected[0]._turned_away(e)
                return
            if "permissions violation" in str(e).lower():  # our user may not do that
                _violations.add(1)
                if connected:
                    connected[0]._denials.append((time.monotonic(), str(e).lower()))
            log.warning("nats: %s: %s", type(e).__name__, e)

        closing = {"now": False}

        async def on_disconnect() -> None:
            if not closing["now"]:
                log.warning("nats: disconnected from %s; reconnecting", shown)

        async def on_reconnect() -> None:
            if connected:
                connected[0]._refusal.since = None
            log.info("nats: reconnected to %s", shown)

        try:
            connecting = asyncio.ensure_future(asyncio.wait_for(
                nats.connect(
                    servers=[url],
                    name=name,
                    connect_timeout=cfg.connect_timeout_s,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    error_cb=on_error,
                    disconnected_cb=on_disconnect,
                    reconnected_cb=on_reconnect,
                    **options,
                ),
                timeout=cfg.connect_timeout_s * 2,
            ))  # fmt: skip
            turned_away = asyncio.ensure_future(refused.wait())
            await asyncio.wait([connecting, turned_away], return_when=asyncio.FIRST_COMPLETED)
            turned_away.cancel()
            if not connecting.done():
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                raise BusRefusedError(
                    f"NATS at {shown} refused this client (Authorization Violation): "
                    "nats.credentials must be the seed file of a user of this server"
                )
            nc = connecting.result()
        except (TimeoutError, OSError, nats.errors.Error) as e:
            raise BusUnavailableError(
                f"cannot connect to NATS at {shown}: {type(e).__name__}: {redact_urls(str(e))}"
            ) from None
        bus = cls(nc, cfg, Subjects(run), store)
        bus._closing = closing
        bus.role = role or ""
        connected.append(bus)
        return bus

    def _turned_away(self, e: Exception) -> None:
        """The server refused a reconnect (or the seed file is gone): remember since when,
        and stop after ``REFUSED_S`` of nothing but refusals (``_Refusal``)."""
        r = self._refusal
        if r.reason:
            return
        why = (f"its seed file {e.filename} is gone" if isinstance(e, FileNotFoundError)
               else f"the server answers {str(e).removeprefix('nats: ')}")  # fmt: skip
        now = time.monotonic()
        if r.since is None:
            r.since = now
            log.warning("nats: %s refuses this client on reconnect (%s); it stops in %.0fs "
                        "unless the server takes it back", self._shown, why, REFUSED_S)  # fmt: skip
            return
        if now - r.since < REFUSED_S:
            return
        r.reason = (
            f"NATS at {self._shown} no longer accepts this client ({why}, on every reconnect "
            f"for {REFUSED_S:.0f}s): its user was removed from the server (a run the platform "
            "let go) or its credentials changed; the connection is closed"
        )
        log.error("nats: %s", r.reason)
        self._closing["now"] = True
        r.closing = asyncio.ensure_future(self.nc.close())
        r.closing.add_done_callback(_closed_quietly)

    def _raise_if_refused(self) -> None:
        """``BusRefusedError`` once the server stopped accepting this client (``_Refusal``)."""
        if self._refusal.reason:
            raise BusRefusedError(self._refusal.reason)

    def _raise_if_denied(self, since: float, *subject_parts: str) -> None:
        """``BusRefusedError`` when, after ``since``, the server refused this user a request
        whose subject holds every one of ``subject_parts``: a JetStream request the user may
        not make is never answered, and would otherwise be asked again until its deadline."""
        self._raise_if_refused()
        parts = [p.lower() for p in subject_parts]
        for when, words in reversed(self._denials):
            if when >= since and all(p in words for p in parts):
                user = f"the {self.role} user of run {self.subjects.run}" if self.role else (
                    f"this client's user on run {self.subjects.run}")  # fmt: skip
                raise BusRefusedError(
                    f"NATS refused {user}: {words.removeprefix('nats: ')} (its permissions "
                    "do not allow that; see nats_auth.py for what each role may do)"
                )

    async def ensure_streams(self) -> list[str]:
        """Create (or update) the run's streams; returns their names."""
        server_max = int(getattr(self.nc, "max_payload", 0) or 0)
        if 0 < server_max <= self.cfg.claim_check_threshold_bytes:
            log.warning(
                "nats.claim_check_threshold_bytes = %d is not below the server's max_payload "
                "(%d bytes): payloads above %d bytes go through the object store",
                self.cfg.claim_check_threshold_bytes, server_max, self.claim_threshold_bytes,
            )  # fmt: skip
        names = []
        if self.replicas > 1:
            log.info("[startup] JetStream cluster %s: the run's streams keep %d replicas",
                     getattr(self.nc, "_server_info", {}).get("cluster"), self.replicas)  # fmt: skip
        for spec in self.subjects.streams(self.cfg):
            await self._ensure_stream(_stream_config(spec, self.replicas))
            names.append(spec.name)
        return names

    async def _ensure_stream(self, config: api.StreamConfig) -> None:
        """Create or update one stream. A JetStream that does not answer yet (a cluster
        electing its leader, a server recovering its streams) is asked again for up to
        ``JETSTREAM_READY_S``, then one clear error."""
        deadline = time.monotonic() + JETSTREAM_READY_S
        while True:
            self._raise_if_refused()
            asked = time.monotonic()
            try:
                try:
                    await self.js.stream_info(config.name)
                except nats.js.errors.NotFoundError:
                    await self.js.add_stream(config)
                else:
                    await self.js.update_stream(config)
                return
            except nats.errors.NoRespondersError:
                raise BusUnavailableError(
                    f"JetStream is not enabled on {self.cfg.url}: start nats-server with -js"
                ) from None
            except nats.errors.ConnectionClosedError:
                self._raise_if_refused()
                raise
            except (nats.errors.TimeoutError, nats.js.errors.APIError) as e:
                if isinstance(e, nats.js.errors.APIError) and not _temporarily_unavailable(e):
                    raise BusUnavailableError(
                        f"cannot create or update stream {config.name}: {e.description} "
                        "(an existing stream with other retention settings must be deleted "
                        "first)"
                    ) from None
                self._raise_if_denied(asked, "$js.api.stream.", f".{config.name}")
                if time.monotonic() > deadline:
                    raise BusUnavailableError(
                        f"JetStream on {redact_urls(self.cfg.url or '')} did not answer for "
                        f"{JETSTREAM_READY_S:.0f}s while creating stream {config.name} "
                        f"({type(e).__name__}): a cluster without a leader (fewer than a "
                        "majority of its nodes up), or a server still starting"
                    ) from None
                await asyncio.sleep(0.5)

    @property
    def replicas(self) -> int:
        """Replicas of the run's streams and key-value buckets (``stream_replicas``)."""
        return stream_replicas(dict(getattr(self.nc, "_server_info", None) or {}))

    @property
    def claim_threshold_bytes(self) -> int:
        """Payloads above this go through the object store: the configured threshold, or
        less when the server's max_payload is smaller (headers need room too)."""
        server_max = int(getattr(self.nc, "max_payload", 0) or 0)
        if server_max <= 0:
            return self.cfg.claim_check_threshold_bytes
        return min(self.cfg.claim_check_threshold_bytes, server_max - 8192)

    # --- publishing ----------------------------------------------------------------------
    async def publish(
        self, subject: str, message: Message, *, msg_id: str | None, timeout_s: float = 10.0
    ) -> PublishResult:
        """Publish ``message`` durably; large payloads go through the object store."""
        with bus_time.timed("encode"):
            data = message.SerializeToString()
        headers = {HDR_TYPE: type_name(message)}
        if msg_id:
            headers[HDR_MSG_ID] = msg_id
        claim = len(data) > self.claim_threshold_bytes
        span: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if telemetry.messaging_spans():
            attributes: dict[str, str | bool | int] = {
                "messaging.system": "nats", "messaging.destination.name": subject,
                "messaging.message.id": msg_id or "", "treadle.claim_check": claim,
            }  # fmt: skip
            span = telemetry.tracer(__name__).start_as_current_span(
                f"publish {subject}", kind=trace.SpanKind.PRODUCER, attributes=attributes
            )
        with span:
            if claim:
                with bus_time.timed("claim_check"):
                    data = await self._claim_check(message, data)
                headers[HDR_CLAIM_CHECK] = "1"
            telemetry.inject(headers)
            with bus_time.timed("publish"):
                ack = await self._publish_acked(subject, data, headers, timeout_s, bool(msg_id))
        return PublishResult(ack.stream, ack.seq, bool(ack.duplicate), claim)

    async def _publish_acked(
        self, subject: str, data: bytes, headers: dict[str, str], timeout_s: float, dedup: bool
    ) -> Any:
        """``js.publish``, sent again while JetStream cannot answer for now -- a stream
        electing a new leader after a cluster node died, a restarted server recovering its
        streams -- for up to ``PUBLISH_RETRY_S``. "No responders" means nothing was
        stored, so it is always sent again; a timeout only when the message has a
        Nats-Msg-Id (``dedup``: the server drops the repeat if the first one was stored)."""
        deadline = time.monotonic() + PUBLISH_RETRY_S
        attempt = 0
        while True:
            attempt += 1
            self._raise_if_refused()
            asked = time.monotonic()
            try:
                return await self.js.publish(subject, data, timeout=timeout_s, headers=headers)
            except nats.errors.ConnectionClosedError:
                self._raise_if_refused()
                raise
            except nats.js.errors.NoStreamResponseError:
                if not await self._captured(subject):
                    raise PublishRejectedError(
                        f"no JetStream stream captures {subject}: call ensure_streams() first"
                    ) from None
                why = "no stream leader answered"
            except nats.js.errors.APIError as e:
                if _temporarily_unavailable(e):
                    why = f"JetStream unavailable: {e.description}"
                else:  # e.g. a full stream (a 503 as well)
                    raise PublishRejectedError(
                        f"JetStream refused a publish to {subject}: {e.description}"
                    ) from None
            except nats.errors.TimeoutError:
                self._raise_if_denied(asked, f'"{subject}"')
                why = f"not acknowledged within {timeout_s}s"
                if not dedup:
                    raise BusUnavailableError(f"publish to {subject} was {why}") from None
            if time.monotonic() > deadline:
                raise BusUnavailableError(
                    f"publish to {subject} failed for {PUBLISH_RETRY_S:.0f}s: {why}"
                )
            log.log(logging.WARNING if attempt == 1 else logging.DEBUG,
                    "publish to %s: %s; sending it again", subject, why)  # fmt: skip
            await asyncio.sleep(0.5)

    async def _captured(self, subject: str) -> bool:
        """Whether a stream captures ``subject`` (True when JetStream cannot say now)."""
        try:
            await self.js.find_stream_name_by_subject(subject)
        except nats.js.errors.NotFoundError:
            return False
        except (nats.errors.Error, OSError, TimeoutError):
            return True
        return True

    async def _claim_check(self, message: Message, data: bytes) -> bytes:
        if self.store is None:
            raise TreadleError(
                f"a {type_name(message)} of {len(data)} bytes exceeds nats.claim_check_threshold_bytes "
                "but this bus has no object store to hold it"
            )
        from treadle.services.objectstore import sha256_bytes

        key = f"{CLAIM_PREFIX}/{type_name(message)}/{sha256_bytes(data)}"  # content-addressed: retries reuse it
        media = f"application/x-protobuf; type={type_name(message)}"
        ref = await asyncio.to_thread(self.store.put_bytes, key, data, media)
        return ref.SerializeToString()

    # --- request / reply (core NATS, not JetStream) -------------------------------------------
    async def request(
        self, subject: str, message: Message, reply_type: type[P], *, timeout_s: float
    ) -> P | None:
        """Send ``message`` to one responder of ``subject`` and decode its answer; None when
        nobody serves the subject (NATS "no responders"). Timeouts raise BusUnavailableError."""
        headers = telemetry.inject({HDR_TYPE: type_name(message)})
        with telemetry.tracer(__name__).start_as_current_span(
            f"request {subject}", kind=trace.SpanKind.CLIENT,
            attributes={"messaging.system": "nats", "messaging.destination.name": subject},
        ):  # fmt: skip
            with bus_time.timed("encode"):
                data = message.SerializeToString()
            try:
                with bus_time.timed("request"):
                    reply = await self.nc.request(subject, data, timeout=timeout_s, headers=headers)
            except nats.errors.NoRespondersError:
                return None
            except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
                self._raise_if_refused()
                raise BusUnavailableError(f"no answer on {subject} within {timeout_s}s") from None
        with bus_time.timed("decode"):
            return decode_message(reply_type, reply.data, where=f"reply on {subject}")

    async def serve(
        self,
        subject: str,
        queue: str,
        request_type: type[P],
        handler: Callable[[P], Awaitable[Message]],
    ) -> Any:
        """Answer requests on ``subject`` (one member of ``queue`` gets each); returns the
        subscription (``await sub.unsubscribe()`` to stop). A handler that raises leaves the
        request unanswered (the requester times out) and is logged."""

        async def on_msg(msg: Any) -> None:
            ctx = telemetry.extract(msg.headers)
            with telemetry.tracer(__name__).start_as_current_span(
                f"serve {subject}", context=ctx, kind=trace.SpanKind.SERVER
            ):
                try:
                    req = decode_message(request_type, msg.data, where=f"request on {subject}")
                    answer = await handler(req)
                    await msg.respond(answer.SerializeToString())
                except TreadleError as e:  # bad input (an undecodable request): one line
                    log.warning("request on %s refused: %s", subject, e)
                except Exception:
                    log.exception("request on %s failed", subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    # --- decoding ------------------------------------------------------------------------
    async def decode(
        self, msg_type: type[P], data: bytes, headers: dict[str, str] | None, where: str
    ) -> P:
        """Payload bytes (maybe a claim check) -> message; DecodeError/IntegrityError on failure."""
        headers = headers or {}
        sent_type = headers.get(HDR_TYPE)
        if not sent_type:
            raise DecodeError(
                f"{where}: no {HDR_TYPE} header (every Treadle publisher sets it); "
                f"refusing to read it as a {type_name(msg_type)}"
            )
        if sent_type != type_name(msg_type):
            raise DecodeError(f"{where}: carries a {sent_type}, expected {type_name(msg_type)}")
        if headers.get(HDR_CLAIM_CHECK):
            ref = decode_message(common_pb2.ObjectRef, data, where=f"{where} (claim check)")
            if not ref.uri or not _SHA256_HEX.fullmatch(ref.sha256) or ref.size_bytes <= 0:
                raise DecodeError(
                    f"{where}: malformed claim check (uri {ref.uri[:200]!r}, sha256 "
                    f"{ref.sha256[:80]!r}, {ref.size_bytes} bytes): a claim check needs a URI, "
                    "a 64-hex sha256 and a size"
                )
            if self.store is None:
                raise DecodeError(
                    f"{where}: claim check {ref.uri} but this bus has no object store"
                )
            try:
                with bus_time.timed("claim_check"):
                    data = await asyncio.to_thread(self.store.get_bytes, ref)
            except (ValueError, UnicodeError) as e:  # not this store's URI, or a bad key
                if isinstance(e, TreadleError):
                    raise
                raise DecodeError(f"{where}: claim check {ref.uri[:200]!r}: {e}") from None
        with bus_time.timed("decode"):
            return decode_message(msg_type, data, where=where)

    async def dead_letter(
        self,
        stream_base: str,
        subject: str,
        seq: int,
        data: bytes,
        headers: dict[str, str],
        reason: str,
    ) -> bool:
        """Keep a message that was terminated (``reason`` says why) on the dead-letter
        subject of ``stream_base``, with its original bytes; False (logged) if that fails.
        Never raises: losing the copy must not stop a consumer."""
        dl_headers = {
            HDR_DL_SUBJECT: _header_value(subject),
            HDR_DL_SEQ: str(seq),
            HDR_DL_REASON: _header_value(reason) or "unknown",
            HDR_MSG_ID: f"dl-{_header_value(subject)}-{seq}",  # one copy per message
        }
        for name in (HDR_TYPE, HDR_CLAIM_CHECK):
            if headers.get(name):
                dl_headers[name] = _header_value(str(headers[name]))
        if headers.get(HDR_MSG_ID):
            dl_headers[HDR_DL_MSG_ID] = _header_value(str(headers[HDR_MSG_ID]))
        target = self.subjects.dead_letter(stream_base)
        try:
            await self.js.publish(target, data, timeout=10.0, headers=dl_headers)
        except (nats.errors.Error, OSError, TimeoutError) as e:
            self.stats.dead_letter_failed += 1
            log.error("cannot keep %s seq %d on %s: %s: %s", subject, seq, target,
                      type(e).__name__, e)  # fmt: skip
            return False
        self.stats.dead_lettered += 1
        return True

    async def last(self, stream_base: str, subject: str, msg_type: type[P]) -> P | None:
        """The newest message on ``subject`` (e.g. the last PolicyPublished), or None."""
        try:
            with bus_time.timed("read"):
                raw = await self.js.get_last_msg(self.subjects.stream_name(stream_base), subject)
        except nats.js.errors.NotFoundError:
            return None
        return await self.decode_stored(stream_base, raw, msg_type)

    async def stored(self, stream_base: str, subject: str | None = None) -> list[Any]:
        """Every message stored on one of the run's streams (optionally of one subject),
        oldest first, as raw messages (``decode_stored`` reads one)."""
        stream = self.subjects.stream_name(stream_base)
        info = await self.js.stream_info(stream)
        out: list[Any] = []
        if not info.state.messages:  # never written (first_seq 0) or emptied
            return out
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            try:
                raw = await self.js.get_msg(stream, seq=seq)
            except nats.js.errors.NotFoundError:  # deleted or purged
                continue
            if subject is None or raw.subject == subject:
                out.append(raw)
        return out

    async def decode_stored(self, stream_base: str, raw: Any, msg_type: type[P]) -> P:
        """Decode a message read from a stream directly (``get_msg``/``get_last_msg``).
        Undecodable: counted, kept on the dead-letter subject (once per sequence), and the
        DecodeError/IntegrityError/ObjectNotFoundError raised for the caller to handle."""
        where = f"{raw.subject} seq {raw.seq}"
        headers = dict(raw.headers or {})
        try:
            return await self.decode(msg_type, raw.data or b"", headers, where)
        except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
            if (raw.subject, raw.seq) in self._poison_read:  # read again (a poller): once
                raise
            self._poison_read.add((raw.subject, raw.seq))
            self.stats.undecodable += 1
            await self.dead_letter(
                stream_base, raw.subject, raw.seq, raw.data or b"", headers, str(e)
            )
            raise

    async def purge_subject(self, stream_base: str, subject: str) -> None:
        """Remove every message of ``subject`` (e.g. a batch after the trainer checkpointed)."""
        await self.js.purge_stream(self.subjects.stream_name(stream_base), subject=subject)

    # --- consuming -----------------------------------------------------------------------
    async def consumer(
        self,
        stream_base: str,
        durable: str,
        filter_subject: str,
        msg_type: type[P],
        *,
        max_ack_pending: int = 1000,
    ) -> PullConsumer[P]:
        """A durable pull consumer with explicit acks on one stream of this run."""
        stream = self.subjects.stream_name(stream_base)
        config = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=self.cfg.ack_wait_s,
            max_deliver=self.cfg.max_deliver,
            filter_subject=filter_subject,
            max_ack_pending=max_ack_pending,
        )
        deadline = time.monotonic() + JETSTREAM_READY_S
        while True:
            self._raise_if_refused()
            asked = time.monotonic()
            try:
                sub = await self.js.pull_subscribe(
                    filter_subject, durable=durable, stream=stream, config=config
                )
                break
            except nats.errors.ConnectionClosedError:
                self._raise_if_refused()
                raise
            except nats.js.errors.NotFoundError:
                raise BusUnavailableError(
                    f"stream {stream} does not exist: call ensure_streams() first"
                ) from None
            except (nats.errors.TimeoutError, nats.js.errors.APIError) as e:
                # a stream electing a new leader (a cluster node died) answers nothing
                # for a few seconds: ask again, as publishes do
                if isinstance(e, nats.js.errors.APIError) and not _temporarily_unavailable(e):
                    raise BusUnavailableError(
                        f"cannot create the consumer {durable!r} of stream {stream}: "
                        f"{e.description}"
                    ) from None
                self._raise_if_denied(asked, "$js.api.consumer.", f".{stream}.{durable}")
                if time.monotonic() > deadline:
                    raise BusUnavailableError(
                        f"JetStream did not answer for {JETSTREAM_READY_S:.0f}s while creating "
                        f"the consumer {durable!r} of stream {stream} ({type(e).__name__})"
                    ) from None
                log.warning("creating the consumer %s of %s: %s; asking again", durable,
                            stream, type(e).__name__)  # fmt: skip
                await asyncio.sleep(0.5)
        return PullConsumer(self, sub, msg_type, filter_subject, stream_base, durable)

    async def close(self) -> None:
        """Drain: flush pending publishes and let subscriptions finish, then disconnect."""
        if self.nc.is_closed:
            return
        self._closing["now"] = True
        try:
            await self.nc.drain()
        except (nats.errors.Error, OSError, TimeoutError) as e:
            log.warning("nats drain failed (%s); closing", e)
            await self.nc.close()


Handler = Callable[[P, Delivery], Awaitable[None]]


@dataclass
class PullConsumer(Generic[P]):
    """Fetches, decodes and hands messages to a handler; acks only after it returns."""

    bus: Bus
    sub: Any
    msg_type: type[P]
    filter_subject: str
    stream_base: str = ""  # e.g. "ROLLOUTS": names the dead-letter subject
    durable: str = ""
    stats: ConsumerStats = field(default_factory=ConsumerStats)

    async def run(
        self,
        handler: Handler[P],
        stop: asyncio.Event,
        *,
        concurrency: int = 1,
        fetch_timeout_s: float = 1.0,
        drain_timeout_s: float = 30.0,
        slots: Slots | None = None,
    ) -> None:
        """Process messages until ``stop`` is set; then let in-flight handlers finish.

        At most ``concurrency`` handlers run at once, and with ``slots`` (a budget shared
        by several consumers) no more than the budget across all of them. Handlers still
        running after ``drain_timeout_s`` are cancelled and their messages nak'ed, so
        another consumer gets them at once.
        """
        try:
            await self._loop(handler, stop, concurrency, fetch_timeout_s, drain_timeout_s, slots)
        finally:
            # leave the durable consumer on the server; drop our client-side subscription
            # so a later drain of the connection does not wait on its queue
            try:
                await self.sub.unsubscribe()
            except (nats.errors.Error, OSError) as e:
                log.debug("unsubscribe of %s failed: %s", self.filter_subject, e)

    async def _loop(
        self,
        handler: Handler[P],
        stop: asyncio.Event,
        concurrency: int,
        fetch_timeout_s: float,
        drain_timeout_s: float,
        slots: Slots | None = None,
    ) -> None:
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            free = concurrency - len(tasks)
            if free <= 0:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                continue
            if slots is not None:
                free = await slots.take(free, stop)
                if not free:
                    continue
            fetch_started = time.perf_counter()
            try:
                msgs = await self.sub.fetch(free, timeout=fetch_timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                self.bus._raise_if_refused()
                msgs = []
            except nats.errors.ConnectionClosedError:
                if slots is not None:
                    slots.give(free)
                self.bus._raise_if_refused()
                log.warning("nats connection closed; consumer of %s stops", self.filter_subject)
                break
            except (nats.js.errors.Error, nats.errors.Error) as e:
                if slots is not None:
                    slots.give(free)
                self.bus._raise_if_refused()
                if await self._gone():
                    raise BusUnavailableError(
                        f"the durable consumer {self.durable!r} of stream "
                        f"{self.bus.subjects.stream_name(self.stream_base)} is gone (the stream "
                        f"or the consumer was deleted): {type(e).__name__}: {e}"
                    ) from None
                log.warning("fetch on %s failed (%s: %s); retrying",
                            self.filter_subject, type(e).__name__, e)  # fmt: skip
                await asyncio.sleep(min(fetch_timeout_s, 1.0))
                continue
            if msgs:  # an empty fetch is idle time, not bus cost
                bus_time.add("fetch", time.perf_counter() - fetch_started)
            if slots is not None:
                slots.give(free - len(msgs))  # what was not used
            for m in msgs:
                t = asyncio.create_task(self._handle_safely(m, handler))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                if slots is not None:
                    t.add_done_callback(lambda _t: slots.give(1))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _gone(self) -> bool:
        """Whether this consumer's stream or durable consumer no longer exists."""
        if not self.durable:
            return False
        try:
            await self.bus.js.consumer_info(
                self.bus.subjects.stream_name(self.stream_base), self.durable
            )
        except nats.js.errors.NotFoundError:
            return True
        except (nats.errors.Error, OSError, TimeoutError):
            return False
        return False

    async def _terminate(self, msg: Any, where: str, reason: str) -> None:
        """Terminate ``msg`` and keep it on the dead-letter subject."""
        try:
            await msg.term()
        except (nats.errors.Error, OSError, TimeoutError) as e:
            log.warning("term of %s not confirmed (%s)", where, e)
        md = msg.metadata
        kept = await self.bus.dead_letter(
            self.stream_base, msg.subject, md.sequence.stream, msg.data or b"",
            dict(msg.headers or {}), reason,
        )  # fmt: skip
        self.stats.dead_lettered += kept

    async def _heartbeat(self, msg: Any) -> None:
        interval = max(0.2, self.bus.cfg.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                await msg.in_progress()
            except (nats.errors.Error, OSError) as e:
                log.debug("in-progress heartbeat failed: %s", e)

    async def _handle_safely(self, msg: Any, handler: Handler[P]) -> None:
        """``_handle``, whose own failures (an ack/nak on a broken connection) are logged
        here: a handler task never dies unseen."""
        try:
            await self._handle(msg, handler)
        except (nats.errors.Error, OSError, TimeoutError) as e:
            log.warning("settling a message of %s failed (%s: %s); it will be redelivered",
                        self.filter_subject, type(e).__name__, e)  # fmt: skip

    async def _handle(self, msg: Any, handler: Handler[P]) -> None:
        md = msg.metadata
        headers = dict(msg.headers or {})
        delivery = Delivery(
            subject=msg.subject,
            msg_id=headers.get(HDR_MSG_ID, ""),
            stream_seq=md.sequence.stream,
            num_delivered=md.num_delivered,
            headers=headers,
        )
        where = f"{msg.subject} seq {delivery.stream_seq}"
        parent = telemetry.extract(headers)
        # without messaging spans the handler's own spans join the publisher's trace
        in_trace: contextlib.AbstractContextManager[trace.Span] = telemetry.in_context(parent)
        if telemetry.messaging_spans():
            attributes: dict[str, str | bool | int] = {
                "messaging.system": "nats", "messaging.destination.name": msg.subject,
                "messaging.message.id": delivery.msg_id,
                "messaging.nats.num_delivered": delivery.num_delivered,
            }  # fmt: skip
            in_trace = telemetry.tracer(__name__).start_as_current_span(
                f"process {msg.subject}", context=parent, kind=trace.SpanKind.CONSUMER,
                attributes=attributes,
            )  # fmt: skip
        with in_trace as span:
            try:
                obj = await self.bus.decode(self.msg_type, msg.data, headers, where)
            except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
                self.stats.undecodable += 1
                self.bus.stats.undecodable += 1
                self.stats.last_error = str(e)
                log.error(
                    "undecodable message %s terminated and dead-lettered to %s: %s",
                    where, self.bus.subjects.dead_letter(self.stream_base), e,
                )  # fmt: skip
                span.record_exception(e)
                await self._terminate(msg, where, f"undecodable: {e}")
                return
            except StoreUnavailableError as e:  # transient: the payload may be readable later
                if delivery.num_delivered >= self.bus.cfg.max_deliver:  # the server stops here
                    self.stats.dropped += 1
                    self.bus.stats.refused += 1
                    log.error("claim check of %s unreadable after %d deliveries (dead-lettered): "
                              "%s", where, delivery.num_delivered, e)  # fmt: skip
                    await self._terminate(msg, where, f"claim check unreadable: {e}")
                    return
                self.stats.retried += 1
                log.warning("claim check of %s unreadable now (%s); will retry", where, e)
                await msg.nak(delay=min(2.0**delivery.num_delivered, 30.0))
                return
            heartbeat = asyncio.create_task(self._heartbeat(msg))
            started = time.monotonic()
            try:
                await handler(obj, delivery)
            except DropMessage as e:
                self.stats.dropped += 1
                self.bus.stats.refused += 1
                self.stats.last_error = str(e)
                log.warning("handler refused %s (dead-lettered): %s", where, e)
                await self._terminate(msg, where, f"refused: {e}")
            except asyncio.CancelledError:
                await asyncio.shield(msg.nak())
                raise
            except Exception as e:  # service boundary: a failing handler must not kill the loop
                self.stats.last_error = f"{type(e).__name__}: {e}"
                span.record_exception(e)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e)))
                if delivery.num_delivered >= self.bus.cfg.max_deliver:
                    self.stats.dropped += 1
                    self.bus.stats.refused += 1
                    log.error(
                        "giving up on %s after %d deliveries (dead-lettered): %s",
                        where, delivery.num_delivered, e, exc_info=not isinstance(e, TreadleError),
                    )  # fmt: skip
                    await self._terminate(
                        msg,
                        where,
                        f"failed {delivery.num_delivered} times: {type(e).__name__}: {e}",
                    )
                else:
                    self.stats.retried += 1
                    log.warning(
                        "handler failed on %s (delivery %d/%d), will retry: %s",
                        where, delivery.num_delivered, self.bus.cfg.max_deliver, e,
                        exc_info=not isinstance(e, TreadleError),
                    )  # fmt: skip
                    await msg.nak(delay=min(2.0 ** (delivery.num_delivered - 1), 30.0))
            else:
                try:
                    with bus_time.timed("ack"):
                        await msg.ack_sync()
                except (nats.errors.Error, OSError, TimeoutError) as e:
                    # the side effect happened; a redelivery will find it done (idempotent)
                    log.warning("ack of %s not confirmed (%s); it may be redelivered", where, e)
                self.stats.handled += 1
                span.set_attribute("treadle.handler_s", time.monotonic() - started)
            finally:
                heartbeat.cancel()
