"""Algorithms: a completed group -> per-token advantages (the trainer only sees the result).

An *algorithm* is a function ``fn(group: Group, **algorithm_args)`` returning one
float array per sample of the group (``group.samples[i]`` -> ``[num_tokens]``), the
advantage of each token; positions outside the sample's loss mask are ignored (written
as 0). It is chosen by ``orchestrator.algorithm`` -- a built-in name or a
``"package.module:function"`` path -- with keyword arguments from
``orchestrator.algorithm_args``, and per environment by ``[orchestrator.envs.<env>]``.
It may declare, with ``@algorithm(...)`` (or the same attributes set by hand):

- ``signals``: per-token signals it reads from ``group.signals`` (names in ``SIGNALS``,
  e.g. a teacher's logprobs of the sampled tokens). The orchestrator fills them through
  a ``SignalProvider`` per name and refuses to start when the run provides none.
- ``min_rollouts``: a group with fewer trainable rollouts is not trained (counted).
- ``check_args``: a function of the keyword arguments that raises ``ValueError`` on a bad
  value (a ``ConfigError`` naming the setting, before the run starts).

Built-ins, written through the same API:

- ``grpo``: reward minus the group mean (``normalize = true``: divided by the group's
  reward std + ``eps``);
- ``rloo``: reward minus the mean of the group's *other* rollouts;
- ``sft``: 1 on every sampled token (imitate every kept rollout);
- ``distill``: on-policy distillation, ``distill_weight * (teacher_logprob -
  student_logprob)`` on every sampled token: the negative per-token estimate of the
  reverse KL(student || teacher), with the student's sampling logprobs (needs a teacher,
  ``[orchestrator.teacher]``, ``teacher.py``); ``center = true`` subtracts its mean over
  the group's sampled tokens (a baseline: the mean is minus the group's KL, which
  otherwise pushes every sampled token down at once);
- ``grpo+distill``: ``grpo``'s advantage plus ``distill``'s (rewards and teacher mixed);
- ``distill-topk``: on-policy distillation on the teacher's distribution, not only the
  sampled token: the teacher's ``k`` most likely tokens where each sampled token was drawn
  (``teacher_topk``, ``[orchestrator.teacher] top_k``) travel with the batch, and the
  trainer adds ``distill_weight * KL(q || p)`` per sampled token, q the teacher's top-k
  renormalized, p the student (``trainer/losses.py``); no advantage (0);
- ``grpo+distill-topk``: ``grpo``'s advantage and the same top-k term.

An algorithm that asks for ``teacher_topk`` gets the trainer's top-k term on its samples,
weighted by its ``distill_weight`` argument (1 when it has none); its
``teacher_temperature`` argument (1 when it has none) is the temperature of the target: q
becomes softmax(log q / teacher_temperature) over the k, so below 1 the student is taught
a sharper distribution than the teacher's (what sampling from it then draws is closer to
the teacher's greedy answer).

Signals ahead of the batch (``Algorithms.prefetch``): the orchestrator asks the providers
for a group's signals as soon as the group completes, while the trainer trains and other
groups sample, so that cutting a batch does not wait for them (a teacher's calls are the
slowest part of a distillation step otherwise). ``score`` then builds the group again,
with the checks against the versions published by then, and uses what was fetched only
when it covers exactly the same samples (rollout, leaf and length); otherwise it asks the
providers again. A provider's failure ahead of time counts like one at ``score``.

Checks. At config time (``resolve``): the path imports, names a callable that accepts
``(group, **algorithm_args)``, and declares only known signals -- a ``ConfigError``
naming the setting. At run time (``Algorithms.score``): the output must be a list of one
finite array of the right length per sample; otherwise the group is refused
(``AlgorithmError``: logged with the setting and the group, counted, none of it trained).

Not here: which groups are trained at all (``filtering.py``), staleness, packing.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from treadle.orchestrator.samples import Sample, checked_samples
from treadle.proto.v1 import rollout_pb2
from treadle.services.errors import ConfigError, DecodeError, TreadleError
from treadle.services.plugins import check_call, is_import_path, load_callable

log = logging.getLogger(__name__)

SIGNALS = {
    "teacher_logprobs": "logprob of each token under a teacher model (0 off the loss mask)",
    "teacher_topk": "a teacher's k most likely tokens and their logprobs where each sampled "
    "token was drawn (TopK: [num_tokens, k] each, 0 off the loss mask); the trainer adds "
    "the distillation term over them",
    "reference_logprobs": "logprob of each token under the reference policy (0 off the loss mask)",
}
"""Per-token signals an algorithm may ask for, by name."""
TEACHER_SIGNALS = ("teacher_logprobs", "teacher_topk")
"""The signals a teacher (``[orchestrator.teacher]``) provides."""


@dataclass(frozen=True)
class TopK:
    """A teacher's distribution at each token of one sample: the ``k`` most likely next
    tokens where token t was drawn (ids by rank) and their logprobs; rows off the loss
    mask are 0."""

    ids: np.ndarray  # [num_tokens, k] int32
    logprobs: np.ndarray  # [num_tokens, k] float32

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])


Signals = dict[str, list[Any]]  # name -> one value per sample ([num_tokens] float32 or TopK)
Covered = tuple[tuple[str, int, int], ...]  # (rollout id, leaf node id, num_tokens) per sample


class AlgorithmError(TreadleError, ValueError):
    """An algorithm (or a signal provider) gave output that cannot be trained on."""


@dataclass(frozen=True)
class Group:
    """One completed group, as an algorithm sees it. S = samples, R = rollouts."""

    group_id: str
    env: str
    task_json: str  # the task every rollout of the group ran
    rollouts: list[rollout_pb2.Rollout]  # [R] trainable rollouts, in group order
    rewards: np.ndarray  # [R] float64, Rollout.reward (group rewards included)
    samples: list[Sample]  # [S] each rollout's root->leaf branches, rollout by rollout
    sample_rollout: np.ndarray  # [S] int64, index into ``rollouts`` of each sample
    # name -> [S] values: float32 arrays of each sample's length (TopK for teacher_topk);
    # only the declared signals
    signals: Mapping[str, list[Any]] = field(default_factory=dict)

    @property
    def num_rollouts(self) -> int:
        return len(self.rollouts)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    def per_rollout(self, values: Sequence[float] | np.ndarray) -> list[np.ndarray]:
        """Per-token advantages that give every loss token of rollout k ``values[k]``."""
        v = np.asarray(values, dtype=np.float32)
        if v.shape != (self.num_rollouts,):
            raise ValueError(f"per_rollout: {v.shape} values for {self.num_rollouts} rollouts")
        out = []
        for smp, k in zip(self.samples, self.sample_rollout, strict=True):
            a = np.zeros(smp.num_tokens, dtype=np.float32)
            a[smp.loss_mask == 1] = v[k]
            out.append(a)
        return out


AlgorithmFn = Callable[..., Sequence[Any]]
SignalProvider = Callable[[Group], Awaitable[Sequence[Any]]]
"""Fills one signal of a group: one [num_tokens] array per sample (checked like an
algorithm's output)."""

F = TypeVar("F", bound=Callable[..., Any])
BUILTIN: dict[str, AlgorithmFn] = {}


def algorithm(
    *,
    signals: Sequence[str] = (),
    min_rollouts: int = 1,
    check_args: Callable[..., None] | None = None,
) -> Callable[[F], F]:
    """Declare what an algorithm function needs (sets ``fn.signals``, ``fn.min_rollouts``,
    ``fn.check_args``)."""

    def mark(fn: F) -> F:
        setattr(fn, "signals", tuple(signals))  # noqa: B010 (attributes of a function)
        setattr(fn, "min_rollouts", min_rollouts)  # noqa: B010
        if check_args is not None:
            setattr(fn, "check_args", check_args)  # noqa: B010
        return fn

    return mark


def _builtin(name: str, **declared: Any) -> Callable[[F], F]:
    def register(fn: F) -> F:
        BUILTIN[name] = algorithm(**declared)(fn)
        return fn

    return register


@_builtin("grpo", min_rollouts=2)
def grpo(group: Group, *, normalize: bool = False, eps: float = 1e-6) -> list[np.ndarray]:
    """Reward minus the group mean, optionally over the group's std."""
    r = group.rewards
    adv = r - r.mean()
    if normalize:
        adv = adv / (r.std() + eps)
    return group.per_rollout(adv.astype(np.float32))


@_builtin("rloo", min_rollouts=2)
def rloo(group: Group) -> list[np.ndarray]:
    """Reward minus the mean of the other rollouts (leave-one-out baseline)."""
    r = group.rewards
    n = r.size
    return group.per_rollout((r - (r.sum() - r) / (n - 1)).astype(np.float32))


@_builtin("sft", min_rollouts=1)
def sft(group: Group) -> list[np.ndarray]:
    """1 on every sampled token: imitate every rollout that is trained."""
    return group.per_rollout(np.ones(group.num_rollouts, dtype=np.float32))


def _check_distill_args(
    *,
    distill_weight: float = 1.0,
    center: bool = False,
    teacher_temperature: float = 1.0,
    **_: Any,
) -> None:
    if not isinstance(center, bool):
        raise ValueError(f"center = {center!r} is not true or false")
    if (
        isinstance(teacher_temperature, bool)
        or not isinstance(teacher_temperature, (int, float))
        or not math.isfinite(teacher_temperature)
        or not 0.05 <= teacher_temperature <= 20
    ):
        raise ValueError(
            f"teacher_temperature = {teacher_temperature!r} must be a number in [0.05, 20] "
            "(the temperature of the top-k target; 1 keeps the teacher's distribution)"
        )
    if isinstance(distill_weight, bool) or not isinstance(distill_weight, (int, float)):
        raise ValueError(f"distill_weight = {distill_weight!r} is not a number")
    if not math.isfinite(distill_weight) or distill_weight <= 0:
        raise ValueError(
            f"distill_weight = {distill_weight} must be a finite number > 0 (0 would train "
            "without the teacher's signal: use 'grpo' for rewards alone)"
        )


def reverse_kl_advantages(
    group: Group, distill_weight: float = 1.0, center: bool = False
) -> list[np.ndarray]:
    """``distill_weight * (teacher_logprob - student_logprob)`` on each sample's loss tokens
    (0 elsewhere): the negative per-token reverse-KL estimate, student = behaviour policy.
    ``center``: minus its mean over the group's loss tokens (a baseline)."""
    out, ons = [], []
    for smp, teacher in zip(group.samples, group.signals["teacher_logprobs"], strict=True):
        a = np.zeros(smp.num_tokens, dtype=np.float32)
        on = smp.loss_mask == 1
        a[on] = distill_weight * (teacher[on] - smp.logprobs[on])
        out.append(a)
        ons.append(on)
    if center:
        scored = np.concatenate([a[on] for a, on in zip(out, ons, strict=True)])
        if scored.size:
            mean = np.float32(scored.astype(np.float64).mean())
            for a, on in zip(out, ons, strict=True):
                a[on] -= mean
    return out


@_builtin("distill", signals=("teacher_logprobs",), min_rollouts=1, check_args=_check_distill_args)
def distill(group: Group, *, distill_weight: float = 1.0, center: bool = False) -> list[np.ndarray]:
    """On-policy distillation: each sampled token's advantage is the teacher's logprob of it
    minus the student's (``distill_weight`` times); ``center``: minus the mean of that over
    the group's sampled tokens."""
    return reverse_kl_advantages(group, distill_weight, center)


@_builtin(
    "grpo+distill",
    signals=("teacher_logprobs",),
    min_rollouts=2,
    check_args=_check_distill_args,
)
def grpo_distill(
    group: Group,
    *,
    distill_weight: float = 1.0,
    normalize: bool = False,
    eps: float = 1e-6,
    center: bool = False,
) -> list[np.ndarray]:
    """GRPO's reward advantage plus the distillation advantage (``center`` as in
    ``distill``), per token."""
    rewards = grpo(group, normalize=normalize, eps=eps)
    kl = reverse_kl_advantages(group, distill_weight, center)
    return [r + k for r, k in zip(rewards, kl, strict=True)]


@_builtin("distill-topk", signals=("teacher_topk",), min_rollouts=1, check_args=_check_distill_args)
def distill_topk(
    group: Group, *, distill_weight: float = 1.0, teacher_temperature: float = 1.0
) -> list[np.ndarray]:
    """On-policy distillation on the teacher's top-k: no advantage (0 on every token);
    the trainer's term ``distill_weight * KL(teacher's renormalized top-k || student)`` at
    each sampled token carries the signal (``TopK``, at ``teacher_temperature``)."""
    return [np.zeros(s.num_tokens, dtype=np.float32) for s in group.samples]


@_builtin(
    "grpo+distill-topk", signals=("teacher_topk",), min_rollouts=2, check_args=_check_distill_args
)
def grpo_distill_topk(
    group: Group,
    *,
    distill_weight: float = 1.0,
    normalize: bool = False,
    eps: float = 1e-6,
    teacher_temperature: float = 1.0,
) -> list[np.ndarray]:
    """GRPO's reward advantage; the trainer adds the top-k distillation term."""
    return grpo(group, normalize=normalize, eps=eps)


@dataclass(frozen=True)
class Algorithm:
    """A resolved ``orchestrator.algorithm`` setting."""

    name: str  # the setting's value: a built-in name or "package.module:function"
    setting: str  # where it was set, e.g. "orchestrator.algorithm"
    fn: AlgorithmFn
    args: Mapping[str, Any]  # orchestrator.algorithm_args
    signals: tuple[str, ...]
    min_rollouts: int

    @property
    def asks_teacher(self) -> bool:
        """Whether it reads a signal of ``[orchestrator.teacher]``."""
        return any(s in TEACHER_SIGNALS for s in self.signals)

    def advantages(self, group: Group) -> list[np.ndarray]:
        """Per-token advantages of ``group``, checked; AlgorithmError when unusable."""
        what = f"{self.setting} = {self.name!r}"
        try:
            out = self.fn(group, **self.args)
        except Exception as e:  # the plug-in's own bug: refuse the group, say where
            raise AlgorithmError(
                f"{what} raised on group {group.group_id}: {type(e).__name__}: {e}"
            ) from e
        return check_per_token(out, group, what)


def resolve(name: str, args: Mapping[str, Any], setting: str) -> Algorithm:
    """The algorithm ``name`` with ``args``; ConfigError naming ``setting`` when the path
    does not import, is not callable, does not take ``(group, **args)`` or declares an
    unknown signal."""
    if is_import_path(name):
        fn = load_callable(name, setting)
    elif name in BUILTIN:
        fn = BUILTIN[name]
    else:
        raise ConfigError(
            f"{setting} = {name!r} is neither a built-in algorithm ({', '.join(sorted(BUILTIN))}) "
            "nor a 'package.module:function' path"
        )
    signals = getattr(fn, "signals", ())
    if isinstance(signals, str) or not all(isinstance(s, str) for s in signals):
        raise ConfigError(f"{setting} = {name!r}: its 'signals' must be a list of names")
    unknown = [s for s in signals if s not in SIGNALS]
    if unknown:
        raise ConfigError(
            f"{setting} = {name!r} asks for unknown per-token signals {unknown}; known: "
            f"{', '.join(sorted(SIGNALS))}"
        )
    min_rollouts = getattr(fn, "min_rollouts", 1)
    if not isinstance(min_rollouts, int) or min_rollouts < 1:
        raise ConfigError(f"{setting} = {name!r}: min_rollouts must be an integer >= 1")
    shown = ", ".join(["group", *(f"{k}=..." for k in args)])
    check_call(fn, setting, f"{name}({shown})", object(), **args)
    check_args = getattr(fn, "check_args", None)
    try:
        if check_args is not None:
            check_args(**args)
        if "teacher_topk" in signals:  # the trainer's term's settings, plug-ins too
            _check_distill_args(
                distill_weight=args.get("distill_weight", 1.0),
                teacher_temperature=args.get("teacher_temperature", 1.0),
            )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{setting} = {name!r}: {e}") from None
    return Algorithm(name, setting, fn, dict(args), tuple(signals), min_rollouts)


def check_per_token(values: Any, group: Group, what: str) -> list[np.ndarray]:
    """``values`` as one float32 [num_tokens] array per sample of ``group``, 0 off the
    loss mask; AlgorithmError naming ``what`` and the sample when that is not possible."""
    where = f"{what} on group {group.group_id}"
    if isinstance(values, (str, bytes, np.ndarray)) or not isinstance(values, Sequence):
        raise AlgorithmError(
            f"{where} returned {type(values).__name__}: expected a list of {group.num_samples} "
            "per-token arrays, one per sample (Group.per_rollout makes one from per-rollout values)"
        )
    if len(values) != group.num_samples:
        raise AlgorithmError(
            f"{where} returned {len(values)} arrays for {group.num_samples} samples"
        )
    out = []
    for i, (v, smp) in enumerate(zip(values, group.samples, strict=True)):
        at = f"{where}: sample {i} (rollout {smp.rollout_id}, leaf {smp.leaf_node_id})"
        try:
            a = np.asarray(v, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise AlgorithmError(f"{at} is not an array of numbers ({e})") from None
        if a.shape != (smp.num_tokens,):
            raise AlgorithmError(
                f"{at} has shape {a.shape}; the sample has {smp.num_tokens} tokens"
            )
        on = smp.loss_mask == 1
        bad = ~np.isfinite(a[on])
        if bad.any():
            raise AlgorithmError(
                f"{at} holds {int(bad.sum())} non-finite values (NaN/inf) on loss tokens"
            )
        out.append(np.where(on, a, np.float32(0)).astype(np.float32, copy=False))
    return out


def check_topk(values: Any, group: Group, what: str) -> list[TopK]:
    """``values`` as one ``TopK`` per sample of ``group`` (one k for all), rows 0 off the
    loss mask; AlgorithmError naming ``what`` and the sample otherwise: ids < 0, logprobs
    not finite or above 0 on a loss token."""
    where = f"{what} on group {group.group_id}"
    if not isinstance(values, Sequence) or len(values) != group.num_samples:
        raise AlgorithmError(f"{where} did not give one TopK per sample ({group.num_samples})")
    out: list[TopK] = []
    for i, (v, smp) in enumerate(zip(values, group.samples, strict=True)):
        at = f"{where}: sample {i} (rollout {smp.rollout_id}, leaf {smp.leaf_node_id})"
        if not isinstance(v, TopK):
            raise AlgorithmError(f"{at} is a {type(v).__name__}, not a TopK")
        ids, lps = np.asarray(v.ids), np.asarray(v.logprobs)
        k = out[0].k if out else (ids.shape[1] if ids.ndim == 2 else -1)
        if ids.shape != (smp.num_tokens, k) or lps.shape != ids.shape or k < 1:
            raise AlgorithmError(
                f"{at} has top-k arrays of shapes {ids.shape} and {lps.shape}; the sample has "
                f"{smp.num_tokens} tokens" + (f" and the group's k is {out[0].k}" if out else "")
            )
        on = smp.loss_mask == 1
        if np.any(ids[on] < 0) or not np.issubdtype(ids.dtype, np.integer):
            raise AlgorithmError(f"{at} holds top-k token ids that are not ids (< 0 or not int)")
        bad = ~np.isfinite(lps[on]) | (lps[on] > 1e-3)
        if bad.any():
            raise AlgorithmError(
                f"{at} holds {int(bad.sum())} top-k logprobs that are not finite or above 0 "
                "on loss tokens"
            )
        off = ~on
        out.append(TopK(
            np.where(off[:, None], 0, ids).astype(np.int32),
            np.where(off[:, None], 0, np.minimum(lps, 0)).astype(np.float32),
        ))  # fmt: skip
    return out


def at_temperature(top: TopK, on: np.ndarray, temperature: float) -> TopK:
    """``top`` with each loss token's row renormalized at ``temperature``:
    log softmax(logprobs / temperature) over the k (rows off ``on`` stay 0); ``top`` itself
    at 1."""
    if temperature == 1.0:
        return top
    z = top.logprobs[on].astype(np.float64) / temperature
    z -= z.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    lps = np.zeros_like(top.logprobs)
    lps[on] = z
    return TopK(top.ids, lps)


@dataclass
class ScoredGroup:
    """What became of one completed group."""

    samples: list[Sample]  # with per-token advantages; empty when refused or skipped
    num_errors: int = 0  # trainable rollouts whose samples failed the checks (dropped)
    refused: str = ""  # why the algorithm's output was refused (nothing trained)
    too_few: bool = False  # fewer trainable rollouts than the algorithm's min_rollouts


class Algorithms:
    """The algorithm of each environment, and the providers of per-token signals."""

    def __init__(
        self,
        by_env: Mapping[str, Algorithm],
        providers: Mapping[str, SignalProvider] | None = None,
    ):
        self.by_env = dict(by_env)
        self.providers = dict(providers or {})
        # group id -> (the samples it covers, the providers' signals being fetched)
        self._ahead: dict[str, tuple[Covered, asyncio.Task[Signals]]] = {}
        for env, algo in self.by_env.items():
            missing = [s for s in algo.signals if s not in self.providers]
            if missing:
                raise ConfigError(
                    f"{algo.setting} = {algo.name!r} (environment {env!r}) asks for the "
                    f"per-token signals {missing}, which nothing in this run provides "
                    f"(provided: {sorted(self.providers) or 'none'})"
                )

    def build_group(
        self,
        env: str,
        group_id: str,
        task_json: str,
        valid: list[rollout_pb2.Rollout],
        *,
        max_policy_version: int,
        vocab_size: int | None,
    ) -> tuple[Group, int]:
        """The Group of ``valid`` (trainable) rollouts whose samples pass the checks, and
        how many did not (logged, dropped)."""
        rollouts: list[rollout_pb2.Rollout] = []
        samples: list[Sample] = []
        owner: list[int] = []
        errors = 0
        for r in valid:
            try:
                branch = checked_samples(
                    r, max_policy_version=max_policy_version, vocab_size=vocab_size
                )
            except DecodeError as e:
                errors += 1
                log.error("dropping rollout %s: %s", r.rollout_id, e)
                continue
            owner += [len(rollouts)] * len(branch)
            rollouts.append(r)
            samples += branch
        group = Group(
            group_id=group_id,
            env=env,
            task_json=task_json,
            rollouts=rollouts,
            rewards=np.array([r.reward for r in rollouts], dtype=np.float64),
            samples=samples,
            sample_rollout=np.array(owner, dtype=np.int64),
        )
        return group, errors

    async def score(
        self,
        env: str,
        group_id: str,
        task_json: str,
        valid: list[rollout_pb2.Rollout],
        *,
        max_policy_version: int,
        vocab_size: int | None,
    ) -> ScoredGroup:
        """Per-token advantages for the samples of one completed group."""
        algo = self.by_env[env]
        if not valid:  # every rollout failed: counted as errors by the caller
            return ScoredGroup([])
        if len(valid) < algo.min_rollouts:
            return ScoredGroup([], too_few=True)
        group, errors = self.build_group(
            env, group_id, task_json, valid,
            max_policy_version=max_policy_version, vocab_size=vocab_size,
        )  # fmt: skip
        if group.num_rollouts < algo.min_rollouts:
            return ScoredGroup([], errors, too_few=True)
        try:
            if algo.signals:
                filled = await self._take_signals(algo, group)
                group = Group(**{**vars(group), "signals": filled})
            advantages = algo.advantages(group)
        except AlgorithmError as e:
            log.error("group %s refused, none of it is trained: %s", group_id, e)
            return ScoredGroup([], errors, refused=str(e))
        for smp, adv in zip(group.samples, advantages, strict=True):
            smp.advantages = adv
        if "teacher_topk" in group.signals:  # the trainer's term: the samples carry it
            weight = float(algo.args.get("distill_weight", 1.0))
            temperature = float(algo.args.get("teacher_temperature", 1.0))
            for smp, top in zip(group.samples, group.signals["teacher_topk"], strict=True):
                smp.teacher_topk = at_temperature(top, smp.loss_mask == 1, temperature)
                smp.teacher_weight = weight
        return ScoredGroup(group.samples, errors)

    # --- signals ahead of the batch ------------------------------------------------------
    def prefetch(
        self,
        env: str,
        group_id: str,
        task_json: str,
        valid: list[rollout_pb2.Rollout],
        *,
        max_policy_version: int,
        vocab_size: int | None,
    ) -> asyncio.Task[Signals] | None:
        """Start fetching the signals of a completed group for a later ``score`` (module
        doc): the fetch, or None when its algorithm reads none or the group is too small
        to train. The caller may wait for it; ``score`` takes its result."""
        algo = self.by_env[env]
        if not algo.signals or len(valid) < algo.min_rollouts:
            return None
        group, _ = self.build_group(
            env, group_id, task_json, valid,
            max_policy_version=max_policy_version, vocab_size=vocab_size,
        )  # fmt: skip
        if group.num_rollouts < algo.min_rollouts:
            return None
        self.forget(group_id)
        task = asyncio.create_task(self._signals(algo, group), name=f"signals {group_id}")
        self._ahead[group_id] = (_covered(group), task)
        return task

    def reads_signals(self, env: str) -> bool:
        return bool(self.by_env[env].signals)

    def forget(self, group_id: str) -> None:
        """Drop what was fetched ahead for a group that will not be scored."""
        ahead = self._ahead.pop(group_id, None)
        if ahead is not None:
            _drop(ahead[1])

    async def aclose(self) -> None:
        """Stop every fetch in flight (at shutdown)."""
        tasks = [task for _, task in self._ahead.values()]
        self._ahead.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _take_signals(self, algo: Algorithm, group: Group) -> Signals:
        ahead = self._ahead.pop(group.group_id, None)
        if ahead is not None:
            covered, task = ahead
            if covered == _covered(group):
                return await task
            _drop(task)  # the group changed since (e.g. a group reward failed a rollout)
        return await self._signals(algo, group)

    async def _signals(self, algo: Algorithm, group: Group) -> Signals:
        filled = {}
        for name in algo.signals:
            got = await self.providers[name](group)
            what = f"the {name} provider"
            filled[name] = (
                check_topk(got, group, what) if name == "teacher_topk"
                else check_per_token(got, group, what)
            )  # fmt: skip
        return filled


def _covered(group: Group) -> Covered:
    return tuple((s.rollout_id, s.leaf_node_id, s.num_tokens) for s in group.samples)


def _drop(task: asyncio.Task[Signals]) -> None:
    """Cancel a fetch nobody will await; a failure it already had is not reported."""
    if task.done():
        if not task.cancelled():
            task.exception()  # retrieved: no "never retrieved" warning
    else:
        task.cancel()
