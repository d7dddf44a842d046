"""The asynchronous RL loop.

      EnvMixture ───▶ dispatch ──RolloutRequested──▶ ROLLOUT_REQUESTS ──▶ env runners
                        │ policy-lag gate                                     │
                        │ (inference version, polled)                         ▼
      state ◀────────── collect ◀───RolloutCompleted─── ROLLOUTS ◀───────────┘
      (object store)       │ groups complete
                           ▼
                        batch: difficulty filter, the env's algorithm (per-token
                           │   advantages; signals it asks for, e.g. a teacher's logprobs
                           │   ──teacher_call──▶ teacher inference), staleness filter,
                           │   pack (treadle_native)
                           │──▶ Batch (object store) + BatchReady ──▶ BATCHES ──▶ trainer
                           └──▶ MetricsReport ──▶ METRICS

      eval plan (evaluation.py) ──▶ eval round: held-out tasks ──RolloutRequested{split=eval}──▶
          ▲ step N published and     (state.eval_round)      (same queue, beside training)
          │ served by inference            │ all completed
          └────────────────────────── eval/ metrics row at step N + eval/step-<N>.jsonl

Several environments (``[orchestrator.envs.<env>]`` with tasks, ``mixture.py``): each new
group draws its environment by weight and takes that environment's next task; groups of
different environments share batches, each scored by its environment's algorithm, and
each step's metrics row has ``env/<env>/...`` keys beside the batch-wide ones.

Continuous batching: up to ``max_groups_in_flight`` groups are out at once; a batch is
cut as soon as ``groups_per_step`` groups are complete (oldest first). The gate lets a
new group start only while the step it will land in, s, satisfies
``(s - 1) - inference_version <= max_async_level`` (``inference_version``: the oldest
version any inference replica that answers its status serves); samples whose oldest
sampled token is older than ``(s - 1) - max_off_policy_steps`` are dropped and counted.
Groups the difficulty filter refuses (``filtering.py``) are counted and, as configured,
trained anyway, dropped, or replaced by new groups before the batch is cut; a group whose
algorithm output is unusable (``algorithms.py``: wrong shape, NaN) is refused, logged and
counted, none of it trained.

On-policy distillation (``[orchestrator.teacher]``, ``teacher.py``): when an algorithm asks
for ``teacher_logprobs`` or ``teacher_topk``, the teacher is checked before anything is dispatched (same
tokenizer and vocabulary as the student, else the loop does not start) and scores each
group's samples as soon as the group completes (``teacher.score_ahead``; ``_prepare``: its
group rewards, then, unless the difficulty filter will refuse it, ``Algorithms.prefetch``;
a restarted orchestrator starts it for the groups its saved state holds complete), while
the trainer trains and other groups sample; cutting the batch waits only for what is still in flight,
and rebuilds each group with the version checks of that moment (the signals are used only
when they cover exactly the samples trained). A group whose teacher call fails is refused
and counted like any unusable algorithm output, never trained without the signal.

Evaluation during training (``[orchestrator.eval]``, ``evaluation.py``): a round's
rollouts have ids of their own (``e<step>-t<task>-<k>``), are collected like training
completions (saved before the ack, re-read or re-requested after a restart) into a
buffer of their own, and are never batched; they count in neither the gate nor
``max_groups_in_flight``. One round is in flight at a time; after the last step the
loop waits for the final round (the final policy) before it ends.

Durability: the state (``state.py``) is saved before requests are published, after
each completion is recorded (then acked), and after each BatchReady; request and
completion ids are deterministic, so a restart republishes what might be missing and
JetStream's duplicate window plus the trained-id ledger make the repeats no-ops. Saves
are group commits (``RLLoop.save``): one write covers every change made before it
began, and completions (``ROLLOUT_HANDLERS`` handled at once) wait up to
``COMMIT_WINDOW_S`` for others to share their write -- only their acks wait; the loop
sees a completion as soon as it is recorded, and whatever it publishes next saves first.

Bad input (design invariant 6): a completion that fails the sanity checks
(``samples.checked_samples``: token ids, versions not ahead of the last published step,
lengths) is recorded as an error rollout — its group completes, nothing of it is trained
— counted (metric ``rollouts_rejected_total``) and copied to the dead-letter subject. The policy
poller survives undecodable PolicyPublished messages (logged once per message). The
collector and the poller are supervised: if either ends, the loop ends with a clear
error. If the ROLLOUTS stream is deleted under the loop it ends with one clear error
rather than going on: completions it recorded could no longer be re-read after a restart.
The restart (which recreates the stream) finds such completions gone or replaced and
requests those rollouts again, so the deletion costs time, not data.

Tracing: each rollout is one trace, begun by its ``dispatch`` span; its completion comes
back in that trace (NATS headers). Each batch is a trace of its own: a ``batch`` span
linked to every rollout it holds, with the group scoring, packing and the BatchReady
publish under it (the trainer's step continues that trace). A group scored ahead of its
batch is a trace of its own (a ``prepare_group`` span linked to its rollouts, with its
group-reward request and ``teacher_call`` spans, each with the teacher's request spans),
which the ``batch`` span links. Rollout latency and policy
lag are also OpenTelemetry histograms (``latency.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import grpc
import nats.errors
import nats.js.errors
import numpy as np
from opentelemetry import trace

from treadle.orchestrator import evaluation
from treadle.orchestrator.algorithms import Algorithms, SignalProvider
from treadle.orchestrator.batching import batch_media_type, build_batch, top_k_of
from treadle.orchestrator.demos import Demos
from treadle.orchestrator.filtering import REASONS, refusal
from treadle.orchestrator.latency import LatencyInstruments, rollout_latency_stats
from treadle.orchestrator.mixture import EnvMixture, EnvTasks
from treadle.orchestrator.samples import (
    InvalidRollout,
    Sample,
    checked_samples,
    rollout_samples,
    trainable,
)
from treadle.orchestrator.served import ServedWatch
from treadle.orchestrator.spec import OrchestratorSection
from treadle.orchestrator.state import (
    EvalRound,
    GroupState,
    OrchestratorState,
    eval_group_id,
    group_id_at,
    group_rollout_ids,
    load_state,
    state_bytes,
    write_state,
)
from treadle.orchestrator.tasks import Cursor, load_tasks
from treadle.orchestrator.teacher import NoPrivilegedContext, Teacher, check_top_k
from treadle.proto.v1 import (
    batch_pb2,
    common_pb2,
    inference_service_pb2,
    inference_service_pb2_grpc,
    policy_pb2,
    rollout_pb2,
)
from treadle.services import bus_time, discovery, telemetry, usage
from treadle.services.bus import Delivery
from treadle.services.errors import (
    BusUnavailableError,
    ConfigError,
    DecodeError,
    IntegrityError,
    ObjectNotFoundError,
    TreadleError,
)
from treadle.services.host import ServiceContext
from treadle.services.inference_client import InferenceClient
from treadle.services.rendering import open_renderer
from treadle.services.rpc import open_channel

log = logging.getLogger(__name__)

INFERENCE = inference_service_pb2.DESCRIPTOR.services_by_name["InferenceAdmin"]
READY = common_pb2.SERVICE_STATE_READY
# consecutive all-dropped batches before the loop gives up with a clear error
MAX_EMPTY_BATCHES = 20
# how often a starting orchestrator asks whether inference answers (inference_wait_s)
INFERENCE_WAIT_POLL_S = 0.1
# completions handled at once, and how long one waits for others to share its state write
# (its ack waits that long; the loop does not). Handled one at a time, each completion's
# usage publish, state write (62 KB of JSON and an fsync on reverse-text) and ack ran in
# turn: a serial pipeline that held back sampling (README, issue 16 "Group commit")
ROLLOUT_HANDLERS = 64
COMMIT_WINDOW_S = 0.05


class RLLoop:
    """Owns the orchestrator's state while the service runs."""

    def __init__(self, ctx: ServiceContext, cfg: OrchestratorSection):
        if cfg.tasks is None and not cfg.lists_envs:
            raise ConfigError(
                "orchestrator.tasks is not set: point it at a JSONL file of tasks (or give "
                "each environment of the run its own, orchestrator.envs.<env>.tasks)"
            )
        self.ctx = ctx
        self.cfg = cfg
        self.env_tasks = [
            EnvTasks(e.name, load_tasks(e.tasks), e.weight)
            for e in cfg.run_envs()
            if e.tasks is not None
        ]
        ev = cfg.eval
        self.eval_tasks = load_tasks(ev.tasks)[: ev.num_tasks] if ev.tasks and ev.enabled else []
        self.eval_plan = evaluation.schedule(ev.every_steps, cfg.max_steps, ev.at_start)
        self.eval_buffer: dict[str, rollout_pb2.Rollout] = {}  # completed eval rollouts
        if ev.enabled and ev.rollouts_per_task > 1 and ev.sampling.temperature == 0:
            log.warning("orchestrator.eval.rollouts_per_task = %d with greedy sampling "
                        "(eval.sampling.temperature = 0): the k rollouts of a task are alike, "
                        "pass@k says little", ev.rollouts_per_task)  # fmt: skip
        # the algorithm of each environment; signal providers (e.g. a teacher) register here
        algorithms = cfg.resolve_algorithms()
        wants_teacher = any(a.asks_teacher for a in algorithms.values())
        self.teacher = Teacher(cfg.teacher) if wants_teacher and cfg.teacher.enabled else None
        providers: dict[str, SignalProvider] = {}
        if self.teacher is not None:
            self.teacher.vocab_size = cfg.vocab_size
            providers = {"teacher_logprobs": self.teacher, "teacher_topk": self.teacher.topk}
        # self-distillation: these environments' runners render privileged prompts
        self.privileged_envs = {
            env for env, a in algorithms.items() if a.asks_teacher and cfg.teacher.self_distill
        }
        self.algorithms = Algorithms(algorithms, providers)
        self.demos: Demos | None = None
        if cfg.demos.enabled:  # rendered now: a row the template cannot render stops here
            assert cfg.tokenizer is not None  # the spec requires it
            renderer = open_renderer(
                cfg.renderer, cfg.tokenizer, force=cfg.renderer_force, what="orchestrator.renderer"
            )
            self.demos = Demos(
                cfg.demos, renderer, cfg.seed, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size
            )
        self.state = OrchestratorState()
        self.buffer: dict[str, rollout_pb2.Rollout] = {}  # completed, not yet trained
        self.trained: set[str] = set()
        self.inference_version = 0  # the oldest version an inference replica serves
        self.inference_versions: dict[str, int] = {}  # per replica that answered (gRPC target)
        self.trainer_version = 0
        self.gated = False
        self.changed = asyncio.Event()
        self._save_lock = asyncio.Lock()
        self._changes = 0  # saves asked for so far
        self._durable = 0  # of those, the ones the last state write covered
        self._started = time.monotonic()
        self._completions: deque[float] = deque()  # completion times of the last 60 s
        self._empty_batches = 0
        self._refusals = dict.fromkeys(REASONS, 0)  # filter refusals since the last BatchReady
        self._refused_in_a_row = 0  # filter.action = resample: refused groups in a row
        self._group_scored: set[str] = set()  # groups whose group rewards were applied
        warn_s = cfg.warn_unserved_env_s
        self.served = ServedWatch(cfg.rollout_timeout_s + 60 if warn_s is None else warn_s)
        self._policy_error = ""  # the last undecodable PolicyPublished, logged once
        self.latency = LatencyInstruments(ctx.config.run.name)
        # buffered rollouts' completion spans (their traces), which the batch span links
        self._links: dict[str, trace.Link] = {}
        # groups made ready ahead of their batch (group rewards, signals: ``_prepare``):
        # group id -> the task (its result: failed group rewards) and its span's link
        self._ahead: dict[str, asyncio.Task[int]] = {}
        self._ahead_links: dict[str, trace.Link] = {}
        # an error found ahead that stops the run (a self-distilled environment without
        # privileged context): raised at once, not when its group's batch is cut
        self._fatal_ahead: NoPrivilegedContext | None = None

    # --- state ---------------------------------------------------------------------------
    async def save(self, within_s: float = 0.0) -> None:
        """Make the state as it is now durable (raises if the write fails). A group commit:
        one write covers every change made before it began, so callers arriving while a
        write is under way share the next one; with ``within_s`` the caller first waits
        that long for others to join (a write already covering it returns at once). The
        state is serialized here on the loop, a consistent snapshot; the put runs in a
        thread."""
        self._changes += 1
        wanted = self._changes
        if within_s > 0:
            await asyncio.sleep(within_s)
        async with self._save_lock:
            if self._durable >= wanted:
                return  # a write begun after this caller's change has made it durable
            covers = self._changes
            data = state_bytes(self.state)
            await asyncio.to_thread(write_state, self.ctx.store, data)
            self._durable = max(self._durable, covers)

    async def recover(self) -> None:
        """Load state, re-read buffered completions, adopt batches published before a crash,
        and republish requests that may not have reached the queue."""
        saved = await asyncio.to_thread(load_state, self.ctx.store)
        bus = self.ctx.bus
        info = await bus.js.stream_info(bus.subjects.stream_name("ROLLOUTS"))
        stream_created = str(info.created)
        if saved is None:
            log.info("[startup] fresh run: no saved orchestrator state")
            self.state.rollouts_stream = stream_created
            self.state.eval_next = evaluation.first_due(self.eval_plan, 0)
            return
        self.state = saved
        self.trained = set(saved.trained)
        if self.demos is not None:
            self.demos.seek(saved.demo_cursor)
        if saved.eval_next is None or (not self.eval_plan and saved.eval_next >= 0):
            # planned now (evaluation turned on, or off, since the last save)
            self.state.eval_next = evaluation.first_due(self.eval_plan, saved.step)
        if saved.eval_round is not None and not self.eval_plan:
            log.warning("[startup] orchestrator.eval is off now: the eval round of step %d "
                        "in flight is abandoned", saved.eval_round.step)  # fmt: skip
            self.state.eval_round = None
        # a ROLLOUTS stream recreated since the last save: completions published to the old
        # one and never recorded are gone with it, and their requests were consumed
        recreated = bool(saved.rollouts_stream) and saved.rollouts_stream != stream_created
        self.state.rollouts_stream = stream_created
        lost: dict[str, list[str]] = {}
        for group, is_eval in self._all_groups():
            for rid, seq in list(group.completed.items()):
                rollout = await self._reread(rid, seq)
                if rollout is None:  # requested again below
                    del group.completed[rid]
                    lost.setdefault(group.group_id, []).append(rid)
                    continue
                if rid in group.rejected:
                    _mark_error(rollout, "refused by the sanity checks when it arrived")
                (self.eval_buffer if is_eval else self.buffer)[rid] = rollout
                if is_eval:
                    self._links.pop(rid, None)  # eval rollouts are in no batch
        if lost:
            num_lost = sum(map(len, lost.values()))
            self.state.lost += num_lost
            log.warning(
                "[startup] %d completed rollouts can no longer be read from %s (the stream was "
                "deleted, or they expired): requesting them again",
                num_lost, bus.subjects.stream_name("ROLLOUTS"),
            )  # fmt: skip
        while True:  # batches published after the last save
            ready = await self._batch_after_restart(self.state.step + 1)
            if ready is None:
                break
            log.warning(
                "[startup] adopting BatchReady of step %d published before the restart", ready.step
            )
            self._mark_trained(ready.step, set(ready.rollout_ids))
            if self.demos is not None:  # its demonstrations were taken: go on after them
                self.demos.advance_past(ready.rollout_ids)
                self.state.demo_cursor = self.demos.cursor
        if recreated:
            log.warning("[startup] the %s stream was recreated since the last save: requesting "
                        "every rollout of the groups in flight that has no completion again",
                        bus.subjects.stream_name("ROLLOUTS"))  # fmt: skip
        for group, is_eval in self._all_groups():
            again = set(lost.get(group.group_id, ()))
            if recreated:
                again |= set(group.rollout_ids) - set(group.completed)
            await self._publish_requests(
                group, only_missing=True, again=frozenset(again), is_eval=is_eval
            )
        await self.save()
        in_eval = self.state.eval_round
        log.info(
            "[startup] resumed at step %d: %d groups in flight, %d completions buffered%s",
            self.state.step, len(self.state.groups), len(self.buffer),
            f"; the eval round of step {in_eval.step} ({len(self.eval_buffer)} of "
            f"{sum(len(g.rollout_ids) for g in in_eval.groups.values())} rollouts done)"
            if in_eval is not None else "",
        )  # fmt: skip

    def env_of(self, group: GroupState) -> str:
        """The environment a training group's rollouts run in."""
        return group.env or self.cfg.default_env  # "": saved before groups had one

    def mixture(self) -> EnvMixture:
        """The (environment, task) draw, where the saved state leaves it."""
        st = self.state
        if self.cfg.lists_envs:
            unknown = sorted(set(st.env_cursors) - {e.env for e in self.env_tasks})
            if unknown:
                log.warning("[startup] the saved state has task cursors of environments this "
                            "run no longer lists (%s): ignored", ", ".join(unknown))  # fmt: skip
            cursors = {env: Cursor(*at) for env, at in st.env_cursors.items()}
        else:
            cursors = {self.cfg.env: Cursor(st.epoch, st.position)}
        return EnvMixture(self.env_tasks, self.cfg.seed, draws=st.env_draws, cursors=cursors)

    def _all_groups(self) -> list[tuple[GroupState, bool]]:
        """Every group in flight, training and eval, with whether it is an eval group."""
        out = [(g, False) for g in self.state.groups.values()]
        if self.state.eval_round is not None:
            out += [(g, True) for g in self.state.eval_round.groups.values()]
        return out

    async def _reread(self, rid: str, seq: int) -> rollout_pb2.Rollout | None:
        """The completion of ``rid`` saved at ROLLOUTS ``seq``; None when it is gone, unreadable
        or another message took that sequence (a recreated stream)."""
        bus = self.ctx.bus
        try:
            raw = await bus.js.get_msg(bus.subjects.stream_name("ROLLOUTS"), seq=seq)
            done = await bus.decode_stored("ROLLOUTS", raw, rollout_pb2.RolloutCompleted)
        except nats.js.errors.NotFoundError:
            return None
        except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
            log.warning("[startup] completion of %s at ROLLOUTS seq %d is unreadable: %s",
                        rid, seq, e)  # fmt: skip
            return None
        if done.rollout.rollout_id != rid:
            return None
        if (link := telemetry.link_to(raw.headers)) is not None:
            self._links[rid] = link
        return done.rollout

    async def _batch_after_restart(self, step: int) -> batch_pb2.BatchReady | None:
        """A BatchReady of ``step`` published before a crash, if any. An undecodable message
        there (it was not ours) is dead-lettered and deleted, then ignored."""
        bus = self.ctx.bus
        stream = bus.subjects.stream_name("BATCHES")
        try:
            raw = await bus.js.get_last_msg(stream, bus.subjects.batches(step))
        except nats.js.errors.NotFoundError:
            return None
        try:
            ready = await bus.decode_stored("BATCHES", raw, batch_pb2.BatchReady)
        except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
            log.error(
                "[startup] %s seq %d is not a BatchReady this orchestrator published (%s): "
                "dead-lettered and deleted", raw.subject, raw.seq, e,
            )  # fmt: skip
            await bus.js.delete_msg(stream, raw.seq)
            return await self._batch_after_restart(step)
        if ready.step != step:
            log.error("[startup] %s seq %d carries step %d: dead-lettered and deleted",
                      raw.subject, raw.seq, ready.step)  # fmt: skip
            await bus.dead_letter("BATCHES", raw.subject, raw.seq, raw.data or b"",
                                  dict(raw.headers or {}), f"carries step {ready.step}")  # fmt: skip
            await bus.js.delete_msg(stream, raw.seq)
            return await self._batch_after_restart(step)
        return ready

    def _mark_trained(self, step: int, rollout_ids: set[str]) -> None:
        for gid in [
            g.group_id for g in self.state.groups.values() if set(g.rollout_ids) <= rollout_ids
        ]:
            del self.state.groups[gid]
            self._forget_ahead(gid)
        for rid in rollout_ids:
            self.buffer.pop(rid, None)
            self._links.pop(rid, None)
        self.trained |= rollout_ids
        self.state.trained.extend(sorted(rollout_ids))
        self.state.step = step

    # --- collecting ----------------------------------------------------------------------
    async def on_completed(self, msg: rollout_pb2.RolloutCompleted, delivery: Delivery) -> None:
        """Record a completion. No span of its own (a rollout's spans are its dispatch, the
        env runner's and vLLM's); its batch span links the trace the headers carry."""
        r = msg.rollout
        # its line in the usage ledger, before the ack: a crash in between records it again
        await usage.record(self.ctx.bus, "orchestrator", f"rollout/{r.rollout_id}",
                           self.ctx.config.run.billed_to, rollouts=1,
                           prompt_tokens=r.timing.prompt_tokens,
                           sampled_tokens=r.timing.sampled_tokens)  # fmt: skip
        if r.env:
            self.served.completed(r.env)
        group = self.state.groups.get(r.group_id)
        is_eval = False
        if group is None and self.state.eval_round is not None:
            group = self.state.eval_round.groups.get(r.group_id)
            is_eval = group is not None
        buffer = self.eval_buffer if is_eval else self.buffer
        if (
            r.rollout_id in self.trained
            or group is None
            or r.rollout_id not in group.rollout_ids
            or r.rollout_id in group.completed
        ):
            self.state.duplicates_ignored += 1
            log.debug("ignoring completion of %s (duplicate or unknown group)", r.rollout_id)
            return
        refusal: InvalidRollout | None = None
        try:
            checked_samples(r, max_policy_version=self.state.step, vocab_size=self.cfg.vocab_size)
        except InvalidRollout as e:
            # recorded as an error (its group completes; nothing of it trains), kept aside
            refusal = e
            self.state.rejected += 1
            group.rejected.append(r.rollout_id)
            _mark_error(r, f"refused by the sanity checks: {e}")
        # recorded before the next await: a copy handled beside it is a duplicate
        group.completed[r.rollout_id] = delivery.stream_seq
        buffer[r.rollout_id] = r
        if not is_eval:
            if (link := telemetry.link_to(delivery.headers)) is not None:
                self._links[r.rollout_id] = link  # the rollout's trace, which its batch links
            if group.done:  # before the loop can take it into a batch
                self._start_prepare(group)
        try:
            if refusal is not None:
                log.warning("refused completion %s seq %d (dead-lettered): %s",
                            r.rollout_id[:80], delivery.stream_seq, refusal)  # fmt: skip
                await self.ctx.bus.dead_letter(
                    "ROLLOUTS", delivery.subject, delivery.stream_seq, msg.SerializeToString(),
                    delivery.headers, f"refused: {refusal}",
                )  # fmt: skip
            # the loop may batch it now: whatever it publishes saves the state first
            self.changed.set()
            await self.save(within_s=COMMIT_WINDOW_S)  # durable before the ack
        except BaseException:
            # not recorded after all: forget it, or its redelivery would look like a
            # duplicate and be acked -- a completion lost, its group waiting forever
            del group.completed[r.rollout_id]
            buffer.pop(r.rollout_id, None)
            self._links.pop(r.rollout_id, None)
            if not is_eval:  # it is not complete after all
                self._forget_ahead(group.group_id)
            if refusal is not None:
                self.state.rejected -= 1
                group.rejected.remove(r.rollout_id)
            raise
        if is_eval:  # not in the training latency histograms, nor in any batch's links
            return
        self.latency.record_rollout(r)
        now = time.monotonic()
        self._completions.append(now)
        while now - self._completions[0] > 60:
            self._completions.popleft()

    # --- dispatching ---------------------------------------------------------------------
    def _landing_step(self) -> int:
        pending = len(self.state.groups)
        return self.state.step + 1 + pending // self.cfg.groups_per_step

    def can_dispatch(self) -> bool:
        in_flight = sum(not g.done for g in self.state.groups.values())
        if in_flight >= self.cfg.max_groups_in_flight:
            return False
        landing = self._landing_step()
        if landing > self.cfg.max_steps:
            return False
        self.gated = (landing - 1) - self.inference_version > self.cfg.max_async_level
        return not self.gated

    async def dispatch_group(self, mixture: EnvMixture) -> GroupState:
        env, task = mixture.next()
        gid = group_id_at(self.state.next_group)
        group = GroupState(
            group_id=gid,
            task_id=task.task_id,
            task_json=task.json,
            rollout_ids=group_rollout_ids(gid, self.cfg.group_size),
            dispatched_version=self.inference_version,
            env=env,
        )
        self.state.next_group += 1
        self.state.groups[gid] = group
        self.state.env_draws = mixture.draws
        cursors = mixture.cursors
        if self.cfg.lists_envs:
            self.state.env_cursors = {e: [c.epoch, c.position] for e, c in cursors.items()}
        else:
            self.state.epoch, self.state.position = cursors[env].epoch, cursors[env].position
        await self.save()  # durable before anything is published
        await self._publish_requests(group, only_missing=False)
        return group

    async def _publish_requests(
        self,
        group: GroupState,
        *,
        only_missing: bool,
        again: frozenset[str] = frozenset(),
        is_eval: bool = False,
    ) -> None:
        """Publish the group's requests (``only_missing``: those not completed). Rollouts in
        ``again`` ran before but their completion was lost: a fresh Nats-Msg-Id, or the
        stream's duplicate window would drop the new request. ``is_eval``: a group of the
        eval round (its environment and sampling, labelled split=eval)."""
        if is_eval:
            assert self.state.eval_round is not None
            s, env, split = (
                self.cfg.eval.sampling.resolved(self.cfg.sampling),
                self.state.eval_round.env,
                "eval",
            )
        else:
            s, env, split = self.cfg.sampling, self.env_of(group), "train"
        subject = self.ctx.bus.subjects.rollouts_requested(env)
        self.served.requested(env, time.monotonic())
        tracer = telemetry.tracer(__name__)
        for k, rid in enumerate(group.rollout_ids):
            if only_missing and rid in group.completed:
                continue
            req = rollout_pb2.RolloutRequested(
                rollout_id=rid,
                group_id=group.group_id,
                group_index=k,
                group_size=len(group.rollout_ids),
                env=env,
                task_id=group.task_id,
                task_json=group.task_json,
                sampling=rollout_pb2.SamplingParams(
                    temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens
                ),
                policy_version=group.dispatched_version,
                timeout_s=self.cfg.rollout_timeout_s,
                labels={"split": split},
                want_privileged_prompts=not is_eval and env in self.privileged_envs,
            )
            req.requested_at.GetCurrentTime()
            msg_id = f"{rid}.again{time.time_ns()}" if rid in again else rid
            with tracer.start_as_current_span(
                "dispatch", context=telemetry.new_trace(),  # the rollout's trace begins
                attributes={"treadle.rollout_id": rid, "treadle.group_id": group.group_id,
                            "treadle.env": env, "treadle.run": self.ctx.config.run.name,
                            "treadle.split": split,
                            "treadle.policy_version": group.dispatched_version,
                            "treadle.requested_again": rid in again or only_missing},
            ):  # fmt: skip
                await self.ctx.bus.publish(subject, req, msg_id=msg_id)

    # --- evaluation ----------------------------------------------------------------------
    def eval_pending(self) -> bool:
        """An eval round is in flight or still planned."""
        return self.state.eval_round is not None or (self.state.eval_next or -1) >= 0

    async def maybe_dispatch_eval(self) -> bool:
        """Dispatch the eval round that is due, if any: the orchestrator has published its
        step and inference serves that policy (or a newer one); one round at a time."""
        next_due = self.state.eval_next
        if self.state.eval_round is not None or next_due is None or next_due < 0:
            return False
        reached = min(self.state.step, self.inference_version)
        due = evaluation.due_now(self.eval_plan, next_due, reached)
        if due is None:
            return False
        step, skipped = due
        if skipped:
            log.warning("eval: %d planned rounds (steps %d..) skipped: the previous round took "
                        "longer than orchestrator.eval.every_steps steps; evaluating step %d",
                        skipped, next_due, step)  # fmt: skip
        ev = self.cfg.eval
        rnd = EvalRound(
            step=step,
            dispatch_step=self.state.step,
            dispatched_version=self.inference_version,
            env=ev.env or self.cfg.default_env,
            dispatched_at=time.time(),
            rounds_skipped=skipped,
        )
        for i, task in enumerate(self.eval_tasks):
            gid = eval_group_id(step, i)
            rnd.groups[gid] = GroupState(
                group_id=gid,
                task_id=task.task_id,
                task_json=task.json,
                rollout_ids=group_rollout_ids(gid, ev.rollouts_per_task),
                dispatched_version=self.inference_version,
                env=rnd.env,
            )
        self.state.eval_round = rnd
        self.state.eval_next = evaluation.next_after(self.eval_plan, step)
        await self.save()  # durable before anything is published
        log.info("eval: round of step %d dispatched (%d tasks x %d, policy version %d served)",
                 step, len(rnd.groups), ev.rollouts_per_task, self.inference_version)  # fmt: skip
        for group in rnd.groups.values():
            await self._publish_requests(group, only_missing=False, is_eval=True)
        return True

    async def maybe_finish_eval(self) -> bool:
        """Once every rollout of the eval round completed (errors included): its metrics
        row (eval/ keys, at the round's step) and its rollouts (eval/step-<N>.jsonl in the
        object store); both before the round leaves the saved state, so a crash in between
        repeats them rather than losing them."""
        rnd = self.state.eval_round
        if rnd is None or not rnd.done:
            return False
        ev = self.cfg.eval
        group_errors = 0
        if ev.rollouts_per_task > 1:  # as `treadle eval`: group rewards of each task's rollouts
            for g in rnd.groups.values():
                g.env = g.env or rnd.env  # saved before eval groups had one
                valid = [self.eval_buffer[rid] for rid in g.rollout_ids]
                valid = [r for r in valid if trainable(r)]
                if valid and g.group_id not in self._group_scored:
                    with telemetry.tracer(__name__).start_as_current_span(
                        "score_group", attributes={"treadle.group_id": g.group_id,
                                                   "treadle.num_rollouts": len(valid),
                                                   "treadle.split": "eval"},
                    ):  # fmt: skip
                        group_errors += await self._score_group(g, valid)
                    self._group_scored.add(g.group_id)
        done = []
        for g in rnd.groups.values():
            for k, rid in enumerate(g.rollout_ids):
                r = self.eval_buffer[rid]
                try:
                    samples = rollout_samples(r) if trainable(r) else []
                except DecodeError:  # refused when it arrived: an error rollout already
                    samples = []
                done.append(evaluation.EvalRollout(g.task_id, k, r, samples))
        values = evaluation.round_metrics(done, k=ev.rollouts_per_task, pass_reward=ev.pass_reward)
        values |= {
            "eval/num_group_reward_errors": float(group_errors),
            "eval/dispatch_step": float(rnd.dispatch_step),
            "eval/duration_s": max(0.0, time.time() - rnd.dispatched_at),
            "eval/num_rounds_skipped": float(rnd.rounds_skipped),
        }
        rows = evaluation.result_rows(rnd.step, done, ev.pass_reward)
        key = evaluation.results_key(rnd.step)
        await asyncio.to_thread(self.ctx.store.put_bytes, key, rows, "application/x-ndjson")
        await self.ctx.report_metrics(rnd.step, values)
        self.state.eval_round = None
        for g in rnd.groups.values():
            self._group_scored.discard(g.group_id)
            for rid in g.rollout_ids:
                self.eval_buffer.pop(rid, None)
        await self.save()
        log.info(
            "eval: step %d: reward %.3f, pass@1 %.3f over %d rollouts (%d errors), policy "
            "version %d; rollouts in %s",
            rnd.step, values.get("eval/reward_mean", 0.0), values.get("eval/pass@1", 0.0),
            len(done), int(values["eval/num_rollouts_error"]),
            int(values.get("eval/policy_version", -1)), key,
        )  # fmt: skip
        return True

    # --- batching ------------------------------------------------------------------------
    def ready_groups(self) -> list[GroupState]:
        return [g for g in self.state.groups.values() if g.done]

    async def maybe_publish_batch(self) -> bool:
        ready = self.ready_groups()
        if len(ready) < self.cfg.groups_per_step:
            return False
        take = ready[: self.cfg.groups_per_step]
        step = self.state.step + 1
        rollout_ids = [rid for g in take for rid in g.rollout_ids]
        links = [link for rid in rollout_ids if (link := self._links.get(rid)) is not None]
        links += [link for g in take if (link := self._ahead_links.get(g.group_id)) is not None]
        with telemetry.tracer(__name__).start_as_current_span(
            "batch", context=telemetry.new_trace(),  # a trace of its own, linked to each rollout
            links=links,  # and to each group's preparation ahead of it (teacher calls)
            attributes={"treadle.step": step, "treadle.run": self.ctx.config.run.name,
                        "treadle.num_groups": len(take), "treadle.num_rollouts": len(rollout_ids)},
        ) as span:  # fmt: skip
            return await self._publish_batch(take, step, span)

    async def _publish_batch(self, take: list[GroupState], step: int, span: trace.Span) -> bool:
        started = time.monotonic()
        group_errors = await self._prepared(take)
        group_errors += await self.apply_group_rewards(take)
        if self.cfg.filter.action == "resample" and await self._resample_refused(take):
            return True  # new groups take the refused ones' places before the batch is cut
        samples, stats = await self.samples_of(take, step)
        stats["num_group_reward_errors"] = float(group_errors)
        span.set_attribute("treadle.num_samples", len(samples))
        span.set_attribute(
            "treadle.num_samples_dropped_stale", int(stats["num_samples_dropped_stale"])
        )
        if not samples:
            self._empty_batches += 1
            if self._empty_batches >= MAX_EMPTY_BATCHES:
                raise TreadleError(
                    f"step {step}: every sample of the last {self._empty_batches} batches was dropped "
                    f"(stale: oldest tokens older than {self.cfg.max_off_policy_steps} steps, errors, "
                    "or groups refused by orchestrator.filter or the algorithm); "
                    f"inference reports policy version {self.inference_version}: check that it serves "
                    "the trainer's policies, and the env runners' logs"
                )
            log.warning(
                "step %d: every sample of %d groups was dropped; sampling new groups",
                step,
                len(take),
            )
            for g in take:
                del self.state.groups[g.group_id]
                self._forget_ahead(g.group_id)
                for rid in g.rollout_ids:
                    self.buffer.pop(rid, None)
            await self.save()
            return True
        self._empty_batches = 0
        if self.demos is not None:  # beside the sampled ones, never alone (demos.py)
            demos = self.demos.take(top_k_of(samples) or 1)
            samples += demos
            stats["num_demos"] = float(len(demos))
            self.state.demo_cursor = self.demos.cursor
        tracer = telemetry.tracer(__name__)
        with tracer.start_as_current_span("pack"):
            built = build_batch(
                step,
                samples,
                seq_len=self.cfg.seq_len,
                num_ranks=self.cfg.num_ranks,
                pad_token_id=self.cfg.pad_token_id,
                temperature=self.cfg.sampling.temperature,
            )
            with bus_time.timed("encode"):
                payload = built.batch.SerializeToString()
        with (
            tracer.start_as_current_span("store_batch", attributes={"treadle.bytes": len(payload)}),
            bus_time.timed("claim_check"),
        ):  # the BatchReady carries its reference
            ref = await asyncio.to_thread(
                self.ctx.store.put_bytes, f"batches/step{step:06d}", payload, batch_media_type()
            )
        built.ready.data.CopyFrom(ref)
        stats["truncated_samples"] = float(built.num_truncated)
        stats["batch_build_s"] = time.monotonic() - started
        built.ready.metrics.update(stats)
        await self.ctx.bus.publish(
            self.ctx.bus.subjects.batches(step), built.ready, msg_id=f"batch-{step}"
        )
        self._mark_trained(step, {g for grp in take for g in grp.rollout_ids})
        self._refusals = dict.fromkeys(REASONS, 0)  # reported with this step
        await self.save()
        stats.update(self.gauges())
        await self.ctx.report_metrics(step, stats)
        log.info(
            "step %d: %d samples, %d tokens, reward %.3f, lag %.2f",
            step, built.ready.num_samples, built.ready.num_tokens, stats.get("reward_mean", 0.0), stats.get("policy_lag_mean", 0.0),
        )  # fmt: skip
        return True

    # --- ahead of the batch ------------------------------------------------------------
    def _start_prepare(self, g: GroupState) -> None:
        """A training group just completed: when its algorithm reads per-token signals (a
        teacher's logprobs), apply its group rewards and fetch its signals now, while the
        trainer trains, instead of when its batch is cut (``Algorithms.prefetch``)."""
        if (
            g.group_id in self._ahead
            or not self.cfg.teacher.score_ahead
            or not self.algorithms.reads_signals(self.env_of(g))
        ):
            return
        self._ahead[g.group_id] = asyncio.create_task(
            self._prepare(g), name=f"prepare {g.group_id}"
        )

    async def _prepare(self, g: GroupState) -> int:
        """Group rewards and signals of ``g`` ahead of its batch; the failed group rewards.
        A span of its own trace (the teacher's calls are its children), which the batch
        span links. Nothing is fetched for a group the filter will refuse."""
        with telemetry.tracer(__name__).start_as_current_span(
            "prepare_group", context=telemetry.new_trace(),
            links=[link for rid in g.rollout_ids if (link := self._links.get(rid)) is not None],
            attributes={"treadle.group_id": g.group_id, "treadle.run": self.ctx.config.run.name,
                        "treadle.num_rollouts": len(g.rollout_ids)},
        ) as span:  # fmt: skip
            self._ahead_links[g.group_id] = trace.Link(span.get_span_context())
            failed = await self.apply_group_rewards([g])
            valid = [self.buffer[rid] for rid in g.rollout_ids if trainable(self.buffer[rid])]
            if self.cfg.filter.action != "keep" and refusal(
                np.array([r.reward for r in valid]), self.cfg.filter
            ):
                return failed
            fetch = self.algorithms.prefetch(
                self.env_of(g), g.group_id, g.task_json, valid,
                max_policy_version=self.state.step, vocab_size=self.cfg.vocab_size,
            )  # fmt: skip
            if fetch is not None:
                await asyncio.wait({fetch})  # its outcome is the batch's: ``score`` takes it
                error = None if fetch.cancelled() else fetch.exception()
                if isinstance(error, NoPrivilegedContext) and self._fatal_ahead is None:
                    self._fatal_ahead = error
                    self.changed.set()
            return failed

    async def _prepared(self, take: list[GroupState]) -> int:
        """Wait for the preparation of the groups of ``take`` started ahead (module doc);
        their failed group rewards."""
        tasks = [t for g in take if (t := self._ahead.pop(g.group_id, None)) is not None]
        return sum(await asyncio.gather(*tasks)) if tasks else 0

    def _forget_ahead(self, group_id: str) -> None:
        task = self._ahead.pop(group_id, None)
        if task is not None and not task.done():
            task.cancel()
        self._ahead_links.pop(group_id, None)
        self.algorithms.forget(group_id)
        if self.teacher is not None:
            self.teacher.forget(group_id)

    async def _stop_ahead(self) -> None:
        tasks = list(self._ahead.values())
        self._ahead.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.algorithms.aclose()

    async def apply_group_rewards(self, groups: list[GroupState]) -> int:
        """Ask an env runner for the group rewards of each complete group (once per group
        per process: after a restart the buffer is rebuilt from the stream and the rewards
        are computed again). No responder: the environment has none. A failed group
        reward makes its group's rollouts errors (not trained). Returns failed groups."""
        failed = 0
        for g in groups:
            if g.group_id in self._group_scored:
                continue
            valid = [self.buffer[rid] for rid in g.rollout_ids if trainable(self.buffer[rid])]
            if not valid:
                continue
            with telemetry.tracer(__name__).start_as_current_span(
                "score_group", attributes={"treadle.group_id": g.group_id,
                                           "treadle.num_rollouts": len(valid)},
            ):  # fmt: skip
                failed += await self._score_group(g, valid)
            self._group_scored.add(g.group_id)
        return failed

    async def _score_group(self, g: GroupState, valid: list[rollout_pb2.Rollout]) -> int:
        """Group rewards of one group applied to ``valid``; 1 when they failed, else 0."""
        bus = self.ctx.bus
        env = self.env_of(g)
        subject = bus.subjects.groups_score(env)
        req = rollout_pb2.GroupScoreRequest(env=env, group_id=g.group_id, task_json=g.task_json)
        for r in valid:
            light = req.rollouts.add()
            light.CopyFrom(r)
            for n in light.nodes:  # scoring reads text: token arrays stay here
                for f in ("token_ids", "sampled_mask", "logprobs", "policy_versions"):
                    n.ClearField(f)
        error = ""
        try:
            reply = await bus.request(subject, req, rollout_pb2.GroupScoreReply,
                                      timeout_s=self.cfg.group_reward_timeout_s)  # fmt: skip
        except TreadleError as e:
            reply, error = None, f"group rewards unavailable: {e}"
        if reply is not None and not reply.error:
            answered = [x.rollout_id for x in reply.rollouts]
            if answered != [r.rollout_id for r in valid]:
                error = f"group reward reply names {answered[:3]}..., not the group's rollouts"
            else:
                for r, got in zip(valid, reply.rollouts, strict=True):
                    r.rewards.extend(got.rewards)
                    r.metrics.update(got.metrics)
                    r.reward += sum(x.value * x.weight for x in got.rewards)
        elif reply is not None:
            error = reply.error
        if not error:
            return 0
        log.warning("group %s: %s; its rollouts are not trained", g.group_id, error)
        for r in valid:
            r.status.CopyFrom(rollout_pb2.RolloutStatus(
                kind=rollout_pb2.RolloutStatus.Kind.KIND_ERROR,
                error_kind=rollout_pb2.RolloutStatus.ErrorKind.ERROR_KIND_REWARD,
                message=error[:2000],
            ))  # fmt: skip
        return 1

    async def _resample_refused(self, take: list[GroupState]) -> bool:
        """filter.action = resample: forget the groups of ``take`` the filter refuses (their
        places go to new groups); True when there were any."""
        refused = []
        for g in take:
            rewards = [
                self.buffer[rid].reward for rid in g.rollout_ids if trainable(self.buffer[rid])
            ]
            why = refusal(np.array(rewards), self.cfg.filter)
            if not why:
                self._refused_in_a_row = 0
                continue
            refused.append(g)
            self._refusals[why] += 1
            self._refused_in_a_row += 1
            log.info("group %s refused by the filter (%s): resampled", g.group_id, why)
        if self._refused_in_a_row >= self.cfg.filter.max_refused_in_a_row:
            raise TreadleError(
                f"the last {self._refused_in_a_row} completed groups were all refused by "
                "orchestrator.filter (every reward equal, or a pass rate outside "
                f"[{self.cfg.filter.min_pass_rate}, {self.cfg.filter.max_pass_rate}]): the tasks "
                "are too easy or too hard for this policy; widen the filter or change the tasks"
            )
        for g in refused:
            del self.state.groups[g.group_id]
            self._group_scored.discard(g.group_id)
            self._forget_ahead(g.group_id)
            for rid in g.rollout_ids:
                self.buffer.pop(rid, None)
                self._links.pop(rid, None)
        self.state.groups_filtered += len(refused)
        if refused:
            await self.save()
        return bool(refused)

    async def samples_of(
        self, groups: list[GroupState], step: int
    ) -> tuple[list[Sample], dict[str, float]]:
        """Samples (with per-token advantages from the environment's algorithm) of complete
        groups the filter lets through, and the step's metrics (with several environments,
        also each environment's: ``env/<env>/...``)."""
        samples: list[Sample] = []
        rewards: list[float] = []
        errors = truncated = stale = too_few = refused = 0
        lags: list[int] = []
        every: list[rollout_pb2.Rollout] = []
        per_env = {env: _EnvStep() for env in self.cfg.env_names}
        for g in groups:
            env = self.env_of(g)
            mine = per_env.setdefault(env, _EnvStep())
            mine.num_groups += 1
            rollouts = [self.buffer[rid] for rid in g.rollout_ids]
            every += rollouts
            valid = [r for r in rollouts if trainable(r)]
            errors += len(rollouts) - len(valid)
            mine.num_errors += len(rollouts) - len(valid)
            truncated += sum(
                r.status.kind == rollout_pb2.RolloutStatus.Kind.KIND_TRUNCATED for r in valid
            )
            rewards += [r.reward for r in valid]
            mine.rewards += [r.reward for r in valid]
            why = refusal(np.array([r.reward for r in valid]), self.cfg.filter)
            if why:
                self._refusals[why] += 1
                mine.num_refused += 1
                if self.cfg.filter.action != "keep":
                    self.state.groups_filtered += 1
                    continue
            scored = await self.algorithms.score(
                env, g.group_id, g.task_json, valid,
                max_policy_version=step - 1, vocab_size=self.cfg.vocab_size,
            )  # fmt: skip
            errors += scored.num_errors
            mine.num_errors += scored.num_errors
            too_few += scored.too_few
            refused += bool(scored.refused)
            mine.num_refused += bool(scored.refused)
            for smp in scored.samples:
                oldest = smp.min_policy_version
                if oldest >= 0:
                    lag = (step - 1) - oldest
                    if lag > self.cfg.max_off_policy_steps:
                        stale += 1
                        mine.num_stale += 1
                        continue
                    lags.append(lag)
                    mine.lags.append(lag)
                samples.append(smp)
                mine.num_samples += 1
                mine.num_tokens += smp.num_tokens
        self.state.dropped_stale += stale
        self.state.dropped_errors += errors
        self.state.groups_refused += refused
        for env, mine in per_env.items():
            if mine.num_groups:
                self.latency.record_samples(env, mine.lags, mine.num_stale)
        rw = np.array(rewards) if rewards else np.zeros(1)
        stats = {
            "reward_mean": float(rw.mean()),
            "reward_std": float(rw.std()),
            "reward_max": float(rw.max()),
            "num_groups": float(len(groups)),
            "num_samples": float(len(samples)),
            "num_rollouts_error": float(errors),
            "num_rollouts_truncated": float(truncated),
            "num_samples_dropped_stale": float(stale),
            "num_groups_too_few_rollouts": float(too_few),
            "num_groups_refused_by_algorithm": float(refused),
            **{f"num_groups_{why}": float(n) for why, n in self._refusals.items()},
            "policy_lag_mean": float(np.mean(lags)) if lags else 0.0,
            "policy_lag_max": float(max(lags)) if lags else 0.0,
            "num_tokens": float(sum(s.num_tokens for s in samples)),
            **rollout_latency_stats(every),
        }
        if len(per_env) > 1:
            for env, mine in per_env.items():
                stats |= mine.metrics(f"env/{env}/")
        if self.teacher is not None:
            stats |= self.teacher.take_metrics([g.group_id for g in groups])
        return samples, stats

    def gauges(self) -> dict[str, float]:
        now = time.monotonic()
        recent = [t for t in self._completions if now - t < 60]
        return {
            "inference_version": float(self.inference_version),
            "inference_replicas_answering": float(len(self.inference_versions)),
            "groups_in_flight": float(sum(not g.done for g in self.state.groups.values())),
            "rollouts_buffered": float(len(self.buffer)),
            "rollouts_per_s": len(recent) / max(1e-9, min(60.0, now - self._started)),
            "dropped_stale_total": float(self.state.dropped_stale),
            "rollouts_rejected_total": float(self.state.rejected),
            "rollouts_lost_total": float(self.state.lost),
            "rollouts_duplicate_total": float(self.state.duplicates_ignored),
            "groups_filtered_total": float(self.state.groups_filtered),
            "groups_refused_by_algorithm_total": float(self.state.groups_refused),
            **(
                {"teacher_errors_total": float(self.teacher.errors_total)}
                if self.teacher is not None
                else {}
            ),
            **self.ctx.bus.stats.metrics(),
        }

    # --- policy version ------------------------------------------------------------------
    async def poll_versions(self, stop: asyncio.Event) -> None:
        channels = {
            target: open_channel(target, [INFERENCE], default_timeout_s=5)
            for target in self.cfg.inference_grpc
        }
        silent: set[str] = set()  # replicas whose silence was logged
        try:
            while not stop.is_set():
                try:
                    last = await self.ctx.bus.last(
                        "POLICY", self.ctx.bus.subjects.policy_published, policy_pb2.PolicyPublished
                    )
                    if last is not None:
                        self.trainer_version = last.policy_version
                    if self.cfg.inference_discovery:
                        await self._follow_announced(channels)
                    if channels:
                        version = await self._oldest_served(channels, silent)
                    else:  # no inference to ask: assume it follows the trainer
                        version = self.trainer_version
                    if version is not None and version != self.inference_version:
                        self.inference_version = version
                        self.changed.set()
                    self._policy_error = ""
                except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
                    if str(e) != self._policy_error:  # once per message: it stays until replaced
                        log.error("undecodable PolicyPublished (dead-lettered; the gate keeps "
                                  "trainer version %d): %s", self.trainer_version, e)  # fmt: skip
                        self._policy_error = str(e)
                except (TreadleError, nats.errors.Error, OSError, TimeoutError) as e:
                    log.warning("policy version unavailable (%s: %s); polling again",
                                type(e).__name__, e)  # fmt: skip
                await _sleep_or_stop(stop, self.cfg.status_poll_s)
        finally:
            for channel in channels.values():
                await channel.close()

    async def _follow_announced(self, channels: dict[str, grpc.aio.Channel]) -> None:
        """Open channels to the inference replicas announced in NATS, close the ones no
        longer announced (listed replicas stay)."""
        announced = {a.grpc: a for a in await discovery.announced(self.ctx.bus)}
        listed = set(self.cfg.inference_grpc)
        for target in sorted(announced.keys() - channels.keys()):
            log.info("inference %s announced itself; the gate asks it too", target)
            channels[target] = open_channel(
                target, [INFERENCE], default_timeout_s=5, tls_name=announced[target].tls_name
            )
        for target in sorted(channels.keys() - announced.keys() - listed):
            log.info("inference %s is no longer announced; the gate leaves it out", target)
            await channels.pop(target).close()

    async def _oldest_served(
        self, channels: dict[str, grpc.aio.Channel], silent: set[str]
    ) -> int | None:
        """The oldest policy version the inference replicas that answer serve (a replica
        that does not answer is not serving); None when none answers."""
        targets = list(channels)
        # named: a deployment hosting several runs answers for this run's adapter
        request = common_pb2.GetStatusRequest(run=self.ctx.config.run.name)
        answers = await asyncio.gather(
            *(inference_service_pb2_grpc.InferenceAdminStub(channels[t]).GetStatus(request)
              for t in targets),
            return_exceptions=True,
        )  # fmt: skip
        versions: dict[str, int] = {}
        for target, answer in zip(targets, answers, strict=True):
            if isinstance(answer, grpc.aio.AioRpcError):
                if target not in silent:
                    log.warning("inference %s does not answer its status (%s); the gate leaves "
                                "it out", target, answer.code().name)  # fmt: skip
                    silent.add(target)
                continue
            if isinstance(answer, BaseException):
                raise answer
            if target in silent:
                log.info("inference %s answers again (policy version %d)", target,
                         answer.policy_version)  # fmt: skip
                silent.discard(target)
            versions[target] = max(0, answer.policy_version)
        self.inference_versions = versions
        if not versions:
            return None
        return min(versions.values())

    # --- the loop ------------------------------------------------------------------------
    async def check_teacher(self) -> None:
        """The teacher's tokenizer and vocabulary against the student's inference server
        (ConfigError naming both when they differ), before anything is dispatched."""
        assert self.teacher is not None
        url = self.cfg.teacher.student_url
        student = InferenceClient(url, timeout_s=30) if url else None
        try:
            await self.teacher.check_tokenizer(
                student, self.cfg.vocab_size, f"the student's inference {url}"
            )
            if any("teacher_topk" in a.signals for a in self.algorithms.by_env.values()):
                await check_top_k(self.teacher.servers, self.cfg.teacher.top_k, self.teacher.name)
        except BaseException:
            await self.teacher.aclose()
            raise
        finally:
            if student is not None:
                await student.aclose()

    async def wait_for_inference(self, stop: asyncio.Event) -> None:
        """Until one of ``inference_grpc`` serves a policy, for at most ``inference_wait_s``
        (then on regardless: the gate leaves a silent replica out)."""
        started = time.monotonic()
        request = common_pb2.GetStatusRequest(run=self.ctx.config.run.name)
        channels = [
            open_channel(target, [INFERENCE], default_timeout_s=2)
            for target in self.cfg.inference_grpc
        ]
        log.info("[startup] waiting for inference (%s) to serve before the first dispatch",
                 ", ".join(self.cfg.inference_grpc))  # fmt: skip
        try:
            while not stop.is_set():
                answers = await asyncio.gather(
                    *(inference_service_pb2_grpc.InferenceAdminStub(c).GetStatus(request)
                      for c in channels),
                    return_exceptions=True,
                )  # fmt: skip
                for answer in answers:
                    if isinstance(answer, BaseException) and not isinstance(
                        answer, grpc.aio.AioRpcError
                    ):
                        raise answer
                waited = time.monotonic() - started
                # while it starts the service answers too: STARTING (or no policy yet: -1)
                if any(not isinstance(a, BaseException) and a.info.state == READY
                       and a.policy_version >= 0 for a in answers):  # fmt: skip
                    log.info("[startup] inference serves after %.1fs", waited)
                    return
                if waited > self.cfg.inference_wait_s:
                    log.warning("[startup] inference does not serve after %.0fs "
                                "(orchestrator.inference_wait_s); dispatching regardless",
                                self.cfg.inference_wait_s)  # fmt: skip
                    return
                await _sleep_or_stop(stop, INFERENCE_WAIT_POLL_S)
        finally:
            for channel in channels:
                await channel.close()

    async def run(self, stop: asyncio.Event) -> None:
        if self.cfg.inference_wait_s and self.cfg.inference_grpc:
            await self.wait_for_inference(stop)
        if self.teacher is not None:
            await self.check_teacher()
        await self.recover()
        for group in list(self.state.groups.values()):
            if group.done:  # completed before a restart: prepared ahead like the others
                self._start_prepare(group)
        mixture = self.mixture()
        consumer = await self.ctx.bus.consumer(
            "ROLLOUTS",
            "orchestrator",
            self.ctx.bus.subjects.rollouts_completed,
            rollout_pb2.RolloutCompleted,
        )
        inner_stop = asyncio.Event()
        collector = asyncio.create_task(
            consumer.run(
                self.on_completed, inner_stop, fetch_timeout_s=0.5, concurrency=ROLLOUT_HANDLERS
            )
        )
        poller = asyncio.create_task(self.poll_versions(inner_stop))
        try:
            final_logged = False
            while not stop.is_set() and (
                self.state.step < self.cfg.max_steps or self.eval_pending()
            ):
                _honour_lost_cancel()
                for warning in self.served.due(time.monotonic()):
                    log.warning("%s", warning)
                progressed = False
                if self.state.step < self.cfg.max_steps:
                    progressed = await self.maybe_publish_batch()
                elif not final_logged:
                    final_logged = True
                    log.info("[shutdown] all %d steps published; waiting for the last eval "
                             "round (inference serves policy %d)", self.cfg.max_steps,
                             self.inference_version)  # fmt: skip
                progressed |= await self.maybe_finish_eval()
                progressed |= await self.maybe_dispatch_eval()
                while self.can_dispatch():
                    await self.dispatch_group(mixture)
                    progressed = True
                if not progressed:
                    self.changed.clear()
                    await _wait_any(stop, self.changed, within_s=1.0)
                _check_alive(collector, "the ROLLOUTS consumer")
                _check_alive(poller, "the policy version poller")
                if self._fatal_ahead is not None:
                    raise self._fatal_ahead
            if self.state.step >= self.cfg.max_steps:
                log.info("[shutdown] all %d steps published", self.cfg.max_steps)
        finally:
            inner_stop.set()
            await asyncio.gather(collector, poller, return_exceptions=True)
            await self._stop_ahead()
            await self.save()
            if self.teacher is not None:
                await self.teacher.aclose()

    def status(self) -> dict[str, Any]:
        return {
            "step": self.state.step,
            "trainer_step": self.trainer_version,
            "inference_policy_version": self.inference_version,
            "num_groups_in_flight": sum(not g.done for g in self.state.groups.values()),
            "num_rollouts_buffered": len(self.buffer),
            "num_rollouts_dropped_stale": self.state.dropped_stale,
            "dispatch_gated": self.gated,
        }


@dataclass
class _EnvStep:
    """One environment's share of a step's groups (its ``env/<env>/`` metrics)."""

    num_groups: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    num_errors: int = 0  # rollouts not trained: error status, or samples that failed checks
    num_stale: int = 0  # samples dropped as too old
    num_refused: int = 0  # groups refused by the filter or the algorithm
    rewards: list[float] = field(default_factory=list)  # trainable rollouts' rewards
    lags: list[int] = field(default_factory=list)  # policy lag of each kept sample

    def metrics(self, prefix: str) -> dict[str, float]:
        out = {
            f"{prefix}num_groups": float(self.num_groups),
            f"{prefix}num_samples": float(self.num_samples),
            f"{prefix}num_tokens": float(self.num_tokens),
            f"{prefix}num_rollouts_error": float(self.num_errors),
            f"{prefix}num_samples_dropped_stale": float(self.num_stale),
            f"{prefix}num_groups_refused": float(self.num_refused),
        }
        if self.rewards:  # no reward of an environment without trainable rollouts this step
            rw = np.array(self.rewards)
            out |= {
                f"{prefix}reward_mean": float(rw.mean()),
                f"{prefix}reward_std": float(rw.std()),
            }
        if self.lags:
            out[f"{prefix}policy_lag_mean"] = float(np.mean(self.lags))
        return out


def _mark_error(rollout: rollout_pb2.Rollout, why: str) -> None:
    """Make ``rollout`` an error rollout (never trained); there is no ErrorKind for a
    completion refused by the orchestrator, the message says it."""
    rollout.status.CopyFrom(
        rollout_pb2.RolloutStatus(
            kind=rollout_pb2.RolloutStatus.Kind.KIND_ERROR, message=why[:2000]
        )
    )


def _check_alive(task: asyncio.Task[None], what: str) -> None:
    """End the loop with a clear error when a background task of it has ended."""
    if not task.done():
        return
    error = task.exception() if not task.cancelled() else None
    if isinstance(error, BusUnavailableError):
        raise BusUnavailableError(
            f"{what} stopped: {error}. Completions recorded so far may be unreadable now; "
            "start the orchestrator again once the stream exists (ensure_streams at a "
            "service's start recreates it): it requests those rollouts again"
        )
    if isinstance(error, TreadleError):
        raise TreadleError(f"{what} stopped: {error}")
    if error is not None:
        log.error("%s died", what, exc_info=error)  # a bug: keep its traceback in the log
        raise TreadleError(f"{what} died: {type(error).__name__}: {error}")
    raise TreadleError(f"{what} stopped unexpectedly")


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass


def _honour_lost_cancel() -> None:
    """Raise CancelledError when this task was asked to stop and the request got lost on
    the way: Python 3.11's ``asyncio.wait_for`` (used by the NATS client) returns a result
    that arrives together with the cancel and drops the cancel, which left a cancelled loop
    running -- waiting forever for rollouts nobody would send."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def _wait_any(stop: asyncio.Event, changed: asyncio.Event, within_s: float) -> None:
    waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(changed.wait())]
    try:
        await asyncio.wait(waiters, timeout=within_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
