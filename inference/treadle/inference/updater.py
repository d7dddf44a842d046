"""Weight updates: fetch, drain, reload in place, verify, label, reopen — or restart.

    update(N, manifest ref)            one at a time (lock); a caller that goes away
      │                                (gRPC deadline, bus shutdown) does not cancel it
      │ N == served: no-op, already_loaded        N < served: StaleVersionError
      ▼
    read MANIFEST.json (its sha256 checked against the ref) ─▶ validate version, format, probe
      ▼
    fetch_dir into <weights_dir>/v{N:06d} (every file's sha256 checked)
      │ any failure so far: a clear error, nothing else changed, N-1 keeps serving
      ▼
    close the admission gate; requests already admitted finish on N-1 (drain_timeout_s,
    then the rest is aborted). New requests wait at the gate, outside the engine.
      ▼
    probe on N-1 (how far N should move the probe: logged, and warned about when the
    update is too small for the tolerance to see)
      ▼
    [in place]  pause(wait) + reset caches ─▶ reload_weights(v{N}) ─▶ resume ─▶ probe ─▶ verify
      │ ok ───────────────────────────────────────────────────────▶ label "N" ─▶ open the gate
      ▼ verification fails, the reload fails, or in place does not apply
    [restart]   held requests get 503 ─▶ stop vLLM ─▶ start on v{N} ─▶ probe ─▶ verify
      │ ok ───────────────────────────────────────────────────────▶ label "N" ─▶ open the gate
      ▼ fails
    [roll back] restart on N-1 ─▶ label "N-1" ─▶ open the gate ─▶ VerificationError
                (if even that fails, the service fails: ``fatal``)

Why drain instead of freezing in-flight requests: verification has to run the probe on
the engine before any client token comes from the new weights, and a frozen (vLLM
``keep``) request would resume together with the probe, sampling from unverified weights
under the old label. Drained, every request is entirely N-1 or entirely N, and vLLM's
per-token ``weight_versions`` spans say so exactly; the cost is the wait for the longest
in-flight request (bounded by its max_tokens) during which new requests queue.

Pause/Resume of the control plane close/open the same gate (``user_paused``); an update
keeps a paused service paused.

A LoRA adapter (manifest format ``peft-lora``, with ``[inference.lora] enabled``) takes a
shorter path, with no reload and no restart; the version before it serves meanwhile:

    check it against the base (adapter.py: base model, rank, shapes) ─▶ load it into vLLM
    as <prefix>-v{N} ─▶ close the gate, drain (as above) ─▶ probe through it ─▶ verify
      │ any failure: unload it, a clear error, open the gate; N-1 keeps serving
      ▼
    gate: requests for the policy go to <prefix>-v{N} ─▶ label "N" ─▶ open the gate
    ─▶ unload the adapter of N-1

The probes run drained because vLLM 0.32's CPU LoRA path fails, killing the engine, when
a prompt-logprobs request shares a batch with sampling requests (seen in `treadle rl`:
an einsum shape error in the LoRA logits processor); requests wait at the gate for the
probes (two prompt-logprobs calls).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.inference.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_adapter
from treadle.inference.engine import VllmEngine
from treadle.inference.errors import (
    EngineError,
    EngineStartError,
    ManifestError,
    StaleVersionError,
    VerificationError,
)
from treadle.inference.probe import (
    LORA_FORMAT,
    Probe,
    ProbeCheck,
    PublishedPolicy,
    compare,
    read_policy_metadata,
)
from treadle.inference.spec import InferenceSection
from treadle.proto.v1 import common_pb2
from treadle.services import telemetry
from treadle.services.errors import TreadleError
from treadle.services.export import published_versions
from treadle.services.objectstore import ObjectStore

log = logging.getLogger(__name__)

# config.json keys that may differ between versions without changing the architecture
_CONFIG_KEYS_FREE = {"torch_dtype", "dtype", "transformers_version", "_name_or_path", "use_cache"}
_WARMUP_TOKEN_IDS = (0, 1)

Reporter = Callable[[int, dict[str, float]], Awaitable[None]]


@dataclass
class Served:
    """The policy vLLM serves now."""

    policy_version: int
    weights: Path  # the model folder the engine loaded
    probe: Probe | None  # None for version 0 (the configured model)
    adapter: str | None = None  # vLLM's name of the LoRA adapter on ``weights``, if any
    adapter_dir: Path | None = None  # the folder it was loaded from


@dataclass(frozen=True)
class UpdateResult:
    policy_version: int  # served now
    already_loaded: bool
    load_s: float  # seconds spent fetching, verifying and loading
    restarted: bool = False
    timings: dict[str, float] = field(default_factory=dict)


def read_config(folder: Path) -> dict[str, Any]:
    try:
        doc = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ManifestError(f"{folder}/config.json is unreadable: {e}") from None
    if not isinstance(doc, dict):
        raise ManifestError(f"{folder}/config.json is not a JSON object")
    return doc


def choose_reload(
    mode: str, served_config: dict[str, Any], new_config: dict[str, Any]
) -> str | None:
    """None when the update may be loaded in place; otherwise why vLLM must restart."""
    if mode == "never":
        return "inference.inplace_reload is 'never'"
    if mode == "always":
        return None
    changed = sorted(
        k
        for k in (served_config.keys() | new_config.keys()) - _CONFIG_KEYS_FREE
        if served_config.get(k) != new_config.get(k)
    )
    if changed:
        return f"config.json changed ({', '.join(changed)})"
    if new_config.get("tie_word_embeddings"):
        return "the model ties its input and output embeddings, which vLLM 0.32 reloads wrongly in place"
    return None


def _log_orphan_failure(task: asyncio.Future[UpdateResult]) -> None:
    """Retrieve an update's error (its caller may have gone away) so it is never lost."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.debug("update ended with %s: %s", type(error).__name__, error)


async def start_engine(engine: VllmEngine, model: Path) -> float:
    """Start vLLM on ``model``, label its tokens version 0 and warm it up, the gate still
    closed; returns the start time, seconds."""
    elapsed = await engine.start(model)
    await engine.set_weight_version("0")
    warm = time.monotonic()
    await engine.prompt_logprobs(_WARMUP_TOKEN_IDS)  # the first request is slow
    log.info("[startup] warm-up request took %.1fs", time.monotonic() - warm)
    return elapsed


class WeightUpdater:
    """Owns the engine's weights: version 0 at start, then every update (module doc)."""

    def __init__(
        self,
        cfg: InferenceSection,
        engine: VllmEngine,
        store: ObjectStore,
        weights_dir: Path,
        report: Reporter | None = None,
        adapter_prefix: str = "policy",
    ):
        assert cfg.model is not None
        self.cfg = cfg
        self.adapter_prefix = adapter_prefix  # adapters are served as <prefix>-v<N>
        self.engine = engine
        self.store = store
        self.weights_dir = weights_dir
        self.report = report
        self.tolerance = cfg.tolerance()
        self.served = Served(0, cfg.model, None)
        self.user_paused = False
        self.updating_to: int | None = None
        self.fatal: BaseException | None = None  # the engine is gone for good
        self.log_label = ""  # what the update log lines start with (a hosted run's name)
        self._lock = asyncio.Lock()  # one update at a time
        self._gate_lock = asyncio.Lock()  # gate changes vs Pause/Resume

    # --- start -------------------------------------------------------------------------------
    async def start(self) -> float:
        """Start vLLM on the configured model as version 0; returns the start time, seconds."""
        assert self.cfg.model is not None
        elapsed = await start_engine(self.engine, self.cfg.model)
        await self.engine.set_gate(True)
        log.info("[startup] serving policy version 0 (%s)", self.cfg.model)
        return elapsed

    async def superseded(self, version: int) -> int | None:
        """The newest policy version whose publication finished in the store, when it is
        newer than ``version``; None otherwise (or when the store cannot say). A version
        gone from the store has one when the trainer deleted it (``trainer.keep_policies``)."""
        try:
            versions = await asyncio.to_thread(published_versions, self.store)
        except TreadleError:
            return None
        newest = max(versions, default=0)
        return newest if newest > version else None

    # --- pause / resume ----------------------------------------------------------------------
    async def pause(self, abort_in_flight: bool) -> int:
        """Stop admitting generation requests; returns how many were aborted."""
        async with self._gate_lock:
            self.user_paused = True
            if self.updating_to is not None:  # the update holds the gate closed already
                if abort_in_flight:
                    try:
                        await self.engine.abort_all()
                    except EngineError as e:
                        log.warning("abort during an update failed: %s", e)
                return 0
            state = await self.engine.set_gate(False)
            if not abort_in_flight or not state.num_in_flight:
                return 0
            await self.engine.pause("abort")
            await self.engine.resume()  # admission stays closed at the gate
            log.info("paused: aborted %d in-flight requests", state.num_in_flight)
            return state.num_in_flight

    async def resume(self) -> None:
        async with self._gate_lock:
            self.user_paused = False
            if self.updating_to is None:
                await self.engine.set_gate(True)

    # --- update ------------------------------------------------------------------------------
    async def update(self, policy_version: int, weights: common_pb2.ObjectRef) -> UpdateResult:
        """Serve ``policy_version`` from the published directory whose manifest is ``weights``.

        Idempotent by version; never goes back to an older version.
        """
        task = asyncio.ensure_future(self._update(policy_version, weights))
        task.add_done_callback(_log_orphan_failure)
        return await asyncio.shield(task)

    async def _update(self, version: int, ref: common_pb2.ObjectRef) -> UpdateResult:
        # a child of the caller's span (the PolicyPublished being processed: the trainer
        # step's trace); its stage timings become attributes
        with telemetry.tracer(__name__).start_as_current_span(
            "update_weights", attributes={"treadle.policy_version": version}
        ) as span:
            result = await self._update_locked(version, ref)
            span.set_attribute("treadle.already_loaded", result.already_loaded)
            span.set_attribute("treadle.restarted", result.restarted)
            for k, v in result.timings.items():
                span.set_attribute(f"treadle.{k}", v)
            return result

    async def _update_locked(self, version: int, ref: common_pb2.ObjectRef) -> UpdateResult:
        async with self._lock:
            if self.fatal is not None:
                raise EngineStartError(f"vLLM is gone: {self.fatal}")
            served = self.served.policy_version
            if version == served:
                return UpdateResult(version, already_loaded=True, load_s=0.0)
            if version < served:
                raise StaleVersionError(
                    f"policy version {version} is older than the served version {served}; "
                    "the service never goes back"
                )
            started = time.monotonic()
            timings: dict[str, float] = {}
            published, folder = await self._fetch(version, ref)
            timings["fetch_s"] = time.monotonic() - started
            if published.format == LORA_FORMAT:
                try:
                    await self._swap_adapter(published, folder, timings)
                except BaseException:
                    shutil.rmtree(folder, ignore_errors=True)
                    raise
                return await self._done(version, started, False, timings)
            async with self._gate_lock:
                self.updating_to = version
            try:
                restarted = await self._swap(published, folder, timings)
            except BaseException:
                if folder != self.served.weights:
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            finally:
                await self._reopen()
            return await self._done(version, started, restarted, timings)

    async def _done(
        self, version: int, started: float, restarted: bool, timings: dict[str, float]
    ) -> UpdateResult:
        """Log and report a finished update."""
        result = UpdateResult(version, False, time.monotonic() - started, restarted, dict(timings))
        log.info(
            "%sserving policy version %d (%s, %.2fs: %s)",
            self.log_label,
            version, "restarted vLLM" if restarted else "in place", result.load_s,
            ", ".join(f"{k} {v:.3g}" for k, v in timings.items()),
        )  # fmt: skip
        if self.report is not None:
            await self.report(version, {"policy_version": float(version), "update_s": result.load_s,
                                        "update_restarted": float(restarted), **timings})  # fmt: skip
        return result

    async def _fetch(self, version: int, ref: common_pb2.ObjectRef) -> tuple[PublishedPolicy, Path]:
        """Read and check the manifest, then download the directory (sha256 verified)."""
        if not ref.uri:
            raise ManifestError(f"policy version {version}: the weights reference has no URI")
        try:
            manifest = await asyncio.to_thread(self.store.read_manifest, ref)
        except ValueError as e:  # a URI outside this store (a bad checksum is IntegrityError)
            raise ManifestError(f"policy version {version}: {e}") from None
        published = read_policy_metadata(manifest.metadata, ref.uri, expected_version=version)
        names = {f.path for f in manifest.files}
        if published.format == LORA_FORMAT:
            if not self.cfg.lora.enabled:
                raise ManifestError(
                    f"policy version {version} is a LoRA adapter ({LORA_FORMAT}), but "
                    "inference.lora.enabled is false: set [inference.lora] enabled = true "
                    "(and max_lora_rank >= the adapter's rank) to serve adapters"
                )
            if not {ADAPTER_CONFIG, ADAPTER_WEIGHTS} <= names:
                raise ManifestError(
                    f"{ref.uri}: an adapter directory needs {ADAPTER_CONFIG} and "
                    f"{ADAPTER_WEIGHTS}, it lists {', '.join(sorted(names)) or 'no files'}"
                )
        elif self.cfg.lora.enabled:
            raise ManifestError(
                f"policy version {version} holds full weights, but this server serves LoRA "
                "adapters on a fixed base (inference.lora.enabled): publish adapters "
                "(trainer.lora.enabled) or turn inference.lora off"
            )
        elif "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
            raise ManifestError(
                f"{ref.uri}: a policy directory needs config.json and *.safetensors, it lists "
                f"{', '.join(sorted(names)) or 'no files'}"
            )
        folder = self.weights_dir / f"v{version:06d}"
        staging = self.weights_dir / f".v{version:06d}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            await asyncio.to_thread(self.store.fetch_dir, ref, staging)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        return published, folder

    async def _swap(
        self, published: PublishedPolicy, folder: Path, timings: dict[str, float]
    ) -> bool:
        """Drain, load and verify; True when vLLM was restarted. On failure N-1 serves again."""
        version, probe = published.policy_version, published.probe
        t = time.monotonic()
        await self._drain()
        timings["drain_s"] = time.monotonic() - t
        before = compare(await self.engine.prompt_logprobs(probe.token_ids), probe, self.tolerance)
        timings["probe_shift_mean"] = before.mean_abs_diff
        if before.ok:
            log.warning(
                "policy version %d moves the probe by only %.3g nats on average, within the "
                "tolerance %.3g: its verification cannot tell it from version %d",
                version, before.mean_abs_diff, self.tolerance, self.served.policy_version,
            )  # fmt: skip
        why_restart = choose_reload(
            self.cfg.inplace_reload, read_config(self.served.weights), read_config(folder)
        )
        if why_restart is None:
            t = time.monotonic()
            try:
                check = await self._reload_in_place(folder, probe)
            except EngineError as e:
                why_restart = f"the in-place reload failed: {e}"
            else:
                timings["reload_s"] = time.monotonic() - t
                timings["verify_mean_abs_diff"] = check.mean_abs_diff
                if check.ok:
                    await self._commit(version, folder, probe)
                    return False
                why_restart = f"the in-place reload failed verification: {check.describe()}"
        log.warning("policy version %d: restarting vLLM because %s", version, why_restart)
        t = time.monotonic()
        failure: str
        try:
            await self._restart(folder)
            timings["restart_s"] = time.monotonic() - t
            check = compare(
                await self.engine.prompt_logprobs(probe.token_ids), probe, self.tolerance
            )
            timings["verify_mean_abs_diff"] = check.mean_abs_diff
            if check.ok:
                await self._commit(version, folder, probe)
                return True
            failure = f"after a clean restart on it: {check.describe()}"
        except (EngineError, EngineStartError) as e:
            failure = f"vLLM could not serve it: {e}"
        await self._roll_back()
        raise VerificationError(
            f"policy version {version} failed verification ({why_restart}; {failure}); "
            f"still serving version {self.served.policy_version}"
        )

    async def _swap_adapter(
        self, published: PublishedPolicy, folder: Path, timings: dict[str, float]
    ) -> None:
        """Check, load and verify the adapter beside the served policy, then switch to it
        (module doc). On any failure before the switch the served policy is untouched."""
        version, probe, old = published.policy_version, published.probe, self.served
        name = await self._load_adapter(published, folder, timings)
        try:
            # drained before the probes: vLLM 0.32's CPU LoRA path fails (and kills the
            # engine) when a prompt-logprobs request shares a batch with sampling requests,
            # so the probes run alone; requests wait at the gate meanwhile
            async with self._gate_lock:
                self.updating_to = version
            try:
                t = time.monotonic()
                await self._drain()
                timings["drain_s"] = time.monotonic() - t
                await self._verify_adapter(published, name, timings)
                await self.engine.set_gate(False, adapter=name)
                try:
                    await self.engine.set_weight_version(str(version))
                except BaseException:
                    await self.engine.set_gate(False, adapter=old.adapter)
                    raise
            finally:
                await self._reopen()
        except BaseException:
            await self._forget(name)
            raise
        self.served = Served(version, old.weights, probe, name, folder)
        if old.adapter is not None:
            await self._forget(old.adapter)
        if old.adapter_dir is not None and old.adapter_dir.parent == self.weights_dir:
            shutil.rmtree(old.adapter_dir, ignore_errors=True)

    async def _load_adapter(
        self, published: PublishedPolicy, folder: Path, timings: dict[str, float]
    ) -> str:
        """Check the adapter in ``folder`` against the base and load it; returns its name."""
        version, old = published.policy_version, self.served
        lora = self.cfg.lora
        check_adapter(
            folder, where=f"policy version {version}", served_model=old.weights,
            served_config=read_config(old.weights), max_rank=lora.max_lora_rank,
            base_name=lora.base_model, published_base=published.base_model,
        )  # fmt: skip
        name = f"{self.adapter_prefix}-v{version}"
        t = time.monotonic()
        try:
            await self.engine.load_lora(name, folder)
        except EngineError as e:
            raise VerificationError(
                f"policy version {version}: vLLM did not load the adapter: {e}; still serving "
                f"version {old.policy_version}"
            ) from None
        timings["load_s"] = time.monotonic() - t
        return name

    async def _verify_adapter(
        self, published: PublishedPolicy, name: str, timings: dict[str, float]
    ) -> None:
        """Run the probe through the served adapter and the loaded one ``name``; a
        VerificationError unless ``name`` serves the published probe."""
        version, probe, old = published.policy_version, published.probe, self.served
        before = compare(
            await self.engine.prompt_logprobs(probe.token_ids, adapter=old.adapter),
            probe, self.tolerance,
        )  # fmt: skip
        timings["probe_shift_mean"] = before.mean_abs_diff
        if before.ok:
            log.warning(
                "policy version %d moves the probe by only %.3g nats on average, within the "
                "tolerance %.3g: its verification cannot tell it from version %d",
                version, before.mean_abs_diff, self.tolerance, old.policy_version,
            )  # fmt: skip
        check = compare(
            await self.engine.prompt_logprobs(probe.token_ids, adapter=name),
            probe, self.tolerance,
        )  # fmt: skip
        timings["verify_mean_abs_diff"] = check.mean_abs_diff
        if not check.ok:
            raise VerificationError(
                f"policy version {version} (adapter {name}) failed verification: "
                f"{check.describe()}; still serving version {old.policy_version}"
            )

    async def _forget(self, name: str) -> None:
        """Unload an adapter no request is sent to any more (a failure is only logged)."""
        try:
            await self.engine.unload_lora(name)
        except EngineError as e:
            log.warning("could not unload LoRA adapter %s: %s", name, e)

    async def _drain(self) -> None:
        state = await self.engine.set_gate(False, drain_timeout_s=self.cfg.drain_timeout_s)
        if state.num_in_flight:
            log.warning(
                "%d requests still running after drain_timeout_s=%.0f; aborting them",
                state.num_in_flight, self.cfg.drain_timeout_s,
            )  # fmt: skip
            await self.engine.abort_all()
            state = await self.engine.set_gate(False, drain_timeout_s=30.0)
            if state.num_in_flight:
                raise EngineError(f"{state.num_in_flight} requests did not end after an abort")

    async def _reload_in_place(self, folder: Path, probe: Probe) -> ProbeCheck:
        await self.engine.pause("wait")  # idle engine; clears the prefix cache
        try:
            await self.engine.reload_weights(folder)
            await self.engine.reset_prefix_cache()
        finally:
            await self.engine.resume()  # only the probe passes the closed gate
        served = await self.engine.prompt_logprobs(probe.token_ids)
        return compare(served, probe, self.tolerance)

    async def _restart(self, folder: Path) -> None:
        try:
            await self.engine.set_gate(False, reject_held=True)
        except EngineError as e:
            log.warning("could not release held requests before the restart: %s", e)
        await self.engine.stop()
        await self.engine.start(folder, restart=True)

    async def _commit(self, version: int, folder: Path, probe: Probe) -> None:
        await self.engine.set_weight_version(str(version))
        old = self.served
        self.served = Served(version, folder, probe)
        if old.weights != folder and old.weights.parent == self.weights_dir:
            shutil.rmtree(old.weights, ignore_errors=True)

    async def _roll_back(self) -> None:
        served = self.served
        log.error("rolling back to policy version %d (%s)", served.policy_version, served.weights)
        try:
            await self._restart(served.weights)
            await self.engine.set_weight_version(str(served.policy_version))
            if served.probe is not None:
                check = compare(
                    await self.engine.prompt_logprobs(served.probe.token_ids),
                    served.probe,
                    self.tolerance,
                )
                if not check.ok:
                    raise EngineError(
                        f"version {served.policy_version} no longer verifies: {check.describe()}"
                    )
        except (EngineError, EngineStartError) as e:
            self.fatal = e
            raise EngineStartError(
                f"cannot serve policy version {served.policy_version} again after a failed update: {e}"
            ) from None

    async def _reopen(self) -> None:
        async with self._gate_lock:
            self.updating_to = None
            if self.fatal is None and not self.user_paused:
                try:
                    await self.engine.set_gate(True)
                except EngineError as e:
                    self.fatal = e
                    raise
