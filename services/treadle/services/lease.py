"""A lease in NATS JetStream key-value: at most one holder of a role per run.

    acquire ── kv.create(key, holder) ──▶ held (revision r)
       │ key exists: someone holds it ── its process is dead on this host: take it over
       │   else wait up to ttl + margin for it to expire (a crashed holder stops
       │   renewing) ── LeaseHeldError
       ▼
    keep ── every ttl/4: kv.update(key, holder, last=r) ──▶ r'
       │ revision moved / key gone (we stalled past the ttl and another took it) ── LeaseLostError
       ▼
    release ── kv.delete(key, last=r)

The bucket (``Subjects.lease_bucket``) keeps one revision per key and expires entries
after ``ttl_s``: a holder that dies without releasing frees the lease within ``ttl_s``.
A holder that cannot renew for ``ttl_s`` (a NATS outage, a stalled event loop) may lose
the lease; ``keep`` then raises and the holder must stop its work.

Not here: what the lease protects (the orchestrator holds the ``orchestrator`` key).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from typing import Any

import nats.errors
import nats.js.errors

from treadle.services.errors import BusUnavailableError, TreadleError

log = logging.getLogger(__name__)


class LeaseHeldError(TreadleError):
    """Another live process holds the lease."""


class LeaseLostError(TreadleError):
    """The lease was taken over (or expired) while this process held it."""


class Lease:
    """One key of the run's lease bucket, held by ``holder`` (e.g. an instance id)."""

    def __init__(self, bus: Any, key: str, holder: str, *, ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError(f"lease ttl must be > 0, got {ttl_s}")
        self.bus = bus
        self.key = key
        self.holder = holder
        self.ttl_s = ttl_s
        self.revision = 0
        self._kv: Any = None

    def _value(self) -> bytes:
        return json.dumps({"holder": self.holder, "host": socket.gethostname(),
                           "pid": os.getpid(), "renewed_at": time.time()}).encode()  # fmt: skip

    async def _bucket(self) -> Any:
        if self._kv is None:
            name = self.bus.subjects.lease_bucket
            try:
                self._kv = await self.bus.js.key_value(name)
            except nats.js.errors.BucketNotFoundError:
                try:
                    self._kv = await self.bus.js.create_key_value(
                        bucket=name, history=1, ttl=self.ttl_s,
                        replicas=getattr(self.bus, "replicas", 1),
                    )  # fmt: skip
                except nats.js.errors.APIError as e:
                    raise BusUnavailableError(
                        f"cannot create the lease bucket {name}: {e.description}"
                    ) from None
        return self._kv

    async def _entry(self, kv: Any) -> tuple[str, bool, int]:
        """(holder, whether its process is known dead, revision) of the current entry."""
        try:
            entry = await kv.get(self.key)
        except nats.js.errors.NotFoundError:  # absent, deleted or expired
            return "", False, 0
        try:
            doc = json.loads(entry.value or b"{}")
            holder = str(doc.get("holder", "?"))
            dead = doc.get("host") == socket.gethostname() and not _alive(int(doc.get("pid", 0)))
        except (ValueError, AttributeError, TypeError):
            return "?", False, entry.revision
        return holder, dead, entry.revision

    async def _holder_now(self, kv: Any) -> str:
        return (await self._entry(kv))[0]

    async def acquire(self, wait_s: float | None = None) -> None:
        """Take the lease; waits (by default ttl + 2 s) for a dead holder's lease to expire,
        then raises LeaseHeldError naming the live holder."""
        kv = await self._bucket()
        deadline = time.monotonic() + (self.ttl_s + 2.0 if wait_s is None else wait_s)
        waited = False
        while True:
            try:
                self.revision = await kv.create(self.key, self._value())
                if waited:
                    log.info("[startup] lease %s taken over after the previous holder expired",
                             self.key)  # fmt: skip
                return
            except nats.js.errors.KeyWrongLastSequenceError:
                holder, dead, revision = await self._entry(kv)
                if dead:  # its process is gone from this host: it cannot renew any more
                    try:
                        self.revision = await kv.update(self.key, self._value(), last=revision)
                    except nats.js.errors.KeyWrongLastSequenceError:
                        continue  # someone else was faster
                    log.info("[startup] lease %s taken over from %s (its process is gone)",
                             self.key, holder)  # fmt: skip
                    return
            if time.monotonic() >= deadline:
                raise LeaseHeldError(
                    f"another {self.key} of run {self.bus.subjects.run!r} is running "
                    f"({holder or 'holder unknown'}) and holds the run's lease; only one may "
                    f"run at a time. Stop it first (a crashed one frees the lease within "
                    f"{self.ttl_s:.0f}s)"
                )
            if not waited:
                log.warning("[startup] lease %s is held by %s; waiting up to %.0fs for it to "
                            "expire", self.key, holder, self.ttl_s + 2.0)  # fmt: skip
                waited = True
            await asyncio.sleep(min(1.0, self.ttl_s / 4))

    async def keep(self, stop: asyncio.Event) -> None:
        """Renew until ``stop`` is set; LeaseLostError when another holder took the key."""
        kv = await self._bucket()
        interval = self.ttl_s / 4
        last_ok = time.monotonic()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval)
                return
            except TimeoutError:
                pass
            try:
                self.revision = await kv.update(self.key, self._value(), last=self.revision)
                last_ok = time.monotonic()
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.NotFoundError):
                raise LeaseLostError(
                    f"the {self.key} lease of run {self.bus.subjects.run!r} was taken by "
                    f"{await self._holder_now(kv) or 'nobody (it expired)'}: this process "
                    f"could not renew it within {self.ttl_s:.0f}s and stops"
                ) from None
            except (nats.errors.Error, OSError, TimeoutError) as e:
                log.warning("lease %s not renewed (%s: %s)", self.key, type(e).__name__, e)
                if time.monotonic() - last_ok > self.ttl_s:
                    raise LeaseLostError(
                        f"the {self.key} lease could not be renewed for {self.ttl_s:.0f}s "
                        f"({type(e).__name__}: {e}); stopping so that no two run at once"
                    ) from None

    async def release(self) -> None:
        """Give the lease back (best effort: it expires anyway)."""
        if not self.revision or self._kv is None:
            return
        try:
            await self._kv.delete(self.key, last=self.revision)
        except (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError) as e:
            log.debug("lease %s not released (%s); it expires in %.0fs", self.key, e, self.ttl_s)
        self.revision = 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a pid of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
