"""Several inference replicas behind one generator: least outstanding requests, a
rollout's turns on one replica, failover, and a probe that keeps lying replicas out.

    InferencePool([url_a, url_b, ...]).for_rollout(rollout_id) ─▶ the generator of one rollout
      pick      the rollout's replica while it is in rotation (its prefix cache holds the
                conversation so far); a rollout's first call, or one whose replica left,
                goes to the replica in rotation with the fewest outstanding requests
                (a request of n samples counts n; ties: the one idle longest); rollouts
                whose first calls shared one request (``generate_n``, env_runner
                siblings.py) keep their later turns on its replica
      failover  a call that never ran on its replica (refused, dropped without an answer,
                503: ``InferenceUnreachableError``), or whose answer breaks the generate
                contract, takes the replica out of rotation and runs again on another
                one; so do the calls still waiting on a replica when it leaves rotation
                (a killed server may keep their connections open without answering);
                with none in rotation a call waits for one until its deadline
      monitor   (background) every ``recheck_s`` each replica's /health: refused or an
                error takes it out of rotation (slow is not dead); one out of rotation
                returns after /health and the probe pass; replicas in rotation are
                probed every ``probe_interval_s``
      discover  (optional) every ``discover_s`` the replicas announced in NATS
                (``discovery.py``) join the pool, checked and probed before any call;
                one no longer announced leaves rotation and stays out until it is
                announced again
      probe     a probe prompt's logprobs and the policy version the answer is labelled
                with (``InferenceClient.score``): the logprobs must match the probe the
                trainer published with that version within ``tolerance`` (mean absolute
                difference, nats). A mismatch (another model, or another version than the
                label says) or a version that was never published takes the replica out
                of rotation, logged and counted; a later probe that matches brings it back.

Retrying a call is idempotent and keeps the rollout token-exact: a generate call changes
nothing on the server, and the model session records a call only from the answer it
returns. A call cut off mid-generation leaves nothing behind; the retry samples the
whole completion again on the other replica, and that replica's ids, logprobs and
per-token policy versions are what the rollout records. The rollout is still published
once (its rollout_id is the message id), so nothing is counted twice.

Version 0 (the model a run starts from) has no published probe: a replica labelling its
answers 0 is not compared with anything until it serves a version the trainer published.
Consecutive versions that move the probe by less than ``tolerance`` cannot be told apart
(the inference service warns about such updates when it verifies them).

Not here: one server's HTTP protocol (``inference_client.py``); where published probes
are read from (``lookup``, given by the caller: the env runner reads the object store).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.services.errors import ObjectNotFoundError, TreadleError
from treadle.services.export import policy_prefix
from treadle.services.inference_client import (
    GenerateResult,
    InferenceClient,
    InferenceRequestError,
    InferenceResponseError,
    InferenceUnavailableError,
    InferenceUnreachableError,
)
from treadle.services.objectstore import ObjectStore

log = logging.getLogger(__name__)

IN_ROTATION = "in_rotation"
UNREACHABLE = "unreachable"
WRONG = "wrong"  # failed the probe, or answered against the contract

# token ids sent to learn which version a replica claims when no probe is known yet
_FIRST_PROBE_IDS = (11, 42, 7, 96)


@dataclass(frozen=True)
class Probe:
    """A token sequence and its logprobs under one published policy (the trainer's)."""

    token_ids: tuple[int, ...]  # [num_probe_tokens]
    logprobs: tuple[float, ...]  # [num_probe_tokens - 1]


def probe_from_metadata(metadata: Any, where: str) -> Probe:
    """The probe of a published policy's manifest metadata; ValueError naming ``where``."""
    probe = metadata.get("probe") if isinstance(metadata, Mapping) else None
    ids = probe.get("token_ids") if isinstance(probe, Mapping) else None
    lps = probe.get("logprobs") if isinstance(probe, Mapping) else None
    if (
        not isinstance(ids, list)
        or len(ids) < 2
        or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        or not isinstance(lps, list)
        or len(lps) != len(ids) - 1
        or not all(isinstance(x, int | float) and math.isfinite(x) for x in lps)
    ):
        raise ValueError(f"{where}: metadata.probe is not token_ids (>= 2) with one logprob fewer")
    return Probe(tuple(ids), tuple(float(x) for x in lps))


# the published probe of a version; None when the version has none (version 0);
# ObjectNotFoundError when the version was never published
ProbeLookup = Callable[[int], Awaitable[Probe | None]]


@dataclass
class Replica:
    """One inference server as the pool sees it."""

    url: str
    client: InferenceClient
    state: str = IN_ROTATION
    reason: str = ""  # why it is out of rotation
    outstanding: int = 0  # completions asked for and not answered (a call of n samples: n)
    idle_since: float = field(default_factory=time.monotonic)
    checked_at: float = 0.0  # last check by the monitor (time.monotonic)
    probed_at: float = 0.0  # last probe that matched
    policy_version: int = -1  # the version its last answer was labelled with
    num_requests: int = 0
    left: asyncio.Event = field(default_factory=asyncio.Event)  # set while out of rotation
    announced: bool = True  # listed, or announced in NATS now (discovery)

    @property
    def in_rotation(self) -> bool:
        return self.state == IN_ROTATION


class PinnedGenerator:
    """The generator one rollout uses: every call on the replica of its first call while
    that replica stays in rotation (``InferencePool.for_rollout``)."""

    def __init__(self, pool: InferencePool):
        self.pool = pool
        self.replica: Replica | None = None

    async def generate(self, prompt_ids: Any, **kwargs: Any) -> GenerateResult:
        return (await self.pool.run_n(self, prompt_ids, 1, **kwargs))[0]

    async def generate_n(self, prompt_ids: Any, n: int, **kwargs: Any) -> list[GenerateResult]:
        return await self.pool.run_n(self, prompt_ids, n, **kwargs)

    def pin_like(self, other: PinnedGenerator) -> None:
        """Keep this rollout's turns on ``other``'s replica (siblings served together)."""
        self.replica = other.replica


class InferencePool:
    """Generate over several inference replicas (see the module doc)."""

    def __init__(
        self,
        urls: Sequence[str],
        timeout_s: float = 300.0,
        *,
        lookup: ProbeLookup | None = None,
        probe_interval_s: float = 30.0,
        recheck_s: float = 2.0,
        tolerance: float = 0.1,
        probe_timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        on_change: Callable[[InferencePool], None] | None = None,
        discover: Callable[[], Awaitable[Sequence[str]]] | None = None,
        discover_s: float = 2.0,
        model: str | None = None,
        api_key: str | None = None,
    ):
        if not urls and discover is None:
            raise ValueError("an inference pool needs at least one replica URL, or discovery")
        normalized = [u.rstrip("/") for u in urls]
        if len(set(normalized)) != len(normalized):
            raise ValueError(f"inference replica URLs repeat: {list(urls)}")
        if timeout_s <= 0 or recheck_s <= 0 or probe_interval_s < 0 or tolerance <= 0:
            raise ValueError(
                "timeout_s, recheck_s and tolerance must be > 0, probe_interval_s >= 0"
            )
        self.timeout_s = timeout_s
        self.lookup = lookup
        self.probe_interval_s = probe_interval_s
        self.recheck_s = recheck_s
        self.tolerance = tolerance
        self.probe_timeout_s = probe_timeout_s
        self.on_change = on_change
        self.connect_timeout_s = connect_timeout_s
        self.model, self._api_key = model, api_key  # a run on hosted servers (inference_client)
        self.replicas = [self._replica(u) for u in normalized]
        self.listed = set(normalized)  # always in the pool, whatever discovery says
        self.discover = discover
        self.discover_s = discover_s
        self._discovered_at = -math.inf
        self._discover_error = ""
        self.num_failovers = 0  # calls that moved to another replica
        self.num_probe_failures = 0  # probes that found a replica wrong
        self._changed = asyncio.Event()
        self._monitor: asyncio.Task[None] | None = None
        self._probes: dict[int, Probe | None] = {}

    def _replica(self, url: str) -> Replica:
        client = InferenceClient(url, self.timeout_s, max_retries=0,
                                 connect_timeout_s=self.connect_timeout_s, model=self.model,
                                 api_key=self._api_key)  # fmt: skip
        return Replica(url, client)

    # --- the generator ---------------------------------------------------------------------
    def for_rollout(self, rollout_id: str) -> PinnedGenerator:
        """The generator of one rollout (its calls stay on one replica)."""
        return PinnedGenerator(self)

    async def generate(self, prompt_ids: Any, **kwargs: Any) -> GenerateResult:
        """One call on the least loaded replica (no rollout to keep together)."""
        return await self.run(PinnedGenerator(self), prompt_ids, **kwargs)

    async def run(
        self, pin: PinnedGenerator, prompt_ids: Any, **kwargs: Any
    ) -> GenerateResult:  # fmt: skip
        """``InferenceClient.generate`` on ``pin``'s replica, failing over (module doc)."""
        return (await self.run_n(pin, prompt_ids, 1, **kwargs))[0]

    async def run_n(
        self, pin: PinnedGenerator, prompt_ids: Any, n: int, *, timeout_s: float | None = None,
        **kwargs: Any,
    ) -> list[GenerateResult]:  # fmt: skip
        """``InferenceClient.generate_n`` on ``pin``'s replica, failing over (module doc)."""
        self.start()
        budget = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        while True:
            remaining = deadline - time.monotonic()
            replica = self.pick(pin.replica)
            if replica is None:
                if remaining <= 0:
                    raise InferenceUnreachableError(
                        f"no inference replica in rotation within {budget:.1f}s ({self.describe()})"
                    )
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), min(remaining, self.recheck_s))
                except TimeoutError:
                    pass
                continue
            if remaining <= 0:
                raise InferenceUnavailableError(f"no answer within {budget:.1f}s")
            if pin.replica is not None and pin.replica is not replica:
                log.info("a rollout moves from %s to %s", pin.replica.url, replica.url)
            pin.replica = replica
            replica.outstanding += n  # sequences: a request of n samples weighs n
            replica.num_requests += 1
            try:
                results = await self._call(replica, prompt_ids, n, remaining, kwargs)
                if results is None:  # the replica left rotation while the call waited on it
                    self.num_failovers += 1
                    continue
            except InferenceUnreachableError as e:
                self.take_out(replica, UNREACHABLE, str(e))
                self.num_failovers += 1
                continue
            except InferenceResponseError as e:
                self.take_out(replica, WRONG, f"its answer breaks the generate contract: {e}")
                self.num_failovers += 1
                continue
            finally:
                replica.outstanding -= n
                replica.idle_since = time.monotonic()
            last = [int(r.policy_versions[-1]) for r in results if r.policy_versions.size]
            if last:
                replica.policy_version = max(last)
            return results

    async def _call(
        self, replica: Replica, prompt_ids: Any, n: int, timeout_s: float, kwargs: dict[str, Any]
    ) -> list[GenerateResult] | None:
        """The call on ``replica``; None when the replica leaves rotation first (the call
        is then cancelled: its connection closes and vLLM aborts it)."""
        call = asyncio.ensure_future(
            replica.client.generate_n(prompt_ids, n, timeout_s=timeout_s, **kwargs)
        )
        left = asyncio.ensure_future(replica.left.wait())
        try:
            await asyncio.wait({call, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
            if not call.done():
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        if call.cancelled():
            return None
        return call.result()

    def pick(self, current: Replica | None) -> Replica | None:
        """``current`` while it is in rotation, else the least loaded replica in rotation."""
        if current is not None and current.in_rotation:
            return current
        live = [r for r in self.replicas if r.in_rotation]
        if not live:
            return None
        return min(live, key=lambda r: (r.outstanding, r.idle_since))

    # --- rotation ---------------------------------------------------------------------------
    def take_out(self, replica: Replica, state: str, reason: str) -> None:
        assert state != IN_ROTATION
        was_in = replica.in_rotation
        replica.state, replica.reason = state, reason
        replica.checked_at = time.monotonic()
        replica.left.set()
        if was_in:
            live = sum(r.in_rotation for r in self.replicas)
            log.warning("inference replica %s is out of rotation (%s): %s; %d of %d in rotation",
                        replica.url, state, reason, live, len(self.replicas))  # fmt: skip
            self._notify()

    def put_back(self, replica: Replica) -> None:
        if replica.in_rotation:
            return
        was = replica.state
        replica.state, replica.reason = IN_ROTATION, ""
        replica.left.clear()
        log.warning("inference replica %s is back in rotation (it was %s; serves policy "
                    "version %d)", replica.url, was, replica.policy_version)  # fmt: skip
        self._changed.set()
        self._notify()

    def _notify(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def describe(self) -> str:
        live = sum(r.in_rotation for r in self.replicas)
        out = [f"{r.url} {r.state}: {r.reason}" for r in self.replicas if not r.in_rotation]
        return f"{live} of {len(self.replicas)} inference replicas in rotation" + (
            f"; out: {'; '.join(out)}" if out else ""
        )

    def stats(self) -> dict[str, float]:
        """Gauges and counters for metrics."""
        return {
            "inference_replicas": float(len(self.replicas)),
            "inference_replicas_in_rotation": float(sum(r.in_rotation for r in self.replicas)),
            "inference_replicas_wrong": float(sum(r.state == WRONG for r in self.replicas)),
            "inference_failovers_total": float(self.num_failovers),
            "inference_probe_failures_total": float(self.num_probe_failures),
        }

    # --- monitor and probe ------------------------------------------------------------------
    def start(self) -> None:
        """Start the monitor (once; needs a running event loop)."""
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch())
            self._monitor.add_done_callback(_log_death)

    async def aclose(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
        for r in self.replicas:
            await r.client.aclose()

    async def __aenter__(self) -> InferencePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _watch(self) -> None:
        while True:
            now = time.monotonic()
            if self.discover is not None and now - self._discovered_at >= self.discover_s:
                self._discovered_at = now
                await self._discover()
            due = [r for r in self.replicas
                   if r.announced and now - r.checked_at >= self.recheck_s]  # fmt: skip
            if due:
                await asyncio.gather(*(self.check(r) for r in due))
            await asyncio.sleep(min(0.5, self.recheck_s))

    async def _discover(self) -> None:
        """Follow the announced replicas: new ones join out of rotation (the next check
        brings them in), gone ones leave rotation; listed ones stay."""
        assert self.discover is not None
        try:
            urls = {u.rstrip("/") for u in await self.discover()}
        except Exception as e:  # NATS down, say: keep the replicas known so far
            if str(e) != self._discover_error:
                log.warning("inference replicas cannot be discovered now (%s: %s); keeping "
                            "the %d known", type(e).__name__, e, len(self.replicas))  # fmt: skip
            self._discover_error = str(e)
            return
        self._discover_error = ""
        known = {r.url: r for r in self.replicas}
        for url in sorted(urls - known.keys()):
            replica = self._replica(url)
            replica.state, replica.reason = UNREACHABLE, "announced; not checked yet"
            replica.left.set()
            self.replicas.append(replica)
            log.info("inference replica %s announced itself; checking it", url)
            self._notify()
        for url, replica in known.items():
            if url in self.listed:
                continue
            if url in urls and not replica.announced:
                replica.announced = True
                replica.checked_at = 0.0  # checked at once
                log.info("inference replica %s is announced again; checking it", url)
            elif url not in urls and replica.announced:
                replica.announced = False
                if replica.in_rotation:
                    self.take_out(replica, UNREACHABLE, "no longer announced in NATS")
                else:
                    replica.reason = "no longer announced in NATS"

    async def check(self, replica: Replica) -> None:
        """/health, then the probe when it is due; moves the replica in or out."""
        now = replica.checked_at = time.monotonic()
        alive = await replica.client.liveness(timeout_s=2.0)
        if alive is False or (alive is None and not replica.in_rotation):
            if replica.state != UNREACHABLE:
                self.take_out(replica, UNREACHABLE, "its /health refuses or fails")
            return
        if replica.in_rotation and (
            alive is None
            or not self.probe_interval_s
            or now - replica.probed_at < self.probe_interval_s
        ):
            return
        try:
            problem = await self.probe(replica) if self.lookup is not None else ""
        except InferenceUnreachableError as e:
            self.take_out(replica, UNREACHABLE, f"the probe got no answer: {e}")
            return
        except InferenceUnavailableError as e:  # slow (e.g. held by a weight update)
            log.debug("probe of %s: %s", replica.url, e)
            return
        except (InferenceResponseError, InferenceRequestError) as e:
            problem = f"its answer to the probe is unusable: {e}"
        except (TreadleError, ValueError) as e:  # the published probe is unreadable now
            log.warning("probe of %s skipped: %s", replica.url, e)
            return
        if problem:
            if replica.state != WRONG:  # counted once per time it is found wrong
                self.num_probe_failures += 1
            self.take_out(replica, WRONG, problem)
            return
        replica.probed_at = time.monotonic()
        self.put_back(replica)

    async def probe(self, replica: Replica) -> str:
        """What is wrong with ``replica``'s answers ("" when nothing is): its probe
        logprobs vs the published probe of the version it labels them with."""
        assert self.lookup is not None
        sent: Probe | None = None
        known = replica.policy_version
        if known > 0:
            try:
                sent = await self._published(known)
            except ObjectNotFoundError:
                sent = None
        for _ in range(3):  # the label may move on (a weight update) between two probes
            ids = sent.token_ids if sent is not None else _FIRST_PROBE_IDS
            score = await replica.client.score(ids, timeout_s=self.probe_timeout_s)
            version = score.policy_version
            replica.policy_version = version
            if version < 0:
                return "its answer carries no policy version"
            try:
                published = await self._published(version)
            except ObjectNotFoundError:
                return (f"it labels its answers policy version {version}, which was never "
                        "published")  # fmt: skip
            if published is None:  # version 0: nothing to compare with
                return ""
            if sent is not None and published.token_ids == sent.token_ids:
                return self._compare(version, score.logprobs, published)
            sent = published
        log.debug("probe of %s: its version kept changing; next round", replica.url)
        return ""

    def _compare(self, version: int, served: Sequence[float], published: Probe) -> str:
        if len(served) != len(published.logprobs):
            return f"its probe answer has {len(served)} logprobs for {len(published.logprobs)}"
        diffs = np.abs(np.asarray(served, np.float64) - np.asarray(published.logprobs))
        mean = float(diffs.mean()) if np.all(np.isfinite(diffs)) else math.inf
        if mean <= self.tolerance:
            return ""
        return (
            f"it labels its answers policy version {version}, but its probe logprobs differ "
            f"from that version's by {mean:.3g} nats on average (tolerance {self.tolerance:.3g}): "
            "it serves another model or another version"
        )

    async def _published(self, version: int) -> Probe | None:
        if version not in self._probes:
            assert self.lookup is not None
            self._probes[version] = await self.lookup(version)
            while len(self._probes) > 16:  # only recent versions are served
                del self._probes[min(self._probes)]
        return self._probes[version]


def published_probes(store: ObjectStore) -> ProbeLookup:
    """Probes as the trainer publishes them: ``policies/v<N>``'s manifest metadata in
    ``store`` (ObjectNotFoundError when version N was never published)."""

    async def lookup(policy_version: int) -> Probe | None:
        if policy_version == 0:
            return None
        manifest = await asyncio.to_thread(store.read_manifest, policy_prefix(policy_version))
        return probe_from_metadata(manifest.metadata, store.uri(manifest.prefix))

    return lookup


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("the inference replica monitor died: %s: %s", type(error).__name__, error,
                  exc_info=error)  # fmt: skip
