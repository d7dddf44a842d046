"""Task sets as data: a JSONL file of tasks and a deterministic, resumable cursor over it.

The orchestrator hands tasks to env runners as JSON; what a task means (prompt, reward)
is the environment's business, not the orchestrator's. Each epoch visits every task
once in an order shuffled by (seed, epoch), so a cursor (epoch, position) fully
describes where sampling stands and survives restarts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from treadle.services.errors import ConfigError


@dataclass(frozen=True)
class Task:
    task_id: str
    data: dict[str, Any]
    json: str  # the task as compact JSON, sent to env runners unchanged
    line: int = 0  # 1-based line of the task file it was read from (0: not from a file)


def load_tasks(path: Path) -> list[Task]:
    """Read a JSONL task file; every line a JSON object (blank lines skipped)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError(f"task file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"task file {path} is a directory: point it at a JSONL file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"task file {path} is not UTF-8 text: {e.reason} at byte {e.start}"
        ) from None
    except OSError as e:
        raise ConfigError(f"task file {path} is unreadable: {e.strerror or e}") from None
    tasks: list[Task] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise ConfigError(f"{path}:{number}: JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"{path}:{number}: a task must be a JSON object, got {type(data).__name__}"
            )
        task_id = str(data.get("id", f"line{number}"))
        if task_id in seen:
            raise ConfigError(f"{path}:{number}: duplicate task id {task_id!r}")
        seen.add(task_id)
        tasks.append(
            Task(task_id, data, json.dumps(data, ensure_ascii=False, separators=(",", ":")), number)
        )
    if not tasks:
        raise ConfigError(f"{path} holds no tasks")
    return tasks


@dataclass
class Cursor:
    """Where sampling stands: the next task is order(epoch)[position]."""

    epoch: int = 0
    position: int = 0


class TaskSampler:
    """Yields tasks epoch by epoch in a seeded shuffled order."""

    def __init__(self, tasks: list[Task], seed: int | str, cursor: Cursor | None = None):
        self.tasks = tasks
        self.seed = seed
        self.cursor = cursor or Cursor()
        self._order_epoch = -1
        self._order: list[int] = []

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def position_of(self, epoch: int, index: int) -> int:
        """Where task ``index`` (of ``tasks``) comes in ``epoch``'s order."""
        return self._order_of(epoch).index(index)

    def next(self) -> tuple[Task, Cursor]:
        """The next task and the cursor position it was taken from; advances the cursor."""
        at = Cursor(self.cursor.epoch, self.cursor.position)
        task = self.tasks[self._order_of(at.epoch)[at.position]]
        self.cursor.position += 1
        if self.cursor.position == len(self.tasks):
            self.cursor = Cursor(self.cursor.epoch + 1, 0)
        return task, at
