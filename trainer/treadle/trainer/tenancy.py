"""Many runs' LoRA adapters trained on one copy of a frozen base model (hosted training).

    SharedBase(base section) ── build_policy once: the frozen base + LoRA slots
        add_run(run, section, store, checkpoint_dir) ─▶ RunTrainer (a Trainer on the shared
            policy), after checking that the run fits: LoRA on, the same base model,
            adapter shape and dtype, no KL reference, one process
            own: adapter tensors (AdapterBank, initial values from its trainer.seed),
                 RNG state, optimizer + LR schedule (per-adapter optimizer state), step
                 counter, object store (the run's prefix), checkpoints, publications
        remove_run(run) ─▶ in the run's turn: its adapter tensors, RNG and optimizer state
            freed, its fair-share entry dropped (runs added and removed at runtime: hosted.py)
        RunTrainer.train_step / save_checkpoint / resume / publish_weights
            ─▶ FairShare.turn(run): waits while another run holds the model; a freed model
               goes to the waiting run that has used the least trainer time
            ─▶ AdapterBank.activate(run): the model's adapter parameters hold this run's
               tensors (and torch's RNG this run's state) for the turn
            ─▶ Trainer's own code on this run's batch only

A run's step never sees another run's samples, gradients, optimizer state or RNG draws:
its result is bit-identical to the same run trained alone by its own Trainer (tests).
Trainer time per run (``FairShare.used_s``) is what the scheduler balances and what usage
metering bills.

Limits: one process (a shared base under FSDP is not done: swapping sharded adapter
tensors per run needs DTensor-aware slots); every run on a base has the same adapter
shape (rank, alpha, target modules, dropout), since the LoRA modules are built once; the
KL penalty's reference (a full model copy per run) is refused — the base itself is that
reference for an adapter, and computing it by switching the adapter off mid-step is not
done yet.

Not here: the bus (``service.py`` runs one TrainerApp per run on a RunTrainer).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from treadle.services.errors import ConfigError, QuotaExceededError
from treadle.services.objectstore import ObjectStore
from treadle.trainer.distributed import Topology
from treadle.trainer.lora import initial_adapters
from treadle.trainer.models.hf import DTYPES
from treadle.trainer.policy import Policy, build_policy, resolve_device
from treadle.trainer.spec import TrainerSection
from treadle.trainer.trainer import StepResult, Trainer

log = logging.getLogger(__name__)


class FairShare:
    """One holder of the shared model at a time. When it is freed, the waiting run with
    the least trainer time used (divided by its weight) goes next; ties go to the one
    that asked first. A run added later starts at the least time of the runs already
    there, so it does not hold the model until it has caught up with them. Re-entrant
    for the thread that holds a turn."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._holder: tuple[str, int] | None = None  # (run, thread id)
        self._waiting: dict[int, str] = {}  # arrival number -> run
        self._arrivals = itertools.count()
        self._weights: dict[str, float] = {}
        self.used_s: dict[str, float] = {}  # trainer seconds per run (turns it held)
        self.turns: dict[str, int] = {}
        self._offset: dict[str, float] = {}  # weighted seconds a late run starts with (not billed)

    def register(self, run: str, weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"weight of run {run!r} is {weight}: it must be > 0")
        with self._cond:
            if run in self._weights:
                raise ValueError(f"run {run!r} is already registered")
            start = min((self._virtual(r) for r in self._weights), default=0.0)
            self._weights[run] = weight
            self.used_s[run] = 0.0
            self.turns[run] = 0
            self._offset[run] = start * weight

    def unregister(self, run: str) -> None:
        """Forget ``run`` (its time used included: a run added again starts afresh)."""
        with self._cond:
            self._weights.pop(run, None)
            self._offset.pop(run, None)
            self.used_s.pop(run, None)
            self.turns.pop(run, None)

    def _virtual(self, run: str) -> float:
        return (self.used_s[run] + self._offset[run]) / self._weights[run]

    def waiting(self) -> list[str]:
        """Runs waiting for a turn, in arrival order."""
        with self._cond:
            return [self._waiting[k] for k in sorted(self._waiting)]

    def held_by_me(self, run: str) -> bool:
        """Whether this thread holds ``run``'s turn."""
        return self._holder == (run, threading.get_ident())

    def _next(self) -> int:
        return min(self._waiting, key=lambda k: (self._virtual(self._waiting[k]), k))

    @contextmanager
    def turn(self, run: str) -> Iterator[None]:
        """Hold the model for ``run`` (blocks until it is this run's turn)."""
        me = threading.get_ident()
        if self.held_by_me(run):
            yield
            return
        with self._cond:
            if run not in self._weights:
                raise ValueError(f"run {run!r} is not registered on this trainer")
            key = next(self._arrivals)
            self._waiting[key] = run
            try:
                while self._holder is not None or self._next() != key:
                    self._cond.wait()
            finally:
                del self._waiting[key]
                self._cond.notify_all()
            self._holder = (run, me)
        started = self._clock()
        try:
            yield
        finally:
            with self._cond:
                self.used_s[run] += self._clock() - started
                self.turns[run] += 1
                self._holder = None
                self._cond.notify_all()


@dataclass
class _Slot:
    tensors: dict[str, torch.Tensor]  # adapter parameter FQN -> this run's values
    rng: torch.Tensor  # torch's RNG state (of the model's device) between this run's turns


class AdapterBank:
    """Each run's adapter tensors for one model whose adapter parameters are shared;
    ``activate`` points those parameters at one run's tensors (no copy)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert self.params, "a shared base needs adapter parameters (LoRA)"
        self._slots: dict[str, _Slot] = {}
        self.active: str | None = None
        self._device = next(iter(self.params.values())).device

    def add(self, run: str, initial: dict[str, torch.Tensor], seed: int) -> None:
        missing = set(self.params) - set(initial)
        assert not missing, f"initial adapter lacks {sorted(missing)[:3]}"
        tensors = {
            n: initial[n].to(device=p.device, dtype=p.dtype).clone() for n, p in self.params.items()
        }
        gen = torch.Generator(self._device).manual_seed(seed)
        self._slots[run] = _Slot(tensors, gen.get_state())

    def remove(self, run: str) -> None:
        """Free ``run``'s tensors. When they are the active ones, the model's adapter
        parameters are parked on a broadcast zero (no memory; the next ``activate`` points
        them at a run's tensors again), so nothing keeps them alive."""
        self._slots.pop(run, None)
        if self.active == run:
            with torch.no_grad():
                for p in self.params.values():
                    p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            self.active = None

    def __contains__(self, run: object) -> bool:
        return run in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def activate(self, run: str) -> None:
        """The model's adapter parameters hold ``run``'s tensors from now on."""
        if self.active == run:
            return
        slot = self._slots[run]
        with torch.no_grad():
            for name, p in self.params.items():
                if p.grad is not None:  # a step's gradients never outlive its turn
                    raise AssertionError(f"{name} holds a gradient while switching adapters")
                p.data = slot.tensors[name]
        self.active = run

    @contextmanager
    def rng(self, run: str) -> Iterator[None]:
        """torch's RNG of the model's device draws from ``run``'s own stream for the
        duration (one run's dropout does not depend on the other runs' steps)."""
        slot = self._slots[run]
        cuda = self._device.type == "cuda"
        get = (lambda: torch.cuda.get_rng_state(self._device)) if cuda else torch.get_rng_state
        put = (lambda s: torch.cuda.set_rng_state(s, self._device)) if cuda else torch.set_rng_state
        outside = get()
        put(slot.rng)
        try:
            yield
        finally:
            slot.rng = get()
            put(outside)

    def nbytes(self, run: str | None = None) -> int:
        """Bytes of ``run``'s adapter tensors (None: of every run's)."""
        slots = self._slots.values() if run is None else [self._slots[run]]
        return sum(t.numel() * t.element_size() for s in slots for t in s.tensors.values())


# the settings every run on one base shares (the base is built once from them)
_SHARED = ("model", "family", "attention", "device", "dtype")
_SHARED_LORA = ("rank", "alpha", "target_modules", "dropout")


class SharedBase:
    """One frozen base model with LoRA slots; the runs trained on it (``add_run``)."""

    def __init__(self, section: TrainerSection, *, topology: Topology | None = None):
        topology = topology or Topology()
        if section.model is None:
            raise ConfigError("trainer.model is not set: a shared base needs the base model")
        if not section.lora.enabled:
            raise ConfigError(
                "trainer.lora.enabled is false: runs share a base only as LoRA adapters "
                "(full fine-tuning needs a trainer of its own)"
            )
        if topology.distributed:
            raise ConfigError(
                f"a shared base trains in one process; this job has {topology.world_size} "
                "ranks (set trainer.distributed to 1 process, or give each run its own trainer)"
            )
        self.section = section
        self.topology = topology
        self.device = resolve_device(section.device, topology)
        self.policy: Policy = build_policy(
            section.model,
            family=section.family,
            attention=section.attention,
            device=self.device,
            dtype=DTYPES[section.dtype],
            topology=topology,
            lora=section.lora,
        )
        self.bank = AdapterBank(self.policy.model)
        self.share = FairShare()
        self.runs: dict[str, RunTrainer] = {}

    def check_fits(self, run: str, section: TrainerSection) -> None:
        """ConfigError naming the setting when ``section`` cannot train on this base."""
        base = self.section
        where = f"run {run!r}"
        for key in _SHARED:
            mine, theirs = getattr(section, key), getattr(base, key)
            if key == "model":
                mine = Path(mine).resolve() if mine is not None else None
                theirs = Path(theirs).resolve()
            if mine != theirs:
                raise ConfigError(
                    f"{where}: trainer.{key} = {mine!s} but this trainer's base has {theirs!s} "
                    "(every run on a shared base uses it as it is)"
                )
        if not section.lora.enabled:
            raise ConfigError(
                f"{where}: trainer.lora.enabled is false; on a shared base every run trains "
                "a LoRA adapter"
            )
        for key in _SHARED_LORA:
            mine, theirs = getattr(section.lora, key), getattr(base.lora, key)
            if mine != theirs:
                raise ConfigError(
                    f"{where}: trainer.lora.{key} = {mine!r} but the adapters on this base "
                    f"have {theirs!r} (the LoRA modules are built once for every run)"
                )
        if section.loss.kl_coef > 0:
            raise ConfigError(
                f"{where}: trainer.loss.kl_coef = {section.loss.kl_coef} needs a reference "
                "model, which runs on a shared base cannot have (set kl_coef = 0)"
            )
        if section.distributed.world_size > 1:
            raise ConfigError(
                f"{where}: trainer.distributed asks for {section.distributed.world_size} "
                "ranks; a shared base trains in one process"
            )

    def add_run(
        self,
        run: str,
        section: TrainerSection,
        store: ObjectStore,
        *,
        checkpoint_dir: Path,
        weight: float = 1.0,
        quota: Quota | None = None,
    ) -> RunTrainer:
        """A trainer for ``run`` on this base: its own adapter (fresh from
        ``section.seed``), optimizer, schedule, store and checkpoints. Call ``resume()``
        on it to continue from the run's newest checkpoint. ``quota``: what the run may
        use in all (its use before this process included)."""
        if run in self.runs:
            raise ConfigError(f"run {run!r} is already trained on this base")
        self.check_fits(run, section)
        initial = initial_adapters(self.policy.model, section.seed)
        self.bank.add(run, initial, section.seed)
        self.share.register(run, weight)
        try:
            trainer = RunTrainer(self, run, section, store, checkpoint_dir=checkpoint_dir,
                                 quota=quota)  # fmt: skip
        except BaseException:
            self.bank.remove(run)
            self.share.unregister(run)
            raise
        self.runs[run] = trainer
        log.info(
            "[startup] run %s: adapter of %d KiB on the shared base (%d runs)",
            run, self.bank.nbytes(run) >> 10, len(self.runs),
        )  # fmt: skip
        return trainer

    def remove_run(self, run: str) -> None:
        """Forget ``run``: its adapter tensors, RNG state, optimizer state and fair-share
        entry are freed (its checkpoints and publications stay in its store). Waits for the
        run's turn, so a use of the model by the run ends first; its RunTrainer cannot take
        a turn afterwards."""
        with self.share.turn(run):
            trainer = self.runs.pop(run, None)
            freed = self.bank.nbytes(run) if run in self.bank else 0
            self.bank.remove(run)
            if trainer is not None:
                trainer.release()
        self.share.unregister(run)
        log.info(
            "[shutdown] run %s: adapter of %d KiB and its optimizer state freed (%d runs left "
            "on the shared base)", run, freed >> 10, len(self.runs),
        )  # fmt: skip

    @contextmanager
    def holding(self, run: str) -> Iterator[None]:
        """The model holds ``run``'s adapter and RNG state for the duration (one turn)."""
        if self.share.held_by_me(run):
            yield  # nested in this run's own turn
            return
        with self.share.turn(run):
            self.bank.activate(run)
            with self.bank.rng(run):
                yield


@dataclass
class Quota:
    """What a hosted run may use in all, and what it had used before this process (its
    usage ledger): a step starts only while the run is below every limit (it may end
    past one by at most that step)."""

    trainer_s: float | None = None  # trainer seconds
    trained_tokens: int | None = None  # tokens of trained batches
    prior_trainer_s: float = 0.0
    prior_trained_tokens: int = 0


class RunTrainer(Trainer):
    """A Trainer of one run on a shared base: every use of the model happens in the run's
    turn, with the run's adapter active."""

    def __init__(
        self,
        base: SharedBase,
        run: str,
        section: TrainerSection,
        store: ObjectStore,
        *,
        checkpoint_dir: Path,
        quota: Quota | None = None,
    ):
        self.base = base
        self.run = run
        self.quota = quota or Quota()
        self.trained_tokens = 0  # in this process
        rng = torch.get_rng_state()
        try:
            super().__init__(
                section,
                store,
                checkpoint_dir=checkpoint_dir,
                topology=base.topology,
                policy=base.policy,
            )
        finally:
            torch.set_rng_state(rng)  # the run's own RNG lives in its slot

    def train_step(self, ready: Any, data: bytes | None = None) -> StepResult:
        self.check_quota()
        with self.base.holding(self.run):
            result = super().train_step(ready, data)
        self.trained_tokens += int(ready.num_tokens)
        return result

    def release(self) -> None:
        """Free the optimizer state (the run is removed from the base: ``remove_run``)."""
        for optimizer in [self.optimizers, *self.optimizers]:
            optimizer.state.clear()

    def check_quota(self) -> None:
        """QuotaExceededError when the run has used what its quota allows."""
        q = self.quota
        used_s = q.prior_trainer_s + self.base.share.used_s.get(self.run, 0.0)
        tokens = q.prior_trained_tokens + self.trained_tokens
        for what, used, limit in (("trainer seconds", used_s, q.trainer_s),
                                  ("trained tokens", tokens, q.trained_tokens)):  # fmt: skip
            if limit is not None and used >= limit:
                raise QuotaExceededError(
                    f"run {self.run!r} has used {used:.6g} {what} of its quota of {limit:.6g} "
                    f"(trainer.hosted.quotas, or AddRun's quota): it trains no further step "
                    f"(through step {self.step}; its checkpoint is kept)"
                )

    def save_checkpoint(self) -> Any:
        with self.base.holding(self.run):
            return super().save_checkpoint()

    def resume(self) -> int:
        with self.base.holding(self.run):
            return super().resume()

    def publish_weights(self, policy_version: int, probe_token_ids: list[int]) -> Any:
        with self.base.holding(self.run):
            return super().publish_weights(policy_version, probe_token_ids)
