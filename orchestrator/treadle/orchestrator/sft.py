"""The SFT data feed: conversations -> rendered tokens with assistant masks -> batches.

No rollouts: each step takes ``sft_samples_per_step`` conversations from the dataset
(``orchestrator.tasks``: a messages JSONL file or a local Hugging Face dataset, every row
checked at startup, see chat_data.py), renders them with
``treadle_native`` (the loss mask covers what the assistant says), packs them and
publishes BatchReady like the RL loop does. It runs at most ``max_async_level`` steps
ahead of the trainer so batches do not pile up. State (step, cursor) is saved after
every batch, so a restart continues where it stopped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from treadle.orchestrator.batching import batch_media_type, build_batch
from treadle.orchestrator.chat_data import load_chat_dataset, render_row
from treadle.orchestrator.samples import Sample
from treadle.orchestrator.spec import OrchestratorSection
from treadle.orchestrator.state import OrchestratorState, load_state, save_state
from treadle.orchestrator.tasks import Cursor, Task, TaskSampler
from treadle.proto.v1 import policy_pb2
from treadle.services.errors import ConfigError, DecodeError, IntegrityError, ObjectNotFoundError
from treadle.services.host import ServiceContext
from treadle.services.rendering import open_renderer

log = logging.getLogger(__name__)


class SFTFeed:
    def __init__(self, ctx: ServiceContext, cfg: OrchestratorSection):
        if cfg.tasks is None:
            raise ConfigError(
                "orchestrator.tasks is not set: point it at a JSONL file of conversations "
                "or a Hugging Face dataset folder (or set [sft_data] env to sample one)"
            )
        if cfg.tokenizer is None:
            raise ConfigError(
                "orchestrator.tokenizer is not set: SFT renders conversations with the model's tokenizer"
            )
        self.ctx = ctx
        self.cfg = cfg
        self.dataset = load_chat_dataset(cfg.tasks)
        self.tasks = self.dataset.rows
        self.renderer = open_renderer(
            cfg.renderer, cfg.tokenizer, force=cfg.renderer_force, what="orchestrator.renderer"
        )
        self.state = OrchestratorState()
        self.trainer_version = 0
        self._policy_error = ""  # the last undecodable PolicyPublished, logged once

    def sample_of(self, task: Task, epoch: int) -> Sample:
        out = render_row(self.dataset, task, self.renderer)
        return Sample.written(
            f"sft-{task.task_id}-e{epoch}", out.token_ids, out.loss_mask, advantage=1.0
        )

    async def run(self, stop: asyncio.Event) -> None:
        saved = await asyncio.to_thread(load_state, self.ctx.store)
        if saved is not None:
            self.state = saved
            log.info("[startup] resuming the SFT feed at step %d", saved.step)
        sampler = TaskSampler(
            self.tasks, self.cfg.seed, Cursor(self.state.epoch, self.state.position)
        )
        bus = self.ctx.bus
        while not stop.is_set() and self.state.step < self.cfg.max_steps:
            step = self.state.step + 1
            try:
                last = await bus.last(
                    "POLICY", bus.subjects.policy_published, policy_pb2.PolicyPublished
                )
            except (DecodeError, IntegrityError, ObjectNotFoundError) as e:
                if str(e) != self._policy_error:  # dead-lettered by the bus; logged once
                    log.error("undecodable PolicyPublished (the feed keeps trainer version "
                              "%d): %s", self.trainer_version, e)  # fmt: skip
                    self._policy_error = str(e)
                last = None
            else:
                self._policy_error = ""
                self.trainer_version = last.policy_version if last is not None else 0
            if (step - 1) - self.trainer_version > self.cfg.max_async_level:
                await _sleep_or_stop(stop, self.cfg.status_poll_s)
                continue
            samples = []
            for _ in range(self.cfg.sft_samples_per_step):
                task, at = sampler.next()
                samples.append(self.sample_of(task, at.epoch))
            built = build_batch(
                step,
                samples,
                seq_len=self.cfg.seq_len,
                num_ranks=self.cfg.num_ranks,
                pad_token_id=self.cfg.pad_token_id,
            )
            ref = await asyncio.to_thread(
                self.ctx.store.put_bytes,
                f"batches/step{step:06d}",
                built.batch.SerializeToString(),
                batch_media_type(),
            )
            built.ready.data.CopyFrom(ref)
            await bus.publish(bus.subjects.batches(step), built.ready, msg_id=f"batch-{step}")
            self.state.step = step
            self.state.epoch, self.state.position = sampler.cursor.epoch, sampler.cursor.position
            await asyncio.to_thread(save_state, self.ctx.store, self.state)
            await self.ctx.report_metrics(
                step,
                {
                    "num_samples": float(len(samples)),
                    "num_tokens": float(built.ready.num_tokens),
                    "epoch": float(at.epoch),
                },
            )
        if self.state.step >= self.cfg.max_steps:
            log.info("[shutdown] all %d SFT steps published", self.cfg.max_steps)

    def status(self) -> dict[str, Any]:
        return {"step": self.state.step, "trainer_step": self.trainer_version}


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        pass
