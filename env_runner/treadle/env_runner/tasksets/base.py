"""Task sets: where an environment's tasks come from.

A task is a JSON object (``dict``) with a stable ``id``. A task set yields them from a
JSONL file, a Hugging Face ``datasets`` split, a list, or a generator function for
procedural tasks, and checks every task for the fields the environment needs, so a row
missing a field is reported with its position instead of failing deep inside a rollout.

    TaskSet.from_jsonl("train.jsonl", required=("question", "answer"))
    TaskSet.from_generator(make_task, n=1000, seed=0)      # make_task(rng, index) -> dict
    TaskSet.from_hf("gsm8k", split="test", config="main", required=("question", "answer"))
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from treadle.services.errors import ConfigError

Task = dict[str, Any]


class TaskError(ValueError):
    """A task lacks a field its environment needs (or is not a JSON object)."""


def check_task(task: Any, required: Sequence[str], where: str = "task") -> Task:
    """``task`` if it is an object holding every ``required`` field; else TaskError."""
    if not isinstance(task, dict):
        raise TaskError(f"{where}: a task must be a JSON object, got {type(task).__name__}")
    missing = [f for f in required if f not in task]
    if missing:
        raise TaskError(
            f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(map(repr, missing))}"
        )
    return task


@dataclass
class TaskSet:
    """A finite, ordered collection of tasks (ids unique), checked against ``required``."""

    name: str
    rows: list[Task]
    required: tuple[str, ...] = ()
    skipped: list[str] = field(default_factory=list)
    """Why rows were left out (when built with ``on_bad_row="skip"``)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, row in enumerate(self.rows):
            check_task(row, self.required, f"{self.name}[{i}]")
            row.setdefault("id", f"{self.name}-{i}")
            row["id"] = str(row["id"])
            if row["id"] in seen:
                raise TaskError(f"{self.name}[{i}]: duplicate task id {row['id']!r}")
            seen.add(row["id"])

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.rows)

    def __getitem__(self, i: int) -> Task:
        return self.rows[i]

    def head(self, n: int | None) -> list[Task]:
        """The first ``n`` tasks (all when None)."""
        return list(self.rows if n is None else self.rows[:n])

    @classmethod
    def from_rows(
        cls,
        name: str,
        rows: Iterable[Any],
        required: Sequence[str] = (),
        on_bad_row: str = "raise",
    ) -> TaskSet:
        """Tasks from ``rows``; a bad row raises, or with ``on_bad_row="skip"`` is left out
        and recorded in ``skipped``."""
        if on_bad_row not in ("raise", "skip"):
            raise ValueError("on_bad_row must be 'raise' or 'skip'")
        kept: list[Task] = []
        skipped: list[str] = []
        for i, row in enumerate(rows):
            try:
                kept.append(dict(check_task(row, required, f"{name}[{i}]")))
            except TaskError as e:
                if on_bad_row == "raise":
                    raise
                skipped.append(str(e))
        return cls(name, kept, tuple(required), skipped)

    @classmethod
    def from_jsonl(
        cls, path: str | Path, required: Sequence[str] = (), name: str | None = None,
        on_bad_row: str = "raise",
    ) -> TaskSet:  # fmt: skip
        """One JSON object per line (blank lines skipped); errors name file and line."""
        path = Path(path)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise ConfigError(f"task file not found: {path}") from None
        rows: list[Any] = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if on_bad_row == "skip":
                    continue
                raise TaskError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if isinstance(row, dict):
                row.setdefault("id", f"line{number}")
            rows.append(row)
        return cls.from_rows(name or path.stem, rows, required, on_bad_row)

    @classmethod
    def from_generator(
        cls,
        make: Callable[[random.Random, int], Task],
        n: int,
        seed: int = 0,
        name: str = "generated",
        required: Sequence[str] = (),
    ) -> TaskSet:
        """``n`` procedural tasks: ``make(rng, index)``, one rng seeded by (seed, index) per
        task, so task i is the same whatever n is."""
        rows = []
        for i in range(n):
            row = make(random.Random(f"{seed}:{i}"), i)
            if isinstance(row, dict):
                row.setdefault("id", f"{name}-{seed}-{i}")
            rows.append(row)
        return cls.from_rows(name, rows, required)

    @classmethod
    def from_hf(
        cls,
        path: str,
        split: str = "train",
        config: str | None = None,
        required: Sequence[str] = (),
        map_row: Callable[[dict[str, Any]], Task] | None = None,
        limit: int | None = None,
        **load_kwargs: Any,
    ) -> TaskSet:
        """A Hugging Face ``datasets`` split: a hub name, a local dataset folder, or a file
        loader such as ``from_hf("json", data_files="tasks.json")`` (``load_kwargs`` go to
        ``datasets.load_dataset``); ``map_row`` turns a row into a task."""
        try:
            import datasets  # type: ignore[import-untyped]
        except ImportError:
            raise ConfigError(
                "TaskSet.from_hf needs the `datasets` package (pip install datasets)"
            ) from None
        ds = datasets.load_dataset(path, config, split=split, **load_kwargs)
        rows = []
        for i, row in enumerate(ds):
            if limit is not None and i >= limit:
                break
            task = map_row(dict(row)) if map_row else dict(row)
            if isinstance(task, dict):
                task.setdefault("id", f"{split}-{i}")
            rows.append(task)
        return cls.from_rows(f"{path}:{split}", rows, required)
