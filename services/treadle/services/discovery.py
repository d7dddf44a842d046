"""Inference replicas found through NATS: each one announces itself in the run's bucket.

    inference (``[inference] announce = true``)
      ── every ttl/3: kv.put("inference-<host>-<port>", {url, grpc, model, ...}) ──▶ REPLICAS_<run>
      ── clean shutdown: kv.delete(key)            (a killed one's entry expires within ttl_s)
    env runners (``env_runner.inference_discovery``), the orchestrator's gate
    (``orchestrator.inference_discovery``)
      ── every few seconds: ``announced(bus)`` ──▶ the replicas announced now

The bucket (``Subjects.replicas_bucket``) keeps one revision per key and expires an entry
``ttl_s`` after its last put, so a replica that dies without saying so leaves the list by
itself; what uses the list still checks each replica (the env runners' pool takes one out
of rotation as soon as its /health fails, and probes it before it gets any call).
Replicas listed in the configuration are used as well; discovery adds the ones that come
and go (``treadle serve inference`` on another node joins a running run).

Not here: how a replica is checked and picked (``inference_pool.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

import nats.errors
import nats.js.errors

from treadle.services.errors import BusUnavailableError

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 10.0


@dataclass(frozen=True)
class Announcement:
    """One inference replica as it announces itself."""

    url: str  # base URL of its HTTP API (token-in/token-out generate)
    grpc: str  # host:port of its control plane (policy version, weight updates)
    model: str  # the served model name
    host: str = ""
    pid: int = 0
    tls_name: str = ""  # verify its control plane's certificate against this name, not grpc's


def replica_key(http_port: int, host: str | None = None) -> str:
    """The key of the replica on ``host`` (this host) serving on ``http_port``."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", host or socket.gethostname())[:64]
    return f"inference-{name}-{http_port}"


async def _bucket(bus: Any, create_ttl_s: float | None) -> Any:
    """The run's replicas bucket; created (with ``create_ttl_s``) when absent and asked to,
    else None when absent."""
    name = bus.subjects.replicas_bucket
    try:
        return await bus.js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        if create_ttl_s is None:
            return None
    try:
        return await bus.js.create_key_value(
            bucket=name, history=1, ttl=create_ttl_s, replicas=getattr(bus, "replicas", 1)
        )
    except nats.js.errors.APIError as e:
        raise BusUnavailableError(
            f"cannot create the replicas bucket {name}: {e.description}"
        ) from None


async def announced(bus: Any) -> list[Announcement]:
    """The replicas announced in the run's bucket now (none when it does not exist yet).
    Entries that cannot be read as an announcement are skipped, logged."""
    kv = await _bucket(bus, None)
    if kv is None:
        return []
    # the keys from the stream's subjects, not kv.keys(): that needs a consumer, and env
    # runners (beside untrusted code) create none; deleted keys are skipped by get()
    name = bus.subjects.replicas_bucket
    info = await bus.js.stream_info(f"KV_{name}", subjects_filter=f"$KV.{name}.>")
    keys = [subject.removeprefix(f"$KV.{name}.") for subject in (info.state.subjects or {})]
    out: list[Announcement] = []
    for key in sorted(keys):
        try:
            entry = await kv.get(key)
        except nats.js.errors.NotFoundError:  # deleted (KeyDeletedError), or expired since
            continue
        try:
            doc = json.loads(entry.value or b"{}")
            a = Announcement(str(doc["url"]), str(doc["grpc"]), str(doc.get("model", "")),
                             str(doc.get("host", "")), int(doc.get("pid", 0)),
                             str(doc.get("tls_name", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:
            log.warning("replicas bucket entry %s is not an announcement (%s); skipped", key, e)
            continue
        if not a.url.startswith(("http://", "https://")):
            log.warning("replicas bucket entry %s has no http(s) URL (%r); skipped", key, a.url)
            continue
        out.append(a)
    return out


class Announcer:
    """Keeps one replica's entry in the run's bucket while it serves."""

    def __init__(self, bus: Any, key: str, announcement: Announcement, *,
                 ttl_s: float = DEFAULT_TTL_S):  # fmt: skip
        if ttl_s <= 0:
            raise ValueError(f"announcement ttl must be > 0, got {ttl_s}")
        self.bus = bus
        self.key = key
        self.announcement = announcement
        self.ttl_s = ttl_s

    def _value(self) -> bytes:
        return json.dumps({**asdict(self.announcement), "announced_at": time.time()}).encode()

    async def put(self) -> None:
        kv = await _bucket(self.bus, self.ttl_s)
        await kv.put(self.key, self._value())

    async def run(self, stop: asyncio.Event) -> None:
        """Announce every ttl/3 until ``stop``; then withdraw. A put that fails (a NATS
        outage) is retried at the next interval: the entry may expire meanwhile, and the
        replica leaves the others' lists until NATS is back."""
        failing = False
        try:
            while not stop.is_set():
                try:
                    await self.put()
                    if failing:
                        log.info("announced again in %s", self.bus.subjects.replicas_bucket)
                    failing = False
                except (BusUnavailableError, nats.errors.Error, OSError, TimeoutError) as e:
                    if not failing:
                        log.warning("cannot announce this replica (%s: %s); retrying",
                                    type(e).__name__, e)  # fmt: skip
                    failing = True
                try:
                    await asyncio.wait_for(stop.wait(), self.ttl_s / 3)
                except TimeoutError:
                    pass
        finally:
            await self.withdraw()

    async def withdraw(self) -> None:
        """Delete the entry (best effort: it expires anyway)."""
        try:
            kv = await _bucket(self.bus, None)
            if kv is not None:
                await kv.delete(self.key)
        except (BusUnavailableError, nats.errors.Error, OSError, TimeoutError) as e:
            log.info("[shutdown] announcement not withdrawn (%s); it expires in %.0fs", e,
                     self.ttl_s)  # fmt: skip


def this_replica(url: str, grpc: str, model: str, tls_name: str = "") -> Announcement:
    return Announcement(url, grpc, model, socket.gethostname(), os.getpid(), tls_name)


WILDCARDS = ("0.0.0.0", "::", "")


def route_address(host: str, port: int) -> str | None:
    """This machine's address on its route to ``host:port``: what another machine that
    reaches the same server most likely reaches this one at (a container's address on
    its network, a node's on the cluster's). None when there is no route or ``host``
    does not resolve. Nothing is sent: a UDP socket is connected, which only picks a
    route."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return None


def advertised_host(bound: str, advertise: str | None, nats_host: str | None,
                    nats_port: int = 4222) -> str:  # fmt: skip
    """The host a replica announces for a server bound to ``bound``: ``advertise`` when
    set; ``bound`` when it is one address; for a wildcard bind, this machine's address
    on its route to the NATS server (the others reach NATS too, so most likely this
    address as well), else its hostname."""
    if advertise:
        return advertise
    if bound not in WILDCARDS:
        return bound
    routed = route_address(nats_host, nats_port) if nats_host else None
    return routed or socket.gethostname()
