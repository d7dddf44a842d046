"""Demonstrations in RL batches (``[orchestrator.demos]``).

Every batch an RL run cuts also carries ``samples_per_step`` conversations of a chat
dataset -- e.g. a teacher's answers kept by rejection sampling -- trained by cross-entropy
on what the assistant says, in the same optimizer step as the sampled tokens' policy
gradient and distillation terms. No second stack, no second phase: the demonstrations
cost the trainer their forward and backward, nothing else.

How the trainer reads them, with no field of their own in the batch contract:

- their tokens carry policy version -1: not sampled, so no behaviour logprob and no
  importance ratio; the trainer's policy-gradient kinds skip such tokens (losses.py);
- each loss token carries a one-hot teacher row: the demonstrated token at rank 1 with
  logprob 0, the other k-1 ranks the same id at ``ONE_HOT_FLOOR`` (probability exactly 0
  once the trainer renormalizes), weight ``demos.weight``. The trainer's top-k term
  ``w·KL(q || p)`` is then ``-w·log p(token)``: the cross-entropy, exactly.

k is the batch's own (the top-k distillation samples' k), else 1. Rows are rendered once,
at startup, so a row the template cannot render (or with token ids outside the policy's
vocabulary) stops the run before it starts; the
cursor (epoch, position of a seeded shuffle) is saved with the orchestrator's state, so a
restart continues where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from treadle.orchestrator.algorithms import TopK
from treadle.orchestrator.chat_data import load_chat_dataset, render_row
from treadle.orchestrator.samples import Sample
from treadle.orchestrator.spec import DemosSection
from treadle.orchestrator.tasks import Cursor, Task, TaskSampler
from treadle.services.errors import ConfigError

log = logging.getLogger(__name__)

DEMO_PREFIX = "demo-"
"""A demonstration's sample id: ``demo-<row id>-e<epoch>``."""
ONE_HOT_FLOOR = -1e4
"""The logprob of a one-hot row's other ranks: exp() of it is 0 in float32 and float64, so
renormalized over k it adds exactly nothing to the KL (0 * finite)."""


@dataclass(frozen=True)
class Rendered:
    token_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] uint8, 1 on what the assistant says


def one_hot_topk(token_ids: np.ndarray, loss_mask: np.ndarray, k: int) -> TopK:
    """Rows that make the trainer's top-k term the cross-entropy of ``token_ids`` on the
    loss tokens (0 elsewhere)."""
    on = loss_mask == 1
    ids = np.zeros((token_ids.size, k), dtype=np.int32)
    ids[on] = token_ids[on, None]
    lps = np.zeros((token_ids.size, k), dtype=np.float32)
    lps[on, 1:] = ONE_HOT_FLOOR
    return TopK(ids, lps)


class Demos:
    """The demonstrations of one run, rendered, and where the next one is taken from."""

    def __init__(
        self,
        section: DemosSection,
        renderer: object,
        seed: int | str,
        *,
        seq_len: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """Every row rendered: a ConfigError naming the first that the template cannot
        render or whose token ids fall outside ``vocab_size`` (the policy's: the tokenizer
        is another model's); rows longer than ``seq_len`` are counted (truncated when
        packed)."""
        assert section.data is not None
        self.section = section
        self.dataset = load_chat_dataset(Path(section.data))
        self.rendered: list[Rendered] = []  # as the dataset's rows
        too_long = 0
        for task in self.dataset.rows:
            out = render_row(self.dataset, task, renderer)
            ids = np.asarray(out.token_ids, dtype=np.int32)
            if vocab_size is not None and ids.size and int(ids.max()) >= vocab_size:
                raise ConfigError(
                    f"{self.dataset.where(task)}: token id {int(ids.max())} is outside the "
                    f"policy's vocabulary ({vocab_size} ids): orchestrator.tokenizer is not "
                    "the policy model's tokenizer"
                )
            too_long += seq_len is not None and ids.size > seq_len
            self.rendered.append(Rendered(ids, np.asarray(out.loss_mask, dtype=np.uint8)))
        self._index = {task.task_id: i for i, task in enumerate(self.dataset.rows)}
        self.sampler = TaskSampler(self.dataset.rows, f"demos:{seed}")
        log.info("[startup] orchestrator.demos: %d conversations of %s, %d a step "
                 "(%d demonstrated tokens in all)", len(self.rendered), self.dataset.path,
                 section.samples_per_step,
                 sum(int(r.loss_mask.sum()) for r in self.rendered))  # fmt: skip
        if too_long:
            log.warning("[startup] orchestrator.demos: %d of %d conversations are longer than "
                        "orchestrator.seq_len = %d tokens: each is truncated to its first %d",
                        too_long, len(self.rendered), seq_len, seq_len)  # fmt: skip

    @property
    def cursor(self) -> list[int]:
        return [self.sampler.cursor.epoch, self.sampler.cursor.position]

    def seek(self, cursor: list[int]) -> None:
        """Continue from a saved ``cursor`` ([epoch, position])."""
        epoch, position = cursor
        if not 0 <= position < max(len(self.rendered), 1):
            position = 0  # the dataset changed under a restart: from its start
        self.sampler.cursor = Cursor(epoch, position)

    def advance_past(self, rollout_ids: Iterable[str]) -> None:
        """Move the cursor past the last demonstration among ``rollout_ids`` (a batch
        published after the last save: adopted at a restart, so its demonstrations count
        as taken); ids of other samples, or of rows no longer in the dataset, are ignored."""
        at = (self.sampler.cursor.epoch, self.sampler.cursor.position)
        for rid in rollout_ids:
            row, sep, number = rid.removeprefix(DEMO_PREFIX).rpartition("-e")
            index = self._index.get(row)
            if not rid.startswith(DEMO_PREFIX) or not sep or not number.isdigit() or index is None:
                continue
            at = max(at, (int(number), self.sampler.position_of(int(number), index) + 1))
        if at[1] >= len(self.rendered):
            at = (at[0] + 1, 0)
        self.sampler.cursor = Cursor(*at)

    def take(self, k: int) -> list[Sample]:
        """The next ``samples_per_step`` demonstrations, with one-hot rows of width ``k``."""
        out = []
        for _ in range(self.section.samples_per_step):
            task, at = self.sampler.next()
            out.append(self._sample(task, at.epoch, k))
        return out

    def _sample(self, task: Task, epoch: int, k: int) -> Sample:
        r = self.rendered[self._index[task.task_id]]
        return Sample.written(
            f"{DEMO_PREFIX}{task.task_id}-e{epoch}", r.token_ids, r.loss_mask,
            advantages=np.zeros(r.token_ids.size, np.float32),
            teacher_topk=one_hot_topk(r.token_ids, r.loss_mask, k),
            teacher_weight=self.section.weight,
        )  # fmt: skip
