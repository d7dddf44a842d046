"""The trainer service: consumes BatchReady strictly in step order, trains, publishes
each policy version, checkpoints, and answers TrainerControl.

    BATCHES stream ── subject batches.<N> ──▶ per-step pull consumer (durable
        │   "trainer-r0-step<N>", recreated at every start so a redelivery is immediate)
        ▼
    handler(BatchReady N) ── older step: ack, ignore ── N: fetch + sha256 ─▶ TRAIN order to
        ▼                    the other ranks ─▶ to_thread(Trainer.train_step) (train, weights
    PolicyPublished(N) on policy.published       to store policies/v<N>, probe)
    (Nats-Msg-Id policy-<N>)
        ▼
    checkpoint when due (every checkpoint_every steps, Checkpoint rpc, Stop, SIGTERM,
        max_steps) ─▶ ack BatchReady N ─▶ purge batches.<=N after a checkpoint of N
        ─▶ delete old policies and checkpoints from the store (trainer.keep_policies,
        keep_checkpoints; off by default: retention.py)
        ▼
    next step N+1 (a BatchReady of a later step simply waits on its own subject)

Acks happen only after the policy is published (and the checkpoint, when one is due),
so a trainer killed mid-step redoes the step from its last checkpoint: BatchReady
messages stay in the stream until a checkpoint covers them.

Under torchrun this runs on rank 0 only: it alone talks to NATS and serves gRPC, and it
drives the other ranks (``follower.py``) with orders (``ranks.py``): TRAIN with the
batch's bytes, CHECKPOINT, NOOP while idle, STOP. A rank that dies fails the next
collective (RankLostError): the job stops, and the restart resumes from the newest
checkpoint and retrains the steps after it, once.

Failure policy (see README of the trainer for the reasons):
- bad batch (tensors disagree): the step is skipped, its unchanged weights are
  published as version N, and the message is acked;
- payload sha256 mismatch / missing payload / wrong rank count: fatal — the message is
  left unacked (nak'ed) and the service exits with the error;
- non-finite loss or gradient: the optimizer update is skipped (weights unchanged).

Not here: the training math (``trainer.py``), checkpoint layout (``checkpoint.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import nats.errors
import nats.js.errors
from google.protobuf.timestamp_pb2 import Timestamp

from treadle.proto.v1 import (
    batch_pb2,
    common_pb2,
    policy_pb2,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)
from treadle.services import telemetry, usage
from treadle.services.bus import Delivery
from treadle.services.errors import DropMessage, StoreUnavailableError, TreadleError
from treadle.services.export import export_model
from treadle.services.host import ServiceContext
from treadle.trainer import retention
from treadle.trainer.errors import RankLostError
from treadle.trainer.ranks import BEAT_S, Command, Order, OrderChannel, is_collective_failure, lost
from treadle.trainer.spec import SPEC, TrainerSection

log = logging.getLogger(__name__)

STREAM = "BATCHES"
DRAIN_TIMEOUT_S = 24 * 3600.0  # a step in flight is never cut short by a stop


class StepDeferred(TreadleError):
    """Raised by the handler to leave a BatchReady unacked (redelivered later)."""


class TrainerControl(trainer_service_pb2_grpc.TrainerControlServicer):
    def __init__(self, app: TrainerApp):
        self.app = app

    async def GetStatus(
        self, request: common_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.TrainerStatus:
        return self.app.status()

    async def Checkpoint(
        self, request: trainer_service_pb2.CheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.CheckpointResponse:
        if self.app.trainer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.app.ctx.message)
        try:
            step, ref = await self.app.request_checkpoint()
        except TreadleError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            raise AssertionError("abort returns by raising") from None
        response = trainer_service_pb2.CheckpointResponse(step=step)
        if ref is not None:
            response.manifest.CopyFrom(ref)
        return response

    async def Stop(
        self, request: trainer_service_pb2.StopRequest, context: grpc.aio.ServicerContext
    ) -> trainer_service_pb2.StopResponse:
        log.info("[shutdown] stop requested over gRPC: %s", request.reason or "(no reason)")
        self.app.stop_requested.set()
        self.app.wake.set()
        return trainer_service_pb2.StopResponse(step=self.app.step)


class TrainerApp:
    """Servicers and the work loop of one trainer process (one rank)."""

    def __init__(
        self,
        ctx: ServiceContext,
        trainer: Any | None,
        idle_reason: str = "",
        orders: OrderChannel | None = None,
    ):
        self.ctx = ctx
        self.trainer = trainer  # treadle.trainer.trainer.Trainer, or None when idle
        self.section: TrainerSection = ctx.config.trainer
        self.idle_reason = idle_reason
        self.stop_requested = asyncio.Event()
        self.wake = asyncio.Event()
        self.waiting_for_batch = False
        self.in_step = False
        self.fatal: BaseException | None = None
        self.checkpoint_waiters: list[asyncio.Future[tuple[int, Any]]] = []
        self.announced_step = self.step
        self.last_weights: Any = None
        self._wait_started = time.monotonic()
        self.purged_through = max(0, self.step - max(self.section.checkpoint_every, 1))
        self._step_done = asyncio.Event()
        self._stop: asyncio.Event | None = None
        self._busy = asyncio.Lock()  # one user of the Trainer at a time (step or idle checkpoint)
        self.orders = orders  # to the other ranks under torchrun
        self._last_order = time.monotonic()
        self.ranks_in_doubt = False  # a collective failed: the other ranks may be gone

    # --- control plane ----------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.trainer.step if self.trainer is not None else 0

    @property
    def topology(self) -> Any:
        assert self.trainer is not None
        return self.trainer.topology

    def servicers(self) -> list[tuple[Any, Any, Any]]:
        return [
            (
                trainer_service_pb2_grpc.add_TrainerControlServicer_to_server,
                TrainerControl(self),
                SPEC.control,
            )
        ]

    def status(self) -> trainer_service_pb2.TrainerStatus:
        t = self.trainer
        return trainer_service_pb2.TrainerStatus(
            info=self.ctx.info(),
            step=self.step,
            policy_version=self.announced_step,
            last_checkpoint_step=t.last_checkpoint_step if t is not None else -1,
            world_size=t.topology.world_size if t is not None else 1,
            waiting_for_batch=self.waiting_for_batch,
        )

    async def request_checkpoint(self) -> tuple[int, Any]:
        """Checkpoint after the current step (now when idle); (step, manifest ref)."""
        if self.step == 0:
            raise TreadleError("no step has been trained yet: nothing to checkpoint")
        fut: asyncio.Future[tuple[int, Any]] = asyncio.get_running_loop().create_future()
        self.checkpoint_waiters.append(fut)
        self.wake.set()
        return await fut

    def _stopping(self) -> bool:
        return self.stop_requested.is_set() or (self._stop is not None and self._stop.is_set())

    # --- work loop --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        if self.trainer is None:
            self.ctx.message = self.idle_reason
            log.warning("[startup] trainer is idle: %s", self.idle_reason)
            await _first(stop.wait(), self.stop_requested.wait())
            return
        self.ctx.message = f"training from step {self.step + 1}"
        watcher = asyncio.create_task(self._watch(stop))
        try:
            await self._purge()
            while not self._stopping():
                if self.section.max_steps and self.step >= self.section.max_steps:
                    log.info("[shutdown] reached trainer.max_steps = %d", self.section.max_steps)
                    await self._export_final()
                    break
                await self._consume_step(self.step + 1)
                if self.fatal is not None:
                    raise self.fatal
                await self._purge()
            if self.step > self.trainer.last_checkpoint_step and self.step > 0:
                log.info("[shutdown] checkpointing step %d before stopping", self.step)
                await self._checkpoint()
                await self._purge()
                await self._prune()
        finally:
            watcher.cancel()
            self.waiting_for_batch = False
            if self.topology.distributed and not self.ranks_in_doubt:
                try:
                    await self._order(Order(Command.STOP))
                except RankLostError as e:  # they stopped on their own (same error)
                    log.warning("[shutdown] %s", e)
            for fut in self.checkpoint_waiters:
                if not fut.done():
                    fut.set_exception(TreadleError("the trainer stopped before checkpointing"))
            self.checkpoint_waiters.clear()

    async def _watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.wake.set()

    async def _consume_step(self, step: int) -> None:
        bus = self.ctx.bus
        name = f"trainer-r0-step{step}"
        await self._delete_consumer(name)  # a consumer left by an earlier life
        consumer = await bus.consumer(
            STREAM, name, bus.subjects.batches(step), batch_pb2.BatchReady, max_ack_pending=1
        )
        self._step_done = asyncio.Event()
        self._wait_started = time.monotonic()
        self.waiting_for_batch = True
        self.ctx.message = f"waiting for the batch of step {step}"
        task = asyncio.create_task(
            consumer.run(self._handle, self._step_done, drain_timeout_s=DRAIN_TIMEOUT_S)
        )
        while not task.done():
            self.wake.clear()
            await _first(task, self.wake.wait(), asyncio.sleep(BEAT_S))
            if self.in_step:
                continue
            if self.checkpoint_waiters and self.step > 0:
                async with self._busy:
                    if self.checkpoint_waiters:
                        await self._checkpoint()
            if self.topology.distributed and time.monotonic() - self._last_order >= BEAT_S:
                async with self._busy:
                    if time.monotonic() - self._last_order >= BEAT_S:
                        try:
                            await self._order(Order(Command.NOOP))
                        except RankLostError as e:
                            self.fatal = e
                            self._step_done.set()
            if self._stopping():
                self._step_done.set()
        await task
        self.waiting_for_batch = False
        if self.step >= step:
            await self._delete_consumer(name)

    async def _delete_consumer(self, name: str) -> None:
        stream = self.ctx.bus.subjects.stream_name(STREAM)
        try:
            await self.ctx.bus.js.delete_consumer(stream, name)
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, OSError) as e:
            log.warning("cannot delete consumer %s: %s", name, e)

    async def _handle(self, ready: batch_pb2.BatchReady, delivery: Delivery) -> None:
        assert self.trainer is not None
        expected = self.step + 1
        if ready.step < expected:
            if ready.step == self.step and self.announced_step < self.step:
                await self._announce(self.step, self.last_weights)
            log.info(
                "BatchReady of step %d already trained (now at %d): ignored", ready.step, self.step
            )
            return
        if ready.step != expected:
            raise DropMessage(
                f"{delivery.subject} carries a BatchReady of step {ready.step}, expected {expected}"
            )
        if self._stopping():
            self._step_done.set()
            raise StepDeferred(f"stopping: step {expected} is left for the next start")
        await self._busy.acquire()
        waited_s = time.monotonic() - self._wait_started
        self.in_step = True
        self.waiting_for_batch = False
        self.ctx.message = f"training step {expected}"
        try:
            self.trainer.check_ready(ready)
            data = await asyncio.to_thread(self.trainer.fetch_batch_bytes, ready)
            await self._order(Order(Command.TRAIN, ready.SerializeToString(), data))
            # the step is in the batch's trace: the BatchReady being processed carries it
            with telemetry.tracer(__name__).start_as_current_span(
                "train_step", attributes={"treadle.step": int(ready.step)}
            ):
                result = await asyncio.to_thread(self.trainer.train_step, ready, data)
            self.last_weights = result.weights
            await self._announce(result.step, result.weights)
            if self.topology.is_main:  # the step's line in the usage ledger
                await usage.record(self.ctx.bus, "trainer", f"step/{result.step}",
                                   self.ctx.config.run.billed_to, trained_tokens=ready.num_tokens,
                                   loss_tokens=ready.num_loss_tokens,
                                   trainer_s=result.metrics.get("step_time_s", 0.0))  # fmt: skip
            if await self._checkpoint_due(result.step):
                await self._checkpoint()
            await self._prune()
            if self.topology.is_main:
                # time idle before this step's batch arrived (async pipelines keep it near 0)
                await self.ctx.report_metrics(
                    result.step,
                    {**result.metrics, "wait_s": waited_s, **self.ctx.bus.stats.metrics()},
                )
            log.info(
                "step %d: %s", result.step,
                " ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())),
            )  # fmt: skip
        except StoreUnavailableError as e:
            if self.step < ready.step:
                raise  # nothing changed yet: nak, redelivered with backoff
            # trained, but its weights (or checkpoint) could not be stored even after the
            # store's patience: this process can neither announce nor redo the step (a
            # redelivery would be "already trained"). Stop; the restart resumes from the
            # last checkpoint and trains the step again.
            self.fatal = e
            self._step_done.set()
            raise
        except Exception as e:  # service boundary: anything else stops the trainer clearly
            if self.topology.distributed and is_collective_failure(e):
                self.ranks_in_doubt = True
                e = e if isinstance(e, RankLostError) else lost(e, f"in step {ready.step}")
            self.fatal = e
            self._step_done.set()
            raise e from None
        finally:
            self.in_step = False
            self._busy.release()
        self._step_done.set()

    async def _checkpoint_due(self, step: int) -> bool:
        every = self.section.checkpoint_every
        local = bool(
            (every and step % every == 0)
            or self.checkpoint_waiters
            or self._stopping()
            or (self.section.max_steps and step >= self.section.max_steps)
        )
        return local  # rank 0 decides; the others follow its CHECKPOINT order

    async def _order(self, order: Order) -> None:
        """Send ``order`` to the other ranks (nothing in a single process)."""
        if not self.topology.distributed:
            return
        assert self.orders is not None
        try:
            await asyncio.to_thread(self.orders.send, order)
        except RankLostError:
            self.ranks_in_doubt = True
            raise
        self._last_order = time.monotonic()

    async def _checkpoint(self) -> None:
        assert self.trainer is not None
        await self._order(Order(Command.CHECKPOINT))
        try:
            ref = await asyncio.to_thread(self.trainer.save_checkpoint)
        except Exception as e:
            if self.topology.distributed and is_collective_failure(e):
                self.ranks_in_doubt = True
                raise lost(e, f"checkpointing step {self.step}") from None
            raise
        waiters, self.checkpoint_waiters = self.checkpoint_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result((self.step, ref))

    async def _announce(self, step: int, weights: Any) -> None:
        assert self.trainer is not None
        if self.topology.is_main:
            stamp = Timestamp()
            stamp.GetCurrentTime()
            msg = policy_pb2.PolicyPublished(
                policy_version=step,
                weights=weights,
                format=self.trainer.weights_format,
                published_at=stamp,
                base_model=self.trainer.base_model,
            )
            bus = self.ctx.bus
            await bus.publish(bus.subjects.policy_published, msg, msg_id=f"policy-{step}")
        self.announced_step = step

    async def _export_final(self) -> None:
        """Write the last published policy as a loadable HF folder, <run_dir>/final_model:
        the published weights and config plus the starting model's tokenizer files (LoRA:
        <run_dir>/final_adapter, the PEFT adapter plus the tokenizer files)."""
        if not self.topology.is_main or self.step == 0:
            return
        weights = self.last_weights or f"policies/v{self.step:06d}"  # after a restart at max_steps
        lora = self.section.lora.enabled
        dest = self.ctx.config.run.run_dir / ("final_adapter" if lora else "final_model")
        source = Path(self.section.model) if self.section.model else None
        await asyncio.to_thread(export_model, self.ctx.store, weights, source, dest)
        what = "final adapter" if lora else "final model"
        log.info("[shutdown] %s (policy version %d) exported to %s", what, self.step, dest)

    async def _prune(self) -> None:
        """Delete old policies and checkpoints from the store (trainer.keep_policies,
        trainer.keep_checkpoints; both 0: nothing)."""
        keep_policies, keep_checkpoints = self.section.keep_policies, self.section.keep_checkpoints
        if not self.topology.is_main or not (keep_policies or keep_checkpoints):
            return
        await asyncio.to_thread(retention.prune, self.ctx.store, self.announced_step,
                                keep_policies, keep_checkpoints)  # fmt: skip

    async def _purge(self) -> None:
        """Remove BatchReady messages of checkpointed steps from the BATCHES stream."""
        assert self.trainer is not None
        through = self.trainer.last_checkpoint_step
        if not self.topology.is_main or through <= self.purged_through:
            return
        bus = self.ctx.bus
        for step in range(self.purged_through + 1, through + 1):
            await bus.purge_subject(STREAM, bus.subjects.batches(step))
        log.info("purged BatchReady of steps %d..%d", self.purged_through + 1, through)
        self.purged_through = through


async def _first(*aws: Any) -> None:
    """Wait until the first of ``aws`` finishes; cancel the others (not given tasks)."""
    tasks = [a if isinstance(a, asyncio.Task) else asyncio.ensure_future(a) for a in aws]
    given = {a for a in aws if isinstance(a, asyncio.Task)}
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        if t not in given:
            t.cancel()


async def build(ctx: ServiceContext) -> Any:
    """Build the model, optimizer and schedule, and resume from the newest checkpoint."""
    section: TrainerSection = ctx.config.trainer
    if section.hosted.enabled:  # several runs on one shared base (or added at runtime)
        from treadle.trainer.hosted import build_hosted

        return await build_hosted(ctx)
    if section.model is None:
        return TrainerApp(
            ctx,
            None,
            "trainer.model is not set: serving the control plane only "
            "(set [trainer] model to a Hugging Face model folder to train)",
        )
    from treadle.trainer.distributed import device_type, init_topology
    from treadle.trainer.trainer import Trainer

    topology = init_topology(device_type(section.device))
    assert topology.is_main, "ranks > 0 run treadle.trainer.follower"
    orders = OrderChannel(topology)
    wanted = section.distributed.world_size
    if wanted > 1 and wanted != topology.world_size:
        log.warning(
            "[startup] trainer.distributed asks for %d ranks, but this job was started with "
            "%d (WORLD_SIZE): the job's own count is used", wanted, topology.world_size,
        )  # fmt: skip
    checkpoint_dir = section.checkpoint_dir or ctx.config.run.run_dir / "trainer" / "checkpoints"
    trainer = await asyncio.to_thread(
        Trainer, section, ctx.store, checkpoint_dir=checkpoint_dir, topology=topology
    )
    await asyncio.to_thread(trainer.resume)
    return TrainerApp(ctx, trainer, orders=orders)
