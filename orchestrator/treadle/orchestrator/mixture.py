"""Several environments in one RL run: which environment, and which of its tasks, each
new group runs.

Each new group draws its environment by weight (environment i with probability
``weight_i / sum(weights)``), then takes the next task of that environment's own
``TaskSampler`` (its task file, shuffled epoch by epoch). The draw is counter-based:
draw ``n`` is a function of ``(seed, n)`` alone, so the RNG's whole state is the number
of draws so far, saved with the task cursors in the orchestrator state; a restart
continues the same sequence of (environment, task) an uninterrupted run dispatches.

A run with one environment is the same object with one entry: no draw decides anything
and its task order is exactly that of a plain ``TaskSampler`` with the run's seed.

Not here: the task file format (``treadle.env_runner.tasksets``), what a group of an environment is scored
with (``algorithms.py``), saving the state (``state.py``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass

from treadle.orchestrator.tasks import Cursor, Task, TaskSampler


@dataclass(frozen=True)
class EnvTasks:
    """One environment of the run and the tasks its groups are drawn from."""

    env: str
    tasks: list[Task]
    weight: float  # > 0, relative to the other environments' weights


class EnvMixture:
    """Draws (environment, task) for each new group; resumable from ``draws`` and the
    task cursors."""

    def __init__(
        self,
        envs: list[EnvTasks],
        seed: int,
        *,
        draws: int = 0,
        cursors: dict[str, Cursor] | None = None,
    ):
        if not envs:
            raise ValueError("a run needs at least one environment")
        for e in envs:
            if not (math.isfinite(e.weight) and e.weight > 0):
                raise ValueError(f"environment {e.env!r}: weight {e.weight} is not > 0")
        self.envs = envs
        self.seed = seed
        self.draws = draws
        cursors = cursors or {}
        # one environment: the run's seed as is, so its order is a plain TaskSampler's
        self.samplers = {
            e.env: TaskSampler(
                e.tasks,
                seed if len(envs) == 1 else f"{seed}:{e.env}",
                Cursor(cursors[e.env].epoch, cursors[e.env].position) if e.env in cursors else None,
            )
            for e in envs
        }
        total = sum(e.weight for e in envs)
        self._cumulative = [w / total for w in itertools.accumulate(e.weight for e in envs)]

    def env_at(self, n: int) -> str:
        """The environment of draw ``n`` (0-based): a function of (seed, n) only."""
        if len(self.envs) == 1:
            return self.envs[0].env
        u = random.Random(f"{self.seed}:env:{n}").random()
        i = bisect.bisect_right(self._cumulative, u)
        return self.envs[min(i, len(self.envs) - 1)].env  # u < 1; rounding of the last sum

    def next(self) -> tuple[str, Task]:
        """The next group's environment and task; advances the draw count and that
        environment's cursor."""
        env = self.env_at(self.draws)
        self.draws += 1
        task, _ = self.samplers[env].next()
        return env, task

    @property
    def cursors(self) -> dict[str, Cursor]:
        """Each environment's task cursor (where its next task is taken from)."""
        return {env: Cursor(s.cursor.epoch, s.cursor.position) for env, s in self.samplers.items()}
